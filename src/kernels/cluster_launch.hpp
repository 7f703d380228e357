// The launch of a persistent, warp-specialised GEMM kernel in clusters of kCluster CTAs (1 or 2), shared by the
// engine (grouped_gemm_kernel.cuh) and the FP8 GEMM (fp8_gemm.cu): the dynamic shared memory set on every call
// (cheap, and correct on every device of a multi-GPU process), the cluster attribute, and as many co-resident
// clusters as the device holds (an odd SM count in a GPC leaves an SM out of pairs), capped at a caller's share
// of the SMs (virtual ranks share one GPU).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

struct ClusterLaunch {
  cudaLaunchConfig_t config{};  // gridDim is set by the caller from `clusters` (it may cap them further)
  cudaLaunchAttribute attribute[2]{};  // the cluster shape, the dependent launch
  int clusters = 0;             // co-resident clusters, at most max_ctas / kCluster when max_ctas > 0

  ClusterLaunch() = default;
  ClusterLaunch(const ClusterLaunch&) = delete;  // config.attrs points into this object
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;

  void set_grid(int grid_clusters, int cluster) { config.gridDim = dim3(grid_clusters * cluster, 1, 1); }
};

// The SM count of the current device, after checking that it is a Hopper GPU (kNotSupported otherwise;
// `what` names the caller in the message).
inline Status hopper_device_sms(const char* what, int* num_sms) {
  int dev = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  int major = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) {
    return Status(StatusCode::kNotSupported, std::string(what) +
                                                 " needs an sm_90 (Hopper) device, found compute capability " +
                                                 std::to_string(major) + ".x");
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, dev));
  return Status::ok();
}

// `what` names the kernel in the error when no cluster fits.
template <int kCluster, class Kernel>
Status prepare_cluster_launch(Kernel kernel, int threads, int smem_bytes, cudaStream_t stream, int num_sms,
                              int max_ctas, const char* what, ClusterLaunch* l) {
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  l->attribute[0].id = cudaLaunchAttributeClusterDimension;
  l->attribute[0].val.clusterDim.x = kCluster;
  l->attribute[0].val.clusterDim.y = 1;
  l->attribute[0].val.clusterDim.z = 1;
  l->config.blockDim = dim3(threads, 1, 1);
  l->config.dynamicSmemBytes = smem_bytes;
  l->config.stream = stream;
  l->config.attrs = l->attribute;
  l->config.numAttrs = 1;  // the occupancy query below sees the cluster shape only
  int clusters = num_sms / kCluster;
  if constexpr (kCluster > 1) {
    l->set_grid(clusters, kCluster);
    int max_clusters = 0;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &l->config));
    if (max_clusters < 1)
      return Status(StatusCode::kNotSupported, std::string(what) + ": no 2-CTA cluster fits on this device");
    clusters = std::min(clusters, max_clusters);
  }
  if (max_ctas > 0) clusters = std::min(clusters, std::max(1, max_ctas / kCluster));
  l->clusters = clusters;
  l->set_grid(clusters, kCluster);
  set_dependent_launch_attribute(&l->attribute[1]);
  l->config.numAttrs = 2;
  return Status::ok();
}

}  // namespace megamoe::kernels
