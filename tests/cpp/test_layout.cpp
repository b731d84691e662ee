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

// [Note: Dim-0 layout] on a small case: a 5x2 and a 3 over F = 4. c = 2 rows of 2 and 1 row of 1:
// S = 4 + 1 = 5; rank 2 keeps row 4 of the first (then one zero row) and none of the second.
TEST(FlatParamLayout, Dim0SmallExample) {
  const FlatParamLayout layout = FlatParamLayout::dim0({{5, 2}, {3}}, 4);
  EXPECT_EQ(layout.kind(), flatshard::LayoutKind::kDim0);
  EXPECT_EQ(layout.offsets(), (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(layout.shard_numel(), 5);
  EXPECT_EQ(layout.padded_numel(), 20);
  EXPECT_EQ(layout.unpadded_numel(), 13);
  EXPECT_EQ(layout.rows_per_shard(0), 2);
  EXPECT_EQ(layout.row_numel(0), 2);
  EXPECT_EQ(layout.rows_of_rank(0, 2), 1);
  EXPECT_EQ(layout.rows_of_rank(0, 3), 0);
  EXPECT_EQ(layout.rows_of_rank(1, 2), 1);
  EXPECT_EQ(layout.rows_of_rank(1, 3), 0);
  const auto slices = layout.shard_slices(2);
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(slices[0].offset_in_param, 8);
  EXPECT_EQ(slices[0].offset_in_shard, 0);
  EXPECT_EQ(slices[0].numel, 2);
  EXPECT_EQ(slices[1].offset_in_param, 2);
  EXPECT_EQ(slices[1].offset_in_shard, 4);
  EXPECT_EQ(slices[1].numel, 1);
  EXPECT_TRUE(layout.shard_slices(3).empty());
  EXPECT_THROW(FlatParamLayout::dim0({{2}, {}}, 2), std::invalid_argument);  // 0-dim: no dim 0
  EXPECT_THROW(FlatParamLayout::dim0({{2}}, 0), std::invalid_argument);
  EXPECT_THROW(FlatParamLayout({{2}}, 2).rows_per_shard(0), std::logic_error);
}

// [Note: Sharding on another dim]: a 2x4x6 sharded on dim 1 over F = 2 is 2 rows (one a rank) of 24 elements;
// its neighbour on dim 0 is laid out as usual. Dims out of range, or that do not divide by F, are refused.
TEST(FlatParamLayout, Dim0ShardedOnAnotherDim) {
  const FlatParamLayout layout = FlatParamLayout::dim0({{2, 4, 6}, {3}}, 2, {1, 0});
  EXPECT_EQ(layout.shard_dims(), (std::vector<std::int64_t>{1, 0}));
  EXPECT_EQ(layout.rows(0), 2);
  EXPECT_EQ(layout.rows_per_shard(0), 1);
  EXPECT_EQ(layout.row_numel(0), 24);
  EXPECT_EQ(layout.rows_of_rank(0, 1), 1);
  EXPECT_EQ(layout.shard_dim(1), 0);
  EXPECT_EQ(layout.rows(1), 3);
  EXPECT_EQ(layout.shard_numel(), 24 + 2);
  EXPECT_EQ(layout.shard_slices(1)[0].offset_in_param, -1);  // (no run of the parameter's elements)
  EXPECT_THROW(FlatParamLayout::dim0({{2, 3}}, 2, {1}), std::invalid_argument);  // 3 columns over 2 ranks
  EXPECT_THROW(FlatParamLayout::dim0({{4}}, 2, {1}), std::invalid_argument);     // no dim 1
  EXPECT_THROW(FlatParamLayout::dim0({{4}}, 2, {0, 0}), std::invalid_argument);  // two dims for one parameter
}

// Property: with F = 1 the dim-0 layout is the packed flat one; for any F, rank r holds exactly the rows
// torch.chunk(param, F)[r] holds (chunks of ceil(d0 / F) rows, then empty ones), each parameter's rows of
// all ranks cover it once, and a parameter's slot in the shard (c rows) holds its slice.
TEST(FlatParamLayout, Dim0PropertyRanksHoldTorchChunkRows) {
  std::mt19937_64 rng(99);
  std::uniform_int_distribution<std::int64_t> factor(1, 64);
  for (int trial = 0; trial < 300; ++trial) {
    auto shapes = random_shapes(rng);
    for (auto& shape : shapes) {
      if (shape.empty()) shape.push_back(3);
    }
    const std::int64_t F = trial < 8 ? trial + 1 : factor(rng);
    const FlatParamLayout layout = FlatParamLayout::dim0(shapes, F);
    ASSERT_EQ(layout.padded_numel(), F * layout.shard_numel());
    if (F == 1) {
      const FlatParamLayout flat(shapes, 1);
      ASSERT_EQ(layout.offsets(), flat.offsets());
      ASSERT_EQ(layout.padded_numel(), flat.padded_numel());
    }
    for (std::int64_t i = 0; i < layout.num_params(); ++i) {
      const std::int64_t d0 = shapes[i][0];
      const std::int64_t chunk = (d0 + F - 1) / F;  // torch.chunk's size
      ASSERT_EQ(layout.rows_per_shard(i), chunk);
      std::int64_t covered = 0;
      for (std::int64_t r = 0; r < F; ++r) {
        const std::int64_t begin = std::min(r * chunk, d0), end = std::min((r + 1) * chunk, d0);
        ASSERT_EQ(layout.rows_of_rank(i, r), end - begin);
        covered += end - begin;
      }
      ASSERT_EQ(covered, d0);
      if (i + 1 < layout.num_params()) {
        ASSERT_EQ(layout.offsets()[i + 1] - layout.offsets()[i], chunk * layout.row_numel(i));
      }
    }
    for (std::int64_t r = 0; r < F; ++r) {
      for (const auto& s : layout.shard_slices(r)) {
        const std::int64_t i = s.param_index;
        ASSERT_EQ(s.offset_in_shard, layout.offsets()[i]);
        ASSERT_EQ(s.offset_in_param, r * layout.rows_per_shard(i) * layout.row_numel(i));
        ASSERT_EQ(s.numel, layout.rows_of_rank(i, r) * layout.row_numel(i));
        ASSERT_LE(s.offset_in_shard + s.numel, layout.shard_numel());
      }
    }
  }
}
