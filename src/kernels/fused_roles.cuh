// The parts the fused forward and the fused backward share: their launch geometry, their bounded waits (a
// timeout breaks the group on every rank), and the roles that move rows between ranks: dispatch (this
// rank's rows to the ranks that own their experts, then one release per destination), the arrival of a
// source's rows, the combine of this rank's tokens once their rows are home, the counters' reset, and the
// diagnostics timeline. Each role is a device function run by every thread of the CTAs given to it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"
#include "comm/rank_barrier.cuh"
#include "device/comm/grid_barrier.cuh"
#include "device/comm/signal.cuh"
#include "kernels/ep_combine.cuh"
#include "kernels/ep_dispatch.cuh"
#include "kernels/fused_forward.hpp"

namespace megamoe::kernels {

inline constexpr int kFusedThreads = 384;
inline constexpr int kFusedWarps = kFusedThreads / 32;
inline constexpr int kFusedMaxExperts = 256;  // local experts
inline constexpr int kFusedMaxRanks = 64;

// ---------------------------------------------------------------- waits

// When a wait of a fused kernel gives up before its target without a timeout.
enum class GiveUp {
  kWhenBroken,  // only when the group is broken: the counter's producers always finish otherwise
  kOnError,     // also when any error is recorded (the waiting result is then NaN anyway)
};

// Waits until *counter >= target (acquire, system scope: peers write some of these counters). A timeout
// breaks the group on every rank (break_group): a late arrival could still come and would leave the
// counter wrong for the next call, so no later call may trust it.
template <class T>
__device__ bool fused_wait(const ep::Params& L, const T* counter, T target, int64_t id, GiveUp give_up,
                           uint64_t timeout_ns) {
  device::WaitReport r{ep::error_record(L.local, L.layout), L.shape.rank, timeout_ns};
  r.stop_on_error = give_up == GiveUp::kOnError;
  r.stop_flag = ep::at<int32_t>(L.local, L.layout.broken);
  bool timed_out = false;
  if (device::wait_at_least<device::Scope::kSystem>(counter, target, r, id, &timed_out)) return true;
  if (timed_out) {
    const T seen = device::load_acquire<device::Scope::kSystem>(counter);
    ep::break_group(L, ep::kErrorWaitTimeout, id, static_cast<int64_t>(seen), static_cast<int64_t>(target));
  }
  return false;
}

// One thread waits, then the CTA goes on together; flag: shared memory.
template <class T>
__device__ __forceinline__ bool cta_wait(const ep::Params& L, const T* counter, T target, int64_t id, GiveUp give_up,
                                         int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) *flag = fused_wait(L, counter, target, id, give_up, L.timeout_ns) ? 1 : 0;
  __syncthreads();
  return *flag != 0;
}

// ---------------------------------------------------------------- roles

// This rank's token rows to their destination ranks (`rows` into the receive buffer at `recv_buffer`; with
// `weights`, the forward, also the routing), one warp per token over every CTA, then one release per
// destination of the token rows sent there (its rows_arrived[this rank]). sent: shared memory, R entries.
// Every CTA takes part: the GEMMs wait for the rows whoever moves them (a first-GEMM tile needs rows from every
// source, counted once all of a source's rows have landed), and one CTA in 16 took 0.70 ms to dispatch 16384
// tokens of 4 KB at R = 1 (docs/PERF.md, run 24).
template <typename Index>
__device__ void dispatch_role(const ep::Params& L, const __nv_bfloat16* rows, int64_t recv_buffer, const Index* idx,
                              const float* weights, uint32_t* sent) {
  const int R = L.shape.num_ranks;
  for (int d = threadIdx.x; d < R; d += kFusedThreads) sent[d] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kFusedWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kFusedWarps + threadIdx.x / 32; t < L.num_tokens; t += warps)
    ep::dispatch_token(L, ep::Bf16Row{rows, recv_buffer}, idx, weights, t, lane, sent);
  __syncthreads();
  for (int d = threadIdx.x; d < R; d += kFusedThreads) {
    if (sent[d] == 0) continue;
    __threadfence_system();  // this CTA's row copies (ordered before by __syncthreads) reach the peer first
    device::signal_add<device::Scope::kSystem>(ep::at<uint32_t>(L.peers[d], L.layout.rows_arrived) + L.shape.rank,
                                               sent[d]);
  }
}

