#pragma once
// FlatParamHandle: one unit's parameter storage.
//
// Contract: movable, not copyable, not thread-safe (the scheduler drives it from
// the thread that runs forward and backward). It owns
//   - the local shard: the tensor the optimizer steps (the nn.Parameter Python
//     registers; this object holds that very TensorImpl, so `.grad` set here is
//     the `.grad` Python sees);
//   - the unsharded buffer: padded_numel elements whose storage exists only
//     while the unit is unsharded (see [Note: Unsharded storage]);
//   - the views of the original parameters into that buffer.
// There is no second copy of the parameters: after construction the original
// tensors can be dropped.
//
// With shard factor 1 (NO_SHARD, or one rank) and no mixed precision or offload
// there is nothing to gather: the unsharded buffer is the local shard itself
// and alloc/free are no-ops (has_own_unsharded() is false).
//
// [Note: Mixed precision and offload]
// The local shard keeps the parameters' own dtype (full precision: the
// optimizer's copy), on the compute device or, with offload, in pinned host
// memory. Forward and backward see `param_dtype` on the compute device: before
// an all-gather the shard is cast (and copied to the device) into a buffer that
// lives until the all-gather completed, so the collective moves param_dtype
// bytes into a param_dtype unsharded buffer. A unit of shard factor 1 then
// needs an unsharded buffer of its own as well, filled by that one copy.
// Gradients accumulate unsharded in param_dtype, as torch's FSDP1 does (several
// uses of a unit in one backward, or no_sync() micro-batches; with the dim-0 layout
// in reduce_dtype, as torch's FSDP2 does), are cast to
// `reduce_dtype` when handed to the reduction and reduced in it (divided before
// and after the SUM by torch FSDP1's factors, so that fp16 sums neither
// overflow nor underflow; for a power-of-two world size the scaling is exact), then accumulated into the shard's
// `.grad` in full precision. With offload each reduced shard is copied to
// pinned host memory as soon as its reduction completed (the device copy goes
// then) and added into the host `.grad` at the end of backward, after one wait
// for all of them (finish_grad_sync). With `grad_dtype`
// (keep_low_precision_grads) `.grad` is cast to it after each accumulation;
// a low-precision `.grad` left from an earlier backward is cast up first, so
// accumulation is always in full precision.
//
// [Note: Unsharded storage]
// The unsharded buffer is one tensor, made at construction and made again only
// when the shard's dtype changes (after_shard_cast, between iterations).
// Resharding resizes its storage to zero bytes; unsharding resizes it back and
// all-gathers into it.
// Views handed to autograd alias that storage, so tensors autograd saved in
// forward (e.g. a linear layer's weight) see the re-gathered values in backward
// without the graph knowing. The all-gather writes through a second TensorImpl
// on the same storage (`all_gather_target`) so the views' version counter is
// never bumped by the refill.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <atomic>
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "flatshard/layout.h"

