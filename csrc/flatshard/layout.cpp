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

FlatParamLayout FlatParamLayout::dim0(std::vector<std::vector<std::int64_t>> shapes, std::int64_t shard_factor,
                                      std::vector<std::int64_t> shard_dims) {
  if (shard_dims.empty()) shard_dims.assign(shapes.size(), 0);
  if (shard_dims.size() != shapes.size()) {
    throw std::invalid_argument("FlatParamLayout::dim0: " + std::to_string(shard_dims.size()) + " shard dims for " +
                                std::to_string(shapes.size()) + " parameters");
  }
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    if (shapes[i].empty()) {
      throw std::invalid_argument("FlatParamLayout::dim0: parameter " + std::to_string(i) +
                                  " has no dim 0 to shard (a 0-dim tensor)");
    }
    const std::int64_t d = shard_dims[i];
    if (d < 0 || d >= static_cast<std::int64_t>(shapes[i].size())) {
      throw std::invalid_argument("FlatParamLayout::dim0: parameter " + std::to_string(i) + " has " +
                                  std::to_string(shapes[i].size()) + " dims: it cannot be sharded on dim " +
                                  std::to_string(d));
    }
    if (d > 0 && shard_factor > 0 && shapes[i][static_cast<std::size_t>(d)] % shard_factor != 0) {
      throw std::invalid_argument("FlatParamLayout::dim0: parameter " + std::to_string(i) + "'s dim " +
                                  std::to_string(d) + " (" + std::to_string(shapes[i][static_cast<std::size_t>(d)]) +
                                  ") does not divide by " + std::to_string(shard_factor));
    }
  }
  FlatParamLayout layout(std::move(shapes), shard_factor);  // validates F and the dims
  layout.kind_ = LayoutKind::kDim0;
  layout.shard_dims_ = std::move(shard_dims);
  std::int64_t cursor = 0;
  for (std::size_t i = 0; i < layout.shapes_.size(); ++i) {
    const std::int64_t numel = layout.numels_[i];
    // See [Note: Sharding on another dim]: one row per rank.
    const std::int64_t rows = layout.shard_dims_[i] == 0 ? layout.shapes_[i][0] : (numel == 0 ? 0 : shard_factor);
    const std::int64_t row_numel = rows == 0 ? 0 : numel / rows;
    const std::int64_t per_shard = (rows + shard_factor - 1) / shard_factor;
    layout.rows_.push_back(rows);
    layout.rows_per_shard_.push_back(per_shard);
    layout.row_numels_.push_back(row_numel);
    layout.offsets_[i] = cursor;
    cursor += per_shard * row_numel;
  }
  layout.padded_numel_ = cursor * shard_factor;
  layout.rows_divide_ = true;
  layout.all_on_dim0_ = true;
  for (std::size_t i = 0; i < layout.shapes_.size(); ++i) {
    layout.rows_divide_ = layout.rows_divide_ && layout.shard_dims_[i] == 0 && layout.rows_[i] % shard_factor == 0;
    layout.all_on_dim0_ = layout.all_on_dim0_ && layout.shard_dims_[i] == 0;
  }
  layout.unpadded_numel_ = 0;
  for (std::int64_t n : layout.numels_) layout.unpadded_numel_ += n;
  return layout;
}

namespace {
void require_dim0(LayoutKind kind, const char* what) {
  if (kind != LayoutKind::kDim0) {
    throw std::logic_error(std::string("FlatParamLayout::") + what + ": only the dim-0 layout has rows");
  }
}
}  // namespace

std::int64_t FlatParamLayout::rows_per_shard(std::int64_t i) const {
  require_dim0(kind_, "rows_per_shard");
  return rows_per_shard_.at(static_cast<std::size_t>(i));
}

std::int64_t FlatParamLayout::row_numel(std::int64_t i) const {
  require_dim0(kind_, "row_numel");
  return row_numels_.at(static_cast<std::size_t>(i));
}

std::int64_t FlatParamLayout::rows_of_rank(std::int64_t i, std::int64_t rank) const {
  shard_range(rank);  // validates rank
  const std::int64_t per_shard = rows_per_shard(i);
  return std::clamp<std::int64_t>(rows(i) - rank * per_shard, 0, per_shard);
}

std::int64_t FlatParamLayout::rows(std::int64_t i) const {
  require_dim0(kind_, "rows");
  return rows_.at(static_cast<std::size_t>(i));
}

std::int64_t FlatParamLayout::shard_dim(std::int64_t i) const {
  require_dim0(kind_, "shard_dim");
  return shard_dims_.at(static_cast<std::size_t>(i));
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
  if (kind_ == LayoutKind::kDim0) {
    for (std::size_t i = 0; i < numels_.size(); ++i) {
      const auto index = static_cast<std::int64_t>(i);
      const std::int64_t numel = rows_of_rank(index, rank) * row_numels_[i];
      if (numel > 0) {  // (sharded on another dim: its chunk is no run of the parameter's elements)
        const std::int64_t in_param = shard_dims_[i] == 0 ? rank * rows_per_shard_[i] * row_numels_[i] : -1;
        slices.push_back(ShardSlice{index, in_param, offsets_[i], numel});
      }
    }
    return slices;
  }
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
