// Shared pieces of the GPU tests: skipping without a GPU, device buffers, CUDA checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace megamoe::testing {

inline bool gpu_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace megamoe::testing

// GPU tests run everywhere; on a machine without a GPU they report SKIPPED, not passed or failed.
#define MEGAMOE_SKIP_WITHOUT_GPU()                                               \
  do {                                                                           \
    if (!::megamoe::testing::gpu_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define MEGAMOE_ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

namespace megamoe::testing {

// A fresh random seed for a test's inputs, or the one in MEGAMOE_TEST_SEED (to run again a case whose failure
// printed its seed).
inline uint64_t test_seed() {
  if (const char* text = std::getenv("MEGAMOE_TEST_SEED")) return std::strtoull(text, nullptr, 10);
  return std::random_device{}();
}

// How many bytes of two equally sized host vectors differ.
template <typename T>
int64_t differing_bytes(const std::vector<T>& x, const std::vector<T>& y) {
  const auto* bx = reinterpret_cast<const uint8_t*>(x.data());
  const auto* by = reinterpret_cast<const uint8_t*>(y.data());
  int64_t differ = 0;
  for (size_t i = 0; i < x.size() * sizeof(T); ++i) differ += bx[i] != by[i];
  return differ;
}

// The bits of a float, for comparisons that must tell -0 from +0 and one NaN from another.
inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// v rounded once to bf16 (nearest even), as a float: what a bf16 store of the fp32 value v holds.
inline float bf16_rounded(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Owning device allocation; the memory is filled with 0xFF bytes on creation (NaN for fp32/bf16), so
// anything a kernel fails to write is caught.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ == 0) return;
    if (cudaMalloc(&ptr_, count_ * sizeof(T)) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << count_ * sizeof(T) << " bytes failed";
      return;
    }
    poison();
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = static_cast<DeviceBuffer&&>(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      if (ptr_ != nullptr) cudaFree(ptr_);
      ptr_ = other.ptr_;
      count_ = other.count_;
      other.ptr_ = nullptr;
      other.count_ = 0;
    }
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }

  void poison() {
    if (ptr_ != nullptr) EXPECT_EQ(cudaMemset(ptr_, 0xFF, count_ * sizeof(T)), cudaSuccess);
  }
  void upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), count_);
    if (count_ > 0) ASSERT_EQ(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0)
      EXPECT_EQ(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace megamoe::testing
