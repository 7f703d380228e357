// The layout step of the forward as device code: a deterministic numbering of every routed (token, slot) on
// the source, on many CTAs. The modular path runs it as two kernels (ep_layout.cu), the fused forward as two
// phases of its persistent kernel with a grid barrier between them (fused_forward_kernel.cuh).
//
// The tokens are cut into one contiguous chunk per CTA. layout_count counts, per CTA, the keys of its chunk
// (a key is an expert, or a destination rank on a token's first slot there) and checks the expert ids.
// layout_assign then gives each CTA the counts of the CTAs before it (its base per key) and numbers its
// chunk in token order: inside the CTA the chunk is cut into one piece per warp; a warp walks its piece 32
// tokens at a time and, for each slot j, numbers the lanes that share a key with __match_any_sync, in two
// passes (per-warp counts, a scan over warps, the numbering). No atomics decide a number. Chunks and pieces
// are whole windows of 32 tokens starting at multiples of 32, so the order of a key's numbers is (token
// window, slot, token) whatever the number of CTAs and warps: the modular kernels (8 warps) and the fused
// forward (12 warps, another CTA count) number alike, and every later summation order that follows from
// the numbering is the same on every run.
#pragma once

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"

namespace megamoe::ep {

inline constexpr int kLayoutTokensPerBlock = 256;
inline constexpr int64_t kLayoutSmemLimit = 96 * 1024;

// CTAs of the layout step for `tokens` tokens when at most max_blocks may take part.
inline int layout_blocks(int64_t tokens, int max_blocks) {
  int64_t b = (tokens + kLayoutTokensPerBlock - 1) / kLayoutTokensPerBlock;
  if (b > kMaxLayoutBlocks) b = kMaxLayoutBlocks;
  if (b > max_blocks) b = max_blocks;
  return static_cast<int>(b < 1 ? 1 : b);
}

// Shared memory of the two phases, in bytes, for a CTA of kWarps warps.
inline int64_t layout_count_smem(const Shape& s) { return 4 * static_cast<int64_t>(s.num_experts + s.num_ranks); }
template <int kWarps>
int64_t layout_assign_smem(const Shape& s) {
  return 4 * static_cast<int64_t>(kWarps + 1) * (s.num_experts + s.num_ranks);
}

template <typename Index>
__device__ __forceinline__ int expert_at(const Index* idx, int64_t t, int64_t T, int K, int j) {
  return t < T ? static_cast<int>(idx[t * K + j]) : -1;
}

// Destination rank of slot j if j is the token's first slot on that rank, else -1.
template <typename Index>
__device__ __forceinline__ int first_send_rank(const Index* idx, int64_t t, int64_t T, int K, int j, int EL) {
  const int e = expert_at(idx, t, T, K, j);
  if (e < 0) return -1;
  const int d = e / EL;
  for (int jj = 0; jj < j; ++jj) {
    const int ee = expert_at(idx, t, T, K, jj);
    if (ee >= 0 && ee / EL == d) return -1;
  }
  return d;
}

struct LayoutChunk {
  int64_t begin, end;
};
inline constexpr int64_t kLayoutWindow = 32;  // tokens a warp numbers at once (one per lane)
__device__ __forceinline__ int64_t whole_windows(int64_t tokens) {
  return (tokens + kLayoutWindow - 1) / kLayoutWindow * kLayoutWindow;
}
// CTA `block`'s tokens: whole windows, so that the numbering does not depend on the number of CTAs.
__device__ __forceinline__ LayoutChunk layout_chunk_of(int64_t T, int block, int blocks) {
  const int64_t per = whole_windows((T + blocks - 1) / blocks);
  const int64_t begin = block * per;
  return LayoutChunk{begin < T ? begin : T, begin + per < T ? begin + per : T};
}

// Phase 1, every thread of CTA `block` of `blocks` (kWarps warps): the key counts of its chunk into
// layout_counts, the bad expert ids into layout_bad (each also recorded on every rank). counts: shared
// memory of layout_count_smem bytes.
template <int kWarps, typename Index>
__device__ void layout_count(const Params& p, const Index* __restrict__ idx, int block, int blocks, int32_t* counts) {
  constexpr int kThreads = kWarps * 32;
  const Shape& s = p.shape;
  const int E = s.num_experts, R = s.num_ranks, K = s.top_k, EL = s.experts_per_rank;
  const int keys = E + R;
  const int64_t T = p.num_tokens;
  const LayoutChunk c = layout_chunk_of(T, block, blocks);
  for (int k = threadIdx.x; k < keys; k += kThreads) counts[k] = 0;
  __syncthreads();
  int bad = 0;
  for (int64_t i = c.begin * K + threadIdx.x; i < c.end * K; i += kThreads) {
    const int64_t t = i / K;
    const int j = static_cast<int>(i % K);
    const int64_t e = static_cast<int64_t>(idx[i]);
    if (e < -1 || e >= E) {
      ++bad;
      // Every rank learns of it: the whole call's outputs become NaN rather than partly stale.
      record_error_everywhere(p, StatusCode::kInvalidArgument, kErrorExpertId, t, e);
      continue;
    }
    if (e < 0) continue;
    atomicAdd(&counts[e], 1);  // counts only: the order is decided by layout_assign
    const int d = first_send_rank(idx, t, T, K, j, EL);
    if (d >= 0) atomicAdd(&counts[E + d], 1);
  }
  bad = __syncthreads_count(bad > 0);
  int32_t* out = at<int32_t>(p.local, p.layout.layout_counts);
  for (int k = threadIdx.x; k < keys; k += kThreads) out[k * kMaxLayoutBlocks + block] = counts[k];
  if (threadIdx.x == 0) at<int32_t>(p.local, p.layout.layout_bad)[block] = bad;
}

// Every thread of CTA 0 of the layout, after it wrote the counts into every receiver's recv_counts: one
// release (system scope) per receiver on its counts_arrived counter, so that a receiver waiting for all R
// sources reads complete counts (fused forward only; the modular path meets at a rank barrier instead).
__device__ __forceinline__ void signal_counts_sent(const Params& p) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < p.shape.num_ranks; ++d)
      device::signal_add<device::Scope::kSystem>(at<uint32_t>(p.peers[d], p.layout.counts_arrived), 1u);
  }
}

