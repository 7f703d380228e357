// CUDA IPC + NCCL bootstrap of the symmetric workspace across processes (include/megamoe/process_group.hpp).
#include "megamoe/process_group.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "comm/rank_agreement.hpp"

#if MEGAMOE_WITH_NCCL
#include <nccl.h>

#include "comm/bounded_nccl.hpp"
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
  std::unique_ptr<comm::BoundedComm> comm;
#endif

  // Collective: a peer may still be running a kernel that writes into this rank's workspace (or holds
  // it mapped), so the memory goes back only after every rank has finished its work and reached this
  // point. A peer that does not arrive within the timeout may still use it: then the workspace is left
  // allocated (the process keeps it until exit) and the reason goes to stderr, which is all a
  // destructor can do.
  ~Impl() {
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    layer.reset();
    bool peers_done = true;
#if MEGAMOE_WITH_NCCL
    if (comm != nullptr && comm->healthy() && stream != nullptr) {
      const Status released = comm->barrier(stream, "releasing the group (every rank's destroy)");
      if (!released.is_ok()) {
        peers_done = false;
        std::fprintf(stderr, "megamoe: %s; the rank's workspace stays allocated\n", released.message().c_str());
      }
    }
    comm.reset();
#endif
    for (char* p : opened_peers) (void)cudaIpcCloseMemHandle(p);
    if (peer_table != nullptr) (void)cudaFree(peer_table);
    if (workspace != nullptr && peers_done) (void)cudaFree(workspace);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

ProcessRankGroup::~ProcessRankGroup() = default;

int ProcessRankGroup::rank() const { return impl_->rank; }
ExpertParallelLayer& ProcessRankGroup::layer() { return *impl_->layer; }
cudaStream_t ProcessRankGroup::stream() const { return impl_->stream; }
Status ProcessRankGroup::synchronize_and_check() { return impl_->layer->synchronize_and_check(); }

#if MEGAMOE_WITH_NCCL

namespace {

// What every rank sends in the one exchange before any memory is shared.
struct Introduction {
  comm::RankFingerprint fingerprint;
  cudaIpcMemHandle_t workspace{};
};

// A small device buffer for NCCL, which moves device memory only.
class DeviceStaging {
 public:
  ~DeviceStaging() {
    if (data_ != nullptr) (void)cudaFree(data_);
  }
  Status allocate(size_t bytes) { return cuda_check(cudaMalloc(&data_, bytes), "cudaMalloc(staging)"); }
  char* data() const { return data_; }

 private:
  char* data_ = nullptr;
};

// Every rank's bytes of `mine` (device-staged), in rank order.
template <typename T>
Status exchange(comm::BoundedComm& comm, const T& mine, int ranks, cudaStream_t stream, const char* what,
                std::vector<T>* all) {
  DeviceStaging staging;
  MEGAMOE_RETURN_IF_ERROR(staging.allocate(sizeof(T) * static_cast<size_t>(ranks + 1)));
  char* send = staging.data() + sizeof(T) * static_cast<size_t>(ranks);
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMemcpy(send, &mine, sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy"));
  MEGAMOE_RETURN_IF_ERROR(comm.all_gather(send, staging.data(), sizeof(T), stream, what));
  all->resize(static_cast<size_t>(ranks));
  return cuda_check(cudaMemcpy(all->data(), staging.data(), sizeof(T) * static_cast<size_t>(ranks),
                               cudaMemcpyDeviceToHost),
                    "cudaMemcpy");
}

// This rank's local setup before the exchange: the workspace, zeroed, and its IPC handle.
Status prepare_workspace(ProcessRankGroup::Impl& m, int64_t bytes, cudaIpcMemHandle_t* handle) {
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&m.workspace, static_cast<size_t>(bytes)), "cudaMalloc(workspace)"));
  // Zeroed before any peer can learn its address: the counters must start at zero.
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMemset(m.workspace, 0, static_cast<size_t>(bytes)), "cudaMemset"));
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  return cuda_check(cudaIpcGetMemHandle(handle, m.workspace), "cudaIpcGetMemHandle");
}

// After the agreement: map every peer's workspace and build the layer on them.
Status map_peers_and_build(ProcessRankGroup::Impl& m, const LayerConfig& config, const LayerOptions& options,
                           const std::vector<Introduction>& all) {
  const int R = static_cast<int>(all.size());
  std::vector<char*> bases(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    if (p == m.rank) {
      bases[static_cast<size_t>(p)] = m.workspace;
      continue;
    }
    void* opened = nullptr;
    MEGAMOE_RETURN_IF_ERROR(cuda_check(
        cudaIpcOpenMemHandle(&opened, all[static_cast<size_t>(p)].workspace, cudaIpcMemLazyEnablePeerAccess),
        ("cudaIpcOpenMemHandle(rank " + std::to_string(p) + ")").c_str()));
    bases[static_cast<size_t>(p)] = static_cast<char*>(opened);
    m.opened_peers.push_back(bases[static_cast<size_t>(p)]);
  }
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&m.peer_table, sizeof(char*) * static_cast<size_t>(R)),
                                     "cudaMalloc(peer table)"));
  MEGAMOE_RETURN_IF_ERROR(cuda_check(
      cudaMemcpy(m.peer_table, bases.data(), sizeof(char*) * static_cast<size_t>(R), cudaMemcpyHostToDevice),
      "cudaMemcpy"));
  RankPlacement placement;
  placement.rank = m.rank;
  placement.stream = m.stream;
  placement.max_blocks = 0;  // the whole GPU
  placement.workspace = m.workspace;
  placement.peer_workspaces_device = m.peer_table;
  return ExpertParallelLayer::create(config, options, placement, &m.layer);
}

