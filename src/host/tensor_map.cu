#include "host/tensor_map.hpp"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

namespace megamoe {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  return fn;
}

Status encode(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base, const cuuint64_t* gdim,
              const cuuint64_t* gstride, const cuuint32_t* bdim, CUtensorMapSwizzle swizzle) {
  auto fn = encode_fn();
  if (fn == nullptr) return Status(StatusCode::kCudaError, "cuTensorMapEncodeTiled entry point not available");
  cuuint32_t estride[3] = {1, 1, 1};
  const CUresult r = fn(map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), gdim, gstride, bdim,
                        estride, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status(StatusCode::kCudaError, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)));
  }
  return Status::ok();
}

}  // namespace

Status make_bf16_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims, const uint32_t* box) {
  if (rank < 1 || rank > 3) return Status(StatusCode::kInternal, "tensor map rank must be 1..3");
  cuuint64_t gdim[3];
  cuuint64_t gstride[2];
  cuuint32_t bdim[3];
  uint64_t stride = 2;
  for (int i = 0; i < rank; ++i) {
    gdim[i] = dims[i];
    bdim[i] = box[i];
    if (i > 0) gstride[i - 1] = stride;
    stride *= dims[i];
  }
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, base, gdim, gstride, bdim, CU_TENSOR_MAP_SWIZZLE_128B);
}

Status make_bf16_rows_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, uint32_t box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows > 1 ? rows : 1)};
  const uint32_t box[2] = {64, box_rows};
  return make_bf16_tensor_map(map, base, 2, dims, box);
}

Status make_bf16_experts_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, int64_t experts,
                             uint32_t box_rows) {
  const uint64_t dims[3] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), static_cast<uint64_t>(experts)};
  const uint32_t box[3] = {64, box_rows, 1};
  return make_bf16_tensor_map(map, base, 3, dims, box);
}

Status make_fp32_tensor_map_2d(CUtensorMap* map, const void* base, const uint64_t* dims, uint64_t pitch,
                               const uint32_t* box, bool swizzle_128b) {
  if (dims[0] > pitch || (pitch * 4) % 16 != 0 || (box[0] * 4) % 16 != 0) {
    return Status(StatusCode::kInternal, "fp32 tensor map: the pitch must hold a row and be a multiple of 16 bytes");
  }
  if (swizzle_128b && box[0] * 4 != 128) {
    return Status(StatusCode::kInternal, "fp32 tensor map: a 128-byte-swizzled box is 32 floats wide");
  }
  const cuuint64_t gdim[2] = {dims[0], dims[1]};
  const cuuint64_t gstride[1] = {pitch * 4};
  const cuuint32_t bdim[2] = {box[0], box[1]};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, gdim, gstride, bdim,
                swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE);
}

Status make_u16_tensor_map_2d(CUtensorMap* map, const void* base, const uint64_t* dims, const uint32_t* box) {
  if ((dims[0] * 2) % 16 != 0 || (box[0] * 2) % 16 != 0) {
    return Status(StatusCode::kInternal, "16-bit tensor map: rows and boxes must be multiples of 16 bytes");
  }
  const cuuint64_t gdim[2] = {dims[0], dims[1]};
  const cuuint64_t gstride[1] = {dims[0] * 2};
  const cuuint32_t bdim[2] = {box[0], box[1]};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, base, gdim, gstride, bdim, CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace megamoe
