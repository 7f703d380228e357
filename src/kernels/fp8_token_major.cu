// One block of 256 threads per group of 128 routed rows of one expert and a run of up to kSlabsPerBlock slabs
// of input channels (fp8_token_major.hpp). Each warp finds the block's group itself, by scans of the clamped
// expert offsets across its lanes, so that nothing waits on one thread walking the experts; the group's rows
// (where each starts in the input, its routing weight) go to shared memory once.
//
// Per slab, each thread loads 4 channels (E4M3: 8) of four rows: 16-byte fp32 loads, 8-byte E4M3 loads.
// The next slab's loads are issued before this slab is quantized, so that they are in flight meanwhile. The
// thread turns them into the slab's values (one to three per input channel: the copy's own; dh's gate and up
// halves from one read of g and h; or a and both halves of dh) and stores them as float4 into a shared fp32
// tile [128 rows][values]. Then eight lanes take one tile column, 16 rows each: amax by three shuffles, and
// each lane stores its 16 codes with one 16-byte store, the eight together one 128-byte line of the channel's
// row of the copy. The tile's columns are XOR-swizzled by row / 16, so that both the row-wise float4 stores
// and the column-wise loads hit 32 distinct banks.
#include <string>

#include "device/epilogue/transforms.cuh"
#include "device/fp8_codes.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/fp8_token_major.hpp"
#include "kernels/token_major_groups.cuh"

