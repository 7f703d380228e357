// Tensor-memory-accelerator (bulk tensor) copies between global and shared memory and the bulk-group protocol
// of TMA stores. The tensor maps are built on the host (src/host/tensor_map.hpp) and passed as
// __grid_constant__ kernel parameters.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>
#include <cuda/ptx>

namespace megamoe::device {

namespace ptx = cuda::ptx;

// Global -> shared, completing `bytes` of transactions on `bar`.
__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  const int32_t crd[2] = {c0, c1};
  ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, smem, map, crd, bar);
}
__device__ __forceinline__ void tma_load_3d(void* smem, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
  const int32_t crd[3] = {c0, c1, c2};
  ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, smem, map, crd, bar);
}
// The same box into the same shared-memory offset of every CTA in `cta_mask` (each CTA's own `bar` at that
// offset completes).
__device__ __forceinline__ void tma_load_2d_multicast(void* smem, const CUtensorMap* map, int c0, int c1,
                                                      uint64_t* bar, uint16_t cta_mask) {
  const int32_t crd[2] = {c0, c1};
  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, smem, map, crd, bar, cta_mask);
}
__device__ __forceinline__ void tma_load_3d_multicast(void* smem, const CUtensorMap* map, int c0, int c1, int c2,
                                                      uint64_t* bar, uint16_t cta_mask) {
  const int32_t crd[3] = {c0, c1, c2};
  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, smem, map, crd, bar, cta_mask);
}

// Shared -> global; the box leaves asynchronously. The writing threads must have issued
// fence_proxy_async_smem() and met at a barrier before one thread calls this.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int c0, int c1, const void* smem) {
  const int32_t crd[2] = {c0, c1};
  ptx::cp_async_bulk_tensor(ptx::space_global, ptx::space_shared, map, crd, smem);
}
__device__ __forceinline__ void tma_store_commit() { ptx::cp_async_bulk_commit_group(); }
// Until at most kPending committed store groups may still read their shared-memory source.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  ptx::cp_async_bulk_wait_group_read(ptx::n32_t<kPending>{});
}
// Until at most kPending committed store groups are still incomplete (their writes included).
template <int kPending>
__device__ __forceinline__ void tma_store_wait_all() {
  ptx::cp_async_bulk_wait_group(ptx::n32_t<kPending>{});
}

}  // namespace megamoe::device
