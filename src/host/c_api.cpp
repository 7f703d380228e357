// The C ABI (include/megamoe/megamoe.h) over the C++ API. Every entry point catches everything: an
// exception crossing a C boundary into ctypes would abort the Python process.
#include "megamoe/megamoe.h"

#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <utility>

#include "megamoe/config.hpp"
#include "megamoe/status.hpp"

#if MEGAMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "megamoe/layer.hpp"
#include "megamoe/process_group.hpp"
#endif

namespace {

using megamoe::Status;
using megamoe::StatusCode;

static_assert(MEGAMOE_OK == static_cast<int>(StatusCode::kOk));
static_assert(MEGAMOE_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(MEGAMOE_CAPACITY_EXCEEDED == static_cast<int>(StatusCode::kCapacityExceeded));
static_assert(MEGAMOE_TIMEOUT == static_cast<int>(StatusCode::kTimeout));
static_assert(MEGAMOE_CUDA_ERROR == static_cast<int>(StatusCode::kCudaError));
static_assert(MEGAMOE_NOT_SUPPORTED == static_cast<int>(StatusCode::kNotSupported));
static_assert(MEGAMOE_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(MEGAMOE_PRECISION_BF16 == static_cast<int>(megamoe::Precision::kBF16));
static_assert(MEGAMOE_PRECISION_FP8_BLOCKWISE == static_cast<int>(megamoe::Precision::kFP8Blockwise));

// The calling thread's latest message. A fixed buffer, not a thread_local std::string: it needs no
// constructor, no TLS destructor registered in a dlopen()ed library (__cxa_thread_atexit), and no heap
// allocation on the error path, and megamoe_last_error()'s pointer never dangles. Longer messages are
// truncated (MEGAMOE_LAST_ERROR_CAPACITY - 1 bytes kept).
thread_local char g_last_error[MEGAMOE_LAST_ERROR_CAPACITY];

void set_last_error(const char* message, size_t length) {
  if (length >= sizeof(g_last_error)) length = sizeof(g_last_error) - 1;
  std::memcpy(g_last_error, message, length);
  g_last_error[length] = '\0';
}

int32_t report(const Status& status) {
  if (status.is_ok()) {
    g_last_error[0] = '\0';
  } else {
    set_last_error(status.message().data(), status.message().size());
  }
  return static_cast<int32_t>(status.code());
}

// Without touching the heap: for the out-of-memory path and the catch-all.
int32_t report_static(StatusCode code, const char* message) {
  set_last_error(message, std::strlen(message));
  return static_cast<int32_t>(code);
}

// Runs body (returning Status) with every exception turned into kInternal.
template <typename Body>
int32_t guarded(Body&& body) {
  try {
    return report(std::forward<Body>(body)());
  } catch (const std::bad_alloc&) {
    return report_static(StatusCode::kInternal, "out of host memory");
  } catch (const std::exception& e) {
    try {
      return report(Status(StatusCode::kInternal, std::string("unexpected exception: ") + e.what()));
    } catch (...) {
      return report_static(StatusCode::kInternal, "unexpected exception");
    }
  } catch (...) {
    return report_static(StatusCode::kInternal, "unexpected exception");
  }
}

Status null_argument(const char* function, const char* argument) {
  return Status::invalid(std::string(function) + ": " + argument + " must not be NULL");
}

Status to_config(const megamoe_config* in, megamoe::LayerConfig* out) {
  if (in->reserved != 0) return Status::invalid("megamoe_config.reserved must be 0");
  out->hidden = in->hidden;
  out->intermediate = in->intermediate;
  out->num_experts = in->num_experts;
  out->top_k = in->top_k;
  out->num_ranks = in->num_ranks;
  out->max_tokens_per_rank = in->max_tokens_per_rank;
  // Out-of-range values are carried through on purpose: validate() names them.
  out->precision = static_cast<megamoe::Precision>(in->precision);
  return megamoe::validate(*out);
}

#if MEGAMOE_WITH_CUDA

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError,
                std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

megamoe::LayerOptions to_options(const megamoe_options* in) {
  megamoe::LayerOptions options;
  if (in != nullptr) {
    options.expert_row_capacity = in->expert_row_capacity;
    options.wait_timeout_seconds = in->wait_timeout_seconds;
    options.forward_path = static_cast<megamoe::ForwardPath>(in->forward_path);
    options.recompute_h = in->recompute_h != 0;
    options.backward_path = static_cast<megamoe::BackwardPath>(in->backward_path);
  }
  return options;
}

// Makes the group's device current for the scope of a call and restores the caller's afterwards:
// Python may call from any device context, and events and streams belong to one device.
class DeviceScope {
 public:
  Status enter(int device) {
    MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&previous_), "cudaGetDevice"));
    if (previous_ != device) {
      MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
      restore_ = true;
    }
    return Status::ok();
  }
  ~DeviceScope() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// Both group kinds take the same per-rank structs.
Status to_forward_args(const megamoe_forward_args& a, megamoe::ForwardArgs* f) {
  if (a.reserved != 0) return Status::invalid("megamoe_forward_args.reserved must be 0");
  if (a.topk_idx_is_int32 != 0 && a.topk_idx_is_int32 != 1)
    return Status::invalid("megamoe_forward_args.topk_idx_is_int32 must be 0 or 1");
  f->num_tokens = a.num_tokens;
  f->x = static_cast<const __nv_bfloat16*>(a.x);
  f->topk_idx = a.topk_idx;
  f->topk_idx_type = a.topk_idx_is_int32 ? megamoe::IndexType::kInt32 : megamoe::IndexType::kInt64;
  f->topk_weights = a.topk_weights;
  f->w13 = static_cast<const __nv_bfloat16*>(a.w13);
  f->w2 = static_cast<const __nv_bfloat16*>(a.w2);
  f->out = static_cast<__nv_bfloat16*>(a.out);
  f->weights_version = a.weights_version;
  f->w13_fp8 = static_cast<const uint8_t*>(a.w13_fp8);
  f->w13_scales = a.w13_scales;
  f->w2_fp8 = static_cast<const uint8_t*>(a.w2_fp8);
  f->w2_scales = a.w2_scales;
  return Status::ok();
}

Status to_backward_args(const megamoe_backward_args& a, megamoe::BackwardArgs* b) {
  if (a.reserved != 0) return Status::invalid("megamoe_backward_args.reserved must be 0");
  b->d_out = static_cast<const __nv_bfloat16*>(a.d_out);
  b->d_x = static_cast<__nv_bfloat16*>(a.d_x);
  b->d_topk_weights = a.d_topk_weights;
  b->d_w13 = a.d_w13;
  b->d_w2 = a.d_w2;
  b->d_w13_bf16 = static_cast<__nv_bfloat16*>(a.d_w13_bf16);
  b->d_w2_bf16 = static_cast<__nv_bfloat16*>(a.d_w2_bf16);
  b->accumulate_weight_grads = a.accumulate_weight_grads != 0;
  return Status::ok();
}

// A machine without a usable GPU is "not supported", not a CUDA error: bindings skip on it.
Status require_device(const char* function) {
  int device_count = 0;
  cudaError_t err = cudaGetDeviceCount(&device_count);
  if (err == cudaSuccess && device_count > 0) return Status::ok();
  (void)cudaGetLastError();  // leave no sticky error behind for the caller's next CUDA call
  return Status(StatusCode::kNotSupported, std::string(function) + ": no usable CUDA device (" +
                                               (err == cudaSuccess ? "none found" : cudaGetErrorString(err)) + ")");
}

#else

Status not_built_with_cuda(const char* function) {
  return Status(StatusCode::kNotSupported, std::string(function) +
                                               ": megamoe was built without CUDA (MEGAMOE_ENABLE_CUDA=OFF); "
                                               "the GPU layer is not available");
}

#endif  // MEGAMOE_WITH_CUDA

}  // namespace