namespace megamoe::kernels {
namespace {

constexpr int kGroup = kTokenMajorGroup;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Enough work per block to amortize finding the group and starting the load pipeline, few enough that the
// grid still has many waves.
constexpr int kSlabsPerBlock = 8;
// The quantizing pass: a lane's rows of one column, and the columns one pass of the block takes (four per
// warp: 8 lanes x 16 rows each).
constexpr int kLaneRows = 16;
constexpr int kPassColumns = 4 * kWarps;
static_assert(kLaneRows * 8 == kGroup && kPassColumns == 32, "the swizzle below assumes these");

// The tile [128 rows][kColumns floats] holds (row, column) at row * kColumns + (column ^ (((row / 16) & 7) << 2)):
// the column's bits 2..4 XORed with the group of 16 rows that one lane of the quantizing pass reads. Aligned
// runs of 32 columns stay in place, so with kColumns a multiple of 32 each row is whole bank rounds; the eight
// float4 stores of a quarter warp (one row, 32 columns) and the 32 lanes reading four columns of eight row
// groups each hit 32 distinct banks.

// A routed row as its loads see it: where it starts in the Rows type's input, in elements (-1: it reads as
// zeros), and its routing weight (0 for a row that reads as zeros).
struct RowRef {
  int64_t base;
  float weight;
};

// One output of a Rows type: where its value k of input channel j goes, channel first + j of a copy of
// `channels` channels.
struct Output {
  uint8_t* qt;
  TokenMajorScale* st;
  int64_t channels;
  int64_t first;
};
template <int kCount>
struct Outputs {
  Output o[kCount];
};

// A Rows type is the value source of one kernel: kPieces pieces of 4 input channels per row and lane, adjacent
// (a lane's 4 kPieces channels are contiguous; a slab is kWidth = 32 kPieces input channels), kOutputs values
// per input channel, kMinBlocks resident blocks an SM (the register budget: the most that compile without
// spilling). row() once per block and row, fetch() a row's raw loads of channels j + 4 m + (0..3) for pieces
// m = 0 .. kPieces - 1, expand() their values. A row that reads as
// zeros gets an all-zero Raw, which every expand() turns into +0 values (0 * anything finite here is +0:
// the value of code 0 times 0 times 0; silu(0) * 0; swiglu_backward(0, 0, 0)).
// kKeepsRows: the type also keeps each routed row's raw input in expert order (keep(), called once per row,
// slab and lane with the raw values expand() takes, for the group's own rows only).

__device__ __forceinline__ float4 load_float4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

struct Fp32Rows {
  static constexpr int kPieces = 1, kOutputs = 1, kMinBlocks = 4;
  static constexpr bool kKeepsRows = false;
  const float* rows;
  int64_t channels;
  using Raw = float4;
  __device__ __forceinline__ RowRef row(int r) const { return {r * channels, 0.0f}; }
  __device__ __forceinline__ void fetch(RowRef row, int64_t j, Raw& raw) const {
    raw = load_float4(rows + row.base + j);
  }
  __device__ __forceinline__ void expand(const Raw& raw, RowRef, float (&v)[kOutputs][4 * kPieces]) const {
    v[0][0] = raw.x;
    v[0][1] = raw.y;
    v[0][2] = raw.z;
    v[0][3] = raw.w;
  }
};

// Two pieces a lane, one 8-byte load of 8 codes: the loads are gathered rows, and the L1 path (a wavefront
// per row a load touches) bound the kernel with a 4-byte load per piece (docs/PERF.md run 64: 82% of L1
// throughput). Four pieces (16-byte loads) spill at the 80 registers of three blocks an SM.
struct E4m3Rows {
  static constexpr int kPieces = 2, kOutputs = 1, kMinBlocks = 4;
  static constexpr bool kKeepsRows = false;
  const uint8_t* q;
  const float* scales;
  int64_t source_rows;
  const int32_t* row_src;
  const float* row_weight;
  int64_t channels;
  struct Raw {
    uint32_t codes[kPieces];
    float scale;
  };
  __device__ __forceinline__ RowRef row(int r) const {
    const int32_t src = __ldg(row_src + r);
    if (src < 0 || src >= source_rows) return {-1, 0.0f};
    return {src * channels, row_weight != nullptr ? __ldg(row_weight + r) : 1.0f};
  }
  // The row's scale for channel j is scales[src * (channels / 128) + j / 128] = scales[(base + j) / 128],
  // written as a shift (both are >= 0) to spare the signed division's fix-ups; a slab's channels share it.
  __device__ __forceinline__ void fetch(RowRef row, int64_t j, Raw& raw) const {
    static_assert(kGroup == 1 << 7 && kGroup % (32 * kPieces) == 0, "a slab has one scale a row");
    static_assert(kPieces == 2, "one 8-byte load is two pieces");
    const uint2 codes = __ldg(reinterpret_cast<const uint2*>(q + row.base + j));
    raw.codes[0] = codes.x;
    raw.codes[1] = codes.y;
    raw.scale = __ldg(scales + ((row.base + j) >> 7));
  }
  __device__ __forceinline__ void expand(const Raw& raw, RowRef row, float (&v)[kOutputs][4 * kPieces]) const {
#pragma unroll
    for (int m = 0; m < kPieces; ++m) {
      float codes[4];
      device::e4m3x4_values(raw.codes[m], codes);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[0][4 * m + k] = codes[k] * raw.scale;
        if (row_weight != nullptr) v[0][4 * m + k] *= row.weight;
      }
    }
  }
};

// E4m3Rows that also copy each routed row, codes and scales as they are, into expert order: routed row r to
// row r of rows_q [capacity, channels] with its scales K-block-major at rows_s[kb * pitch + r] (what
// gather_rows_e4m3 writes, the A operand of the layer's FP8 GEMMs). The copy comes from the loads the
// transposition makes anyway, so the rows are read once for both (docs/FP8.md). A lane holds 8 codes of a row:
// the eight lanes of a row store one 64-byte run of it, and the lane whose run starts a K block stores that
// block's scale.
struct E4m3GatheringRows : E4m3Rows {
  static constexpr bool kKeepsRows = true;
  static constexpr int kMinBlocks = 3;  // 79 registers; at 64 it spills
  uint8_t* rows_q;
  float* rows_s;
  int64_t pitch;
  __device__ __forceinline__ void keep(const Raw& raw, int64_t r, int64_t j) const {
    *reinterpret_cast<uint2*>(rows_q + r * channels + j) = make_uint2(raw.codes[0], raw.codes[1]);
    if (j % kGroup == 0) rows_s[(j / kGroup) * pitch + r] = raw.scale;
  }
};

// a = silu(g) u of GEMM1's fp32 output h [rows, 2I] (gate columns, then up), I channels: the forward's
// activation, recomputed with the epilogues' arithmetic (device/epilogue/transforms.cuh).
struct SwigluRows {
  static constexpr int kPieces = 1, kOutputs = 1, kMinBlocks = 3;
  static constexpr bool kKeepsRows = false;
  const float* h;
  int64_t I;
  struct Raw {
    float4 gate, up;
  };
  __device__ __forceinline__ RowRef row(int r) const { return {r * (2 * I), 0.0f}; }
  __device__ __forceinline__ void fetch(RowRef row, int64_t j, Raw& raw) const {
    raw.gate = load_float4(h + row.base + j);
    raw.up = load_float4(h + row.base + I + j);
  }
  __device__ __forceinline__ void expand(const Raw& raw, RowRef, float (&v)[kOutputs][4 * kPieces]) const {
    v[0][0] = device::swiglu(raw.gate.x, raw.up.x);
    v[0][1] = device::swiglu(raw.gate.y, raw.up.y);
    v[0][2] = device::swiglu(raw.gate.z, raw.up.z);
    v[0][3] = device::swiglu(raw.gate.w, raw.up.w);
  }
};

// dh = SwiGLU'(w g) of row r, from g [rows, I], h and the row's routing weight: the values
// swiglu_backward_quantize_rows_1x128 (fp8_quantize.hpp) quantizes along the channels, the same arithmetic.
// Input channel j gives dh's channels j (dg) and I + j (du), so g and h are read once.
struct SwigluGradRows {
  static constexpr int kPieces = 1, kOutputs = 2, kMinBlocks = 2;
  static constexpr bool kKeepsRows = false;
  const float* g;
  const float* h;
  const float* row_weight;
  int64_t I;
  struct Raw {
    float4 g, gate, up;
  };
  // base: the row's start in g; in h it is 2 base.
  __device__ __forceinline__ RowRef row(int r) const { return {r * I, __ldg(row_weight + r)}; }
  __device__ __forceinline__ void fetch(RowRef row, int64_t j, Raw& raw) const {
    raw.g = load_float4(g + row.base + j);
    raw.gate = load_float4(h + 2 * row.base + j);
    raw.up = load_float4(h + 2 * row.base + I + j);
  }
  // dh's gate and up values into v[kDg] and v[kDu].
  template <int kDg, int kDu, int kCount>
  __device__ __forceinline__ static void backward(const Raw& raw, float w, float (&v)[kCount][4]) {
    const float da[4] = {w * raw.g.x, w * raw.g.y, w * raw.g.z, w * raw.g.w};
    const float gate[4] = {raw.gate.x, raw.gate.y, raw.gate.z, raw.gate.w};
    const float up[4] = {raw.up.x, raw.up.y, raw.up.z, raw.up.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const device::SwiGLUGrad d = device::swiglu_backward(da[k], gate[k], up[k]);
      v[kDg][k] = d.dg;
      v[kDu][k] = d.du;
    }
  }
  __device__ __forceinline__ void expand(const Raw& raw, RowRef row, float (&v)[kOutputs][4 * kPieces]) const {
    backward<0, 1>(raw, row.weight, v);
  }
};

// Both SwiGLU operands of the weight gradients from one read of g and h: a (SwigluRows' values), then dh's dg
// and du (SwigluGradRows').
struct SwigluPairRows : SwigluGradRows {
  static constexpr int kOutputs = 3, kMinBlocks = 2;
  __device__ __forceinline__ void expand(const Raw& raw, RowRef row, float (&v)[kOutputs][4 * kPieces]) const {
    v[0][0] = device::swiglu(raw.gate.x, raw.up.x);
    v[0][1] = device::swiglu(raw.gate.y, raw.up.y);
    v[0][2] = device::swiglu(raw.gate.z, raw.up.z);
    v[0][3] = device::swiglu(raw.gate.w, raw.up.w);
    backward<1, 2>(raw, row.weight, v);
  }
};

template <class Rows>
__global__ void __launch_bounds__(kThreads, Rows::kMinBlocks)
    token_major_quantize_kernel(Rows rows, Outputs<Rows::kOutputs> out, const int32_t* __restrict__ offsets,
                                int experts, int64_t capacity, int64_t columns, int slabs) {
  device::begin_dependent_grid();
  constexpr int kPieces = Rows::kPieces, kWidth = 32 * kPieces, kColumns = Rows::kOutputs * kWidth;
  extern __shared__ __align__(16) unsigned char smem[];
  float* const tile = reinterpret_cast<float*>(smem);  // [kGroup][kColumns], swizzled
  // Shared rather than in registers: there the compiler would hoist every row's addresses out of the slab loop.
  RowRef* const row_refs = reinterpret_cast<RowRef*>(tile + kGroup * kColumns);

  const TokenMajorGroup group = find_token_major_group(offsets, experts, capacity, static_cast<int>(blockIdx.x));
  if (group.rows == 0) return;  // uniform over the block
  const unsigned t = threadIdx.x;
  if (t < kGroup) row_refs[t] = static_cast<int>(t) < group.rows ? rows.row(group.first + static_cast<int>(t))
                                                                 : RowRef{-1, 0.0f};
  __syncthreads();

  // The loading steps: step i takes 32 rows, 8 lanes a row. A thread's four rows all lie in one group of 16
  // (rows 16 row_group + 4 i + row_slot / 8), so its tile swizzle is fixed: it stores tile quad `quad` (and
  // quad + 8 m for piece m) of its rows, which holds channels 4 kPieces (quad ^ row_group) (+ 4 m) of the
  // slab (the eight lanes of a row load one contiguous run of the row), and every address moves by a constant
  // from step to step (so the compiler has nothing to hoist out of the slab loop into registers). Tile column
  // 32 m + 4 q + k of a row of group g so holds slab channel 4 kPieces (q ^ g) + 4 m + k.
  constexpr int kSteps = 4, kRowStride = 4;
  static_assert(kSteps * (kThreads / 8) == kGroup && kRowStride * kSteps == 16, "8 lanes a row, 4 rows a group");
  const int quad = static_cast<int>(t % 8), row_slot = static_cast<int>(t / 8);
  const int row_group = row_slot % 8, first_row = 16 * row_group + row_slot / 8;
  const int channel = 4 * kPieces * (quad ^ row_group);
  float* const tile_rows = tile + first_row * kColumns + 4 * quad;

  const int slab_begin = static_cast<int>(blockIdx.y) * kSlabsPerBlock;
  const int slab_end = min(slabs, slab_begin + kSlabsPerBlock);
  typename Rows::Raw raw[kSteps];
  const auto fetch = [&](int slab) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const RowRef row = row_refs[first_row + kRowStride * i];
      if (row.base >= 0)
        rows.fetch(row, static_cast<int64_t>(slab) * kWidth + channel, raw[i]);
      else
        raw[i] = typename Rows::Raw{};
    }
  };
  fetch(slab_begin);

  // The quantizing passes: eight lanes per tile column, `part` taking rows 16 part .. 16 part + 15, which all
  // have the swizzle of group `part`; a pass moves by whole bank rounds, so every load is one base plus a
  // constant.
  const int warp = static_cast<int>(t / 32), lane = static_cast<int>(t % 32), part = lane % 8;
  const int pass_column = 4 * warp + lane / 8;
  const float* const lane_tile = tile + kLaneRows * part * kColumns + (pass_column ^ (part << 2));
  // The lane reads tile column 32 m + 4 (q ^ part) + k of its rows (group `part`), m the pass's piece and
  // pass_column = 4 q + k: slab channel 4 kPieces q + 4 m + k, the same for the column's eight lanes.
  const int lane_channel = 4 * kPieces * (pass_column / 4) + pass_column % 4;
  // The group's K block of the copy (its scales' row): unsigned 32 bits, widened by a zero (the 64-bit column
  // kept live through the slab loop cost E4m3Rows a spill at 64 registers).
  const uint32_t k_block = static_cast<uint32_t>(group.column / kGroup);

  for (int slab = slab_begin; slab < slab_end; ++slab) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      if constexpr (Rows::kKeepsRows) {
        // Rows past the group's end belong to the next expert (or to no one): not this block's to write.
        if (first_row + kRowStride * i < group.rows)
          rows.keep(raw[i], group.first + first_row + kRowStride * i, static_cast<int64_t>(slab) * kWidth + channel);
      }
      float v[Rows::kOutputs][4 * kPieces];
      rows.expand(raw[i], row_refs[first_row + kRowStride * i], v);
