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

}  // namespace flatshard