// Every handle starts with a tag: a call on a pointer that is not a live group (never created, already
// destroyed, or corrupted) is reported as an invalid argument instead of running on freed memory. This is
// best effort (a freed block may be reused), meant to turn a binding's lifetime bug into a message.
constexpr uint64_t kLiveGroupTag = 0x70756f7267656f6dULL;  // "moegroup" in memory (little endian)
constexpr uint64_t kDeadGroupTag = 0x646165642d2d2d2dULL;  // "----dead"

#if MEGAMOE_WITH_CUDA
struct megamoe_vgroup {
  uint64_t tag = kLiveGroupTag;
  int device = 0;
  std::unique_ptr<megamoe::VirtualRankGroup> group;
  cudaEvent_t caller_ready = nullptr;      // recorded on the caller's stream, waited on by every rank
  std::vector<cudaEvent_t> rank_done;      // one per rank, waited on by the caller's stream

  ~megamoe_vgroup() {
    tag = kDeadGroupTag;
    DeviceScope scope;
    (void)scope.enter(device);
    if (group) (void)group->synchronize_and_check();
    if (caller_ready != nullptr) (void)cudaEventDestroy(caller_ready);
    for (cudaEvent_t e : rank_done) (void)cudaEventDestroy(e);
  }

  // fork: every rank's stream waits for what the caller enqueued so far.
  Status fork(cudaStream_t caller) {
    MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaEventRecord(caller_ready, caller), "cudaEventRecord"));
    for (int r = 0; r < group->num_ranks(); ++r)
      MEGAMOE_RETURN_IF_ERROR(
          cuda_status(cudaStreamWaitEvent(group->stream(r), caller_ready, 0), "cudaStreamWaitEvent"));
    return Status::ok();
  }

  // join: the caller's stream waits for every rank. Run even after a failed enqueue, so that a capture
  // never ends with a forked stream left unjoined.
  Status join(cudaStream_t caller) {
    Status first;
    for (int r = 0; r < group->num_ranks(); ++r) {
      Status s = cuda_status(cudaEventRecord(rank_done[static_cast<size_t>(r)], group->stream(r)), "cudaEventRecord");
      if (s.is_ok())
        s = cuda_status(cudaStreamWaitEvent(caller, rank_done[static_cast<size_t>(r)], 0), "cudaStreamWaitEvent");
      if (first.is_ok() && !s.is_ok()) first = std::move(s);
    }
    return first;
  }

  // check(layer, r) runs for every rank before anything is enqueued: a bad argument of rank r must not
  // leave ranks 0..r-1 waiting at a barrier for a rank that never comes (that would break the group).
  template <typename Check, typename Call>
  Status run_all_ranks(void* stream, Check&& check, Call&& call) {
    DeviceScope scope;
    MEGAMOE_RETURN_IF_ERROR(scope.enter(device));
    for (int r = 0; r < group->num_ranks(); ++r) {
      Status s = check(group->layer(r), r);
      if (!s.is_ok()) return Status(s.code(), "rank " + std::to_string(r) + ": " + s.message() + " (nothing enqueued)");
    }
    auto caller = static_cast<cudaStream_t>(stream);
    Status first = fork(caller);
    for (int r = 0; r < group->num_ranks() && first.is_ok(); ++r) {
      Status s = call(group->layer(r), r);
      if (!s.is_ok()) first = Status(s.code(), "rank " + std::to_string(r) + ": " + s.message());
    }
    Status joined = join(caller);
    return first.is_ok() ? joined : first;
  }
};
#else
struct megamoe_vgroup {
  uint64_t tag = kLiveGroupTag;
  ~megamoe_vgroup() { tag = kDeadGroupTag; }
};
#endif

