// Receiver side of dispatch as device code: from every source's counts to the expert-major row numbering,
// without moving a single row. Rows of local expert e are ordered by (source rank, the source's row index),
// so the order, and the weight-gradient summation order that follows it, never depends on timing. For each
// row it records where its input lies in the receive buffer (row_src, read by the GEMMs' gathering loads),
// its routing weight, and where its results go on the source rank (its combine row and its d_topk_weights
// partials, written straight there by the GEMM epilogues, and the token's counter that the fused kernels
// count the row's arrival on). Used by the modular route_rows kernel
// (ep_route_rows.cu) and by the fused forward's route role, which routes each source's rows as they land.
#pragma once

#include <cuda_bf16.h>

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"

namespace megamoe::ep {

// The offsets every CTA derives from the counts (a few hundred integers), in shared memory.
struct RouteTables {
  int32_t* base;         // [R * EL]: first expert-major row of (source, local expert)
  int32_t* offsets;      // [EL + 1]: expert-major row offsets; offsets[EL] < 0 on capacity overflow
  int32_t* block_start;  // [EL + 1]: first 128-row block of each expert (the GEMMs' row-block numbering)

  static int64_t smem_bytes(const Shape& s) {
    return 4 * (static_cast<int64_t>(s.num_ranks) * s.experts_per_rank + 2 * (s.experts_per_rank + 1));
  }
  __device__ static RouteTables in(int32_t* smem, const Shape& s) {
    int32_t* base = smem;
    int32_t* offsets = base + s.num_ranks * s.experts_per_rank;
    return RouteTables{base, offsets, offsets + s.experts_per_rank + 1};
  }
  __device__ bool overflow(const Shape& s) const { return offsets[s.experts_per_rank] < 0; }
};

// Peers write the counts, routes and token indices this code reads: every one is checked against its range
// before it addresses anything (a violation is recorded on every rank and the value is not used).
__device__ __forceinline__ bool peer_value_ok(const Params& p, bool ok, int src, int64_t value, PeerField field) {
  if (!ok) record_error_everywhere(p, StatusCode::kInternal, kErrorPeerIndex, src, value, field);
  return ok;
}

// Every thread of a CTA, once every source's counts are in recv_counts: fills `t` (on overflow every expert
// is left empty: nothing is written past the buffers, the GEMMs do nothing, and the error recorded by the
// CTA with `report` set turns the outputs into NaN). publish: this CTA also writes expert_offsets. Returns
// false when a peer wrote a count out of range (recorded; that count was taken as 0).
__device__ inline bool route_offsets(const Params& p, const RouteTables& t, bool report, bool publish) {
  const Shape& s = p.shape;
  const int EL = s.experts_per_rank, R = s.num_ranks, K = s.top_k;
  const int32_t* counts = at<int32_t>(p.local, p.layout.recv_counts);
  const int64_t max_rows_per_source = static_cast<int64_t>(s.max_tokens) * K;
  bool counts_ok = true;
  for (int e = threadIdx.x; e < EL; e += blockDim.x) {
    int64_t running = 0;
    for (int src = 0; src < R; ++src) {
      t.base[src * EL + e] = static_cast<int32_t>(running);
      const int32_t n = counts[src * (EL + 1) + e];
      if (peer_value_ok(p, n >= 0 && n <= max_rows_per_source, src, n, kPeerCount)) {
        running += n;
      } else {
        counts_ok = false;
      }
    }
    // Rows of expert e (scanned below); past the capacity the scan reports the overflow.
    t.offsets[e] = static_cast<int32_t>(running <= s.row_capacity ? running : s.row_capacity + 1);
  }
  counts_ok = __syncthreads_and(counts_ok);
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int e = 0; e < EL; ++e) {
      const int64_t n = t.offsets[e];
      t.offsets[e] = static_cast<int32_t>(total);  // zeroed below on overflow
      total += n;
    }
    const bool overflow = total > s.row_capacity;
    if (overflow) {
      for (int e = 0; e < EL; ++e) t.offsets[e] = 0;
      if (report) {
        // The per-expert sums above stop at capacity + 1; the message gives the rows this call needed.
        int64_t needed = 0;
        for (int i = 0; i < R * (EL + 1); ++i) {
          const int32_t n = counts[i];
          if (i % (EL + 1) < EL && n > 0 && n <= max_rows_per_source) needed += n;
        }
        record_error_everywhere(p, StatusCode::kCapacityExceeded, kErrorCapacity, needed, s.row_capacity);
      }
    }
    t.offsets[EL] = overflow ? -1 : static_cast<int32_t>(total);
    int32_t blocks = 0;
    for (int e = 0; e < EL; ++e) {
      t.block_start[e] = blocks;
      if (!overflow) blocks += (t.offsets[e + 1] - t.offsets[e] + 127) / 128;
    }
    t.block_start[EL] = blocks;
  }
  __syncthreads();
  const bool overflow = t.overflow(s);
  if (publish) {
    int32_t* out = at<int32_t>(p.local, p.layout.expert_offsets);
    for (int e = threadIdx.x; e <= EL; e += blockDim.x) out[e] = overflow ? 0 : t.offsets[e];
  }
  if (overflow) return counts_ok;
  for (int k = threadIdx.x; k < R * EL; k += blockDim.x) t.base[k] += t.offsets[k % EL];
  __syncthreads();
  return counts_ok;
}

