// Per-kernel device times of a region of a benchmark, collected with CUPTI's activity API (the profiler
// interface the CUDA toolkit ships): every kernel that runs between start() and stop() is recorded with its
// name, start and end. Benchmarks use it for their time breakdown (which kernels, how long, how many).
#pragma once

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace megamoe::bench {

struct KernelRecord {
  std::string name;
  uint64_t start_ns, end_ns;
  uint32_t correlation = 0;  // the runtime call that launched it (ApiRecord::correlation)
  double ms() const { return static_cast<double>(end_ns - start_ns) * 1e-6; }
};

// A host call of the CUDA runtime, on the kernels' clock: where the host was while the GPU idled.
struct ApiRecord {
  std::string name;
  uint64_t start_ns, end_ns;
  uint32_t correlation;
};

class KernelProfile {
 public:
  static KernelProfile& instance() {
    static KernelProfile p;
    return p;
  }
  // Records kernels from now on (kernel activity serialises nothing: launches keep their concurrency).
  bool start() {
    records_.clear();
    if (!check(cuptiActivityRegisterCallbacks(&KernelProfile::request, &KernelProfile::complete),
               "cuptiActivityRegisterCallbacks"))
      return false;
    if (!check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable")) return false;
    api_records_.clear();
    return check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "cuptiActivityEnable(runtime)");
  }
  // The runtime calls recorded by the last stop(), in start order.
  const std::vector<ApiRecord>& api_records() const { return api_records_; }
  // Stops recording; the caller has synchronised the device. Returns the kernels in start order.
  std::vector<KernelRecord> stop() {
    check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
    check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable");
    check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_RUNTIME), "cuptiActivityDisable(runtime)");
    std::sort(api_records_.begin(), api_records_.end(),
              [](const ApiRecord& a, const ApiRecord& b) { return a.start_ns < b.start_ns; });
    std::vector<KernelRecord> out = std::move(records_);
    records_.clear();
    std::sort(out.begin(), out.end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
    return out;
  }

 private:
  static bool check(CUptiResult r, const char* what) {
    if (r == CUPTI_SUCCESS) return true;
    const char* msg = nullptr;
    cuptiGetResultString(r, &msg);
    std::fprintf(stderr, "kernel profile: %s failed: %s\n", what, msg != nullptr ? msg : "?");
    return false;
  }
  static void CUPTIAPI request(uint8_t** buffer, size_t* size, size_t* max_records) {
    constexpr size_t kBytes = 8u << 20;
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
    *size = kBytes;
    *max_records = 0;
  }
  static void CUPTIAPI complete(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    CUpti_Activity* record = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        instance().records_.push_back({short_name(k->name), k->start, k->end, k->correlationId});
      } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
        const char* name = nullptr;
        if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name) != CUPTI_SUCCESS) name = nullptr;
        instance().api_records_.push_back({name != nullptr ? name : "?", a->start, a->end, a->correlationId});
      }
    }
    std::free(buffer);
  }
  // "megamoe::ep::(anonymous namespace)::combine_kernel<true>(...)" -> "combine_kernel<true>"; the engine's
  // configurations keep their template arguments out of the name (one row for the engine).
  static std::string short_name(const char* mangled) {
    if (mangled == nullptr) return "?";
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string name = status == 0 && d != nullptr ? d : mangled;
    std::free(d);
    for (size_t at; (at = name.find("(anonymous namespace)::")) != std::string::npos;) name.erase(at, 23);
    const size_t paren = name.find('(');
    if (paren != std::string::npos) name.resize(paren);
    size_t depth = 0, cut = 0;
    for (size_t i = 0; i < name.size(); ++i) {  // last "::" outside template brackets
      if (name[i] == '<') ++depth;
      if (name[i] == '>') --depth;
      if (depth == 0 && name.compare(i, 2, "::") == 0) cut = i + 2;
    }
    name = name.substr(cut);
    if (name.rfind("grouped_gemm_kernel", 0) == 0) name = "grouped_gemm_kernel";
    return name;
  }
  std::vector<KernelRecord> records_;
  std::vector<ApiRecord> api_records_;
};

}  // namespace megamoe::bench
