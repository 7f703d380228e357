// Between the engine's host code (grouped_gemm.cu: checks, tensor maps) and its kernel instantiations
// (grouped_gemm_{nt,nn,tn}.cu, one translation unit per form so that they compile in parallel): the
// launch description and the per-form launchers that pick the kernel template for it.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime_api.h>

#include "device/epilogue/epilogues.cuh"
#include "device/gemm/operands.cuh"
#include "device/sched/schedulers.cuh"
#include "kernels/grouped_gemm.hpp"

namespace megamoe::kernels {

// Everything a kernel reads, by value.
struct GemmKernelParams {
  const int32_t* group_offsets;
  int num_groups;
  int max_rows;
  int M;  // form 3: rows of each C[e]
  int N;  // accumulator columns (SwiGLU forward: 2I)
  int K;  // forms 1, 2: reduction length
  device::OperandSources src;
  device::EpilogueArgs epi;
  float* c32;      // form 3 output, fp32
  __nv_bfloat16* c16;  // form 3 output rounded to bf16 instead (c32 null)
  int accumulate;  // form 3
  int transpose_c;  // form 3: c32 is [groups, N, M] (each C[e] stored transposed)
  int tma_store;   // 1: the C (and aux) tensor maps are valid and the outputs contiguous
  int* work_counter;  // non-null: dynamic scheduling (zero at the launch, left zero by it)
  int longest_first;  // form 3, dynamic: the experts with the most rows first
  device::ReadinessGate ready;
};

struct GemmLaunch {
  CUtensorMap a, b, c, aux;  // a / b: unused when gathered; c / aux: read by the TMA store path only
  CUtensorMap h;             // SwiGLU backward: the h input of the epilogue
  GemmKernelParams p;
  GemmActivation activation;
  bool gather_a, gather_b;
  GemmTuning tuning;  // resolved: tile_n 128 or 256, store kThreads or kTmaTile
};

Status launch_grouped_gemm_nt(const GemmLaunch& launch, cudaStream_t stream);
Status launch_grouped_gemm_nn(const GemmLaunch& launch, cudaStream_t stream);
Status launch_grouped_gemm_tn(const GemmLaunch& launch, cudaStream_t stream);
Status preload_grouped_gemm_nt();
Status preload_grouped_gemm_nn();
Status preload_grouped_gemm_tn();

}  // namespace megamoe::kernels