#pragma unroll
      for (int o = 0; o < Rows::kOutputs; ++o)
#pragma unroll
        for (int m = 0; m < kPieces; ++m)
          *reinterpret_cast<float4*>(tile_rows + kRowStride * i * kColumns + o * kWidth + 32 * m) =
              make_float4(v[o][4 * m], v[o][4 * m + 1], v[o][4 * m + 2], v[o][4 * m + 3]);
    }
    __syncthreads();
    if (slab + 1 < slab_end) fetch(slab + 1);

#pragma unroll
    for (int pass = 0; pass < kColumns / kPassColumns; ++pass) {
      float v[kLaneRows];
#pragma unroll
      for (int i = 0; i < kLaneRows; ++i) v[i] = lane_tile[i * kColumns + kPassColumns * pass];
      const device::OctetGroupQuantized q = device::quantize_octet_group(v);
      const Output& o = out.o[kPassColumns * pass / kWidth];  // a constant index: the pass's output
      const int piece = (kPassColumns * pass % kWidth) / 32;
      const int64_t c = o.first + static_cast<int64_t>(slab) * kWidth + lane_channel + 4 * piece;
      *reinterpret_cast<uint4*>(o.qt + c * columns + group.column + kLaneRows * part) =
          make_uint4(q.words[0], q.words[1], q.words[2], q.words[3]);
      if (part == 0)
        o.st[k_block * static_cast<uint64_t>(o.channels) + static_cast<uint64_t>(c)] =
            device::power_of_two_scale_bits(q.scale);
    }
    __syncthreads();
  }
}

