// An NCCL communicator whose every step has a deadline. NCCL's blocking calls wait forever for a peer
// that never comes (a process that failed before joining, or after); a training job must get an error
// instead, on every rank. So the communicator is created non-blocking and each step (creation, a
// collective, teardown) is polled until it completes, NCCL reports an error, or the deadline passes; on
// error or timeout the communicator is aborted, which also ends any NCCL kernel still waiting on the GPU.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>

#include "megamoe/status.hpp"

namespace megamoe::comm {

class BoundedComm {
 public:
  ~BoundedComm();
  BoundedComm(const BoundedComm&) = delete;
  BoundedComm& operator=(const BoundedComm&) = delete;

  // Collective over nranks processes; fails with kTimeout when they have not all joined within timeout.
  static Status create(int nranks, const ncclUniqueId& id, int rank, double timeout_seconds,
                       std::unique_ptr<BoundedComm>* comm);

  // recv[r * bytes + i] = rank r's send[i], device buffers, on stream; returns when done on the GPU.
  Status all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream, const char* what);
  // Returns once every rank has entered it (or the deadline passed).
  Status barrier(cudaStream_t stream, const char* what);

  // Ends the communicator after finishing its work with the peers; false when that did not complete in
  // time (the communicator is aborted then, and the caller must assume a peer is still busy).
  bool finish();
  bool healthy() const { return comm_ != nullptr && !failed_; }
  int rank() const { return rank_; }

 private:
  BoundedComm() = default;
  // Polls until NCCL's asynchronous state is success and stream (when given) is idle.
  Status wait(cudaStream_t stream, const char* what);
  Status fail(Status why);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int nranks_ = 0;
  double timeout_seconds_ = 0;
  bool failed_ = false;
  int* token_ = nullptr;  // the barrier's one device int
};

}  // namespace megamoe::comm