// The verdict of the last step, gathered: every rank fails when any did (the first failed rank named),
// so that no rank starts using peers that gave up.
struct Outcome {
  int32_t code = 0;
  char message[comm::RankFingerprint::kMessageBytes] = {};
};

Status agree_on_outcome(comm::BoundedComm& comm, const Status& mine, int ranks, cudaStream_t stream) {
  Outcome local;
  local.code = static_cast<int32_t>(mine.code());
  std::memcpy(local.message, mine.message().data(), std::min<size_t>(mine.message().size(), sizeof(local.message) - 1));
  std::vector<Outcome> all;
  MEGAMOE_RETURN_IF_ERROR(exchange(comm, local, ranks, stream, "finishing the group's creation", &all));
  for (int r = 0; r < ranks; ++r) {
    const Outcome& o = all[static_cast<size_t>(r)];
    if (o.code == 0) continue;
    const char* end = std::find(o.message, o.message + sizeof(o.message), '\0');
    return Status(static_cast<StatusCode>(o.code), "rank " + std::to_string(r) + " could not map its peers or build "
                                                       "its layer: " + std::string(o.message, end));
  }
  return Status::ok();
}

}  // namespace

Status ProcessRankGroup::create_bootstrap_id(BootstrapId* id) {
  static_assert(sizeof(ncclUniqueId) == sizeof(BootstrapId));
  ncclUniqueId unique{};
  MEGAMOE_RETURN_IF_ERROR(nccl_check(ncclGetUniqueId(&unique), "ncclGetUniqueId"));
  std::memcpy(id->data(), &unique, sizeof(unique));
  return Status::ok();
}

Status ProcessRankGroup::create(const LayerConfig& config, const LayerOptions& options, int rank,
                                const BootstrapId& id, std::unique_ptr<ProcessRankGroup>* group) {
  // Only what makes joining impossible returns before the join (the peers then time out joining): an
  // invalid rank or rank count, or no bound on the wait. Every other local failure is told to the peers.
  if (config.num_ranks < 1 || config.num_ranks > kMaxRanks)
    return Status::invalid("num_ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                           std::to_string(config.num_ranks));
  if (rank < 0 || rank >= config.num_ranks)
    return Status::invalid("rank must be in [0, num_ranks), got " + std::to_string(rank));
  MEGAMOE_RETURN_IF_ERROR(validate(options));
  const int R = static_cast<int>(config.num_ranks);
  std::unique_ptr<ProcessRankGroup> g(new ProcessRankGroup());
  g->impl_ = std::make_unique<Impl>();
  Impl& m = *g->impl_;
  m.rank = rank;
  MEGAMOE_RETURN_IF_ERROR(cuda_check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  ncclUniqueId unique{};
  std::memcpy(&unique, id.data(), sizeof(unique));
  MEGAMOE_RETURN_IF_ERROR(comm::BoundedComm::create(R, unique, rank, options.wait_timeout_seconds, &m.comm));

  Introduction mine;
  int64_t bytes = 0, capacity = 0;
  Status local = ExpertParallelLayer::workspace_bytes(config, options, &bytes);
  if (local.is_ok()) local = ExpertParallelLayer::row_capacity(config, options, &capacity);
  if (local.is_ok()) local = prepare_workspace(m, bytes, &mine.workspace);
  mine.fingerprint = local.is_ok() ? comm::RankFingerprint::ready(config, rank, capacity, bytes)
                                   : comm::RankFingerprint::failed(config, rank, local);
  mine.fingerprint.forward_path = static_cast<int64_t>(options.forward_path);
  mine.fingerprint.recompute_h = options.recompute_h ? 1 : 0;
  mine.fingerprint.backward_path = static_cast<int64_t>(options.backward_path);
  std::vector<Introduction> all;
  MEGAMOE_RETURN_IF_ERROR(exchange(*m.comm, mine, R, m.stream, "exchanging configurations", &all));
  std::vector<comm::RankFingerprint> fingerprints;
  for (const Introduction& i : all) fingerprints.push_back(i.fingerprint);
  MEGAMOE_RETURN_IF_ERROR(comm::agree_on_layout(fingerprints));

  // Nobody may write into a peer before every peer has mapped every workspace: this exchange is also
  // the barrier after which the layer may run.
  const Status built = map_peers_and_build(m, config, options, all);
  MEGAMOE_RETURN_IF_ERROR(agree_on_outcome(*m.comm, built, R, m.stream));
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