// Phase 2, every thread of CTA `block` of `blocks` (kWarps warps), after every CTA's layout_count: numbers
// the CTA's chunk (pair_dest_slot, pair_send_rank, pair_row_index); CTA 0 writes the totals into every
// receiver's recv_counts (rows per local expert, then tokens) and, with signal_receivers, tells them
// (signal_counts_sent). A bad expert id anywhere rejects the whole call: nothing is numbered, every receiver
// gets zero counts. smem: layout_assign_smem<kWarps> bytes.
template <int kWarps, typename Index>
__device__ void layout_assign(const Params& p, const Index* __restrict__ idx, int block, int blocks, int32_t* smem,
                              bool signal_receivers) {
  constexpr int kThreads = kWarps * 32;
  const Shape& s = p.shape;
  const int E = s.num_experts, R = s.num_ranks, K = s.top_k, EL = s.experts_per_rank;
  const int keys = E + R;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = p.num_tokens;
  int32_t* hist = smem;                    // [warps][keys]: per-warp bases
  int32_t* base = smem + kWarps * keys;    // [keys]: this block's base
  const int32_t* counts = at<int32_t>(p.local, p.layout.layout_counts);
  int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  int32_t* send_rank = at<int32_t>(p.local, p.layout.pair_send_rank);
  int32_t* row_index = at<int32_t>(p.local, p.layout.pair_row_index);
  const LayoutChunk c = layout_chunk_of(T, block, blocks);

  int bad = 0;
  for (int b = threadIdx.x; b < blocks; b += kThreads) bad += at<int32_t>(p.local, p.layout.layout_bad)[b];
  if (__syncthreads_or(bad > 0)) {
    for (int64_t i = c.begin * K + threadIdx.x; i < c.end * K; i += kThreads)
      dest_slot[i] = send_rank[i] = row_index[i] = -1;
    if (block == 0) {
      for (int k = threadIdx.x; k < R * (EL + 1); k += kThreads)
        at<int32_t>(p.peers[k / (EL + 1)], p.layout.recv_counts)[s.rank * (EL + 1) + k % (EL + 1)] = 0;
      if (signal_receivers) signal_counts_sent(p);
    }
    return;
  }
  for (int k = threadIdx.x; k < keys; k += kThreads) {
    int32_t before = 0, total = 0;
    for (int b = 0; b < blocks; ++b) {
      const int32_t v = counts[k * kMaxLayoutBlocks + b];
      if (b < block) before += v;
      total += v;
    }
    base[k] = before;
    // Counts to every receiver: rows per local expert, then the number of tokens.
    if (block == 0) {
      if (k < E) {
        at<int32_t>(p.peers[k / EL], p.layout.recv_counts)[s.rank * (EL + 1) + k % EL] = total;
      } else {
        at<int32_t>(p.peers[k - E], p.layout.recv_counts)[s.rank * (EL + 1) + EL] = total;
      }
    }
  }
  if (block == 0 && signal_receivers) signal_counts_sent(p);
  for (int k = threadIdx.x; k < kWarps * keys; k += kThreads) hist[k] = 0;
  __syncthreads();
  // Whole windows per warp (the chunk starts at a multiple of 32): the windows are the same for any kWarps.
  const int64_t piece = whole_windows((c.end - c.begin + kWarps - 1) / kWarps);
  const int64_t begin = c.begin + warp * piece;
  const int64_t end = begin + piece < c.end ? begin + piece : c.end;
  int32_t* my_hist = hist + warp * keys;
  const unsigned lanes_below = (1u << lane) - 1u;

  // pass 1: per-warp counts; pass 2 (assign == true): numbering from the scanned bases.
  for (int assign = 0; assign < 2; ++assign) {
    for (int64_t step = begin; step < end; step += 32) {
      const int64_t t = step + lane;
      const bool live = t < end;
      for (int j = 0; j < K; ++j) {
        const int e = live ? expert_at(idx, t, T, K, j) : -1;
        const int d = live ? first_send_rank(idx, t, T, K, j, EL) : -1;
        for (int which = 0; which < 2; ++which) {
          const int key = which == 0 ? e : (d >= 0 ? E + d : -1);
          const unsigned peers = __match_any_sync(0xffffffffu, key);
          const bool leader = (peers & lanes_below) == 0;
          int32_t number = 0;
          if (key >= 0 && assign) number = base[key] + my_hist[key] + __popc(peers & lanes_below);
          __syncwarp();
          if (key >= 0 && leader) my_hist[key] += __popc(peers);
          __syncwarp();
          if (assign && live) {
            const int64_t pair = t * K + j;
            if (which == 0) {
              row_index[pair] = e >= 0 ? number : -1;
            } else if (key >= 0) {
              send_rank[pair] = d;
              dest_slot[pair] = number;
            } else {
              send_rank[pair] = -1;
              int32_t slot = -1;  // a later slot on an already-visited rank shares the first one's slot
              if (e >= 0)
                for (int jj = 0; jj < j; ++jj)
                  if (send_rank[t * K + jj] == e / EL) slot = dest_slot[t * K + jj];
              dest_slot[pair] = slot;
            }
          }
        }
      }
    }
    __syncthreads();
    if (!assign) {
      // Exclusive scan over the warps, per key: each warp's base inside the block.
      for (int key = threadIdx.x; key < keys; key += kThreads) {
        int32_t running = 0;
        for (int w = 0; w < kWarps; ++w) {
          const int32_t v = hist[w * keys + key];
          hist[w * keys + key] = running;
          running += v;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace megamoe::ep