// A different live tag from a vgroup's: both cross ctypes as plain pointers, and handing one kind to the
// other's functions must be an error, not a misread struct.
constexpr uint64_t kLivePGroupTag = 0x2170726770656f6dULL;  // "moepgrp!"

#if MEGAMOE_WITH_CUDA
struct megamoe_pgroup {
  uint64_t tag = kLivePGroupTag;
  int device = 0;
  int32_t num_ranks = 0;
  std::unique_ptr<megamoe::ProcessRankGroup> group;
  cudaEvent_t caller_ready = nullptr;  // recorded on the caller's stream, waited on by the rank's stream
  cudaEvent_t rank_done = nullptr;     // recorded on the rank's stream, waited on by the caller's stream

  ~megamoe_pgroup() {
    tag = kDeadGroupTag;
    DeviceScope scope;
    (void)scope.enter(device);
    if (group) (void)group->synchronize_and_check();
    group.reset();
    if (caller_ready != nullptr) (void)cudaEventDestroy(caller_ready);
    if (rank_done != nullptr) (void)cudaEventDestroy(rank_done);
  }

  // Same fork/join as megamoe_vgroup::run_all_ranks, for the one local rank: the rank's stream waits for
  // the caller's work, and the caller's stream waits for the rank's, even after a failed enqueue (so that
  // a capture never ends with the forked stream unjoined).
  template <typename Call>
  Status run(void* stream, Call&& call) {
    DeviceScope scope;
    MEGAMOE_RETURN_IF_ERROR(scope.enter(device));
    auto caller = static_cast<cudaStream_t>(stream);
    cudaStream_t own = group->stream();
    Status first = cuda_status(cudaEventRecord(caller_ready, caller), "cudaEventRecord");
    if (first.is_ok()) first = cuda_status(cudaStreamWaitEvent(own, caller_ready, 0), "cudaStreamWaitEvent");
    if (first.is_ok()) first = call(group->layer());
    Status joined = cuda_status(cudaEventRecord(rank_done, own), "cudaEventRecord");
    if (joined.is_ok()) joined = cuda_status(cudaStreamWaitEvent(caller, rank_done, 0), "cudaStreamWaitEvent");
    return first.is_ok() ? joined : first;
  }
};
#else
struct megamoe_pgroup {
  uint64_t tag = kLivePGroupTag;
  ~megamoe_pgroup() { tag = kDeadGroupTag; }
};
#endif