Status check_common(const char* what, int64_t channels, const int32_t* offsets, int experts, int64_t capacity,
                    const uint8_t* qt, const TokenMajorScale* st) {
  if (channels <= 0 || channels % kGroup != 0 || experts < 1 || capacity < 0)
    return Status::invalid(std::string(what) + ": channels must be a positive multiple of 128, experts >= 1 and "
                           "capacity >= 0, got channels=" + std::to_string(channels) + " experts=" +
                           std::to_string(experts) + " capacity=" + std::to_string(capacity));
  if (offsets == nullptr || qt == nullptr || st == nullptr) return Status::invalid(std::string(what) + ": null pointer");
  if ((reinterpret_cast<uintptr_t>(qt) & 15u) != 0)
    return Status::invalid(std::string(what) + ": qt must be 16-byte aligned");
  const int64_t groups = (capacity + kGroup - 1) / kGroup + experts;
  if (groups >= (int64_t{1} << 31)) return Status::invalid(std::string(what) + ": too many row groups");
  return Status::ok();
}

// `inputs`: the input channels (channels, or I for the SwiGLU rows).
template <class Rows>
Status launch(const char* what, const Rows& rows, const Outputs<Rows::kOutputs>& out, int64_t inputs,
              const int32_t* offsets, int experts, int64_t capacity, cudaStream_t stream) {
  // Every possible group gets a block (the counts are on the device): at most one partial group per expert.
  const int64_t groups = (capacity + kGroup - 1) / kGroup + experts;
  const int64_t slabs = inputs / (32 * Rows::kPieces), slab_blocks = (slabs + kSlabsPerBlock - 1) / kSlabsPerBlock;
  if (slab_blocks > 65535) return Status::invalid(std::string(what) + ": too many channels");
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>(slab_blocks), 1);
  constexpr int kSmemBytes =
      static_cast<int>(kGroup * Rows::kOutputs * 32 * Rows::kPieces * sizeof(float) + kGroup * sizeof(RowRef));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(token_major_quantize_kernel<Rows>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  return kernels::launch_dependent(token_major_quantize_kernel<Rows>, grid, dim3(kThreads), kSmemBytes, stream, what,
                                   rows, out, offsets, experts, capacity, token_major_columns(capacity, experts),
                                   static_cast<int>(slabs));
}

