#include <gtest/gtest.h>

#include <random>
#include <stdexcept>

#include "flatshard/layout.h"

using flatshard::FlatParamLayout;

namespace {

std::vector<std::vector<std::int64_t>> random_shapes(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> count(1, 12), rank(0, 3), dim(0, 9);
  std::vector<std::vector<std::int64_t>> shapes(count(rng));
  for (auto& shape : shapes) {
    shape.resize(rank(rng));
    for (auto& d : shape) d = dim(rng);
  }
  return shapes;
}

}  // namespace

TEST(FlatParamLayout, SmallExample) {
  // 3x2 (6) + 5 (5) = 11 elements, F = 4 -> padded to 12, shards of 3.
  FlatParamLayout layout({{3, 2}, {5}}, 4);
  EXPECT_EQ(layout.offsets(), (std::vector<std::int64_t>{0, 6}));
  EXPECT_EQ(layout.numels(), (std::vector<std::int64_t>{6, 5}));
  EXPECT_EQ(layout.unpadded_numel(), 11);
  EXPECT_EQ(layout.padded_numel(), 12);
  EXPECT_EQ(layout.shard_numel(), 3);
  EXPECT_EQ(layout.shard_range(2), (std::pair<std::int64_t, std::int64_t>{6, 9}));
  auto slices = layout.shard_slices(1);  // [3, 6): param 0 elements 3..5
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(slices[0].param_index, 0);
  EXPECT_EQ(slices[0].offset_in_param, 3);
  EXPECT_EQ(slices[0].offset_in_shard, 0);
  EXPECT_EQ(slices[0].numel, 3);
  slices = layout.shard_slices(3);  // [9, 12): param 1 elements 3..4, then padding
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(slices[0].param_index, 1);
  EXPECT_EQ(slices[0].offset_in_param, 3);
  EXPECT_EQ(slices[0].numel, 2);
}

TEST(FlatParamLayout, RejectsBadInput) {
  EXPECT_THROW(FlatParamLayout({{2}}, 0), std::invalid_argument);
  EXPECT_THROW(FlatParamLayout({{2}}, 2, 0), std::invalid_argument);
  EXPECT_THROW(FlatParamLayout({{2, -1}}, 2), std::invalid_argument);
  FlatParamLayout layout({{2}}, 2);
  EXPECT_THROW(layout.shard_range(2), std::out_of_range);
  EXPECT_THROW(layout.shard_range(-1), std::out_of_range);
}

// Property: for random shapes, F in 1..1024 and alignment in {1, 4, 16}, the
// shards tile the padded flat parameter with no gap or overlap, the right
// padding is below F, parameters do not overlap, and every element of every
// parameter appears in exactly one shard slice, at the right place.
TEST(FlatParamLayout, PropertyShardsTileAndCoverEveryElement) {
  std::mt19937_64 rng(1234);
  std::uniform_int_distribution<std::int64_t> factor(1, 1024);
  const std::int64_t alignments[] = {1, 4, 16};
  for (int trial = 0; trial < 300; ++trial) {
    const auto shapes = random_shapes(rng);
    const std::int64_t F = trial < 8 ? trial + 1 : factor(rng);
    const std::int64_t A = alignments[trial % 3];
    FlatParamLayout layout(shapes, F, A);
    ASSERT_EQ(layout.padded_numel() % F, 0);
    ASSERT_GE(layout.padding_numel(), 0);
    ASSERT_LT(layout.padding_numel(), F);
    std::int64_t end_prev = 0;
    for (std::int64_t i = 0; i < layout.num_params(); ++i) {
      ASSERT_EQ(layout.offsets()[i] % A, 0);
      ASSERT_GE(layout.offsets()[i], end_prev);
      ASSERT_LT(layout.offsets()[i] - end_prev, A);  // alignment gap below A
      end_prev = layout.offsets()[i] + layout.numels()[i];
    }
    ASSERT_EQ(end_prev, layout.unpadded_numel());

    // Shards tile [0, padded) exactly.
    std::int64_t cursor = 0;
    for (std::int64_t r = 0; r < F; ++r) {
      const auto [b, e] = layout.shard_range(r);
      ASSERT_EQ(b, cursor);
      ASSERT_EQ(e - b, layout.shard_numel());
      cursor = e;
    }
    ASSERT_EQ(cursor, layout.padded_numel());

    // Every parameter element is covered exactly once, at its flat position.
    std::vector<std::vector<int>> seen(layout.num_params());
    for (std::int64_t i = 0; i < layout.num_params(); ++i) seen[i].assign(layout.numels()[i], 0);
    for (std::int64_t r = 0; r < F; ++r) {
      const auto [b, e] = layout.shard_range(r);
      for (const auto& s : layout.shard_slices(r)) {
        ASSERT_GT(s.numel, 0);
        ASSERT_EQ(b + s.offset_in_shard, layout.offsets()[s.param_index] + s.offset_in_param);
        ASSERT_LE(s.offset_in_shard + s.numel, e - b);
        for (std::int64_t k = 0; k < s.numel; ++k) seen[s.param_index][s.offset_in_param + k]++;
      }
    }
    for (const auto& v : seen) {
      for (int count : v) ASSERT_EQ(count, 1);
    }
  }
}

TEST(FlatParamLayout, EmptyAndZeroNumelParameters) {
  FlatParamLayout layout({{0}, {3}, {2, 0}}, 4);
  EXPECT_EQ(layout.unpadded_numel(), 3);
  EXPECT_EQ(layout.padded_numel(), 4);
  for (std::int64_t r = 0; r < 4; ++r) {
    for (const auto& s : layout.shard_slices(r)) EXPECT_EQ(s.param_index, 1);
  }
}
