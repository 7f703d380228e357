// The symmetric workspace of the expert-parallel layer: the same byte layout on every rank, so a kernel
// reaches a peer's copy of any buffer at peer_base + offset. Host and device code share this header.
#pragma once

#include <cstdint>

#include "comm/device_error.hpp"
#include "kernels/fp8_layout.hpp"

namespace megamoe::ep {

// Barriers of one forward + backward; each has its own counter so that the counters can reset
// themselves (see device_sync.cuh). kBarrierGradDone: after the fused backward's weight gradients, which read
// recv_x and recv_dout after the kernel's own last barrier, so that no peer's next call writes them sooner.
enum BarrierId : int { kBarrierDispatched = 0, kBarrierCombined = 1, kBarrierGradDispatched = 2,
                       kBarrierGradCombined = 3, kBarrierGradDone = 4, kNumBarriers = 5 };

// Per-slot routing as the receiver sees it.
struct SlotRoute {
  int32_t local_expert;  // -1: this slot goes elsewhere or is masked
  int32_t index;         // position among the rows the source sends to this expert
};

inline constexpr int kMaxLayoutBlocks = 128;  // CTAs of the source-side layout step (ep_layout.cu)

struct Shape {
  int32_t hidden;
  int32_t intermediate;
  int32_t num_experts;
  int32_t experts_per_rank;
  int32_t top_k;
  int32_t num_ranks;
  int32_t rank;
  int32_t max_tokens;
  int64_t row_capacity;
  int32_t dot_parts;  // partial sums of the routing-weight gradient per (token, slot): n-tiles of da
  int32_t recompute_h;  // 1: the forward keeps no h, the backward recomputes it into the dh buffer (h == dh)
  int32_t fp8;          // 1: blockwise FP8 (the e4m3 operands and their scales below have room)
};

inline constexpr int64_t kAlign = 256;
inline constexpr int64_t align_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of every buffer in a rank's slice. Row counts: T = max tokens, C = row capacity, R ranks.
// Expert-major rows (row r of local expert e's block) are never copied: the GEMMs read them from the
// receive buffers through row_src, and store their outputs home through row_dest.
struct WorkspaceLayout {
  // control
  int64_t error = 0;           // DeviceError
  int64_t barriers = 0;        // uint64 [kNumBarriers]
  int64_t broken = 0;          // int32: set for good when a barrier timed out on any rank (see rank_barrier.cuh)
  // source side (this rank's tokens)
  int64_t pair_dest_slot = 0;  // int32 [T, K]: slot of token t in the receive slab of slot j's rank; -1 masked
  int64_t pair_send_rank = 0;  // int32 [T, K]: slot j's rank if j is the token's first slot on it, else -1
  int64_t pair_row_index = 0;  // int32 [T, K]: index among this rank's rows for slot j's expert
  int64_t layout_counts = 0;   // int32 [E + R][kMaxLayoutBlocks]: per-block key counts of the layout step
  int64_t layout_bad = 0;      // int32 [kMaxLayoutBlocks]: per-block count of bad expert ids
  int64_t combine = 0;         // bf16 [T, K, H]: y rows (forward) and d_x rows (backward) sent home
  int64_t slot_dots = 0;       // f32 [T, K, dot_parts]: partials of d_topk_weights sent home
  // receive side (rows for this rank's experts)
  int64_t recv_counts = 0;     // int32 [R, E_local + 1]: rows per local expert, then tokens, per source
  int64_t recv_x = 0;          // bf16 [R, T, H]: x of the received tokens, kept for the backward (d_w13)
  int64_t recv_dout = 0;       // bf16 [R, T, H]: d_out of the received tokens (backward)
  int64_t recv_token = 0;      // int32 [R, T]: token index on the source
  int64_t recv_routes = 0;     // SlotRoute [R, T, K]
  int64_t recv_weights = 0;    // f32 [R, T, K]
  int64_t expert_offsets = 0;  // int32 [E_local + 1]: expert-major row offsets (device-side counts)
  int64_t gemm_work_counter = 0;  // int32: work-item counter of the weight-gradient GEMMs (dynamic scheduling)
  int64_t row_src = 0;         // int32 [C]: the row's receive-buffer row (src * T + slot)
  int64_t row_weight = 0;      // f32 [C]: its routing weight
  int64_t row_dest = 0;        // pointer [C]: its combine row on the source rank
  int64_t row_dot_dest = 0;    // pointer [C]: its dot_parts partials on the source rank
  int64_t h = 0;               // bf16 [C, 2I]  saved for the backward (SwiGLU backward); with recompute_h the
                               //               backward recomputes it here and the SwiGLU backward overwrites
                               //               it with dh in place
  int64_t a = 0;               // bf16 [C, I]   forward: a; backward: w * a (recomputed from h) for d_w2
  int64_t dh = 0;              // bf16 [C, 2I]  (== h with recompute_h)
  // fused kernels (kernels/fused_roles.cuh): counters that are 0 between calls
  int64_t grid_arrivals = 0;   // uint32: grid barrier of the rank's persistent kernel (device/comm/grid_barrier.cuh)
  int64_t grid_exits = 0;      // uint32
  int64_t counts_arrived = 0;  // uint32: sources whose counts have reached this rank's recv_counts
  int64_t rows_arrived = 0;    // uint32 [R]: token rows each source has written into this rank's receive slab
  int64_t rows_ready = 0;      // uint32 [row blocks]: rows routed per 128-row block of the expert-major rows
  int64_t act_ready = 0;       // uint32 [row blocks]: GEMM1 warpgroup slices whose a is stored, per block
  int64_t token_done = 0;      // uint32 [T]: y rows stored home per token (one per slot and GEMM2 n-tile)
  int64_t row_signal = 0;      // pointer [C]: the row's token_done counter on its source rank (route_rows)
  int64_t fused_work = 0;      // int32: work-item counter of the fused forward's GEMMs (dynamic schedule)
  // blockwise FP8 (shape.fp8; empty otherwise): e4m3 bytes and fp32 1x128 / 128x128 scales
  int64_t x_q = 0;             // e4m3 [T, H]: this rank's tokens, quantized before the dispatch
  int64_t x_s = 0;             // f32 [T, H / 128]
  int64_t recv_xq = 0;         // e4m3 [R, T, H]: the received token rows
  int64_t recv_xs = 0;         // f32 [R, T, H / 128]: their scales, a row's together
  int64_t rows_q = 0;          // e4m3 [C, H]: received rows in expert order, GEMM1's x then the dgrad's d_out
  int64_t rows_s = 0;          // f32 [H / 128, kernels::fp8_scale_pitch(C)]: their scales, K-block-major
  int64_t h_f32 = 0;           // f32 [C, 2I]: GEMM1's output, unrounded (a is quantized from it)
  int64_t a_q = 0;             // e4m3 [C, I]: GEMM2's operand
  int64_t a_s = 0;             // f32 [I / 128, kernels::fp8_scale_pitch(C)]: K-block-major
  int64_t w13_q = 0;           // e4m3 [E_local, 2I, H]: the call's W13, 128x128 blocks
  int64_t w13_s = 0;           // f32 [E_local, 2I / 128, H / 128]
  int64_t w2_q = 0;            // e4m3 [E_local, H, I]
  int64_t w2_s = 0;            // f32 [E_local, H / 128, I / 128]
  // blockwise FP8 backward (docs/FP8.md, the backward's steps)
  int64_t dout_q = 0;          // e4m3 [T, H]: this rank's d_out, quantized before its dispatch
  int64_t dout_s = 0;          // f32 [T, H / 128]
  int64_t recv_doutq = 0;      // e4m3 [R, T, H]: the received d_out rows
  int64_t recv_douts = 0;      // f32 [R, T, H / 128]
  int64_t g_f32 = 0;           // f32 [C, I]: g = q(dOut) . W2q, the dgrad of GEMM2 before the routing weight
  int64_t dh_q = 0;            // e4m3 [C, 2I]: dh, the dgrad of GEMM1's operand
  int64_t dh_s = 0;            // f32 [2I / 128, kernels::fp8_scale_pitch(C)]: K-block-major
  int64_t w2t_q = 0;           // e4m3 [E_local, I, H]: W2q transposed (K-major for g = dOut . W2)
  int64_t w2t_s = 0;           // f32 [E_local, I / 128, H / 128]
  int64_t w13t_q = 0;          // e4m3 [E_local, H, 2I]: W13q transposed (K-major for dx = dh . W13)
  int64_t w13t_s = 0;          // f32 [E_local, H / 128, 2I / 128]
  // The weight gradients' token-major operands (kernels/fp8_token_major.hpp): [channels, columns] e4m3 and
  // K-block-major scales [columns / 128, channels] (16 bits each: TokenMajorScale, kernels/fp8_layout.hpp),
  // columns = token_major_columns(C, E_local).
  int64_t dyt_q = 0, dyt_s = 0;  // dy = w dOut, H channels
  int64_t at_q = 0, at_s = 0;    // a, I channels
  int64_t dht_q = 0, dht_s = 0;  // dh, 2I channels
  int64_t xt_q = 0, xt_s = 0;    // x, H channels
  int64_t total = 0;

  // 128-row blocks of the expert-major rows: at most one partial block per expert besides the full ones.
  static constexpr int64_t row_blocks(const Shape& s) { return (s.row_capacity + 127) / 128 + s.experts_per_rank; }

  static WorkspaceLayout make(const Shape& s) {
    WorkspaceLayout l;
    const int64_t H = s.hidden, I = s.intermediate, K = s.top_k, R = s.num_ranks, T = s.max_tokens;
    const int64_t EL = s.experts_per_rank, C = s.row_capacity, E = s.num_experts, P = s.dot_parts;
    int64_t at = 0;
    auto take = [&at](int64_t bytes) {
      const int64_t offset = at;
      at = align_up(at + bytes);
      return offset;
    };
    l.error = take(sizeof(DeviceError));
    l.barriers = take(8 * kNumBarriers);
    l.broken = take(4);
    l.pair_dest_slot = take(4 * T * K);
    l.pair_send_rank = take(4 * T * K);
    l.pair_row_index = take(4 * T * K);
    l.layout_counts = take(4 * (E + R) * kMaxLayoutBlocks);
    l.layout_bad = take(4 * kMaxLayoutBlocks);
    l.combine = take(2 * T * K * H);
    l.slot_dots = take(4 * T * K * P);
    l.recv_counts = take(4 * R * (EL + 1));
    // The bf16 rows, activations and gradients only the bf16 layer reads and writes take no room in an FP8
    // layer, whose forward and backward use their e4m3 and fp32 counterparts (at the end).
    const int64_t b = s.fp8 ? 0 : 1;
    l.recv_x = take(b * 2 * R * T * H);
    l.recv_dout = take(b * 2 * R * T * H);
    l.recv_token = take(4 * R * T);
    l.recv_routes = take(static_cast<int64_t>(sizeof(SlotRoute)) * R * T * K);
    l.recv_weights = take(4 * R * T * K);
    l.expert_offsets = take(4 * (EL + 1));
    l.gemm_work_counter = take(4);
    l.row_src = take(4 * C);
    l.row_weight = take(4 * C);
    l.row_dest = take(8 * C);
    l.row_dot_dest = take(8 * C);
    l.h = take(b * 2 * C * 2 * I);
    l.a = take(b * 2 * C * I);
    l.dh = s.recompute_h ? l.h : take(b * 2 * C * 2 * I);
    const int64_t blocks = row_blocks(s);
    l.grid_arrivals = take(4);
    l.grid_exits = take(4);
    l.counts_arrived = take(4);
    l.rows_arrived = take(4 * R);
    l.rows_ready = take(4 * blocks);
    l.act_ready = take(4 * blocks);
    l.token_done = take(4 * T);
    l.row_signal = take(8 * C);
    l.fused_work = take(4);
    const int64_t q = s.fp8 ? 1 : 0;  // FP8 buffers take no room otherwise
    l.x_q = take(q * T * H);
    l.x_s = take(q * 4 * T * (H / 128));
    l.recv_xq = take(q * R * T * H);
    l.recv_xs = take(q * 4 * R * T * (H / 128));
    l.rows_q = take(q * C * H);
    l.rows_s = take(q * 4 * (H / 128) * kernels::fp8_scale_pitch(C));
    l.h_f32 = take(q * 4 * C * 2 * I);
    l.a_q = take(q * C * I);
    l.a_s = take(q * 4 * (I / 128) * kernels::fp8_scale_pitch(C));
    l.w13_q = take(q * EL * 2 * I * H);
    l.w13_s = take(q * 4 * EL * (2 * I / 128) * (H / 128));
    l.w2_q = take(q * EL * H * I);
    l.w2_s = take(q * 4 * EL * (H / 128) * (I / 128));
    l.dout_q = take(q * T * H);
    l.dout_s = take(q * 4 * T * (H / 128));
    l.recv_doutq = take(q * R * T * H);
    l.recv_douts = take(q * 4 * R * T * (H / 128));
    l.g_f32 = take(q * 4 * C * I);
    l.dh_q = take(q * C * 2 * I);
    l.dh_s = take(q * 4 * (2 * I / 128) * kernels::fp8_scale_pitch(C));
    l.w2t_q = take(q * EL * I * H);
    l.w2t_s = take(q * 4 * EL * (I / 128) * (H / 128));
    l.w13t_q = take(q * EL * H * 2 * I);
    l.w13t_s = take(q * 4 * EL * (H / 128) * (2 * I / 128));
    const int64_t columns = kernels::token_major_columns(C, EL);
    l.dyt_q = take(q * H * columns);
    l.dyt_s = take(q * 2 * (columns / 128) * H);
    l.at_q = take(q * I * columns);
    l.at_s = take(q * 2 * (columns / 128) * I);
    l.dht_q = take(q * 2 * I * columns);
    l.dht_s = take(q * 2 * (columns / 128) * 2 * I);
    l.xt_q = take(q * H * columns);
    l.xt_s = take(q * 2 * (columns / 128) * H);
    l.total = at;
    return l;
  }
};

// Everything a layer kernel needs, passed by value.
struct Params {
  Shape shape;
  WorkspaceLayout layout;
  char* local;                 // this rank's workspace
  char* const* peers;          // device array [R] of workspace bases
  int64_t num_tokens;          // T of this rank's current call
  uint64_t timeout_ns;
};

}  // namespace megamoe::ep