Status check_swiglu_grad_inputs(const char* what, const float* g, const float* h, const float* row_weight) {
  if (g == nullptr || h == nullptr || row_weight == nullptr || (reinterpret_cast<uintptr_t>(g) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(h) & 15u) != 0)
    return Status::invalid(std::string(what) + ": g, h and row_weight must be non-null, g and h 16-byte aligned");
  return Status::ok();
}

}  // namespace

Status token_major_quantize_fp32(const float* rows, int64_t channels, const int32_t* offsets, int experts,
                                 int64_t capacity, uint8_t* qt, TokenMajorScale* st, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_fp32", channels, offsets, experts, capacity, qt, st));
  if (capacity == 0) return Status::ok();
  if (rows == nullptr || (reinterpret_cast<uintptr_t>(rows) & 15u) != 0)
    return Status::invalid("token_major_quantize_fp32: rows must be non-null and 16-byte aligned");
  return launch("token_major_quantize_kernel<Fp32Rows>", Fp32Rows{rows, channels},
                Outputs<1>{{{qt, st, channels, 0}}}, channels, offsets, experts, capacity, stream);
}

// The inputs both E4M3 forms read (after check_common; capacity > 0).
Status check_e4m3_inputs(const char* what, const uint8_t* q, const float* scales, const int32_t* row_src) {
  if (q == nullptr || scales == nullptr || row_src == nullptr)
    return Status::invalid(std::string(what) + ": null pointer");
  if ((reinterpret_cast<uintptr_t>(q) & 7u) != 0)
    return Status::invalid(std::string(what) + ": q must be 8-byte aligned");
  return Status::ok();
}

