// The expert-parallel MoE layer on the GPU (BF16, modular path): one object per rank.
//
// Data path per call, all on the device with no host synchronisation (so forward and backward can be
// captured in a CUDA graph):
//   forward : layout (counts, slots) -> dispatch (each token once per destination rank) -> barrier
//             -> expert-major row numbering (no copy) -> GEMM1 reading the received rows by index, SwiGLU
//             in its epilogue -> GEMM2 storing each row into the source rank's per-slot buffer -> barrier
//             -> weighted reduce over the K slots in a fixed order.
//   backward: dispatch d_out with the forward's routing -> barrier -> dgrad GEMM with the SwiGLU backward
//             and the d_topk_weights partials in its epilogue -> dgrad GEMM storing d_x rows home ->
//             weight-gradient GEMMs (fp32 or bf16) -> barrier -> reduce over the K slots.
// Ranks meet only at device-side barriers over a symmetric workspace (same layout on every rank, peers
// reached through a table of base addresses); every wait has a timeout.
//
// Errors found on the device (expert id out of range, receive capacity exceeded, barrier timeout, a value a
// peer wrote out of range) are recorded in the workspace of every rank they concern; every output of an
// affected call is NaN on every rank (weight gradients included; also the backward of a failed forward),
// never silently wrong, and synchronize_and_check() returns the recorded Status. Arguments are checked
// (null, sizes, 16-byte alignment) before anything is enqueued.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/status.hpp"

