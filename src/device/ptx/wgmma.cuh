// Warpgroup MMA (wgmma, sm_90a) in inline PTX: shared-memory operand descriptors, the fence / commit / wait
// protocol, and the MMA itself templated on the N extent, for bf16 (m64nNk16, either operand transposable)
// and e4m3 (m64nNk32, both operands K-major, as FP8 wgmma requires).
//
// Descriptors: a 64-bit word holding the start address, the leading and stride byte offsets (all >> 4) and
// the swizzle mode. Every operand tile here is stored with the 128-byte swizzle (as TMA writes it with
// CU_TENSOR_MAP_SWIZZLE_128B, and as the row-gather loader writes it by hand) in 1024-byte aligned atoms of
// 8 rows x 128 bytes, so the base-offset field stays 0.
//   K-major  (a tile row = 64 bf16 along K): LBO unused (16), SBO = 1024; the next k16 slice is 32 bytes on.
//   MN-major (a tile row = 64 bf16 along M or N, rows along K): LBO = bytes between two 64-element chunks
//            along M/N, SBO = 1024; the next k16 slice starts 16 rows (2048 bytes) further.
#pragma once

#include <cstdint>

namespace megamoe::device {

__device__ __forceinline__ uint64_t make_smem_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return desc;
}

// The descriptor of the operand `bytes` further on in the same swizzled tile: the start address field is
// (address mod 2^18) / 16 in the low 14 bits, and shared-memory addresses stay below 2^18, so moving on by
// `bytes` (a multiple of 16) adds bytes / 16 to the descriptor without a carry out of that field. One add,
// where make_smem_desc's masks and shifts would be recomputed for every k slice.
__device__ __forceinline__ uint64_t advance_smem_desc(uint64_t desc, uint32_t bytes) {
  // On the low word only, so that no carry into the high word (the strides and the swizzle) is computed.
  const uint32_t low = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | low;
}

// Orders register accesses of the warpgroup before the wgmma that follows (needed whenever the
// accumulators were touched by ordinary instructions since the last wgmma).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most kPending committed wgmma groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads of the accumulators above a wgmma_wait.
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x N] (+)= A[64 x 16] * B[16 x N], bf16 operands from shared memory, fp32 accumulators (N / 2 per
// thread). scale_d == 0 overwrites D. kTransA / kTransB: 0 = K-major, 1 = MN-major.
template <int kN>
struct WgmmaBf16;

// D[64 x N] (+)= A[64 x 32] * B[32 x N], e4m3 operands (both K-major) from shared memory, fp32 accumulators
// with Hopper's limited-precision FP8 accumulation (promote to fp32 registers every few k-steps).
template <int kN>
struct WgmmaE4m3;

// The accumulator operands of a wgmma, d[b] .. d[b + 7] as read-write floats, and the first 64, 96 or 128.
#define MEGAMOE_WGMMA_D8(b)                                                                                    \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), \
      "+f"(d[b + 7])
#define MEGAMOE_WGMMA_D64                                                                                       \
  MEGAMOE_WGMMA_D8(0), MEGAMOE_WGMMA_D8(8), MEGAMOE_WGMMA_D8(16), MEGAMOE_WGMMA_D8(24), MEGAMOE_WGMMA_D8(32), \
      MEGAMOE_WGMMA_D8(40), MEGAMOE_WGMMA_D8(48), MEGAMOE_WGMMA_D8(56)
#define MEGAMOE_WGMMA_D96 \
  MEGAMOE_WGMMA_D64, MEGAMOE_WGMMA_D8(64), MEGAMOE_WGMMA_D8(72), MEGAMOE_WGMMA_D8(80), MEGAMOE_WGMMA_D8(88)
#define MEGAMOE_WGMMA_D128 \
  MEGAMOE_WGMMA_D96, MEGAMOE_WGMMA_D8(96), MEGAMOE_WGMMA_D8(104), MEGAMOE_WGMMA_D8(112), MEGAMOE_WGMMA_D8(120)
// Their places in the instruction's accumulator list (operands 0 .. 63, 95 or 127).
#define MEGAMOE_WGMMA_R64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MEGAMOE_WGMMA_R96 \
  MEGAMOE_WGMMA_R64 "," \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MEGAMOE_WGMMA_R128 \
  MEGAMOE_WGMMA_R96 "," \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

template <>
struct WgmmaBf16<128> {
  template <int kTransA, int kTransB>
  static __device__ __forceinline__ void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MEGAMOE_WGMMA_R64
                 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                 : MEGAMOE_WGMMA_D64
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <>
struct WgmmaBf16<256> {
  template <int kTransA, int kTransB>
  static __device__ __forceinline__ void mma(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" MEGAMOE_WGMMA_R128
                 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : MEGAMOE_WGMMA_D128
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <>
struct WgmmaE4m3<128> {
  static __device__ __forceinline__ void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" MEGAMOE_WGMMA_R64
                 "}, %64, %65, p, 1, 1;\n}\n"
                 : MEGAMOE_WGMMA_D64
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct WgmmaE4m3<192> {
  static __device__ __forceinline__ void mma(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {" MEGAMOE_WGMMA_R96
                 "}, %96, %97, p, 1, 1;\n}\n"
                 : MEGAMOE_WGMMA_D96
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct WgmmaE4m3<256> {
  static __device__ __forceinline__ void mma(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" MEGAMOE_WGMMA_R128
                 "}, %128, %129, p, 1, 1;\n}\n"
                 : MEGAMOE_WGMMA_D128
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

#undef MEGAMOE_WGMMA_D8
#undef MEGAMOE_WGMMA_D64
#undef MEGAMOE_WGMMA_D96
#undef MEGAMOE_WGMMA_D128
#undef MEGAMOE_WGMMA_R64
#undef MEGAMOE_WGMMA_R96
#undef MEGAMOE_WGMMA_R128

}  // namespace megamoe::device