Status token_major_quantize_e4m3(const uint8_t* q, const float* scales, int64_t source_rows, const int32_t* row_src,
                                 const float* row_weight, int64_t channels, const int32_t* offsets, int experts,
                                 int64_t capacity, uint8_t* qt, TokenMajorScale* st, cudaStream_t stream) {
  constexpr const char* kWhat = "token_major_quantize_e4m3";
  MEGAMOE_RETURN_IF_ERROR(check_common(kWhat, channels, offsets, experts, capacity, qt, st));
  if (source_rows < 0) return Status::invalid(std::string(kWhat) + ": source_rows must be >= 0");
  if (capacity == 0) return Status::ok();
  MEGAMOE_RETURN_IF_ERROR(check_e4m3_inputs(kWhat, q, scales, row_src));
  return launch("token_major_quantize_kernel<E4m3Rows>",
                E4m3Rows{q, scales, source_rows, row_src, row_weight, channels}, Outputs<1>{{{qt, st, channels, 0}}},
                channels, offsets, experts, capacity, stream);
}

Status token_major_quantize_e4m3_gathering(const uint8_t* q, const float* scales, int64_t source_rows,
                                           const int32_t* row_src, const float* row_weight, int64_t channels,
                                           const int32_t* offsets, int experts, int64_t capacity, uint8_t* qt,
                                           TokenMajorScale* st, uint8_t* rows_q, float* rows_s, int64_t rows_s_pitch,
                                           cudaStream_t stream) {
  constexpr const char* kWhat = "token_major_quantize_e4m3_gathering";
  MEGAMOE_RETURN_IF_ERROR(check_common(kWhat, channels, offsets, experts, capacity, qt, st));
  if (source_rows < 0) return Status::invalid(std::string(kWhat) + ": source_rows must be >= 0");
  if (rows_s_pitch < capacity)
    return Status::invalid(std::string(kWhat) + ": rows_s_pitch must be at least capacity=" +
                           std::to_string(capacity) + ", got " + std::to_string(rows_s_pitch));
  if (capacity == 0) return Status::ok();
  MEGAMOE_RETURN_IF_ERROR(check_e4m3_inputs(kWhat, q, scales, row_src));
  if (rows_q == nullptr || rows_s == nullptr) return Status::invalid(std::string(kWhat) + ": null pointer");
  if ((reinterpret_cast<uintptr_t>(rows_q) & 7u) != 0)
    return Status::invalid(std::string(kWhat) + ": rows_q must be 8-byte aligned");
  const E4m3GatheringRows rows{{q, scales, source_rows, row_src, row_weight, channels}, rows_q, rows_s, rows_s_pitch};
  return launch("token_major_quantize_kernel<E4m3GatheringRows>", rows, Outputs<1>{{{qt, st, channels, 0}}}, channels,
                offsets, experts, capacity, stream);
}