namespace megamoe {

// Which forward a layer runs. kModular: a sequence of kernels (layout, dispatch, a rank barrier, row
// routing, GEMM1 with SwiGLU, GEMM2 storing each row home, a rank barrier, combine). kFused: one persistent
// kernel per rank that does all of it with the communication overlapped with the GEMMs (docs/LAYER.md).
// Both compute bitwise the same outputs and leave the same state for the backward; every rank of a group
// must use the same one.
enum class ForwardPath : int32_t { kModular = 0, kFused = 1 };

// Which backward a layer runs. kModular: dispatch of d_out, a rank barrier, the two dgrad GEMMs, the weight
// gradients, a rank barrier, combine. kFused: one persistent kernel per rank for the data path (dispatch of
// d_out, both dgrad GEMMs gated on the rows as they land, d_x rows home, combine) with the communication
// overlapped, then the weight-gradient GEMMs. Bitwise the same gradients; every rank must use the same one.
enum class BackwardPath : int32_t { kModular = 0, kFused = 1 };

struct LayerOptions {
  // Expert-major rows a rank can receive in one call. 0 = num_ranks * max_tokens_per_rank *
  // min(top_k, experts_per_rank): the worst case for tokens whose top-k experts are distinct (every token of
  // every rank routed here with all its slots). A token that lists one expert twice makes two rows, so such
  // routing can need more; a call that would need more than the capacity reports kCapacityExceeded.
  int64_t expert_row_capacity = 0;
  // Bound on every device spin-wait, in [0.001, 86400] seconds; past it the call reports kTimeout naming
  // the wait, and the layer is unusable from then on (every rank's later calls give NaN and report it;
  // once reported, calls are refused): recreate it.
  double wait_timeout_seconds = 20.0;
  // kFused (either direction) runs at most 256 local experts per rank and 64 ranks (create() says so
  // otherwise).
  ForwardPath forward_path = ForwardPath::kModular;
  BackwardPath backward_path = BackwardPath::kModular;
  // What the forward keeps for the backward. false: h (2I values per routed row), so the backward needs no
  // GEMM1. true: no h; the backward runs GEMM1 once more (a third of the forward's FLOPs) and h shares its
  // buffer with dh, so the layer's workspace is 4I bytes per routed row smaller and the forward writes 4I
  // bytes per row less. The gradients are bitwise the same either way (docs/LAYER.md).
  bool recompute_h = false;
};

// Checks the options' own rules (the capacity's sign, the timeout's range); the message names the field.
Status validate(const LayerOptions& options);

enum class IndexType { kInt64, kInt32 };

// Which fp8-blockwise GEMMs of the layer run the overlapped promotion (ExpertParallelLayer::
// set_fp8_overlap_promotion). On H200 it speeds up the GEMMs whose A rows arrive by TMA (8-12% each, run 58)
// and slows the weight gradients (1-4%). The layer's four data GEMMs (GEMM1, GEMM2 and the backward's two
// dgrads) all load A by TMA since their received rows are copied into expert order first; the whole step
// then runs 3-4% faster than with the plain loops (docs/PERF.md, run 62).
enum class Fp8PromotionOverlap : int32_t {
  kNone = 0,         // every FP8 GEMM with the plain loop
  kTmaOperands = 1,  // the GEMMs whose A rows are loaded by TMA: the four data GEMMs (the default)
  kAll = 2,          // every FP8 GEMM, the weight gradients included
};

struct ForwardArgs {
  int64_t num_tokens = 0;                    // T <= max_tokens_per_rank, may be 0
  const __nv_bfloat16* x = nullptr;          // [T, H]
  const void* topk_idx = nullptr;            // [T, K], global expert ids, -1 = masked
  IndexType topk_idx_type = IndexType::kInt64;
  const float* topk_weights = nullptr;       // [T, K]
  const __nv_bfloat16* w13 = nullptr;        // [E_local, 2I, H]
  const __nv_bfloat16* w2 = nullptr;         // [E_local, H, I]
  __nv_bfloat16* out = nullptr;              // [T, H]
  // fp8-blockwise layers quantize w13 and w2 once per version. 0 (the default): unknown, quantized on every
  // call. Any other value promises that w13 and w2 hold the values they held in this layer's last call with
  // the same pointers and version, whose quantized copies are then reused: bump it whenever the weights
  // change (an optimizer step). A CUDA graph captured with a reused version replays without quantizing; a
  // captured call never counts as the one that quantized a version. The quantized copies live in the layer's
  // workspace, one set: a graph whose capture quantized rewrites them when it replays, so a layer that
  // replays such graphs must not mix in eager calls that reuse a version of other weights.
  uint64_t weights_version = 0;
  // fp8-blockwise only, optional: the expert weights already quantized, in the layout of the layer's own
  // quantization (fp8.hpp's 128 x 128 blocks of w13 as one [E_local * 2I, H] matrix and of w2 as one
  // [E_local * H, I] matrix): e4m3 codes w13_fp8 [E_local, 2I, H] and w2_fp8 [E_local, H, I], fp32 scales
  // w13_scales [E_local * 2I / 128, H / 128] and w2_scales [E_local * H / 128, I / 128], row-major. All four
  // or none. With them the layer quantizes nothing, reads neither w13 nor w2 (either may be null) and ignores
  // weights_version. They are read where they are, as w13 and w2 are: they must hold their values until
  // this forward's backward has run (which differentiates with respect to the weights they represent).
  const uint8_t* w13_fp8 = nullptr;
  const float* w13_scales = nullptr;
  const uint8_t* w2_fp8 = nullptr;
  const float* w2_scales = nullptr;
  bool prequantized() const { return w13_fp8 != nullptr; }
};

struct BackwardArgs {
  const __nv_bfloat16* d_out = nullptr;      // [T, H], T as in the forward
  __nv_bfloat16* d_x = nullptr;              // [T, H]
  float* d_topk_weights = nullptr;           // [T, K]
  float* d_w13 = nullptr;                    // [E_local, 2I, H] fp32
  float* d_w2 = nullptr;                     // [E_local, H, I] fp32
  // Or the weight gradients in bf16 (both precisions): each value rounded once to nearest even by the GEMM that
  // makes it, so a bf16 parameter's gradient needs no conversion. Exactly one of the pairs d_w13 / d_w2 and
  // d_w13_bf16 / d_w2_bf16 is given.
  __nv_bfloat16* d_w13_bf16 = nullptr;       // [E_local, 2I, H]
  __nv_bfloat16* d_w2_bf16 = nullptr;        // [E_local, H, I]
  // Add into the weight gradients instead of overwriting them (in fp32; bf16 gradients: the sum of the
  // existing value and the new one rounded once).
  bool accumulate_weight_grads = false;
  bool bf16_weight_grads() const { return d_w13_bf16 != nullptr || d_w2_bf16 != nullptr; }
};

// Where a rank runs and how it reaches its peers.
struct RankPlacement {
  int rank = 0;
  cudaStream_t stream = nullptr;
  int max_blocks = 0;          // persistent blocks per kernel; 0 = all SMs (one rank per GPU)
  char* workspace = nullptr;   // this rank's symmetric workspace (workspace_bytes() long)
  char* const* peer_workspaces_device = nullptr;  // device array [R]: every rank's workspace base
};

// One object per rank. Not thread-safe: one host thread at a time makes the calls of a layer (and of a
// VirtualRankGroup); different layers may be driven from different threads.
class ExpertParallelLayer {
 public:
  ~ExpertParallelLayer();
  ExpertParallelLayer(const ExpertParallelLayer&) = delete;
  ExpertParallelLayer& operator=(const ExpertParallelLayer&) = delete;