// One received token (item = src * T + slot of the receive slab) whose rows have landed: the tables of each
// of its expert rows. on_row(row, local_expert, token, j) runs after a row's tables are written. False when
// a value the peer wrote was out of range (recorded; its rows are left out).
template <class OnRow>
__device__ __forceinline__ bool route_item(const Params& p, const RouteTables& t, int64_t item, OnRow&& on_row) {
  const Shape& s = p.shape;
  const int EL = s.experts_per_rank, K = s.top_k;
  const int32_t* counts = at<int32_t>(p.local, p.layout.recv_counts);
  const int src = static_cast<int>(item / s.max_tokens);
  const int slot = static_cast<int>(item % s.max_tokens);
  const int32_t tokens = counts[src * (EL + 1) + EL];
  if (slot == 0 && !peer_value_ok(p, tokens >= 0 && tokens <= s.max_tokens, src, tokens, kPeerTokens)) return false;
  if (slot >= tokens) return true;
  const int64_t token = at<int32_t>(p.local, p.layout.recv_token)[item];
  if (!peer_value_ok(p, token >= 0 && token < s.max_tokens, src, token, kPeerToken)) return false;
  bool ok = true;
  const SlotRoute* routes = at<SlotRoute>(p.local, p.layout.recv_routes);
  const float* recv_weights = at<float>(p.local, p.layout.recv_weights);
  for (int j = 0; j < K; ++j) {
    const SlotRoute route = routes[item * K + j];
    if (route.local_expert < 0) continue;
    if (!peer_value_ok(p, route.local_expert < EL, src, route.local_expert, kPeerLocalExpert)) {
      ok = false;
      continue;
    }
    // The count as route_offsets took it (a count out of range counted as 0 there), and the row inside the
    // expert's rows: whatever a peer wrote, no table entry outside them is written.
    const int32_t count = counts[src * (EL + 1) + route.local_expert];
    const int64_t rows_of_source = count >= 0 && count <= static_cast<int64_t>(s.max_tokens) * K ? count : 0;
    const int64_t row = t.base[src * EL + route.local_expert] + route.index;
    if (!peer_value_ok(p, route.index >= 0 && route.index < rows_of_source && row < t.offsets[route.local_expert + 1],
                       src, route.index, kPeerRowIndex)) {
      ok = false;
      continue;
    }
    const int64_t pair = token * K + j;
    at<int32_t>(p.local, p.layout.row_src)[row] = static_cast<int32_t>(item);
    at<float>(p.local, p.layout.row_weight)[row] = recv_weights[item * K + j];
    at<void*>(p.local, p.layout.row_dest)[row] = at<__nv_bfloat16>(p.peers[src], p.layout.combine) + pair * s.hidden;
    at<float*>(p.local, p.layout.row_dot_dest)[row] = at<float>(p.peers[src], p.layout.slot_dots) + pair * s.dot_parts;
    at<uint32_t*>(p.local, p.layout.row_signal)[row] = at<uint32_t>(p.peers[src], p.layout.token_done) + token;
    on_row(row, route.local_expert, token, j);
  }
  return ok;
}

}  // namespace megamoe::ep
