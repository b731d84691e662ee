#include "flatshard/flat_param.h"

#include "flatshard/dim0_rows.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <utility>

namespace flatshard {
namespace {

std::atomic<std::int64_t> g_unsharded_bytes{0};
std::atomic<std::int64_t> g_peak_unsharded_bytes{0};

// Resizes a storage in place, keeping every tensor that aliases it valid (see
// [Note: Unsharded storage]). Contents are not preserved.
void resize_storage(c10::StorageImpl* storage, std::size_t nbytes) {
  if (nbytes == 0) {
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  } else {
    TORCH_INTERNAL_ASSERT(storage->allocator() != nullptr, "flatshard: storage has no allocator");
    storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  }
  storage->set_nbytes(nbytes);
}

// [Note: Buffers made without memory]
// A unit's unsharded buffers are storage-less between iterations, but their views (the placeholders,
// the all-gather's target) must be made while the storage is large enough, or ATen's bounds checks
// refuse them (and set_ would grow the storage back). Allocating the buffer only to free it again
// costs a transient of the whole unit at every construction (on a GPU, a block the caching allocator
// keeps). So the buffer's storage is made with its byte size and no memory (a null pointer, the
// device's allocator for later), its views are made, and then it is resized to nothing: no byte of it
// is ever allocated before the first unshard. Nothing reads it in between.
at::Tensor empty_without_memory(std::int64_t numel, const at::TensorOptions& options) {
  at::Tensor probe = at::empty({0}, options);
  const std::size_t nbytes = static_cast<std::size_t>(numel) * probe.element_size();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, at::DataPtr(nullptr, probe.device()),
                       probe.storage().allocator(), /*resizable=*/true);
  return probe.set_(std::move(storage), 0, {numel}, {1});
}

std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace

std::int64_t MemoryCounter::unsharded_bytes() { return g_unsharded_bytes.load(); }
std::int64_t MemoryCounter::peak_unsharded_bytes() { return g_peak_unsharded_bytes.load(); }
void MemoryCounter::reset_peak() { g_peak_unsharded_bytes.store(g_unsharded_bytes.load()); }
void MemoryCounter::add(std::int64_t bytes) {
  const std::int64_t now = g_unsharded_bytes.fetch_add(bytes) + bytes;
  std::int64_t peak = g_peak_unsharded_bytes.load();
  while (now > peak && !g_peak_unsharded_bytes.compare_exchange_weak(peak, now)) {
  }
}

at::Tensor FlatParamHandle::flatten(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout,
                              const at::TensorOptions& options) {
  TORCH_CHECK(static_cast<std::int64_t>(tensors.size()) == layout.num_params(),
              "flatshard.flatten: expected ", layout.num_params(), " tensors but got ",
              tensors.size());
  if (layout.kind() == LayoutKind::kDim0 && layout.shard_factor() > 1) {  // rank-major rows: see [Note: Dim-0 layout]
    for (std::int64_t i = 0; i < layout.num_params(); ++i) {
      const at::Tensor& t = tensors[i];
      TORCH_CHECK(!t.defined() || t.numel() == layout.numels()[i], "flatshard.flatten: tensor ", i, " has shape ",
                  shape_str(t.sizes()), " but the layout expects ", shape_str(layout.shapes()[i]));
    }
    if (rank_major_takes(tensors, layout)) return rank_major(tensors, layout, options);  // [Note: One copy a unit]
    at::Tensor flat = at::zeros({layout.padded_numel()}, options);
    for (std::int64_t i = 0; i < layout.num_params(); ++i) {
      if (!tensors[i].defined()) continue;
      for (auto& [into, from] : dim0_row_pieces(flat, layout, i, tensors[i].contiguous())) into.copy_(from);
    }
    return flat;
  }
  at::Tensor flat = at::empty({layout.padded_numel()}, options);
  std::int64_t cursor = 0;  // first element not yet written
  for (std::int64_t i = 0; i < layout.num_params(); ++i) {
    const std::int64_t offset = layout.offsets()[i];
    const std::int64_t numel = layout.numels()[i];
    if (offset > cursor) flat.narrow(0, cursor, offset - cursor).zero_();
    const at::Tensor& t = tensors[i];
    if (numel > 0) {
      if (t.defined()) {
        TORCH_CHECK(t.numel() == numel, "flatshard.flatten: tensor ", i, " has shape ",
                    shape_str(t.sizes()), " but the layout expects ",
                    shape_str(layout.shapes()[i]));
        contiguous_view(flat, offset, t.sizes()).copy_(t);  // (as many elements: no broadcast)
      } else {
        contiguous_view(flat, offset, {numel}).zero_();
      }
    }
    cursor = offset + numel;
  }
  if (layout.padded_numel() > cursor) {
    flat.narrow(0, cursor, layout.padded_numel() - cursor).zero_();
  }
  return flat;
}

std::vector<at::Tensor> FlatParamHandle::views_of(const at::Tensor& flat, const FlatParamLayout& layout) {
  TORCH_CHECK(layout.kind() == LayoutKind::kFlat || layout.shard_factor() == 1, "flatshard.views_of: a parameter "
              "of the dim-0 layout over several ranks is not a view of the gathered tensor (see [Note: Dim-0 "
              "layout]); copy its rows out instead");
  TORCH_CHECK(flat.dim() == 1 && flat.numel() == layout.padded_numel(),
              "flatshard.views_of: expected a 1-D tensor of ", layout.padded_numel(),
              " elements but got shape ", shape_str(flat.sizes()));
  std::vector<at::Tensor> views;
  views.reserve(layout.num_params());
  for (std::int64_t i = 0; i < layout.num_params(); ++i) {
    views.push_back(contiguous_view(flat, layout.offsets()[i], layout.shapes()[i]));
  }
  return views;
}

at::Tensor FlatParamHandle::contiguous_view(const at::Tensor& flat, std::int64_t offset, at::IntArrayRef shape) {
  // One as_strided, not narrow (slice, as_strided) then view: these run for every unit at every forward (see
  // [Note: One crossing per lifecycle step] in bindings.cpp), and each op is a dispatch.
  return flat.as_strided(shape, c10::contiguous_strides(shape), flat.storage_offset() + offset);
}

at::Tensor FlatParamHandle::alias_with_own_storage(const at::Tensor& view) {
  TORCH_CHECK(view.defined() && view.layout() == c10::kStrided && !view.is_meta(),
              "flatshard.alias_with_own_storage: expected a strided tensor with memory");
  // The deleter holds the storage the memory belongs to: freed when the last of its tensors and aliases goes.
  c10::Storage owner = view.storage();
  // (The device given, not looked up from the pointer: an empty view's may be null.)
  return at::from_blob(view.data_ptr(), view.sizes(), view.strides(), [owner](void*) {}, view.options(),
                       view.device());
}

FlatParamHandle::FlatParamHandle(std::string name, FlatParamLayout layout, std::int64_t rank,
                     const std::vector<at::Tensor>& params, const FlatParamOptions& opts)
    : name_(std::move(name)),
      layout_(std::move(layout)),
      rank_(rank),
      compute_device_(c10::kCPU),
      param_dtype_(c10::kFloat),
      reduce_dtype_(c10::kFloat) {
  TORCH_CHECK(!params.empty(), "flatshard: unit '", name_, "' has no parameters to flatten");
  TORCH_CHECK(rank_ >= 0 && rank_ < layout_.shard_factor(), "flatshard: unit '", name_,
              "': expected 0 <= rank < ", layout_.shard_factor(), " but got ", rank_);
  const at::TensorOptions options = params.front().options().requires_grad(false);
  compute_device_ = opts.compute_device.value_or(options.device());
  param_dtype_ = opts.param_dtype.value_or(options.dtype().toScalarType());
  reduce_dtype_ = opts.reduce_dtype.value_or(options.dtype().toScalarType());
  grad_dtype_ = opts.grad_dtype;
  TORCH_CHECK(opts.predivide > 0 && opts.postdivide > 0, "flatshard: unit '", name_,
              "': expected positive gradient divide factors but got ", opts.predivide, " and ", opts.postdivide);
  predivide_ = opts.predivide;
  postdivide_ = opts.postdivide;
  all_reduce_replicas_ = opts.all_reduce_replicas;
  for (const auto& [what, dtype] : {std::pair{"param_dtype", opts.param_dtype}, std::pair{"reduce_dtype", opts.reduce_dtype}}) {
    TORCH_CHECK(!dtype.has_value() || c10::isFloatingType(*dtype), "flatshard: unit '", name_,
                "': expected a floating-point ", what, " but got ", *dtype);
  }
  // On a CPU-only run the host is the compute device: offloading moves nothing.
  offload_ = opts.offload && compute_device_.type() != c10::DeviceType::CPU;
  pin_host_memory_ = opts.pin_host_memory;
  if (options.device().is_meta()) {  // see [Note: A shard from meta parameters]
    TORCH_CHECK(opts.compute_device.has_value() && !opts.compute_device->is_meta(), "flatshard: unit '", name_,
                "': its parameters are on the meta device: the handle needs the compute device to put the shard on");
    for (const at::Tensor& p : params) {
      TORCH_CHECK(p.is_meta(), "flatshard: unit '", name_, "' mixes meta and real parameters; materialize them all "
                  "or none before sharding");
    }
    local_shard_ = at::empty({layout_.shard_numel()}, options.device(offload_ ? c10::Device(c10::kCPU) : compute_device_));
    if (offload_ && pin_host_memory_) local_shard_ = local_shard_.pin_memory();
  } else {
    // The full flat tensor lives only until the shard is cut from it.
    const at::Tensor flat = flatten(params, layout_, options);
    const auto [begin, end] = layout_.shard_range(rank_);
    local_shard_ = flat.narrow(0, begin, end - begin).clone();
    if (offload_) local_shard_ = local_shard_.to(c10::kCPU);
    if (offload_ && pin_host_memory_) local_shard_ = local_shard_.pin_memory();
  }
  explicit_param_dtype_ = opts.param_dtype.has_value();
  explicit_reduce_dtype_ = opts.reduce_dtype.has_value();
  make_buffers();
}

void FlatParamHandle::make_buffers() {
  const at::TensorOptions options = local_shard_.options().requires_grad(false);
  const at::TensorOptions compute = options.device(compute_device_).dtype(param_dtype_);
  casts_ = local_shard_.device() != compute_device_ || param_dtype_ != local_shard_.scalar_type();
  all_gather_target_ = at::Tensor();
  if (!has_own_unsharded()) {
    unsharded_ = local_shard_.detach();
    placeholder_views_ = views_of(unsharded_, layout_);
    state_ = ShardedState::kUnsharded;
  } else {
    // Everything that aliases the buffer is made while its storage has its size
    // (set_ would grow an empty storage back), then the storage is dropped; no
    // memory meanwhile (see [Note: Buffers made without memory]).
    unsharded_ = empty_without_memory(layout_.padded_numel(), compute);
    all_gather_target_ = at::empty({0}, compute);
    all_gather_target_.set_(unsharded_.storage(), 0, {layout_.padded_numel()}, {1});
    if (copies_out()) {
      // The views are of the parameters' own buffer, refilled through a second TensorImpl (see
      // [Note: Unsharded storage]); the gathered buffer is nobody's view.
      param_offsets_.assign(1, 0);
      for (std::int64_t i = 0; i < layout_.num_params(); ++i) {  // (padded: see [Note: Copy-out])
        param_offsets_.push_back(param_offsets_.back() +
                                 (layout_.all_on_dim0()
                                      ? layout_.shard_factor() * layout_.rows_per_shard(i) * layout_.row_numel(i)
                                      : layout_.numels()[static_cast<std::size_t>(i)]));
      }
      const std::int64_t numel = param_offsets_.back();
      params_ = empty_without_memory(numel, compute);
      params_target_ = at::empty({0}, compute);
      params_target_.set_(params_.storage(), 0, {numel}, {1});
      if (casts_) {
        const at::Tensor base = empty_without_memory(numel, options.device(compute_device_));
        placeholder_views_ = param_views(base);
        resize_storage(base.storage().unsafeGetStorageImpl(), 0);
      } else {
        placeholder_views_ = param_views(params_);
      }
      resize_storage(params_.storage().unsafeGetStorageImpl(), 0);
    } else if (is_replicated()) {
      placeholder_views_ = views_of(local_shard_.detach(), layout_);  // real values: see set_name
    } else if (casts_) {
      // Between iterations the modules see the parameters' own dtype (see [Note: Placeholders]).
      // The views keep their base alive: its storage goes too, not only theirs.
      const at::Tensor base = empty_without_memory(layout_.padded_numel(), options.device(compute_device_));
      placeholder_views_ = views_of(base, layout_);
      resize_storage(base.storage().unsafeGetStorageImpl(), 0);
    } else {
      placeholder_views_ = views_of(unsharded_, layout_);
    }
    resize_storage(unsharded_.storage().unsafeGetStorageImpl(), 0);
    state_ = ShardedState::kSharded;
  }
  set_name(name_);  // also gives the placeholders their error message
}

void FlatParamHandle::set_state(ShardedState next) {
  const auto allowed = [&] {
    switch (state_) {
      case ShardedState::kSharded:
        return next == ShardedState::kUnsharding || next == ShardedState::kUnsharded;
      case ShardedState::kUnsharding:
        return next == ShardedState::kUnsharded || next == ShardedState::kSharded;
      case ShardedState::kUnsharded:
        return next == ShardedState::kSharded;
    }
    return false;
  };
  TORCH_INTERNAL_ASSERT(allowed(), "flatshard: unit '", name_, "': no sharded-state transition from ",
                        static_cast<int>(state_), " to ", static_cast<int>(next),
                        " (see [Note: Sharded-state transitions])");
  state_ = next;
}

void FlatParamHandle::after_shard_cast() {
  TORCH_CHECK(state_ != ShardedState::kUnsharding && !has_unsharded_storage() && !has_unsharded_grad(),
              "flatshard: unit '", name_, "': its dtype can only change between iterations (it is unsharded now); "
              "cast the model before training or between steps.");
  const c10::ScalarType dtype = local_shard_.scalar_type();
  if (!explicit_param_dtype_) param_dtype_ = dtype;
  if (!explicit_reduce_dtype_) reduce_dtype_ = dtype;
  make_buffers();
}

void FlatParamHandle::set_name(std::string name) {
  name_ = std::move(name);
  const std::string suffix = name_.empty() ? std::string() : " " + name_;
  all_gather_range_ = "flatshard::all_gather" + suffix;
  wait_range_ = "flatshard::wait_for_unshard" + suffix;
  reduce_scatter_range_ = "flatshard::reduce_scatter" + suffix;
  reshard_range_ = "flatshard::reshard" + suffix;
  all_reduce_range_ = "flatshard::all_reduce" + suffix;
  if (is_replicated()) return;  // its placeholders are views of the local shard: real data
  // See [Note: Placeholders]. Setting it again (a rename) only changes the message.
  const std::string message =
      "flatshard: a parameter of " + (name_.empty() ? std::string("an FSDP unit") : "unit '" + name_ + "'") +
      " has no storage between iterations (the unit is sharded): only its shape, dtype and device "
      "are there. Read or change parameters inside FSDP.summon_full_params(model), or with "
      "model.apply(fn), which summons them for you.";
  for (at::Tensor& view : placeholder_views_) {
    view.unsafeGetTensorImpl()->release_storage_and_set_meta_custom_data_ptr_error_msg_(message);
  }
}

FlatParamHandle::~FlatParamHandle() {
  if (unsharded_.defined()) free_unsharded();
  drop_post_forward_shard();
}

void FlatParamHandle::set_reduce_prefix(std::int64_t numel) {
  TORCH_CHECK(!has_unsharded_grad(), "flatshard: unit '", name_,
              "': the trainable prefix changed while a gradient was being accumulated");
  prefix_layout_.reset();
  if (numel != -1 && layout_.kind() == LayoutKind::kDim0) {  // whole parameters' rows of each rank's shard
    std::int64_t k = 0;
    std::int64_t prefix = 0;
    while (k < layout_.num_params() && prefix < numel) {
      prefix += layout_.rows_per_shard(k) * layout_.row_numel(k);
      ++k;
    }
    TORCH_CHECK(numel > 0 && prefix == numel && numel <= layout_.shard_numel(), "flatshard: unit '", name_,
                "': a trainable prefix of ", numel, " elements of each shard of ", layout_.shard_numel(),
                " does not end at a parameter's rows");
    prefix_layout_ = FlatParamLayout::dim0(
        std::vector<std::vector<std::int64_t>>(layout_.shapes().begin(), layout_.shapes().begin() + k),
        layout_.shard_factor(),
        std::vector<std::int64_t>(layout_.shard_dims().begin(), layout_.shard_dims().begin() + k));
  } else {
    TORCH_CHECK(numel == -1 || (numel > 0 && numel <= layout_.unpadded_numel()), "flatshard: unit '", name_,
                "': a trainable prefix of ", numel, " elements for ", layout_.unpadded_numel());
  }
  reduce_prefix_ = numel;
}

void FlatParamHandle::accumulate_grad(const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(static_cast<std::int64_t>(grads.size()) == layout_.num_params(), "flatshard: unit '",
              name_, "': expected ", layout_.num_params(), " gradients but got ", grads.size());
  // A backward with create_graph=True hands over gradients that require grad: the flat gradient is data (it is
  // reduced and becomes `.grad`), and out= ops (the fused flatten's cat) refuse inputs that require grad.
  at::NoGradGuard no_grad;
  if (layout_.kind() == LayoutKind::kDim0) {  // rank-major: see flatten
    // With a trainable prefix, in the trainable parameters' own layout (see [Note: Trainable prefix]).
    const FlatParamLayout& into_layout = prefix_layout_.has_value() ? *prefix_layout_ : layout_;
    if (!unsharded_grad_.defined()) {  // this backward's, in param_dtype (see [Note: FSDP2's gradient sums])
      unsharded_grad_ = flatten(std::vector<at::Tensor>(grads.begin(), grads.begin() + into_layout.num_params()),
                                into_layout, at::TensorOptions().device(compute_device_).dtype(param_dtype_));
      return;
    }
    for (std::int64_t i = 0; i < into_layout.num_params(); ++i) {
      if (!grads[i].defined()) continue;
      if (into_layout.shard_factor() == 1) {  // the packed flat layout (see [Note: Dim-0 layout])
        if (into_layout.numels()[i] > 0) add_at(into_layout, i, grads[i]);
        continue;
      }
      for (auto& [into, from] : dim0_row_pieces(unsharded_grad_, into_layout, i, grads[i].contiguous())) {
        into.add_(from);
      }
    }
    return;
  }
  if (reduce_prefix_ >= 0) {  // see [Note: Trainable prefix]
    if (!unsharded_grad_.defined()) {
      unsharded_grad_ = at::zeros({reduce_prefix_}, at::TensorOptions().device(compute_device_).dtype(param_dtype_));
    }
    for (std::int64_t i = 0; i < layout_.num_params(); ++i) {
      // A frozen parameter's view still gets a gradient from autograd (the views come from the
      // trainable flat parameter); like the whole-gradient path's, it is never used: dropped here.
      if (!grads[i].defined() || layout_.numels()[i] == 0 ||
          layout_.offsets()[i] + layout_.numels()[i] > reduce_prefix_) {
        continue;
      }
      add_at(layout_, i, grads[i]);
    }
    return;
  }
  if (!unsharded_grad_.defined()) {  // in param_dtype, as torch's FSDP1 (see [Note: Mixed precision and offload])
    unsharded_grad_ = flatten(grads, layout_, at::TensorOptions().device(compute_device_).dtype(param_dtype_));
    return;
  }
  for (std::int64_t i = 0; i < layout_.num_params(); ++i) {
    if (!grads[i].defined() || layout_.numels()[i] == 0) continue;
    add_at(layout_, i, grads[i]);
  }
}

void FlatParamHandle::add_at(const FlatParamLayout& layout, std::int64_t i, const at::Tensor& grad) {
  TORCH_CHECK(grad.numel() == layout.numels()[i], "flatshard: unit '", name_, "': gradient ", i, " has shape ",
              shape_str(grad.sizes()), " but the layout expects ", shape_str(layout.shapes()[i]));
  contiguous_view(unsharded_grad_, layout.offsets()[i], grad.sizes()).add_(grad);  // (as many elements: no broadcast)
}

void FlatParamHandle::end_backward_grad() {
  if (layout_.kind() != LayoutKind::kDim0 || !unsharded_grad_.defined()) return;
  // See [Note: FSDP2's gradient sums].
  at::Tensor sum = std::exchange(unsharded_grad_, at::Tensor());
  if (!accumulated_grad_.defined()) {
    accumulated_grad_ = sum.scalar_type() == reduce_dtype_ ? sum : sum.to(reduce_dtype_);
  } else {
    accumulated_grad_.add_(sum);
  }
}

at::Tensor FlatParamHandle::take_unsharded_grad() {
  end_backward_grad();
  if (accumulated_grad_.defined()) return std::exchange(accumulated_grad_, at::Tensor());
  TORCH_INTERNAL_ASSERT(unsharded_grad_.defined(), "flatshard: unit '", name_,
                        "' has no unsharded gradient to reduce");
  at::Tensor grad = std::exchange(unsharded_grad_, at::Tensor());
  // On the current (compute) stream, so that the param_dtype gradient is freed in its order.
  return grad.scalar_type() == reduce_dtype_ ? grad : grad.to(reduce_dtype_);
}

void FlatParamHandle::put_back_unsharded_grad(const at::Tensor& grad) {
  TORCH_CHECK(layout_.kind() == LayoutKind::kDim0, "flatshard: unit '", name_,
              "': put_back_unsharded_grad is for the dim-0 layout");
  TORCH_CHECK(!unsharded_grad_.defined() && !accumulated_grad_.defined(), "flatshard: unit '", name_,
              "': put_back_unsharded_grad while it holds an unsharded gradient (take it first)");
  TORCH_CHECK(grad.defined() && grad.scalar_type() == reduce_dtype_ && grad.device() == compute_device_ &&
                  grad.dim() == 1,
              "flatshard: unit '", name_, "': put_back_unsharded_grad expects a 1-D ", reduce_dtype_,
              " gradient on ", compute_device_);
  accumulated_grad_ = grad;
}

void FlatParamHandle::set_local_shard(const at::Tensor& param) {
  TORCH_CHECK(param.defined() && param.is_alias_of(local_shard_) &&
                  param.numel() == local_shard_.numel(),
              "flatshard: unit '", name_,
              "': set_local_shard expects the parameter made from local_shard()");
  local_shard_ = param;
}

bool FlatParamHandle::has_unsharded_storage() const {
  return has_own_unsharded() &&
         (unsharded_.storage().nbytes() > 0 || (copies_out() && params_.storage().nbytes() > 0));
}

std::int64_t FlatParamHandle::params_nbytes() const {
  return param_offsets_.back() * static_cast<std::int64_t>(params_.element_size());
}

std::vector<at::Tensor> FlatParamHandle::param_views(const at::Tensor& buffer) const {
  std::vector<at::Tensor> views;
  views.reserve(static_cast<std::size_t>(layout_.num_params()));
  for (std::int64_t i = 0; i < layout_.num_params(); ++i) {
    const auto k = static_cast<std::size_t>(i);
    views.push_back(contiguous_view(buffer, param_offsets_[k], layout_.shapes()[k]));
  }
  return views;
}

void FlatParamHandle::copy_out() {
  if (!copies_out()) return;
  // On the current (compute) stream: the gathered buffer is freed once the copies are enqueued; the
  // next all-gather, the only other user of its memory, waits for this stream first (Scheduler::unshard).
  if (params_.storage().nbytes() == 0) {
    resize_storage(params_.storage().unsafeGetStorageImpl(), static_cast<std::size_t>(params_nbytes()));
    MemoryCounter::add(params_nbytes());
  }
  if (layout_.all_on_dim0()) {  // see [Note: One copy a unit] in dim0_rows.h
    std::vector<at::Tensor> outs;
    outs.reserve(static_cast<std::size_t>(layout_.num_params()));
    for (std::size_t i = 0; i + 1 < param_offsets_.size(); ++i) {  // each parameter's region, padded
      outs.push_back(params_target_.narrow(0, param_offsets_[i], param_offsets_[i + 1] - param_offsets_[i]));
    }
    copy_rows_out(all_gather_target_, layout_, outs);
  } else {
    for (std::int64_t i = 0; i < layout_.num_params(); ++i) {
      const std::int64_t numel = layout_.numels()[i];
      if (numel == 0) continue;
      const at::Tensor out = params_target_.narrow(0, param_offsets_[static_cast<std::size_t>(i)], numel);
      for (auto& [from, into] : dim0_row_pieces(all_gather_target_, layout_, i, out)) into.copy_(from);
    }
  }
  if (unsharded_.storage().nbytes() > 0) {
    resize_storage(unsharded_.storage().unsafeGetStorageImpl(), 0);
    MemoryCounter::add(-unsharded_nbytes());
  }
}

void FlatParamHandle::keep_post_forward_shard(std::int64_t group_size, std::int64_t group_rank) {
  TORCH_INTERNAL_ASSERT(copies_out() && state_ == ShardedState::kUnsharded && params_.storage().nbytes() > 0,
                        "flatshard: unit '", name_, "': a post-forward shard is kept from unsharded parameters");
  TORCH_INTERNAL_ASSERT(group_size > 1 && layout_.shard_factor() % group_size == 0 && group_rank >= 0 &&
                            group_rank < group_size,
                        "flatshard: unit '", name_, "': post-forward group of ", group_size, " ranks (rank ",
                        group_rank, ") for shard factor ", layout_.shard_factor());
  // See [Note: Reshard to a smaller group]: the rows of `ranks` shard ranks from `first` on, padding zero.
  const std::int64_t ranks = layout_.shard_factor() / group_size;
  const std::int64_t first = group_rank * ranks;
  drop_post_forward_shard();
  at::Tensor chunk = at::zeros({ranks * layout_.shard_numel()}, params_.options());
  for (std::int64_t i = 0; i < layout_.num_params(); ++i) {
    const std::int64_t numel = layout_.numels()[i];
    if (numel == 0) continue;
    const at::Tensor param = params_.narrow(0, param_offsets_[static_cast<std::size_t>(i)], numel);
    for (auto& [into, from] : dim0_row_pieces(chunk, layout_, i, param, first, ranks)) into.copy_(from);
  }
  post_forward_shard_ = std::move(chunk);
  MemoryCounter::add(static_cast<std::int64_t>(post_forward_shard_.nbytes()));
}

void FlatParamHandle::drop_post_forward_shard() {
  if (!post_forward_shard_.defined()) return;
  MemoryCounter::add(-static_cast<std::int64_t>(post_forward_shard_.nbytes()));
  post_forward_shard_ = at::Tensor();
}

std::vector<at::Tensor> FlatParamHandle::views() const {
  if (!copies_out()) return views_of(unsharded_, layout_);
  return param_views(params_);
}


std::int64_t FlatParamHandle::unsharded_nbytes() const {
  return layout_.padded_numel() * static_cast<std::int64_t>(unsharded_.element_size());
}

void FlatParamHandle::alloc_unsharded() {
  if (!has_own_unsharded() || unsharded_.storage().nbytes() > 0 || layout_.padded_numel() == 0) return;
  resize_storage(unsharded_.storage().unsafeGetStorageImpl(),
                 static_cast<std::size_t>(unsharded_nbytes()));
  MemoryCounter::add(unsharded_nbytes());
}

void FlatParamHandle::free_unsharded() {
  if (!has_own_unsharded()) return;
  if (unsharded_.storage().nbytes() > 0) {
    resize_storage(unsharded_.storage().unsafeGetStorageImpl(), 0);
    MemoryCounter::add(-unsharded_nbytes());
  }
  if (copies_out() && params_.storage().nbytes() > 0) {
    resize_storage(params_.storage().unsafeGetStorageImpl(), 0);
    MemoryCounter::add(-params_nbytes());
  }
}

namespace {
// The shard on the compute device: moved there in its own dtype first (an
// asynchronous copy from pinned memory), so that any cast runs on the device.
at::Tensor on_device(const at::Tensor& shard, const c10::Device& device) {
  return shard.detach().to(device, /*non_blocking=*/true);
}
}  // namespace

at::Tensor FlatParamHandle::all_gather_input() {
  if (!casts_) return local_shard_.detach();
  all_gather_input_ = on_device(local_shard_, compute_device_).to(param_dtype_);
  return all_gather_input_;
}

void FlatParamHandle::copy_shard_into_unsharded() {
  all_gather_target_.copy_(on_device(local_shard_, compute_device_));
}

void FlatParamHandle::accumulate_grad_shard(const at::Tensor& shard_grad) {
  if (!offload_) {
    add_into_grad(shard_grad);
    return;
  }
  // On its way to the host at once, on the current (reduction) stream: the device
  // copy goes as soon as that stream is past it. Added into `.grad` in add_offloaded_grads().
  const at::Tensor full = shard_grad.to(local_shard_.scalar_type());
  at::Tensor host = at::empty(full.sizes(), full.options().device(c10::kCPU).pinned_memory(pin_host_memory_));
  host.copy_(full, /*non_blocking=*/true);
  host_grads_.push_back(std::move(host));
}

void FlatParamHandle::add_offloaded_grads() {
  for (at::Tensor& host : host_grads_) add_into_grad(host);
  host_grads_.clear();
}

void FlatParamHandle::add_into_grad(const at::Tensor& grad_shard) {
  at::Tensor& grad = local_shard_.mutable_grad();
  const c10::ScalarType full = local_shard_.scalar_type();
  if (!grad.defined()) {
    grad = grad_shard.scalar_type() == full ? grad_shard : grad_shard.to(full);
  } else {
    if (grad.scalar_type() != full) grad = grad.to(full);  // a low-precision .grad from an earlier backward
    grad.add_(grad_shard);
  }
  if (grad_dtype_.has_value() && *grad_dtype_ != full) grad = grad.to(*grad_dtype_);
}

}  // namespace flatshard
