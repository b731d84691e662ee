#include "flatshard/dim0_rows.h"

#include <ATen/ops/_chunk_cat.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace flatshard {

std::vector<std::pair<at::Tensor, at::Tensor>> dim0_row_pieces(const at::Tensor& gathered,
                                                               const FlatParamLayout& layout, std::int64_t i,
                                                               const at::Tensor& param, std::int64_t first_rank,
                                                               std::int64_t num_ranks) {
  TORCH_INTERNAL_ASSERT(layout.kind() == LayoutKind::kDim0, "flatshard: dim0_row_pieces of a flat layout");
  const std::int64_t per_shard = layout.rows_per_shard(i);
  const std::int64_t row = layout.row_numel(i);
  const std::int64_t rows = layout.rows(i);
  std::vector<std::pair<at::Tensor, at::Tensor>> pieces;
  if (per_shard == 0 || row == 0) return pieces;
  const std::int64_t ranks = num_ranks < 0 ? layout.shard_factor() : num_ranks;
  // (rank, row in its chunk, element in the row): strides (S, row, 1).
  const at::Tensor by_rank =
      gathered.view({ranks, layout.shard_numel()}).narrow(1, layout.offsets()[i], per_shard * row).view(
          {ranks, per_shard, row});
  if (const std::int64_t d = layout.shard_dim(i); d > 0) {  // see [Note: Sharding on another dim] in layout.h
    const std::vector<std::int64_t>& shape = layout.shapes()[static_cast<std::size_t>(i)];
    std::int64_t before = 1;
    for (std::int64_t k = 0; k < d; ++k) before *= shape[static_cast<std::size_t>(k)];
    const std::int64_t chunk_row = row / before;  // L B: this rank's part of one slice of the dims before d
    pieces.emplace_back(by_rank.view({ranks, before, chunk_row}),
                        param.view({before, layout.shard_factor(), chunk_row}).narrow(1, first_rank, ranks).transpose(0, 1));
    return pieces;
  }
  const at::Tensor rows_of = param.view({rows, row});
  const std::int64_t full = rows / per_shard;  // ranks that hold a whole chunk: 0 .. full - 1
  const std::int64_t rest = rows - full * per_shard;  // rank `full` holds these
  const std::int64_t whole = std::min(full, first_rank + ranks) - first_rank;  // of ours with a whole chunk
  if (whole > 0) {
    pieces.emplace_back(by_rank.narrow(0, 0, whole),
                        rows_of.narrow(0, first_rank * per_shard, whole * per_shard).view({whole, per_shard, row}));
  }
  if (rest > 0 && full >= first_rank && full < first_rank + ranks) {
    pieces.emplace_back(by_rank.select(0, full - first_rank).narrow(0, 0, rest), rows_of.narrow(0, full * per_shard, rest));
  }
  return pieces;
}

void copy_rows_out(const at::Tensor& gathered, const FlatParamLayout& layout, const std::vector<at::Tensor>& params) {
  TORCH_INTERNAL_ASSERT(layout.all_on_dim0() && static_cast<std::int64_t>(params.size()) == layout.num_params(),
                        "flatshard: copy_rows_out needs a dim-0 layout with every parameter on dim 0, and one tensor a "
                        "parameter");
  const std::int64_t ranks = layout.shard_factor();
  std::vector<std::int64_t> widths;
  std::vector<at::Tensor> outs;
  widths.reserve(params.size());
  outs.reserve(params.size());
  for (std::int64_t i = 0; i < layout.num_params(); ++i) {
    const std::int64_t width = layout.rows_per_shard(i) * layout.row_numel(i);
    widths.push_back(width);
    outs.push_back(params[static_cast<std::size_t>(i)].view({ranks, width}));
  }
  at::split_with_sizes_copy_out(outs, gathered.view({ranks, layout.shard_numel()}), widths, 1);
}

bool rank_major_takes(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout) {
  if (!layout.all_on_dim0() || static_cast<std::int64_t>(tensors.size()) != layout.num_params()) return false;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) return false;
    if (!layout.rows_divide() && (t.numel() == 0 || t.scalar_type() != tensors.front().scalar_type())) return false;
  }
  return true;
}

at::Tensor rank_major(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout,
                      const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(rank_major_takes(tensors, layout), "flatshard: rank_major of tensors it does not take");
  const std::int64_t ranks = layout.shard_factor();
  at::Tensor flat = at::empty({ranks, layout.shard_numel()}, options);
  if (!layout.rows_divide()) {  // each chunked on dim 0 into F chunks of c_i rows, zero-padded
    std::vector<at::Tensor> rows;
    rows.reserve(tensors.size());
    for (std::int64_t i = 0; i < layout.num_params(); ++i) {
      rows.push_back(tensors[static_cast<std::size_t>(i)].reshape({layout.rows(i), layout.row_numel(i)}));
    }
    at::_chunk_cat_out(flat, rows, 0, ranks);
    return flat.view({layout.padded_numel()});
  }
  std::vector<at::Tensor> blocks;
  blocks.reserve(tensors.size());
  for (std::int64_t i = 0; i < layout.num_params(); ++i) {
    const at::Tensor& t = tensors[static_cast<std::size_t>(i)];
    blocks.push_back(t.reshape({ranks, layout.rows_per_shard(i) * layout.row_numel(i)}));
  }
  at::cat_out(flat, blocks, 1);
  return flat.view({layout.padded_numel()});
}

}  // namespace flatshard