// Every thread of a CTA: waits until all the token rows source `src` sends this rank have landed and returns
// their number, or -1 (the wait gave up; or the peer-written count is out of range, which breaks the group:
// its arrivals cannot be counted). The wait does not give up on a recorded error: every source signals once
// per call whatever happened, and rows_arrived must have seen every arrival before it is reset.
// report: this CTA records and breaks the group on a bad count (one CTA of those that wait for `src`).
// shared: two ints of shared memory.
__device__ inline int32_t source_rows_landed(const ep::Params& L, int src, bool report, int* shared) {
  const ep::Shape& s = L.shape;
  const int EL = s.experts_per_rank;
  // One thread reads the peer-written count, so that the CTA agrees on it.
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t tokens = ep::at<int32_t>(L.local, L.layout.recv_counts)[src * (EL + 1) + EL];
    const bool ok = tokens >= 0 && tokens <= s.max_tokens;
    if (!ok && report) {
      (void)ep::peer_value_ok(L, false, src, tokens, ep::kPeerTokens);
      ep::break_group(L, ep::kErrorPeerIndex, src, tokens, ep::kPeerTokens);
    }
    shared[1] = ok ? tokens : -1;
  }
  __syncthreads();
  const int32_t tokens = shared[1];
  if (tokens < 0) return -1;
  const uint32_t* rows_arrived = ep::at<uint32_t>(L.local, L.layout.rows_arrived);
  if (!cta_wait(L, rows_arrived + src, static_cast<uint32_t>(tokens), ep::fused_wait_id(ep::kWaitRows, src),
                GiveUp::kWhenBroken, shared))
    return -1;
  return tokens;
}

// This rank's tokens, one warp each over every CTA, as soon as each has its rows home: token_done[t] must
// reach (its routed slots) x signals_per_slot. kWeighted: the forward's out = sum_j w_j y_j; else the
// backward's d_x and d_topk_weights.
template <bool kWeighted>
__device__ void combine_role(const ep::Params& L, int signals_per_slot, const float* topk_weights,
                             __nv_bfloat16* out, float* d_topk_weights) {
  const uint32_t* token_done = ep::at<uint32_t>(L.local, L.layout.token_done);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kFusedWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kFusedWarps + threadIdx.x / 32; t < L.num_tokens; t += warps) {
    int ok = 1;
    if (lane == 0) {
      const uint32_t target = static_cast<uint32_t>(ep::routed_slots(L, t) * signals_per_slot);
      ok = fused_wait(L, token_done + t, target, ep::fused_wait_id(ep::kWaitToken, t), GiveUp::kOnError, L.timeout_ns)
               ? 1
               : 0;
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();  // the lanes' reads of the slots after lane 0's acquire
    ep::combine_token<kWeighted, 2>(L, t, lane, ok == 0 || ep::has_error(L), topk_weights, out, d_topk_weights);
  }
}

// Every thread of every CTA (between two grid barriers, before the rank barrier): the call's counters back to
// 0. The counters peers signal (counts_arrived, rows_arrived) have seen every arrival of the call by now, and
// a peer's next signal needs this rank's arrival at the rank barrier that follows. (token_done is reset after
// that barrier: fused_kernel_end.)
__device__ inline void reset_counters(const ep::Params& L) {
  const int64_t blocks = ep::WorkspaceLayout::row_blocks(L.shape);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFusedThreads;
  uint32_t* rows_ready = ep::at<uint32_t>(L.local, L.layout.rows_ready);
  uint32_t* act_ready = ep::at<uint32_t>(L.local, L.layout.act_ready);
  uint32_t* rows_arrived = ep::at<uint32_t>(L.local, L.layout.rows_arrived);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kFusedThreads + threadIdx.x;
  for (int64_t i = first; i < blocks; i += stride) {
    rows_ready[i] = 0;
    act_ready[i] = 0;
  }
  for (int64_t i = first; i < L.shape.num_ranks; i += stride) rows_arrived[i] = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *ep::at<uint32_t>(L.local, L.layout.counts_arrived) = 0;
    *ep::at<int>(L.local, L.layout.fused_work) = 0;
  }
}

// Diagnostics, the producer's first thread in the GEMM phase: the time it spent at readiness gates and the
// items it loaded, written into the CTA's kStampGateWaitNs / kStampItems entries of the timeline, if any.
struct GateClock {
  uint64_t* timeline;
  uint64_t waited = 0;
  uint64_t items = 0;
  __device__ __forceinline__ uint64_t start() const { return timeline != nullptr ? device::global_timer_ns() : 0; }
  __device__ __forceinline__ void stop(uint64_t since) {
    if (timeline != nullptr) waited += device::global_timer_ns() - since;
  }
  __device__ __forceinline__ void write() const {
    if (timeline == nullptr) return;
    uint64_t* mine = timeline + static_cast<int64_t>(blockIdx.x) * ep::kFusedTimelineStamps;
    mine[ep::kStampGateWaitNs] = waited;
    mine[ep::kStampItems] = items;
  }
};

