// A deadline on every NCCL step (src/comm/bounded_nccl.hpp).
#include "comm/bounded_nccl.hpp"

#if MEGAMOE_WITH_NCCL

#include <chrono>
#include <string>
#include <thread>

namespace megamoe::comm {

namespace {

std::string nccl_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

}  // namespace

Status BoundedComm::create(int nranks, const ncclUniqueId& id, int rank, double timeout_seconds,
                           std::unique_ptr<BoundedComm>* comm) {
  std::unique_ptr<BoundedComm> c(new BoundedComm());
  c->rank_ = rank;
  c->nranks_ = nranks;
  c->timeout_seconds_ = timeout_seconds;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t started = ncclCommInitRankConfig(&c->comm_, nranks, id, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    const std::string text = nccl_text(started, c->comm_);
    if (c->comm_ != nullptr) (void)ncclCommAbort(c->comm_);
    c->comm_ = nullptr;
    return Status(StatusCode::kCudaError, "rank " + std::to_string(rank) + ": NCCL communicator: " + text);
  }
  MEGAMOE_RETURN_IF_ERROR(c->wait(nullptr, "joining the group (NCCL communicator)"));
  const cudaError_t alloc = cudaMalloc(&c->token_, sizeof(int));
  if (alloc != cudaSuccess) {
    c->token_ = nullptr;
    return c->fail(Status(StatusCode::kCudaError, std::string("cudaMalloc(barrier token): ") + cudaGetErrorString(alloc)));
  }
  *comm = std::move(c);
  return Status::ok();
}

BoundedComm::~BoundedComm() {
  if (comm_ != nullptr) {
    if (failed_)
      (void)ncclCommAbort(comm_);
    else
      (void)finish();
  }
  if (token_ != nullptr) (void)cudaFree(token_);
}

Status BoundedComm::fail(Status why) {
  failed_ = true;
  if (comm_ != nullptr) {
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  return why;
}

Status BoundedComm::wait(cudaStream_t stream, const char* what) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_seconds_));
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) state = queried;
    if (state != ncclSuccess && state != ncclInProgress)
      return fail(Status(StatusCode::kCudaError,
                         "rank " + std::to_string(rank_) + ": " + what + " failed in NCCL: " + nccl_text(state, comm_)));
    if (state == ncclSuccess) {
      if (stream == nullptr) return Status::ok();
      const cudaError_t done = cudaStreamQuery(stream);
      if (done == cudaSuccess) return Status::ok();
      if (done != cudaErrorNotReady)
        return fail(Status(StatusCode::kCudaError,
                           "rank " + std::to_string(rank_) + ": " + what + ": " + cudaGetErrorString(done)));
    }
    if (Clock::now() > deadline)
      return fail(Status(StatusCode::kTimeout,
                         "rank " + std::to_string(rank_) + ": " + what + " did not complete within " +
                             std::to_string(timeout_seconds_) + " s (LayerOptions::wait_timeout_seconds): one of the " +
                             std::to_string(nranks_) + " processes never joined it or failed before it did"));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

Status BoundedComm::all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream, const char* what) {
  if (!healthy()) return Status(StatusCode::kInternal, std::string(what) + ": the NCCL communicator has failed");
  const ncclResult_t started = ncclAllGather(send, recv, bytes, ncclChar, comm_, stream);
  if (started != ncclSuccess && started != ncclInProgress)
    return fail(Status(StatusCode::kCudaError,
                       "rank " + std::to_string(rank_) + ": " + what + ": " + nccl_text(started, comm_)));
  return wait(stream, what);
}

Status BoundedComm::barrier(cudaStream_t stream, const char* what) {
  if (!healthy()) return Status(StatusCode::kInternal, std::string(what) + ": the NCCL communicator has failed");
  const ncclResult_t started = ncclAllReduce(token_, token_, 1, ncclInt, ncclSum, comm_, stream);
  if (started != ncclSuccess && started != ncclInProgress)
    return fail(Status(StatusCode::kCudaError,
                       "rank " + std::to_string(rank_) + ": " + what + ": " + nccl_text(started, comm_)));
  return wait(stream, what);
}

bool BoundedComm::finish() {
  if (!healthy()) return false;
  const ncclResult_t started = ncclCommFinalize(comm_);
  if ((started != ncclSuccess && started != ncclInProgress) ||
      !wait(nullptr, "closing the NCCL communicator").is_ok()) {
    (void)fail(Status::ok());
    return false;
  }
  (void)ncclCommDestroy(comm_);
  comm_ = nullptr;
  return true;
}

}  // namespace megamoe::comm

#endif  // MEGAMOE_WITH_NCCL