namespace {

// group must not be NULL and must be a live handle from megamoe_vgroup_create.
Status check_group(const megamoe_vgroup* group, const char* function) {
  if (group == nullptr) return null_argument(function, "group");
  if (group->tag != kLiveGroupTag)
    return Status::invalid(std::string(function) + ": group is not a live megamoe_vgroup (destroyed already, or not "
                                                   "from megamoe_vgroup_create)");
#if MEGAMOE_WITH_CUDA
  if (!group->group) return Status(StatusCode::kInternal, std::string(function) + ": group has no layer");
#endif
  return Status::ok();
}

// group must not be NULL and must be a live handle from megamoe_pgroup_create.
Status check_pgroup(const megamoe_pgroup* group, const char* function) {
  if (group == nullptr) return null_argument(function, "group");
  if (group->tag != kLivePGroupTag)
    return Status::invalid(std::string(function) + ": group is not a live megamoe_pgroup (destroyed already, or not "
                                                   "from megamoe_pgroup_create)");
#if MEGAMOE_WITH_CUDA
  if (!group->group) return Status(StatusCode::kInternal, std::string(function) + ": group has no layer");
#endif
  return Status::ok();
}

}  // namespace

extern "C" {

int32_t megamoe_abi_version(void) { return MEGAMOE_ABI_VERSION; }

int32_t megamoe_built_with_cuda(void) { return MEGAMOE_WITH_CUDA ? 1 : 0; }

int32_t megamoe_private_cxx_runtime(void) { return MEGAMOE_PRIVATE_CXX_RUNTIME_BUILD ? 1 : 0; }

const char* megamoe_last_error(void) { return g_last_error; }

const char* megamoe_status_name(int32_t code) {
  if (code < MEGAMOE_OK || code > MEGAMOE_INTERNAL) return "unknown status";
  return megamoe::status_code_name(static_cast<StatusCode>(code));
}

int32_t megamoe_default_options(megamoe_options* options) {
  return guarded([&]() -> Status {
    if (options == nullptr) return null_argument("megamoe_default_options", "options");
    // Mirrors megamoe::LayerOptions' defaults without needing layer.hpp (a CUDA header) here.
    options->expert_row_capacity = 0;
    options->wait_timeout_seconds = 20.0;
    options->forward_path = MEGAMOE_FORWARD_MODULAR;
    options->recompute_h = 0;
    options->backward_path = MEGAMOE_BACKWARD_MODULAR;
    options->reserved = 0;
    return Status::ok();
  });
}

int32_t megamoe_validate_config(const megamoe_config* config) {
  return guarded([&]() -> Status {
    if (config == nullptr) return null_argument("megamoe_validate_config", "config");
    megamoe::LayerConfig c;
    return to_config(config, &c);
  });
}

int32_t megamoe_workspace_bytes(const megamoe_config* config, const megamoe_options* options, int64_t* bytes) {
  return guarded([&]() -> Status {
    if (config == nullptr) return null_argument("megamoe_workspace_bytes", "config");
    if (bytes == nullptr) return null_argument("megamoe_workspace_bytes", "bytes");
    *bytes = 0;
    megamoe::LayerConfig c;
    MEGAMOE_RETURN_IF_ERROR(to_config(config, &c));
#if MEGAMOE_WITH_CUDA
    return megamoe::ExpertParallelLayer::workspace_bytes(c, to_options(options), bytes);
#else
    (void)options;
    return not_built_with_cuda("megamoe_workspace_bytes");
#endif
  });
}

int32_t megamoe_vgroup_create(const megamoe_config* config, const megamoe_options* options,
                              megamoe_vgroup** group) {
  if (group != nullptr) *group = nullptr;
  return guarded([&]() -> Status {
    if (config == nullptr) return null_argument("megamoe_vgroup_create", "config");
    if (group == nullptr) return null_argument("megamoe_vgroup_create", "group");
    megamoe::LayerConfig c;
    MEGAMOE_RETURN_IF_ERROR(to_config(config, &c));
#if MEGAMOE_WITH_CUDA
    MEGAMOE_RETURN_IF_ERROR(require_device("megamoe_vgroup_create"));
    auto handle = std::make_unique<megamoe_vgroup>();
    MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&handle->device), "cudaGetDevice"));
    MEGAMOE_RETURN_IF_ERROR(megamoe::VirtualRankGroup::create(c, to_options(options), &handle->group));
    MEGAMOE_RETURN_IF_ERROR(cuda_status(
        cudaEventCreateWithFlags(&handle->caller_ready, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
    handle->rank_done.reserve(static_cast<size_t>(handle->group->num_ranks()));
    for (int r = 0; r < handle->group->num_ranks(); ++r) {
      cudaEvent_t e = nullptr;
      MEGAMOE_RETURN_IF_ERROR(
          cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
      handle->rank_done.push_back(e);
    }
    *group = handle.release();
    return Status::ok();
#else
    (void)options;
    return not_built_with_cuda("megamoe_vgroup_create");
#endif
  });
}

void megamoe_vgroup_destroy(megamoe_vgroup* group) {
  try {
    // A second destroy of the same handle is ignored when its tag still reads dead (best effort).
    if (group == nullptr || group->tag != kLiveGroupTag) return;
    delete group;
  } catch (...) {
    // Destruction has no status to report to; never let it reach the caller.
  }
}

int32_t megamoe_vgroup_num_ranks(const megamoe_vgroup* group, int32_t* num_ranks) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_group(group, "megamoe_vgroup_num_ranks"));
    if (num_ranks == nullptr) return null_argument("megamoe_vgroup_num_ranks", "num_ranks");
#if MEGAMOE_WITH_CUDA
    *num_ranks = group->group->num_ranks();
    return Status::ok();
#else
    return not_built_with_cuda("megamoe_vgroup_num_ranks");
#endif
  });
}

