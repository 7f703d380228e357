// Per-thread asynchronous copies global -> shared (cp.async, 16 or 4 bytes), the path of operand rows (and
// their scales) gathered by index (TMA moves boxes of consecutive rows only). Completion is tracked by an mbarrier
// (mbarrier_arrive_on_copies); the copies land through the generic proxy, so a reader that goes through the
// async proxy (wgmma) issues fence_proxy_async_smem() after its wait.
#pragma once

#include <cstdint>

namespace megamoe::device {

// 16 bytes from `src` to shared address `dst`; with src_bytes == 0 nothing is read and `dst` is zero-filled
// (rows past an expert, columns past the tensor). L2 only: operand rows are reused by other CTAs, not by
// this one.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// 4 bytes (one fp32 scale), the same way (sizes below 16 go through L1: .ca).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

}  // namespace megamoe::device