namespace flatshard {

// [Note: Placeholders]
// Between iterations a sharded unit's modules hold placeholders: tensors with
// the original parameters' shapes, dtype and device but no storage at all
// (their TensorImpl's storage is released and data access throws a message
// naming the unit and the fix), so that user code reading `module.weight.shape`
// works and code touching its values raises instead of writing through a null
// pointer. A replicated unit's placeholders are views of its local shard.

// [Note: Gradient accumulation]
// A unit's post-backward adds its parameters' gradients into one unsharded
// flat gradient. It is reduced (and then dropped) once the unit has no other
// use left in this backward and gradients are being synchronized; so a module
// called twice, or several forwards before one backward, cost one reduction,
// and inside no_sync() the flat gradient simply lives on until the first
// backward outside it. Reduced gradient shards accumulate into the local
// shard's `.grad`, which is gradient accumulation with communication.

// Sharded state of a unit; values match flatshard's Python enum.
enum class ShardedState : std::uint8_t {
  kSharded = 0,     // only the local shard exists
  kUnsharding = 1,  // all-gather issued, not yet waited on
  kUnsharded = 2,   // buffer complete and visible to the compute stream
};

// Bytes of unsharded buffers alive across all FlatParams of this process (also
// the full-precision ones Scheduler::gather_full_precision returns), and the
// peak since the last reset. Read by tests and benchmarks. Thread-safe.
struct MemoryCounter {
  static std::int64_t unsharded_bytes();
  static std::int64_t peak_unsharded_bytes();
  static void reset_peak();
  static void add(std::int64_t bytes);
};

// How a unit computes and keeps its shard; see [Note: Mixed precision and offload].
// Unset fields default to the parameters' own device and dtype.
struct FlatParamOptions {
  std::optional<c10::Device> compute_device;   // where forward, backward and collectives run
  std::optional<c10::ScalarType> param_dtype;   // the unsharded buffer's and the views' dtype
  std::optional<c10::ScalarType> reduce_dtype;  // the gradient's dtype for its reduction
  std::optional<c10::ScalarType> grad_dtype;    // `.grad` after each reduction (keep_low_precision_grads)
  bool offload = false;                         // shard and `.grad` on the host (pinned with a GPU)
  bool pin_host_memory = true;  // with offload: the host shard and gradients pinned (false: pageable memory)
  // How the unit's gradient is averaged (torch FSDP1's factors; see Scheduler::reduce_grad):
  double predivide = 1.0;            // divided by this before the SUM
  double postdivide = 1.0;           // and by this after it
  bool all_reduce_replicas = false;  // hybrid sharding: the shard is then all-reduced over the replicate group
};

class FlatParamHandle {
 public:
  // Flattens `params` (which must match layout's shapes, share one dtype and
  // device) and keeps `rank`'s shard as a fresh tensor. Throws c10::Error
  // naming the parameter when a shape does not match the layout, or naming
  // the option when a dtype is not floating point.
  //
  // [Note: A shard from meta parameters]
  // Parameters on the meta device (fully_shard on a model built on meta, torchtitan's way: its users
  // `to_empty` and initialize in place afterwards) give an uninitialized shard on the compute device
  // (the host with offload), as `to_empty` would: the unit's full parameters never exist, so a model
  // larger than one device can be sharded from meta. Needs `compute_device`.
  FlatParamHandle(std::string name, FlatParamLayout layout, std::int64_t rank,
            const std::vector<at::Tensor>& params, const FlatParamOptions& options = {});
  ~FlatParamHandle();
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  // Concatenates `tensors` into one padded 1-D tensor laid out as `layout`
  // says; gaps and the right padding are zero. Undefined tensors count as zeros.
  static at::Tensor flatten(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout,
                            const at::TensorOptions& options);
  // Views of `flat` (1-D, padded_numel long) shaped as the original parameters.
  static std::vector<at::Tensor> views_of(const at::Tensor& flat, const FlatParamLayout& layout);
  // `shape`'s contiguous view of `flat` from element `offset` on (within flat's storage).
  static at::Tensor contiguous_view(const at::Tensor& flat, std::int64_t offset, at::IntArrayRef shape);
  // `view`'s elements as a tensor over a storage of its own (storage_offset 0, exactly their bytes) that aliases
  // view's memory and keeps view's storage alive: a fully_shard state dict's local tensors (see [Note: A state
  // dict's tensors have storages of their own] in python/flatshard/_dtensor_params.py).
  static at::Tensor alias_with_own_storage(const at::Tensor& view);

