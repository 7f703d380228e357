// Real peers: one process per GPU. Each rank allocates its own symmetric workspace, the ranks exchange
// CUDA IPC handles of their workspaces through NCCL (bootstrapped by an NCCL unique id that rank 0
// creates and the caller hands to every rank, e.g. through torch.distributed or MPI), and every rank
// builds the device table of peer base addresses the layer's kernels use. Same-node peers (NVLink).
#pragma once

#include <array>
#include <memory>

#include <cuda_runtime_api.h>

#include "megamoe/config.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/status.hpp"

namespace megamoe {

// The 128 bytes of an ncclUniqueId.
using BootstrapId = std::array<char, 128>;

class ProcessRankGroup {
 public:
  ~ProcessRankGroup();
  ProcessRankGroup(const ProcessRankGroup&) = delete;
  ProcessRankGroup& operator=(const ProcessRankGroup&) = delete;

  // On rank 0 only; the id is then sent to every rank by the caller.
  static Status create_bootstrap_id(BootstrapId* id);
  // Collective over all R ranks of config.num_ranks (each in its own process, on its current device).
  static Status create(const LayerConfig& config, const LayerOptions& options, int rank, const BootstrapId& id,
                       std::unique_ptr<ProcessRankGroup>* group);

  int rank() const;
  ExpertParallelLayer& layer();
  cudaStream_t stream() const;
  Status synchronize_and_check();

  struct Impl;  // defined where the group is built (src/comm/process_group.cpp)

 private:
  ProcessRankGroup() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe
