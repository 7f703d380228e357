// The receiver's row routing checks every value a peer wrote into its receive buffers (counts, token
// indices, local experts, row indices) before using it to address anything: each corrupted field is
// reported as an error naming the field and the value, and nothing is written out of range.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "comm/ep_workspace.hpp"
#include "gpu/gpu_test_util.hpp"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

using megamoe::testing::DeviceBuffer;

struct Receiver {
  Params p{};
  DeviceBuffer<char> workspace;
  DeviceBuffer<char*> peers;
};

Receiver make_receiver() {
  Receiver r;
  Shape& s = r.p.shape;
  s.hidden = 64;
  s.intermediate = 128;
  s.num_experts = 4;
  s.experts_per_rank = 4;
  s.top_k = 2;
  s.num_ranks = 1;
  s.rank = 0;
  s.max_tokens = 8;
  s.row_capacity = 16;
  s.dot_parts = 1;
  r.p.layout = WorkspaceLayout::make(s);
  r.workspace = DeviceBuffer<char>(static_cast<size_t>(r.p.layout.total));
  EXPECT_EQ(cudaMemset(r.workspace.get(), 0, r.workspace.size()), cudaSuccess);
  r.peers = DeviceBuffer<char*>(1);
  r.peers.upload({r.workspace.get()});
  r.p.local = r.workspace.get();
  r.p.peers = r.peers.get();
  r.p.timeout_ns = 1'000'000'000ull;
  return r;
}

template <typename T>
void put(Receiver& r, int64_t offset, const std::vector<T>& values) {
  ASSERT_EQ(cudaMemcpy(r.workspace.get() + offset, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
}

DeviceError run_and_read(Receiver& r) {
  EXPECT_TRUE(launch_route_rows(r.p, nullptr, 4).is_ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  DeviceError e{};
  EXPECT_EQ(cudaMemcpy(&e, r.workspace.get() + r.p.layout.error, sizeof(e), cudaMemcpyDeviceToHost), cudaSuccess);
  return e;
}

// Two tokens from the one source: token 0 -> experts 0 and 1, token 1 -> expert 0 (and a masked slot).
void put_valid(Receiver& r) {
  put<int32_t>(r, r.p.layout.recv_counts, {2, 1, 0, 0, 2});
  put<int32_t>(r, r.p.layout.recv_token, {0, 1});
  put<SlotRoute>(r, r.p.layout.recv_routes, {{0, 0}, {1, 0}, {0, 1}, {-1, 0}});
  put<float>(r, r.p.layout.recv_weights, {0.5f, 0.5f, 1.0f, 0.0f});
}

TEST(EpRouteRows, ValidRoutesGiveTheExpertMajorRows) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  Receiver r = make_receiver();
  put_valid(r);
  const DeviceError e = run_and_read(r);
  EXPECT_EQ(e.code, 0);
  std::vector<int32_t> offsets(5), row_src(3);
  ASSERT_EQ(cudaMemcpy(offsets.data(), r.workspace.get() + r.p.layout.expert_offsets, 20, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(row_src.data(), r.workspace.get() + r.p.layout.row_src, 12, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 2, 3, 3, 3}));
  EXPECT_EQ(row_src, (std::vector<int32_t>{0, 1, 0}));  // expert 0: token 0, token 1; expert 1: token 0
}

// The capacity is the most rows a call may bring: exactly the capacity fits, one more is reported with
// the rows the call needed (not a figure capped at capacity + 1).
TEST(EpRouteRows, ExactlyTheCapacityFitsAndOneMoreIsReportedWithTheRowsNeeded) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (int capacity : {3, 2}) {
    Receiver r = make_receiver();
    r.p.shape.row_capacity = capacity;  // the layout stays the 16-row one: only the check changes
    put_valid(r);                       // 3 rows: expert 0 gets 2, expert 1 gets 1
    const DeviceError e = run_and_read(r);
    if (capacity == 3) {
      EXPECT_EQ(e.code, 0) << "3 rows must fit a capacity of 3";
    } else {
      EXPECT_EQ(e.code, static_cast<int32_t>(StatusCode::kCapacityExceeded));
      EXPECT_EQ(e.what, kErrorCapacity);
      EXPECT_EQ(e.a, 3) << "rows needed";
      EXPECT_EQ(e.b, 2) << "capacity";
    }
  }
  Receiver one = make_receiver();
  one.p.shape.row_capacity = 2;  // a single expert receiving exactly the capacity
  put<int32_t>(one, one.p.layout.recv_counts, {2, 0, 0, 0, 2});
  put<int32_t>(one, one.p.layout.recv_token, {0, 1});
  put<SlotRoute>(one, one.p.layout.recv_routes, {{0, 0}, {-1, 0}, {0, 1}, {-1, 0}});
  put<float>(one, one.p.layout.recv_weights, {0.5f, 0.0f, 1.0f, 0.0f});
  EXPECT_EQ(run_and_read(one).code, 0);
}

TEST(EpRouteRows, EveryPeerWrittenFieldIsBoundsChecked) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  struct Case {
    const char* what;
    PeerField field;
    int64_t value;
    void (*corrupt)(Receiver&);
  };
  const Case cases[] = {
      {"negative count", kPeerCount, -5, [](Receiver& r) { put<int32_t>(r, r.p.layout.recv_counts, {-5, 1, 0, 0, 2}); }},
      {"too many tokens", kPeerTokens, 9, [](Receiver& r) { put<int32_t>(r, r.p.layout.recv_counts, {2, 1, 0, 0, 9}); }},
      {"token index", kPeerToken, 99, [](Receiver& r) { put<int32_t>(r, r.p.layout.recv_token, {0, 99}); }},
      {"local expert", kPeerLocalExpert, 7,
       [](Receiver& r) { put<SlotRoute>(r, r.p.layout.recv_routes, {{0, 0}, {7, 0}, {0, 1}, {-1, 0}}); }},
      {"row index", kPeerRowIndex, 5,
       [](Receiver& r) { put<SlotRoute>(r, r.p.layout.recv_routes, {{0, 0}, {1, 5}, {0, 1}, {-1, 0}}); }},
  };
  for (const Case& c : cases) {
    Receiver r = make_receiver();
    put_valid(r);
    c.corrupt(r);
    const DeviceError e = run_and_read(r);
    EXPECT_EQ(e.code, static_cast<int32_t>(StatusCode::kInternal)) << c.what;
    EXPECT_EQ(e.what, kErrorPeerIndex) << c.what;
    EXPECT_EQ(e.a, 0) << c.what;  // the source rank
    EXPECT_EQ(e.b, c.value) << c.what;
    EXPECT_EQ(e.c, c.field) << c.what;
  }
}

}  // namespace
}  // namespace megamoe::ep
