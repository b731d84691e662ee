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

#include <cstdint>
#include <vector>

namespace flatshard {

// One parameter's piece of one rank's shard.
struct ShardSlice {
  std::int64_t param_index;      // index into the unit's parameters
  std::int64_t offset_in_param;  // first element of the parameter in the shard
  std::int64_t offset_in_shard;  // where that element sits in the shard
  std::int64_t numel;            // elements of the parameter in the shard
};

class FlatParamLayout {
 public:
  // shapes: the original parameters' shapes, in order. shard_factor: F >= 1.
  // alignment: offsets are multiples of it (>= 1; 1 means packed).
  // Throws std::invalid_argument for F < 1, alignment < 1 or a negative dim.
  FlatParamLayout(std::vector<std::vector<std::int64_t>> shapes,
                  std::int64_t shard_factor,
                  std::int64_t alignment = 1);

  std::int64_t num_params() const { return static_cast<std::int64_t>(shapes_.size()); }
  const std::vector<std::vector<std::int64_t>>& shapes() const { return shapes_; }
  const std::vector<std::int64_t>& numels() const { return numels_; }
  const std::vector<std::int64_t>& offsets() const { return offsets_; }
  std::int64_t shard_factor() const { return shard_factor_; }
  std::int64_t alignment() const { return alignment_; }
  // Elements covered by parameters and alignment gaps, before the right padding.
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
};

}  // namespace flatshard