Status token_major_quantize_swiglu(const float* h, int64_t I, const int32_t* offsets, int experts, int64_t capacity,
                                   uint8_t* qt, TokenMajorScale* st, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_swiglu", I, offsets, experts, capacity, qt, st));
  if (capacity == 0) return Status::ok();
  if (h == nullptr || (reinterpret_cast<uintptr_t>(h) & 15u) != 0)
    return Status::invalid("token_major_quantize_swiglu: h must be non-null and 16-byte aligned");
  return launch("token_major_quantize_kernel<SwigluRows>", SwigluRows{h, I}, Outputs<1>{{{qt, st, I, 0}}}, I,
                offsets, experts, capacity, stream);
}

Status token_major_quantize_swiglu_grad(const float* g, const float* h, const float* row_weight, int64_t I,
                                        const int32_t* offsets, int experts, int64_t capacity, uint8_t* qt,
                                        TokenMajorScale* st, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_swiglu_grad", I, offsets, experts, capacity, qt, st));
  if (capacity == 0) return Status::ok();
  MEGAMOE_RETURN_IF_ERROR(check_swiglu_grad_inputs("token_major_quantize_swiglu_grad", g, h, row_weight));
  return launch("token_major_quantize_kernel<SwigluGradRows>", SwigluGradRows{g, h, row_weight, I},
                Outputs<2>{{{qt, st, 2 * I, 0}, {qt, st, 2 * I, I}}}, I, offsets, experts, capacity, stream);
}

Status token_major_quantize_swiglu_pair(const float* g, const float* h, const float* row_weight, int64_t I,
                                        const int32_t* offsets, int experts, int64_t capacity, uint8_t* at_q,
                                        TokenMajorScale* at_s, uint8_t* dht_q, TokenMajorScale* dht_s,
                                        cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_swiglu_pair", I, offsets, experts, capacity, at_q, at_s));
  MEGAMOE_RETURN_IF_ERROR(
      check_common("token_major_quantize_swiglu_pair", 2 * I, offsets, experts, capacity, dht_q, dht_s));
  if (capacity == 0) return Status::ok();
  MEGAMOE_RETURN_IF_ERROR(check_swiglu_grad_inputs("token_major_quantize_swiglu_pair", g, h, row_weight));
  return launch("token_major_quantize_kernel<SwigluPairRows>", SwigluPairRows{{g, h, row_weight, I}},
                Outputs<3>{{{at_q, at_s, I, 0}, {dht_q, dht_s, 2 * I, 0}, {dht_q, dht_s, 2 * I, I}}}, I, offsets,
                experts, capacity, stream);
}

Status token_major_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<Fp32Rows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<E4m3Rows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<E4m3GatheringRows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<SwigluRows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<SwigluGradRows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<SwigluPairRows>));
  return Status::ok();
}

}  // namespace megamoe::kernels
