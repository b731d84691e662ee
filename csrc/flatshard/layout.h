#pragma once
// FlatParamLayout: where each original parameter of one unit lives inside the
// unit's flat parameter, and which slice of it each rank keeps.
//
// Contract: pure metadata (no tensors, no torch headers), immutable after
// construction, copyable, thread-safe for concurrent reads. The constructor
// validates its input and throws std::invalid_argument on bad shapes or F.
//
// [Note: Flat parameter layout]
// The unit's parameters are flattened and concatenated in registration order.
// Parameter i starts at offsets[i]; with alignment A > 1 every offset is rounded
// up to a multiple of A (the gap is padding that belongs to no parameter). The
// concatenation is then right-padded so that padded_numel % F == 0, and split
// into F equal, contiguous shards of shard_numel = padded_numel / F elements;
// rank r keeps [r * shard_numel, (r + 1) * shard_numel). The right padding is
// at most F - 1 elements. Zero-numel parameters are allowed: they occupy no
// elements and intersect no shard.
//
// [Note: Dim-0 layout]
// FSDP2's layout (fully_shard), the second kind (LayoutKind::kDim0): each
// parameter is sharded on its own, on dim 0, as torch.chunk cuts it: with
// rows_per_shard c_i = ceil(d0_i / F), rank r keeps rows [r c_i, min((r+1) c_i, d0_i))
// (none when r c_i >= d0_i), and its shard holds parameter i at offsets[i] as
// c_i * row_numel_i elements: its rows, then zeros up to c_i rows. The shard's
// numel S is the sum of those; the gathered flat tensor is F * S elements,
// rank-major (rank r's shard at [r S, (r+1) S), as the all-gather writes it),
// so a parameter is spread over F places in it: it is not a view of it, and
// reading it out or writing it in is a copy (FlatParamHandle does both). With
// F = 1 the dim-0 layout is the packed flat layout. Parameters need a dim 0:
// a 0-dim one throws std::invalid_argument, as torch's Shard(0) refuses it.
//
// [Note: Sharding on another dim]
// fully_shard's shard_placement_fn may give Shard(d), d > 0, for a parameter: rank r
// keeps chunk r of it along dim d, contiguous, as torch's FSDP2 does, which requires
// dim d to divide by F (torch refuses uneven sharding there). In the layout that chunk
// is one row of numel / F elements: the parameter has F rows (its "rows" below), one per
// rank, and c = 1. Reading it out or writing it in pairs the rank-major rows, viewed
// (F, A, L B), with the parameter viewed (A, F, L B) and transposed, where A is the
// product of the dims before d, L = d_d / F and B the product of the dims after d:
// one strided copy (dim0_row_pieces).

#include <cstdint>
#include <vector>

namespace flatshard {

// One parameter's piece of one rank's shard.
struct ShardSlice {
  std::int64_t param_index;      // index into the unit's parameters
  std::int64_t offset_in_param;  // first element of the parameter in the shard (-1: see [Note: Sharding on another dim])
  std::int64_t offset_in_shard;  // where that element sits in the shard
  std::int64_t numel;            // elements of the parameter in the shard
};

enum class LayoutKind : std::uint8_t {
  kFlat = 0,  // [Note: Flat parameter layout]: flatten, concatenate, chunk (FSDP1)
  kDim0 = 1,  // [Note: Dim-0 layout]: each parameter chunked on dim 0 (FSDP2)
};

class FlatParamLayout {
 public:
  // shapes: the original parameters' shapes, in order. shard_factor: F >= 1.
  // alignment: offsets are multiples of it (>= 1; 1 means packed).
  // Throws std::invalid_argument for F < 1, alignment < 1 or a negative dim.
  FlatParamLayout(std::vector<std::vector<std::int64_t>> shapes,
                  std::int64_t shard_factor,
                  std::int64_t alignment = 1);
  // The dim-0 layout of `shapes` over F ranks (see [Note: Dim-0 layout]), each
  // parameter sharded on its dim `shard_dims[i]` (empty: all on dim 0; see
  // [Note: Sharding on another dim]). Throws std::invalid_argument for F < 1, a
  // 0-dim shape, a negative dim, a shard dim out of range or a dim d > 0 that
  // does not divide by F.
  static FlatParamLayout dim0(std::vector<std::vector<std::int64_t>> shapes, std::int64_t shard_factor,
                              std::vector<std::int64_t> shard_dims = {});