int32_t megamoe_vgroup_expert_row_capacity(const megamoe_vgroup* group, int64_t* rows) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_group(group, "megamoe_vgroup_expert_row_capacity"));
    if (rows == nullptr) return null_argument("megamoe_vgroup_expert_row_capacity", "rows");
#if MEGAMOE_WITH_CUDA
    *rows = group->group->layer(0).expert_row_capacity();
    return Status::ok();
#else
    return not_built_with_cuda("megamoe_vgroup_expert_row_capacity");
#endif
  });
}

int32_t megamoe_vgroup_forward(megamoe_vgroup* group, const megamoe_forward_args* args, void* stream) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_group(group, "megamoe_vgroup_forward"));
    if (args == nullptr) return null_argument("megamoe_vgroup_forward", "args");
#if MEGAMOE_WITH_CUDA
    std::vector<megamoe::ForwardArgs> f(static_cast<size_t>(group->group->num_ranks()));
    return group->run_all_ranks(
        stream,
        [&](const megamoe::ExpertParallelLayer& layer, int r) -> Status {
          MEGAMOE_RETURN_IF_ERROR(to_forward_args(args[r], &f[static_cast<size_t>(r)]));
          return layer.check_forward(f[static_cast<size_t>(r)]);
        },
        [&](megamoe::ExpertParallelLayer& layer, int r) { return layer.forward(f[static_cast<size_t>(r)]); });