  const std::string& name() const { return name_; }
  // Renames the unit (the root names units by their module path at lazy init).
  void set_name(std::string name);
  const FlatParamLayout& layout() const { return layout_; }
  std::int64_t rank() const { return rank_; }
  // [Note: Trainable prefix]
  // A unit whose frozen parameters (use_orig_params, e.g. LoRA's base weights)
  // are laid out after its trainable ones accumulates its unsharded gradient
  // over the first `numel` elements only (the trainable prefix) and the
  // scheduler reduces just those: an all-reduce of the prefix, of which each
  // rank keeps what falls in its shard (zeros elsewhere). torch's FSDP1
  // reduce-scatters the whole flat gradient, zeros included. -1 (the
  // default): the whole flat parameter. Set before the first backward.
  // In the dim-0 layout (rank-major) `numel` is the prefix of each rank's
  // shard: whole trainable parameters' rows, the same length on every rank.
  // The gradient is then accumulated in the dim-0 layout of the trainable
  // parameters alone (rank r's segment there is the prefix of its shard) and
  // reduce-scattered, as torch's FSDP2 reduce-scatters only the parameters
  // that have gradients; each rank's reduced prefix is padded with zeros to
  // its shard.
  void set_reduce_prefix(std::int64_t numel);
  std::int64_t reduce_prefix() const { return reduce_prefix_; }
  // The dim-0 layout with a trainable prefix: the gradient is reduce-scattered (see above).
  bool reduce_scatters_prefix() const { return prefix_layout_.has_value(); }
  // Input bytes of the collectives the scheduler issued for this unit, per kind (all-gather,
  // reduce-scatter, all-reduce over the shard group, all-reduce over the replicate group), since
  // the last reset: what flatshard.plan predicts per unit (see [Note: Collective byte counters]).
  enum CollectiveSlot : int { kGathered = 0, kReduceScattered = 1, kAllReduced = 2, kReplicaAllReduced = 3 };
  void count_collective(CollectiveSlot slot, std::int64_t bytes) { collective_bytes_[slot] += bytes; }
  const std::array<std::int64_t, 4>& collective_bytes() const { return collective_bytes_; }
  void reset_collective_bytes() { collective_bytes_.fill(0); }
  // Which of the scheduler's group pairs this unit's collectives use (see [Note: Groups per unit]).
  std::int64_t group_index() const { return group_index_; }
  void set_group_index(std::int64_t index) { group_index_ = index; }
  // [Note: Reshard to a smaller group]
  // fully_shard's reshard_after_forward=N (an int, 1 < N < the shard factor W): after
  // forward the unit keeps 1/N of its gathered parameters instead of freeing all but its
  // 1/W shard, and its next unshard (the pre-backward's) all-gathers over a group of N
  // ranks instead of all W, as torch's FSDP2 does. The groups are consecutive ranks (torch's
  // post-forward mesh, the mesh viewed as (-1, N)); the group's rank g keeps chunk g of
  // the rank-major gathered buffer (the rows of shard ranks g*W/N .. (g+1)*W/N - 1), so
  // the group's all-gather refills that buffer exactly and copy-out follows as after any
  // all-gather. Any other reshard (post-backward, an explicit one) drops the chunk.
  // The index of the scheduler's group pair whose shard group is that group; -1: none.
  std::int64_t post_forward_group_index() const { return post_forward_group_index_; }
  void set_post_forward_group_index(std::int64_t index) { post_forward_group_index_ = index; }
  bool has_post_forward_shard() const { return post_forward_shard_.defined(); }
  const at::Tensor& post_forward_shard() const { return post_forward_shard_; }
  // Copies the chunk out of the parameters' buffer, on the current stream; the unit must be
  // unsharded and copy out (see [Note: Copy-out]). Counted by MemoryCounter until dropped.
  void keep_post_forward_shard(std::int64_t group_size, std::int64_t group_rank);
  void drop_post_forward_shard();

  const at::Tensor& local_shard() const { return local_shard_; }
  // Replaces the local shard by `param`, which must alias it (Python passes the
  // nn.Parameter made from local_shard()), so that `.grad` is shared.
  void set_local_shard(const at::Tensor& param);
  // After the local shard's dtype changed (model.half(), .to(dtype)): the
  // unsharded buffer, the views and the dtypes that follow the shard's are made
  // again. Between iterations only; throws c10::Error naming the unit otherwise.
  void after_shard_cast();

