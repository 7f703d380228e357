// for_each_ring_stage (src/device/ring_state.hpp), the FP8 main loops' walk over the pipeline ring with
// constant stage indices, against stepping a PipeState one stage at a time: the same stages, phases and
// last-stage flag, in the same order, and the same final position, for every ring depth the walk supports,
// every start position and phase, and counts up to several rounds.
#include <gtest/gtest.h>

#include <tuple>
#include <utility>
#include <vector>

#include "device/ring_state.hpp"

namespace {

using megamoe::device::for_each_ring_stage;
using megamoe::device::PipeState;

using Visit = std::tuple<int, uint32_t, bool>;  // stage, phase, last

template <int kStages>
void check_depth() {
  for (int start = 0; start < kStages; ++start) {
    for (uint32_t phase = 0; phase < 2; ++phase) {
      for (int count = 1; count <= 3 * kStages + 2; ++count) {
        PipeState<kStages> stepped{start, phase};
        std::vector<Visit> want;
        for (int i = 0; i < count; ++i) {
          want.emplace_back(stepped.index, stepped.phase, i + 1 == count);
          stepped.advance();
        }
        PipeState<kStages> walked{start, phase};
        std::vector<Visit> got;
        for_each_ring_stage(walked, count, [&](auto stage, uint32_t p, bool last) {
          got.emplace_back(decltype(stage)::value, p, last);
        });
        SCOPED_TRACE(testing::Message() << "stages " << kStages << ", start " << start << ", phase " << phase
                                        << ", count " << count);
        EXPECT_EQ(got, want);
        EXPECT_EQ(walked.index, stepped.index);
        EXPECT_EQ(walked.phase, stepped.phase);
      }
    }
  }
}

TEST(RingWalk, VisitsTheStagesPipeStateSteppingVisits) {
  check_depth<1>();
  check_depth<2>();
  check_depth<3>();
  check_depth<4>();
  check_depth<5>();
  check_depth<6>();
}

}  // namespace
