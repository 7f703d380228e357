// Benchmarks stop at the first failed call, naming it: a timing of a failed run is worthless.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "megamoe/status.hpp"

#define BENCH_CHECK_CUDA(call)                                                                   \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

#define BENCH_CHECK_OK(expr)                                                           \
  do {                                                                                 \
    ::megamoe::Status st_ = (expr);                                                    \
    if (!st_.is_ok()) {                                                                \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, st_.to_string().c_str()); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
