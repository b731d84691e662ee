#pragma once
// Where one parameter's rows sit in a rank-major gathered tensor of the dim-0
// layout (see [Note: Dim-0 layout] in layout.h): the copies between a
// parameter and the all-gather's output (reading it out), and between a
// gradient and the reduce-scatter's input (writing it in).

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "flatshard/layout.h"

namespace flatshard {

// Pairs (gathered side, parameter side) of views of equal shapes that together
// cover parameter i's rows exactly once: at most two (the ranks holding a full
// chunk of c_i rows, then the one holding fewer), none for a parameter without
// elements. `gathered` is 1-D, layout.padded_numel() long; `param` has parameter
// i's numel and is contiguous. Copy one side of each pair into the other to move
// rows either way; the padding rows of `gathered` are in no pair.
// With `first_rank` and `num_ranks`, `gathered` is only those ranks' part of the
// rank-major tensor (num_ranks * layout.shard_numel() long) and the pairs cover
// the rows those ranks hold (see [Note: Reshard to a smaller group] in flat_param.h).
std::vector<std::pair<at::Tensor, at::Tensor>> dim0_row_pieces(const at::Tensor& gathered,
                                                               const FlatParamLayout& layout, std::int64_t i,
                                                               const at::Tensor& param, std::int64_t first_rank = 0,
                                                               std::int64_t num_ranks = -1);

// [Note: One copy a unit]
// Where every parameter is sharded on dim 0 (FlatParamLayout::all_on_dim0), parameter i
// padded to F c_i rows is exactly the (F, c_i row_i) block of the gathered tensor
// viewed (F, S) at column offsets[i] (the padding rows are the gathered tensor's
// zeros): reading every parameter out is one split_with_sizes_copy along dim 1 into
// buffers padded so, as torch's FSDP2 reads its all-gather out, and writing gradients
// in is one cat along dim 1 where the rows divide (rows_divide: no padding), else one
// _chunk_cat, which pads each gradient's chunks with zeros as torch's FSDP2 writes its
// reduce-scatter input. On CUDA each is one kernel for the whole unit instead of one or
// two a parameter; on CPUs one dispatch. A parameter sharded on another dim: the
// pieces above, copied one by one.

// Parameter i's rows out of `gathered` (1-D, layout.padded_numel() long) into
// `params[i]` (contiguous, F c_i row_i elements: parameter i's rows, then room for
// its padding rows, which get the gathered zeros), all at once. Requires all_on_dim0().
void copy_rows_out(const at::Tensor& gathered, const FlatParamLayout& layout, const std::vector<at::Tensor>& params);

// Whether rank_major takes `tensors` (one per parameter, each with its parameter's
// numel): every parameter on dim 0, none undefined, and where the rows do not divide,
// none empty and all of one dtype (what _chunk_cat takes).
bool rank_major_takes(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout);

// The rank-major flat tensor of `tensors`, in `options`, its padding rows zero.
// Requires rank_major_takes(tensors, layout).
at::Tensor rank_major(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout,
                      const at::TensorOptions& options);

}  // namespace flatshard