#else
    (void)stream;
    return not_built_with_cuda("megamoe_vgroup_forward");
#endif
  });
}

int32_t megamoe_vgroup_backward(megamoe_vgroup* group, const megamoe_backward_args* args, void* stream) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_group(group, "megamoe_vgroup_backward"));
    if (args == nullptr) return null_argument("megamoe_vgroup_backward", "args");
#if MEGAMOE_WITH_CUDA
    std::vector<megamoe::BackwardArgs> b(static_cast<size_t>(group->group->num_ranks()));
    return group->run_all_ranks(
        stream,
        [&](const megamoe::ExpertParallelLayer& layer, int r) -> Status {
          MEGAMOE_RETURN_IF_ERROR(to_backward_args(args[r], &b[static_cast<size_t>(r)]));
          return layer.check_backward(b[static_cast<size_t>(r)]);
        },
        [&](megamoe::ExpertParallelLayer& layer, int r) { return layer.backward(b[static_cast<size_t>(r)]); });
#else
    (void)stream;
    return not_built_with_cuda("megamoe_vgroup_backward");
#endif
  });
}

int32_t megamoe_vgroup_synchronize_and_check(megamoe_vgroup* group) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_group(group, "megamoe_vgroup_synchronize_and_check"));
#if MEGAMOE_WITH_CUDA
    DeviceScope scope;
    MEGAMOE_RETURN_IF_ERROR(scope.enter(group->device));
    return group->group->synchronize_and_check();
#else
    return not_built_with_cuda("megamoe_vgroup_synchronize_and_check");
#endif
  });
}

int32_t megamoe_create_bootstrap_id(megamoe_bootstrap_id* id) {
  return guarded([&]() -> Status {
    if (id == nullptr) return null_argument("megamoe_create_bootstrap_id", "id");
    std::memset(id->bytes, 0, sizeof(id->bytes));
#if MEGAMOE_WITH_CUDA
    static_assert(sizeof(megamoe::BootstrapId) == MEGAMOE_BOOTSTRAP_ID_BYTES);
    megamoe::BootstrapId bootstrap{};
    MEGAMOE_RETURN_IF_ERROR(megamoe::ProcessRankGroup::create_bootstrap_id(&bootstrap));
    std::memcpy(id->bytes, bootstrap.data(), sizeof(id->bytes));
    return Status::ok();
#else
    return not_built_with_cuda("megamoe_create_bootstrap_id");
#endif
  });
}

int32_t megamoe_pgroup_create(const megamoe_config* config, const megamoe_options* options, int32_t rank,
                              const megamoe_bootstrap_id* id, megamoe_pgroup** group) {
  if (group != nullptr) *group = nullptr;
  return guarded([&]() -> Status {
    if (config == nullptr) return null_argument("megamoe_pgroup_create", "config");
    if (id == nullptr) return null_argument("megamoe_pgroup_create", "id");
    if (group == nullptr) return null_argument("megamoe_pgroup_create", "group");
    megamoe::LayerConfig c;
    MEGAMOE_RETURN_IF_ERROR(to_config(config, &c));
    // Checked here too (the C++ create checks it after nothing collective has started either): a binding
    // gets the same message from a build without CUDA.
    if (rank < 0 || rank >= c.num_ranks)
      return Status::invalid("megamoe_pgroup_create: rank must be in [0, num_ranks=" + std::to_string(c.num_ranks) +
                             "), got " + std::to_string(rank));
#if MEGAMOE_WITH_CUDA
    MEGAMOE_RETURN_IF_ERROR(require_device("megamoe_pgroup_create"));
    auto handle = std::make_unique<megamoe_pgroup>();
    handle->num_ranks = static_cast<int32_t>(c.num_ranks);
    MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&handle->device), "cudaGetDevice"));
    // Events first: once create has returned the peers count on this rank, so nothing may fail after it.
    MEGAMOE_RETURN_IF_ERROR(cuda_status(
        cudaEventCreateWithFlags(&handle->caller_ready, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
    MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(&handle->rank_done, cudaEventDisableTiming),
                                        "cudaEventCreateWithFlags"));
    megamoe::BootstrapId bootstrap{};
    std::memcpy(bootstrap.data(), id->bytes, bootstrap.size());
    MEGAMOE_RETURN_IF_ERROR(megamoe::ProcessRankGroup::create(c, to_options(options), rank, bootstrap, &handle->group));
    *group = handle.release();
    return Status::ok();
#else
    (void)options;
    return not_built_with_cuda("megamoe_pgroup_create");
#endif
  });
}

