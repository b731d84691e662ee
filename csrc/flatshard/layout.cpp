#include "flatshard/layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace flatshard {
namespace {

std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

FlatParamLayout::FlatParamLayout(std::vector<std::vector<std::int64_t>> shapes,
                                 std::int64_t shard_factor,
                                 std::int64_t alignment)
    : shapes_(std::move(shapes)), shard_factor_(shard_factor), alignment_(alignment) {
  if (shard_factor_ < 1) {
    throw std::invalid_argument("FlatParamLayout: expected shard_factor >= 1 but got " +
                                std::to_string(shard_factor_));
  }
  if (alignment_ < 1) {
    throw std::invalid_argument("FlatParamLayout: expected alignment >= 1 but got " +
                                std::to_string(alignment_));
  }
  numels_.reserve(shapes_.size());
  offsets_.reserve(shapes_.size());
  std::int64_t cursor = 0;
  for (std::size_t i = 0; i < shapes_.size(); ++i) {
    std::int64_t numel = 1;
    for (std::int64_t dim : shapes_[i]) {
      if (dim < 0) {
        throw std::invalid_argument("FlatParamLayout: parameter " + std::to_string(i) +
                                    " has negative dimension " + std::to_string(dim));
      }
      numel *= dim;
    }
    cursor = round_up(cursor, alignment_);
    offsets_.push_back(cursor);
    numels_.push_back(numel);
    cursor += numel;
  }
  unpadded_numel_ = cursor;
  padded_numel_ = round_up(std::max<std::int64_t>(cursor, 0), shard_factor_);
}

std::int64_t FlatParamLayout::total_padding_numel() const {
  std::int64_t used = 0;
  for (std::int64_t n : numels_) used += n;
  return padded_numel_ - used;
}

std::pair<std::int64_t, std::int64_t> FlatParamLayout::shard_range(std::int64_t rank) const {
  if (rank < 0 || rank >= shard_factor_) {
    throw std::out_of_range("FlatParamLayout::shard_range: expected 0 <= rank < " +
                            std::to_string(shard_factor_) + " but got " +
                            std::to_string(rank));
  }
  const std::int64_t size = shard_numel();
  return {rank * size, (rank + 1) * size};
}

std::vector<ShardSlice> FlatParamLayout::shard_slices(std::int64_t rank) const {
  const auto [begin, end] = shard_range(rank);
  std::vector<ShardSlice> slices;
  for (std::size_t i = 0; i < numels_.size(); ++i) {
    const std::int64_t p_begin = offsets_[i];
    const std::int64_t p_end = p_begin + numels_[i];
    const std::int64_t lo = std::max(begin, p_begin);
    const std::int64_t hi = std::min(end, p_end);
    if (lo < hi) {
      slices.push_back(ShardSlice{static_cast<std::int64_t>(i), lo - p_begin, lo - begin, hi - lo});
    }
  }
  return slices;
}

}  // namespace flatshard