  LayoutKind kind() const { return kind_; }
  // Dim-0 layout: parameter i's rows per shard (c_i) and elements per row; throws
  // std::logic_error for the flat layout.
  std::int64_t rows_per_shard(std::int64_t i) const;
  std::int64_t row_numel(std::int64_t i) const;
  // Dim-0 layout: how many of parameter i's rows rank keeps (0 <= it <= c_i).
  std::int64_t rows_of_rank(std::int64_t i, std::int64_t rank) const;
  // Dim-0 layout: parameter i's rows (its dim 0; F when sharded on another dim) and
  // the dim it is sharded on (see [Note: Sharding on another dim]).
  std::int64_t rows(std::int64_t i) const;
  std::int64_t shard_dim(std::int64_t i) const;
  const std::vector<std::int64_t>& shard_dims() const { return shard_dims_; }
  // Dim-0 layout: whether every parameter is sharded on dim 0 with rows that divide
  // by F (no padding rows), so that each is viewed (F, c_i row_i) and the gathered
  // tensor viewed (F, S) is their concatenation along dim 1 (see [Note: One copy a
  // unit] in dim0_rows.h). False for the flat layout.
  bool rows_divide() const { return rows_divide_; }
  // Dim-0 layout: whether every parameter is sharded on dim 0 (rows that divide or
  // not), so that each, padded to F c_i rows as torch's FSDP2 pads it, is viewed
  // (F, c_i row_i) and the gathered tensor is still their concatenation along dim 1.
  // False for the flat layout.
  bool all_on_dim0() const { return all_on_dim0_; }

  std::int64_t num_params() const { return static_cast<std::int64_t>(shapes_.size()); }
  const std::vector<std::vector<std::int64_t>>& shapes() const { return shapes_; }
  const std::vector<std::int64_t>& numels() const { return numels_; }
  // Flat layout: where each parameter starts in the flat parameter. Dim-0
  // layout: where its rows start in every rank's shard.
  const std::vector<std::int64_t>& offsets() const { return offsets_; }
  std::int64_t shard_factor() const { return shard_factor_; }
  std::int64_t alignment() const { return alignment_; }
  // Elements covered by parameters and alignment gaps, before the right padding
  // (dim-0 layout: the parameters' elements).
  std::int64_t unpadded_numel() const { return unpadded_numel_; }
  // Multiple of shard_factor(); padded_numel() - unpadded_numel() < F.
  std::int64_t padded_numel() const { return padded_numel_; }
  std::int64_t padding_numel() const { return padded_numel_ - unpadded_numel_; }
  // Elements that belong to no parameter (alignment gaps plus right padding).
  std::int64_t total_padding_numel() const;
  std::int64_t shard_numel() const { return padded_numel_ / shard_factor_; }
  // [begin, end) of rank's shard in the flat parameter. Throws
  // std::out_of_range unless 0 <= rank < shard_factor().
  std::pair<std::int64_t, std::int64_t> shard_range(std::int64_t rank) const;
  // The parameters rank's shard intersects, in parameter order.
  std::vector<ShardSlice> shard_slices(std::int64_t rank) const;

 private:
  std::vector<std::vector<std::int64_t>> shapes_;
  std::vector<std::int64_t> numels_;
  std::vector<std::int64_t> offsets_;
  std::int64_t shard_factor_;
  std::int64_t alignment_;
  std::int64_t unpadded_numel_ = 0;
  std::int64_t padded_numel_ = 0;
  LayoutKind kind_ = LayoutKind::kFlat;
  std::vector<std::int64_t> rows_per_shard_;  // dim-0 layout only
  std::vector<std::int64_t> row_numels_;      // dim-0 layout only
  std::vector<std::int64_t> rows_;            // dim-0 layout only
  std::vector<std::int64_t> shard_dims_;      // dim-0 layout only
  bool rows_divide_ = false;                  // dim-0 layout only
  bool all_on_dim0_ = false;                  // dim-0 layout only
};

}  // namespace flatshard