  const at::Tensor& unsharded() const { return unsharded_; }
  const at::Tensor& all_gather_target() const { return all_gather_target_; }
  ShardedState state() const { return state_; }
  // [Note: Sharded-state transitions]
  // The one place a unit's sharded state changes (the scheduler's verbs call it):
  //   kSharded    -> kUnsharding  all-gather issued (unshard)
  //   kSharded    -> kUnsharded   nothing to gather: a replicated unit (unshard)
  //   kUnsharding -> kUnsharded   all-gather waited for (wait_for_unshard)
  //   kUnsharding -> kSharded     resharded with the all-gather in flight: waited first (reshard)
  //   kUnsharded  -> kSharded     resharded (reshard)
  // Anything else is a bug of ours: TORCH_INTERNAL_ASSERT naming the unit.
  void set_state(ShardedState next);
  double predivide() const { return predivide_; }
  double postdivide() const { return postdivide_; }
  // fully_shard's set_gradient_divide_factor / set_force_sum_reduction_for_comms, between iterations.
  void set_divide_factors(double predivide, double postdivide) {
    predivide_ = predivide;
    postdivide_ = postdivide;
  }
  bool all_reduce_replicas() const { return all_reduce_replicas_; }
  // [Note: Reduce-scatter only]
  // fully_shard's set_requires_all_reduce(False) (HSDP's gradient accumulation): each backward's
  // reduce-scattered shard is summed into `partial_replica_sum` instead of being all-reduced over the
  // replicas and added to `.grad`; the next reduction with it True all-reduces its own shard plus that
  // sum, once, as torch's FSDP2 does. The sum is before the post-divide (which follows the all-reduce).
  bool requires_all_reduce() const { return requires_all_reduce_; }
  void set_requires_all_reduce(bool requires) { requires_all_reduce_ = requires; }
  // [Note: The all-reduce hook]
  // fully_shard's set_all_reduce_hook: called on each reduced gradient shard of the unit (after the
  // reduce-scatter, and after the replicas' all-reduce with HSDP; not for a backward that only
  // reduce-scatters, see [Note: Reduce-scatter only]), in reduce_dtype, on the reduction's stream, as
  // torch's FSDP2 calls it; it may change the shard in place (torchft all-reduces it over its replica
  // group there). It sees what torch's sees: where torch divides inside its collectives (ReduceOp.AVG
  // or PREMUL_SUM: fp32 and bf16 unless summing is forced) the divided shard, so `after_postdivide`;
  // else the sum, before the post-divide. The shard's rows that were reduced: with frozen parameters
  // laid out after the trainable ones (see [Note: Trainable prefix]) the trainable ones' only, as
  // torch's leaves out parameters without gradients (a trainable parameter no rank gave a gradient is
  // in it, as zeros, where torch's leaves it out; a replicated unit has no prefix: its whole shard). Empty: none. Its exceptions propagate out of the scheduler
  // call that completed the reduction (a post-backward, or the end of backward).
  using GradShardHook = std::function<void(const at::Tensor&)>;
  void set_all_reduce_hook(GradShardHook hook, bool after_postdivide) {
    all_reduce_hook_ = std::move(hook);
    hook_after_postdivide_ = after_postdivide;
  }
  const GradShardHook& all_reduce_hook() const { return all_reduce_hook_; }
  bool hook_after_postdivide() const { return hook_after_postdivide_; }
  at::Tensor& partial_replica_sum() { return partial_replica_sum_; }