// Diagnostics: thread 0 of the CTA writes the global timer into its entry `which` of the timeline, if any.
__device__ __forceinline__ void stamp(uint64_t* timeline, ep::FusedStamp which) {
  if (timeline != nullptr && threadIdx.x == 0)
    timeline[static_cast<int64_t>(blockIdx.x) * ep::kFusedTimelineStamps + which] = device::global_timer_ns();
}

// The grid barriers of a fused kernel: numbered in the order every CTA passes them. A CTA can reach one up to
// a wait timeout after the others (its last wait gave up there, or CTA 0 waited at the rank barrier), so they
// wait three timeouts before they give up; giving up (a CTA never came) breaks the group.
struct FusedGrid {
  device::GridBarrier barrier;
  device::WaitReport report;
  int passed;

  __device__ static FusedGrid of(const ep::Params& L) {
    device::WaitReport r{ep::error_record(L.local, L.layout), L.shape.rank, 3 * L.timeout_ns};
    r.stop_flag = ep::at<int32_t>(L.local, L.layout.broken);
    return FusedGrid{device::GridBarrier{ep::at<uint32_t>(L.local, L.layout.grid_arrivals),
                                         ep::at<uint32_t>(L.local, L.layout.grid_exits), static_cast<int>(gridDim.x)},
                     r, 0};
  }
  // Every thread of every CTA.
  __device__ void sync(const ep::Params& L) {
    ++passed;
    const int64_t id = ep::fused_wait_id(ep::kWaitGridBarrier, passed);
    bool timed_out = false;
    if (!barrier.sync(passed, report, id, &timed_out) && threadIdx.x == 0 && timed_out)
      ep::break_group(L, ep::kErrorWaitTimeout, id, 0, static_cast<int64_t>(passed) * gridDim.x);
  }
};

// Every thread of every CTA, first thing: a group broken by an earlier timeout has counters nobody can
// trust, so such a call sends and awaits nothing; it records kErrorBroken and NaNs its outputs (nan_outputs,
// run by every thread), and the kernel returns. (Each CTA reads the flag: should a peer set it during these
// first instructions, the CTAs that missed it give up at their first grid barrier, through its stop flag.)
template <class NanOutputs>
__device__ bool fused_kernel_refused(const ep::Params& L, int barrier_id, NanOutputs&& nan_outputs) {
  if (!ep::is_broken(L)) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    ep::record_error(ep::error_record(L.local, L.layout), StatusCode::kTimeout, ep::kErrorBroken, L.shape.rank,
                     barrier_id, 0);
  nan_outputs();
  return true;
}

// Every thread of every CTA, last thing: the counters back to 0, the rank barrier `barrier_id` (so that every
// rank's errors of the call are seen), token_done back to 0 (every token of the workspace: a row of a failed
// call may have counted any), the outputs NaN (nan_outputs) if any rank recorded an error, and the grid
// barrier's own reset.
template <class NanOutputs>
__device__ void fused_kernel_end(const ep::Params& L, FusedGrid& grid, int barrier_id, uint64_t* timeline,
                                 NanOutputs&& nan_outputs) {
  grid.sync(L);
  reset_counters(L);
  grid.sync(L);
  if (blockIdx.x == 0 && threadIdx.x == 0) ep::rank_barrier(L, barrier_id);
  grid.sync(L);
  const bool failed = ep::has_error(L);
  uint32_t* token_done = ep::at<uint32_t>(L.local, L.layout.token_done);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFusedThreads + threadIdx.x; i < L.shape.max_tokens;
       i += static_cast<int64_t>(gridDim.x) * kFusedThreads)
    token_done[i] = 0;
  if (failed) nan_outputs();
  stamp(timeline, ep::kStampEnd);
  grid.barrier.leave();
}

// Every thread of every CTA: data[0, count) = NaN.
template <typename T>
__device__ __forceinline__ void fill_nan(T* data, int64_t count) {
  const T nan = static_cast<T>(__int_as_float(0x7fc00000));
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFusedThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kFusedThreads)
    data[i] = nan;
}


}  // namespace megamoe::kernels