void megamoe_pgroup_destroy(megamoe_pgroup* group) {
  try {
    if (group == nullptr || group->tag != kLivePGroupTag) return;
    delete group;
  } catch (...) {
    // Destruction has no status to report to; never let it reach the caller.
  }
}

int32_t megamoe_pgroup_rank(const megamoe_pgroup* group, int32_t* rank) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_pgroup(group, "megamoe_pgroup_rank"));
    if (rank == nullptr) return null_argument("megamoe_pgroup_rank", "rank");
#if MEGAMOE_WITH_CUDA
    *rank = group->group->rank();
    return Status::ok();
#else
    return not_built_with_cuda("megamoe_pgroup_rank");
#endif
  });
}

int32_t megamoe_pgroup_num_ranks(const megamoe_pgroup* group, int32_t* num_ranks) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_pgroup(group, "megamoe_pgroup_num_ranks"));
    if (num_ranks == nullptr) return null_argument("megamoe_pgroup_num_ranks", "num_ranks");
#if MEGAMOE_WITH_CUDA
    *num_ranks = group->num_ranks;
    return Status::ok();
#else
    return not_built_with_cuda("megamoe_pgroup_num_ranks");
#endif
  });
}

int32_t megamoe_pgroup_expert_row_capacity(const megamoe_pgroup* group, int64_t* rows) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_pgroup(group, "megamoe_pgroup_expert_row_capacity"));
    if (rows == nullptr) return null_argument("megamoe_pgroup_expert_row_capacity", "rows");
#if MEGAMOE_WITH_CUDA
    *rows = group->group->layer().expert_row_capacity();
    return Status::ok();
#else
    return not_built_with_cuda("megamoe_pgroup_expert_row_capacity");
#endif
  });
}

int32_t megamoe_pgroup_forward(megamoe_pgroup* group, const megamoe_forward_args* args, void* stream) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_pgroup(group, "megamoe_pgroup_forward"));
    if (args == nullptr) return null_argument("megamoe_pgroup_forward", "args");
#if MEGAMOE_WITH_CUDA
    megamoe::ForwardArgs f;
    MEGAMOE_RETURN_IF_ERROR(to_forward_args(*args, &f));
    return group->run(stream, [&](megamoe::ExpertParallelLayer& layer) { return layer.forward(f); });
#else
    (void)stream;
    return not_built_with_cuda("megamoe_pgroup_forward");
#endif
  });
}

int32_t megamoe_pgroup_backward(megamoe_pgroup* group, const megamoe_backward_args* args, void* stream) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_pgroup(group, "megamoe_pgroup_backward"));
    if (args == nullptr) return null_argument("megamoe_pgroup_backward", "args");
#if MEGAMOE_WITH_CUDA
    megamoe::BackwardArgs b;
    MEGAMOE_RETURN_IF_ERROR(to_backward_args(*args, &b));
    return group->run(stream, [&](megamoe::ExpertParallelLayer& layer) { return layer.backward(b); });
#else
    (void)stream;
    return not_built_with_cuda("megamoe_pgroup_backward");
#endif
  });
}

int32_t megamoe_pgroup_synchronize_and_check(megamoe_pgroup* group) {
  return guarded([&]() -> Status {
    MEGAMOE_RETURN_IF_ERROR(check_pgroup(group, "megamoe_pgroup_synchronize_and_check"));
#if MEGAMOE_WITH_CUDA
    DeviceScope scope;
    MEGAMOE_RETURN_IF_ERROR(scope.enter(group->device));
    return group->group->synchronize_and_check();
#else
    return not_built_with_cuda("megamoe_pgroup_synchronize_and_check");
#endif
  });
}

}  // extern "C"