  // Gives the unsharded buffer its storage. Safe to call twice. Allocates with
  // the current stream of the buffer's device.
  void alloc_unsharded();
  // Drops the unsharded buffer's storage. Safe to call twice.
  void free_unsharded();
  bool has_unsharded_storage() const;
  std::int64_t unsharded_nbytes() const;
  // True when the shard is the whole flat parameter (shard factor 1).
  bool is_replicated() const { return layout_.shard_factor() == 1; }
  // Whether unsharding fills a buffer of its own: sharded, or the shard's dtype
  // or device is not the compute one (see [Note: Mixed precision and offload]).
  bool has_own_unsharded() const { return !is_replicated() || casts_; }
  const c10::Device& compute_device() const { return compute_device_; }
  c10::ScalarType param_dtype() const { return param_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  std::optional<c10::ScalarType> grad_dtype() const { return grad_dtype_; }
  bool offload() const { return offload_; }

  // The all-gather's input, on the current stream: the local shard itself, or
  // its copy in param_dtype on the compute device, kept until
  // drop_all_gather_input() (which drops a post-forward shard too: it was the
  // input of that all-gather). Sharded units only.
  at::Tensor all_gather_input();
  void drop_all_gather_input() {
    all_gather_input_ = at::Tensor();
    drop_post_forward_shard();
  }
  // A replicated unit with a buffer of its own: the local shard copied (cast,
  // moved) into it on the current stream.
  void copy_shard_into_unsharded();
  // Adds `grads` (one per original parameter, undefined for none) into the
  // unsharded flat gradient, allocating it (zeros where undefined) on first
  // use. Runs on the current stream. See [Note: Gradient accumulation].
  void accumulate_grad(const std::vector<at::Tensor>& grads);
  bool has_unsharded_grad() const { return unsharded_grad_.defined() || accumulated_grad_.defined(); }
  const at::Tensor& unsharded_grad() const { return unsharded_grad_.defined() ? unsharded_grad_ : accumulated_grad_; }
  // [Note: FSDP2's gradient sums]
  // With the dim-0 layout the gradients of one backward are summed in param_dtype (torch's
  // FSDP2 sums a parameter's uses in one backward there: autograd, on its unsharded
  // parameter), and each backward's sum is then added into an accumulation in reduce_dtype
  // (its no_sync accumulation across micro-batches); end_backward_grad() does that when the
  // unit's last use in a backward is done, take_unsharded_grad() before the reduction.
  void end_backward_grad();
  // Hands the unsharded flat gradient over (to the reduction), cast to
  // reduce_dtype on the current stream, and forgets it.
  at::Tensor take_unsharded_grad();
  // Gives back what take_unsharded_grad() handed over (changed in place: fully_shard's tensor-parallel partial
  // gradients added, see [Note: Partial gradients of tensor-parallel parameters] in _tensor_parallel.py), for the
  // reduction that follows. Dim-0 layout.
  void put_back_unsharded_grad(const at::Tensor& grad);
  // Forgets the unsharded flat gradient and a reduce-scatter-only sum, if any (a backward that raised).
  void drop_unsharded_grad() {
    unsharded_grad_ = at::Tensor();
    accumulated_grad_ = at::Tensor();
    partial_replica_sum_ = at::Tensor();
  }
  // A reduced gradient shard (reduce_dtype, compute device, already divided)
  // into `.grad`, on the current stream; with offload, copied (non-blocking)
  // into pinned host memory instead, and added by add_offloaded_grads() once
  // the caller waited for the current stream.
  void accumulate_grad_shard(const at::Tensor& shard_grad);
  bool has_offloaded_grads() const { return !host_grads_.empty(); }
  void add_offloaded_grads();
  void drop_offloaded_grads() { host_grads_.clear(); }

  // Views of the unsharded buffer (dim-0 layout: of the parameters' buffer copy_out()
  // filled); the buffer must have storage.
  std::vector<at::Tensor> views() const;
  // [Note: Copy-out]
  // With the dim-0 layout and a shard factor above 1 a parameter is not a view of
  // the gathered buffer (see [Note: Dim-0 layout]): once the all-gather completed
  // (Scheduler::wait_for_unshard, on the compute stream) its rows are copied into a
  // buffer of the parameters in order, whose views the modules get, and the gathered
  // buffer is freed. Where every parameter is on dim 0, each one's region there is
  // padded to F c_i rows, as torch's FSDP2 pads its all-gather outputs, so that the
  // copy is one for the whole unit (see [Note: One copy a unit] in dim0_rows.h); its
  // view is the region's first d0_i rows. The unsharded state is then that buffer alone; a
  // gradient is written back into the rank-major order (accumulate_grad) for the
  // reduce-scatter. A no-op for the flat layout.
  void copy_out();
  bool copies_out() const { return layout_.kind() == LayoutKind::kDim0 && !is_replicated(); }
  // Views made once at construction, outside autograd: what the modules hold
  // while the unit is sharded. See [Note: Placeholders].
  const std::vector<at::Tensor>& placeholder_views() const { return placeholder_views_; }

  // Profiler range names, built once: "flatshard::<what> <unit name>".
  const std::string& all_gather_range() const { return all_gather_range_; }
  const std::string& wait_range() const { return wait_range_; }
  const std::string& reduce_scatter_range() const { return reduce_scatter_range_; }
  const std::string& reshard_range() const { return reshard_range_; }
  const std::string& all_reduce_range() const { return all_reduce_range_; }

 private:
  std::string name_;
  FlatParamLayout layout_;
  std::int64_t rank_;
  std::int64_t reduce_prefix_ = -1;  // see [Note: Trainable prefix]
  std::optional<FlatParamLayout> prefix_layout_;  // the dim-0 layout of the trainable parameters (prefix set)
  std::int64_t group_index_ = 0;
  std::int64_t post_forward_group_index_ = -1;  // see [Note: Reshard to a smaller group]
  at::Tensor post_forward_shard_;
  std::array<std::int64_t, 4> collective_bytes_{};  // by CollectiveSlot
  at::Tensor local_shard_;
  at::Tensor unsharded_;
  at::Tensor all_gather_target_;
  std::vector<at::Tensor> placeholder_views_;
  ShardedState state_ = ShardedState::kSharded;
  double predivide_ = 1.0;
  double postdivide_ = 1.0;
  bool all_reduce_replicas_ = false;
  bool requires_all_reduce_ = true;  // see [Note: Reduce-scatter only]
  GradShardHook all_reduce_hook_;    // see [Note: The all-reduce hook]
  bool hook_after_postdivide_ = false;
  at::Tensor partial_replica_sum_;
  std::string all_gather_range_;
  std::string wait_range_;
  std::string reduce_scatter_range_;
  std::string reshard_range_;
  std::string all_reduce_range_;
  at::Tensor unsharded_grad_;
  at::Tensor accumulated_grad_;  // dim-0 layout: earlier backwards' sums (see [Note: FSDP2's gradient sums])
  // See [Note: Mixed precision and offload].
  void add_into_grad(const at::Tensor& grad_shard);
  // The unsharded buffer, its all-gather target and the placeholders, from the
  // local shard and the dtypes (the constructor's second half).
  void make_buffers();
  bool explicit_param_dtype_ = false;
  bool explicit_reduce_dtype_ = false;
  c10::Device compute_device_;
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;
  std::optional<c10::ScalarType> grad_dtype_;
  bool offload_ = false;  // the shard lives on the host and compute does not
  bool pin_host_memory_ = true;  // with offload_: host memory pinned (see FlatParamOptions)
  bool casts_ = false;    // the shard's dtype or device differs from the compute ones
  at::Tensor all_gather_input_;
  // See [Note: Copy-out]: the parameters' buffer, its refill TensorImpl, and where each parameter's region
  // starts in it, then where the buffer ends (num_params() + 1 offsets).
  at::Tensor params_;
  at::Tensor params_target_;
  std::vector<std::int64_t> param_offsets_;
  std::int64_t params_nbytes() const;
  // Each parameter's view of `buffer` (params_, or a buffer of its size): its region's first numel elements.
  std::vector<at::Tensor> param_views(const at::Tensor& buffer) const;
  // Adds `grad` (parameter `i` of `layout`, as many elements) into its place in the unsharded gradient.
  void add_at(const FlatParamLayout& layout, std::int64_t i, const at::Tensor& grad);
  std::vector<at::Tensor> host_grads_;  // reduced shards on their way to the host (offload)
};

}  // namespace flatshard
