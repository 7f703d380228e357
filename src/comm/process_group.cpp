// CUDA IPC + NCCL bootstrap of the symmetric workspace across processes (include/megamoe/process_group.hpp).
#include "megamoe/process_group.hpp"

#include <cstring>
#include <string>
#include <vector>

#if MEGAMOE_WITH_NCCL
#include <nccl.h>
#endif

namespace megamoe {

namespace {

#if MEGAMOE_WITH_NCCL
Status cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(err));
}

Status nccl_check(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + ncclGetErrorString(result));
}
#endif

}  // namespace

struct ProcessRankGroup::Impl {
  int rank = 0;
  cudaStream_t stream = nullptr;
  char* workspace = nullptr;
  std::vector<char*> opened_peers;  // peers' workspaces mapped into this process
  char** peer_table = nullptr;
  std::unique_ptr<ExpertParallelLayer> layer;
#if MEGAMOE_WITH_NCCL
  ncclComm_t comm = nullptr;
#endif

  ~Impl() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    layer.reset();
    for (char* p : opened_peers) cudaIpcCloseMemHandle(p);
    if (peer_table != nullptr) cudaFree(peer_table);
    if (workspace != nullptr) cudaFree(workspace);
    if (stream != nullptr) cudaStreamDestroy(stream);
#if MEGAMOE_WITH_NCCL
    if (comm != nullptr) ncclCommDestroy(comm);
#endif
  }
};

ProcessRankGroup::~ProcessRankGroup() = default;

int ProcessRankGroup::rank() const { return impl_->rank; }
ExpertParallelLayer& ProcessRankGroup::layer() { return *impl_->layer; }
cudaStream_t ProcessRankGroup::stream() const { return impl_->stream; }
Status ProcessRankGroup::synchronize_and_check() { return impl_->layer->synchronize_and_check(); }

#if MEGAMOE_WITH_NCCL

Status ProcessRankGroup::create_bootstrap_id(BootstrapId* id) {
  static_assert(sizeof(ncclUniqueId) == sizeof(BootstrapId));
  ncclUniqueId unique{};
  MEGAMOE_RETURN_IF_ERROR(nccl_check(ncclGetUniqueId(&unique), "ncclGetUniqueId"));
  std::memcpy(id->data(), &unique, sizeof(unique));
  return Status::ok();
}

Status ProcessRankGroup::create(const LayerConfig& config, const LayerOptions& options, int rank,
                                const BootstrapId& id, std::unique_ptr<ProcessRankGroup>* group) {
  MEGAMOE_RETURN_IF_ERROR(validate(config));
  if (rank < 0 || rank >= config.num_ranks)
    return Status::invalid("rank must be in [0, num_ranks), got " + std::to_string(rank));
  int64_t bytes = 0;
  MEGAMOE_RETURN_IF_ERROR(ExpertParallelLayer::workspace_bytes(config, options, &bytes));
  std::unique_ptr<ProcessRankGroup> g(new ProcessRankGroup());
  g->impl_ = std::make_unique<Impl>();
  Impl& m = *g->impl_;
  m.rank = rank;
  const int R = static_cast<int>(config.num_ranks);
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  ncclUniqueId unique{};
  std::memcpy(&unique, id.data(), sizeof(unique));
  MEGAMOE_RETURN_IF_ERROR(nccl_check(ncclCommInitRank(&m.comm, R, unique, rank), "ncclCommInitRank"));

  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&m.workspace, static_cast<size_t>(bytes)), "cudaMalloc(workspace)"));
  // Zeroed before any peer can learn its address: the counters must start at zero.
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMemset(m.workspace, 0, static_cast<size_t>(bytes)), "cudaMemset"));
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));

  cudaIpcMemHandle_t mine{};
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaIpcGetMemHandle(&mine, m.workspace), "cudaIpcGetMemHandle"));
  // NCCL moves device memory: stage the handles through a small device buffer.
  constexpr size_t kHandle = sizeof(cudaIpcMemHandle_t);
  char* staging = nullptr;
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&staging, kHandle * (R + 1)), "cudaMalloc(staging)"));
  std::vector<cudaIpcMemHandle_t> handles(R);
  Status exchanged = cuda_check(cudaMemcpy(staging + kHandle * R, &mine, kHandle, cudaMemcpyHostToDevice), "cudaMemcpy");
  if (exchanged.is_ok())
    exchanged = nccl_check(ncclAllGather(staging + kHandle * R, staging, kHandle, ncclChar, m.comm, m.stream),
                           "ncclAllGather(IPC handles)");
  if (exchanged.is_ok()) exchanged = cuda_check(cudaStreamSynchronize(m.stream), "cudaStreamSynchronize");
  if (exchanged.is_ok())
    exchanged = cuda_check(cudaMemcpy(handles.data(), staging, kHandle * R, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(staging);
  MEGAMOE_RETURN_IF_ERROR(exchanged);

  std::vector<char*> bases(R);
  for (int p = 0; p < R; ++p) {
    if (p == rank) {
      bases[p] = m.workspace;
      continue;
    }
    void* opened = nullptr;
    MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaIpcOpenMemHandle(&opened, handles[p], cudaIpcMemLazyEnablePeerAccess),
                                       ("cudaIpcOpenMemHandle(rank " + std::to_string(p) + ")").c_str()));
    bases[p] = static_cast<char*>(opened);
    m.opened_peers.push_back(bases[p]);
  }
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&m.peer_table, sizeof(char*) * R), "cudaMalloc(peer table)"));
  MEGAMOE_RETURN_IF_ERROR(
      cuda_check(cudaMemcpy(m.peer_table, bases.data(), sizeof(char*) * R, cudaMemcpyHostToDevice), "cudaMemcpy"));

  RankPlacement placement;
  placement.rank = rank;
  placement.stream = m.stream;
  placement.max_blocks = 0;  // the whole GPU
  placement.workspace = m.workspace;
  placement.peer_workspaces_device = m.peer_table;
  MEGAMOE_RETURN_IF_ERROR(ExpertParallelLayer::create(config, options, placement, &m.layer));
  // Nobody may write into a peer before every peer has mapped every workspace.
  int* token = nullptr;
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&token, sizeof(int)), "cudaMalloc"));
  Status ready = nccl_check(ncclAllReduce(token, token, 1, ncclInt, ncclSum, m.comm, m.stream), "ncclAllReduce");
  if (ready.is_ok()) ready = cuda_check(cudaStreamSynchronize(m.stream), "cudaStreamSynchronize");
  cudaFree(token);
  MEGAMOE_RETURN_IF_ERROR(ready);
  *group = std::move(g);
  return Status::ok();
}

#else

Status ProcessRankGroup::create_bootstrap_id(BootstrapId*) {
  return Status(StatusCode::kNotSupported, "megamoe was built without NCCL: no multi-process ranks");
}

Status ProcessRankGroup::create(const LayerConfig&, const LayerOptions&, int, const BootstrapId&,
                                std::unique_ptr<ProcessRankGroup>*) {
  return Status(StatusCode::kNotSupported, "megamoe was built without NCCL: no multi-process ranks");
}

#endif

}  // namespace megamoe