  // Bytes of symmetric workspace each rank needs (forward state saved for the backward included).
  static Status workspace_bytes(const LayerConfig& config, const LayerOptions& options, int64_t* bytes);
  // Expert rows each rank can receive per call: options.expert_row_capacity after its default.
  static Status row_capacity(const LayerConfig& config, const LayerOptions& options, int64_t* rows);
  // Validates the config and the placement; the workspace must be zero-initialised once
  // (the layer leaves its counters at zero after every call).
  static Status create(const LayerConfig& config, const LayerOptions& options, const RankPlacement& placement,
                       std::unique_ptr<ExpertParallelLayer>* layer);

  // Enqueue on the rank's stream. Every rank must make the same sequence of calls (the peers meet at
  // device barriers). The backward uses the routing, activations and weight pointers (w13, w2) of the
  // latest forward on this rank: those weights must stay unchanged until the backward has run.
  Status forward(const ForwardArgs& args);
  Status backward(const BackwardArgs& args);
  // The host-side checks forward/backward make before enqueueing anything (sizes, required pointers,
  // alignment, a layer broken by an earlier timeout), without enqueueing: a caller that drives several
  // ranks checks all of them first, so that no rank starts a call its peers would then never join.
  Status check_forward(const ForwardArgs& args) const;
  Status check_backward(const BackwardArgs& args) const;

  // Waits for the rank's stream, then returns the first error recorded on the device since the last
  // check (and clears it).
  Status synchronize_and_check();

  // Diagnostics of the fused forward: while set, every fused forward writes, per CTA of the rank's kernel,
  // kFusedTimelineStamps global-timer readings (ns) into `stamps` (device memory, kFusedTimelineStamps *
  // fused_forward_ctas() entries): entry, layout numbered, dispatch done, counts in, routing done, GEMMs
  // done, tokens combined, end; then two counts of the GEMM phase: the ns the CTA's producer waited at
  // readiness gates, and the GEMM items it loaded. The fused backward writes the same entries (its phases:
  // entry, -, d_out dispatched, work numbered, arrivals counted, dgrad items done, d_x combined, end).
  // nullptr turns it off (the default; it costs a few stores and timer reads per CTA).
  static constexpr int kFusedTimelineStamps = 10;
  Status set_fused_timeline(uint64_t* stamps);
  int fused_forward_ctas() const;
  // Tuning of the fused kernels' work order (measurements; the results do not depend on it): the second
  // GEMM's items of expert e come after the first GEMM's items of expert e + lag (default 1; 0 = right after
  // the expert's own first-GEMM items; a lag of at least the local expert count puts every first-GEMM item
  // first). Must be >= 0; takes effect at the next call.
  Status set_fused_wave_lag(int lag);
  // Tuning of the fp8-blockwise GEMMs' main loop (measurements; the results are bitwise the same): each K
  // block's promotion overlapped with the next block's tensor-core work (two partial sums per thread), on
  // the GEMMs that Fp8PromotionOverlap names. Default kTmaOperands; takes effect at the next call.
  void set_fp8_overlap_promotion(Fp8PromotionOverlap where);

  const LayerConfig& config() const;
  int64_t expert_row_capacity() const;

 private:
  struct Impl;
  explicit ExpertParallelLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// R virtual ranks on the current GPU: one allocation in R slices, one stream per rank, each rank's
// kernels limited to its share of the SMs so that all ranks are resident at once. For tests and
// single-GPU runs of the multi-rank path.
class VirtualRankGroup {
 public:
  ~VirtualRankGroup();
  VirtualRankGroup(const VirtualRankGroup&) = delete;
  VirtualRankGroup& operator=(const VirtualRankGroup&) = delete;

  static Status create(const LayerConfig& config, const LayerOptions& options,
                       std::unique_ptr<VirtualRankGroup>* group);

  int num_ranks() const;
  ExpertParallelLayer& layer(int rank);
  cudaStream_t stream(int rank) const;
  // Synchronises every rank's stream and returns the first error of any rank.
  Status synchronize_and_check();

 private:
  VirtualRankGroup() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe
