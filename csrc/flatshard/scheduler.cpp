#include "flatshard/scheduler.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace flatshard {
namespace {

constexpr const char* kRateLimitWait = "flatshard::rate_limit_wait";

bool device_has_events(const c10::Device& device) { return device.type() != c10::DeviceType::CPU; }

// Waits for `work`; a failure (a peer gone, the group's timeout) is thrown again naming the
// unit and the collective, as the same kind of error (c10::DistBackendError stays one).
void wait_for(CommWork& work, const FlatParamHandle& unit, const std::string& what) {
  try {
    work.wait("the " + what + " of unit '" + (unit.name().empty() ? "<root>" : unit.name()) + "'");
  } catch (const RankDivergence&) {
    throw;  // a stalled wait's verdict (see [Note: Stalled waits]), as it is
  } catch (const PeerGone&) {
    throw;  // likewise
  } catch (const Interrupted&) {
    throw;  // Ctrl-C while it stalled
  } catch (const c10::DistBackendError& e) {
    C10_THROW_ERROR(DistBackendError, "flatshard: the " + what + " of unit '" +
                                          (unit.name().empty() ? "<root>" : unit.name()) + "' failed: " +
                                          e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flatshard: the ", what, " of unit '", unit.name().empty() ? "<root>" : unit.name(),
                "' failed: ", e.what());
  }
}

// `t` as a tensor whose bytes MemoryCounter counts until its storage is freed
// (by whichever thread drops the last reference): the full-precision buffers
// that summons, state dicts and exports hold are unsharded memory too.
at::Tensor counted(at::Tensor t) {
  const std::int64_t bytes = static_cast<std::int64_t>(t.nbytes());
  MemoryCounter::add(bytes);
  void* data = t.data_ptr();
  const std::vector<std::int64_t> sizes = t.sizes().vec();
  const at::TensorOptions options = t.options();
  return at::from_blob(
      data, sizes,
      [owner = std::move(t), bytes](void*) mutable {
        owner.reset();
        MemoryCounter::add(-bytes);
      },
      options);
}

c10::Stream pool_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  if (!device_has_events(device)) return impl.getStream(device);
  return impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
}

// The free fence of an unsharded buffer on a device with events.
class EventFence final : public Fence {
 public:
  explicit EventFence(c10::Event event) : event_(std::move(event)) {}
  bool is_completed() const override { return event_.query(); }
  void wait() override { event_.synchronize(); }

 private:
  c10::Event event_;
};

// On the CPU a buffer is busy while the all-gather into it runs on the
// process group's thread: its fence is the collective's completion. It
// watches the work without owning it: once the collective completed, or the
// scheduler waited on it and dropped it, the fence is complete (gloo's
// temporaries are gone by then: [Note: gloo's temporaries]).
class WorkFence final : public Fence {
 public:
  explicit WorkFence(std::weak_ptr<CommWork> work) : work_(std::move(work)) {}
  bool is_completed() const override {
    auto work = work_.lock();
    return !work || work->is_completed();
  }
  void wait() override {
    if (auto work = work_.lock()) work->wait();
  }

 private:
  std::weak_ptr<CommWork> work_;
};

}  // namespace

Scheduler::Scheduler(Collectives shard, std::optional<Collectives> replicate, c10::Device device,
                     std::int64_t max_in_flight)
    : device_(device),
      has_events_(device_has_events(device)),
      all_gather_stream_(pool_stream(device)),
      reduce_scatter_stream_(pool_stream(device)),
      all_reduce_stream_(pool_stream(device)),
      limiter_(max_in_flight) {
  groups_.push_back(GroupPair{std::move(shard), std::move(replicate), std::nullopt});
}

std::int64_t Scheduler::add_groups(Collectives shard, std::optional<Collectives> replicate) {
  groups_.push_back(GroupPair{std::move(shard), std::move(replicate), std::nullopt});
  return static_cast<std::int64_t>(groups_.size()) - 1;
}

void Scheduler::set_reduce_scatter_group(std::int64_t index, std::optional<Collectives> group) {
  TORCH_CHECK(index >= 0 && index < static_cast<std::int64_t>(groups_.size()), "flatshard: group pair ", index,
              " but the scheduler has ", groups_.size());
  GroupPair& pair = groups_[static_cast<std::size_t>(index)];
  TORCH_CHECK(!group.has_value() || (group->size() == pair.shard.size() && group->rank() == pair.shard.rank()),
              "flatshard: a reduce-scatter group of ", group.has_value() ? group->size() : 0,
              " ranks (this rank ", group.has_value() ? group->rank() : -1, ") for a shard group of ",
              pair.shard.size(), " (this rank ", pair.shard.rank(), "): it must be the same ranks");
  pair.reduce_scatter = std::move(group);
}

Scheduler::GroupPair& Scheduler::groups_of(const FlatParamHandle& unit) {
  return group_pair(unit, unit.group_index());
}

Scheduler::GroupPair& Scheduler::group_pair(const FlatParamHandle& unit, std::int64_t index) {
  TORCH_CHECK(index >= 0 && index < static_cast<std::int64_t>(groups_.size()), "flatshard: unit '", unit.name(),
              "' has group index ", index, " but the scheduler has ", groups_.size(), " group pairs");
  return groups_[static_cast<std::size_t>(index)];
}

Scheduler::~Scheduler() = default;

c10::Stream Scheduler::current_stream() const {
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

void Scheduler::stream_wait(const c10::Stream& waiter, const c10::Stream& signaller) {
  if (!has_events_ || waiter == signaller) return;
  c10::Event event(device_.type());
  event.record(signaller);
  event.block(waiter);
}

void Scheduler::reap_completed_reductions() {
  // Never one that would issue a replica all-reduce, or run an all-reduce hook
  // (which issues the user's collectives: see [Note: The all-reduce hook]): when
  // the host notices a completion differs between ranks, and collectives must be
  // issued in the same order everywhere (NCCL requires it across communicators too).
  while (!reductions_.empty() && !reductions_.front().unit->all_reduce_replicas() &&
         !reductions_.front().unit->all_reduce_hook() && reductions_.front().shard_work.is_completed()) {
    complete_shard_reduction();
  }
  while (!replica_reductions_.empty() && !replica_reductions_.front().unit->all_reduce_hook() &&
         replica_reductions_.front().replica_work.is_completed()) {
    complete_replica_reduction();
  }
}

void Scheduler::unshard(FlatParamHandle& unit) {
  reap_completed_reductions();
  if (unit.state() != ShardedState::kSharded) return;
  if (!unit.has_own_unsharded()) {
    unit.set_state(ShardedState::kUnsharded);
    return;
  }
  make_room_for_all_gather();
  RECORD_USER_SCOPE(unit.all_gather_range());
  const c10::Stream compute = current_stream();
  stream_wait(all_gather_stream_, compute);
  c10::StreamGuard stream_guard(all_gather_stream_);
  unit.alloc_unsharded();
  std::shared_ptr<CommWork> work;
  if (unit.is_replicated()) {  // a buffer of its own only for the cast or the copy to the device
    unit.copy_shard_into_unsharded();
    work = std::make_shared<CommWork>();  // stream order is all there is to wait for
  } else {
    at::Tensor output = unit.all_gather_target();
    // After a forward that resharded to a smaller group, from the chunk kept for it over that group (see [Note:
    // Reshard to a smaller group] in flat_param.h); else the shard, cast and copied to the device here, on this
    // stream (see [Note: Mixed precision and offload]).
    const bool from_post_forward = unit.has_post_forward_shard();
    at::Tensor input = from_post_forward ? unit.post_forward_shard() : unit.all_gather_input();
    Collectives& group =
        from_post_forward ? group_pair(unit, unit.post_forward_group_index()).shard : groups_of(unit).shard;
    check_sequence(group, unit, "all_gather", input.nbytes());
    unit.count_collective(FlatParamHandle::kGathered, static_cast<std::int64_t>(input.nbytes()));
    work = std::make_shared<CommWork>(group.all_gather(output, input));
  }
  track_all_gather({&unit}, std::move(work));
}

void Scheduler::make_room_for_all_gather() {
  if (limiter_.would_block()) {
    RECORD_USER_SCOPE(kRateLimitWait);
    limiter_.acquire();
  }
}

void Scheduler::track_all_gather(const std::vector<FlatParamHandle*>& units, std::shared_ptr<CommWork> work) {
  if (!has_events_) limiter_.record_free(std::make_unique<WorkFence>(work));  // one fence for the collective
  // (With events the fence is recorded at reshard: a group's at its last unit's, see [Note: Small units gathered
  // together].)
  auto left = units.size() > 1 && has_events_ ? std::make_shared<std::int64_t>(units.size()) : nullptr;
  for (FlatParamHandle* unit : units) {
    all_gathers_[unit] = work;
    if (left) gathered_together_[unit] = left;
    unit->set_state(ShardedState::kUnsharding);
  }
}

void Scheduler::set_coalesce_bytes(std::int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "flatshard: units gathered together up to ", bytes, " bytes: expected 0 or more");
  coalesce_bytes_ = bytes;
}

bool Scheduler::joins_group(const FlatParamHandle& unit, const FlatParamHandle& first) const {
  return unit.state() == ShardedState::kSharded && !unit.is_replicated() && !unit.has_post_forward_shard() &&
         unit.group_index() == first.group_index() && unit.param_dtype() == first.param_dtype() &&
         unit.compute_device() == first.compute_device();
}

std::int64_t Scheduler::unshard_together(const std::vector<FlatParamHandle*>& units) {
  if (units.empty()) return 0;
  FlatParamHandle& first = *units.front();
  if (first.state() != ShardedState::kSharded) return 0;
  // See [Note: Small units gathered together].
  std::vector<FlatParamHandle*> group;
  std::int64_t bytes = 0;
  for (FlatParamHandle* unit : units) {
    if (coalesce_bytes_ == 0 || !joins_group(*unit, first) ||
        std::find(group.begin(), group.end(), unit) != group.end()) {
      break;
    }
    bytes += unit->layout().padded_numel() * static_cast<std::int64_t>(c10::elementSize(unit->param_dtype()));
    if (bytes > coalesce_bytes_) break;
    group.push_back(unit);
  }
  if (group.size() < 2) {
    unshard(first);
    return 1;
  }
  reap_completed_reductions();
  make_room_for_all_gather();
  RECORD_USER_SCOPE(first.all_gather_range());
  Collectives& collectives = groups_of(first).shard;
  std::size_t input_bytes = 0;
  for (const FlatParamHandle* unit : group) {
    input_bytes += static_cast<std::size_t>(unit->layout().shard_numel()) * c10::elementSize(unit->param_dtype());
  }
  check_sequence(collectives, first, "all_gather together with the next units", input_bytes);
  const c10::Stream compute = current_stream();
  stream_wait(all_gather_stream_, compute);
  c10::StreamGuard stream_guard(all_gather_stream_);
  std::vector<at::Tensor> outputs, inputs;
  std::shared_ptr<CommWork> work;
  try {
    for (FlatParamHandle* unit : group) {
      unit->alloc_unsharded();
      outputs.push_back(unit->all_gather_target());
      inputs.push_back(unit->all_gather_input());
    }
    work = std::make_shared<CommWork>(collectives.all_gather_coalesced(outputs, inputs));
  } catch (...) {  // (out of memory, say): every unit sharded as it was, its buffers gone
    for (FlatParamHandle* unit : group) {
      unit->drop_all_gather_input();
      unit->free_unsharded();
    }
    throw;
  }
  for (std::size_t i = 0; i < group.size(); ++i) {
    group[i]->count_collective(FlatParamHandle::kGathered, static_cast<std::int64_t>(inputs[i].nbytes()));
  }
  track_all_gather(group, std::move(work));
  return static_cast<std::int64_t>(group.size());
}

void Scheduler::wait_for_unshard(FlatParamHandle& unit) {
  if (unit.state() == ShardedState::kUnsharded) return;
  if (unit.state() == ShardedState::kSharded) unshard(unit);
  if (unit.state() == ShardedState::kUnsharded) return;  // replicated
  RECORD_USER_SCOPE(unit.wait_range());
  const c10::Stream compute = current_stream();
  auto it = all_gathers_.find(&unit);
  TORCH_INTERNAL_ASSERT(it != all_gathers_.end(), "flatshard: no all-gather pending for unit '",
                        unit.name(), "'");
  {
    c10::StreamGuard stream_guard(all_gather_stream_);
    wait_for(*it->second, unit, "all-gather");
  }
  all_gathers_.erase(it);
  unit.drop_all_gather_input();  // the all-gather stream is done with it (stream order)
  stream_wait(compute, all_gather_stream_);
  try {
    unit.copy_out();  // dim-0 layout: see [Note: Copy-out] in flat_param.h
  } catch (...) {
    reshard(unit);  // (out of memory for the parameters, say): sharded again, so that a retry can run
    throw;
  }
  unit.set_state(ShardedState::kUnsharded);
}

void Scheduler::reshard(FlatParamHandle& unit, bool after_forward) {
  if (unit.state() == ShardedState::kSharded) {
    unit.drop_post_forward_shard();
    return;
  }
  if (!unit.has_own_unsharded()) {
    unit.set_state(ShardedState::kSharded);
    return;
  }
  RECORD_USER_SCOPE(unit.reshard_range());
  if (unit.state() == ShardedState::kUnsharding) {
    // The collective still writes into the buffer: it must finish first.
    auto it = all_gathers_.find(&unit);
    if (it != all_gathers_.end()) {
      c10::StreamGuard stream_guard(all_gather_stream_);
      wait_for(*it->second, unit, "all-gather");
      all_gathers_.erase(it);
    }
    unit.drop_all_gather_input();
    stream_wait(current_stream(), all_gather_stream_);
  } else if (after_forward && unit.post_forward_group_index() >= 0 && unit.copies_out()) {
    // See [Note: Reshard to a smaller group] in flat_param.h.
    const Collectives& group = group_pair(unit, unit.post_forward_group_index()).shard;
    unit.keep_post_forward_shard(group.size(), group.rank());
  }
  unit.free_unsharded();
  unit.set_state(ShardedState::kSharded);
  if (auto it = gathered_together_.find(&unit); it != gathered_together_.end()) {
    // See [Note: Small units gathered together]: one fence for the group, at its last unit's reshard.
    const bool last = --*it->second == 0;
    gathered_together_.erase(it);
    if (!last) return;
  }
  if (has_events_) {
    c10::Event event(device_.type());
    event.record(current_stream());
    limiter_.record_free(std::make_unique<EventFence>(std::move(event)));
  }
}

void Scheduler::reduce_grad(FlatParamHandle& unit) {
  TORCH_CHECK(!unit.all_reduce_replicas() || groups_of(unit).replicate.has_value(), "flatshard: unit '", unit.name(),
              "' asks for a replica all-reduce but the scheduler has no replicate group");
  at::Tensor flat_grad = unit.take_unsharded_grad();
  // See [Note: Small units reduced together].
  if (can_defer_reduction(unit, flat_grad)) {
    if (!deferred_.empty() && (deferred_.front().unit->group_index() != unit.group_index() ||
                               deferred_.front().flat_grad.scalar_type() != flat_grad.scalar_type() ||
                               deferred_bytes_ + static_cast<std::int64_t>(flat_grad.nbytes()) > coalesce_bytes_)) {
      reduce_deferred();
    }
    deferred_bytes_ += static_cast<std::int64_t>(flat_grad.nbytes());
    deferred_.push_back(DeferredReduction{&unit, std::move(flat_grad)});
    if (deferred_.size() == kMaxReducedTogether) reduce_deferred();
    return;
  }
  reduce_deferred();
  issue_reduction(unit, std::move(flat_grad));
}

bool Scheduler::can_defer_reduction(FlatParamHandle& unit, const at::Tensor& flat_grad) {
  return coalesce_bytes_ > 0 && flat_grad.defined() && !unit.is_replicated() && !unit.all_reduce_replicas() &&
         !unit.all_reduce_hook() && unit.reduce_prefix() < 0 &&
         static_cast<std::int64_t>(flat_grad.nbytes()) <= coalesce_bytes_ &&
         groups_of(unit).scatter().reduce_scatters_together_exactly(flat_grad.device());
}

void Scheduler::reduce_deferred() {
  if (deferred_.empty()) return;
  std::vector<DeferredReduction> deferred = std::move(deferred_);
  deferred_.clear();
  deferred_bytes_ = 0;
  if (deferred.size() == 1) {
    issue_reduction(*deferred.front().unit, std::move(deferred.front().flat_grad));
    return;
  }
  FlatParamHandle& first = *deferred.front().unit;
  make_room_for_reduction();  // see [Note: Reductions in flight]
  const c10::Stream compute = current_stream();
  stream_wait(reduce_scatter_stream_, compute);
  c10::StreamGuard stream_guard(reduce_scatter_stream_);
  RECORD_USER_SCOPE(first.reduce_scatter_range());
  std::vector<at::Tensor> outputs, inputs;
  std::size_t bytes = 0;
  for (DeferredReduction& d : deferred) {
    if (d.unit->predivide() != 1.0) d.flat_grad.div_(d.unit->predivide());
    outputs.push_back(at::empty({d.flat_grad.numel() / d.unit->layout().shard_factor()}, d.flat_grad.options()));
    inputs.push_back(d.flat_grad);
    bytes += d.flat_grad.nbytes();
    d.unit->count_collective(FlatParamHandle::kReduceScattered, static_cast<std::int64_t>(d.flat_grad.nbytes()));
  }
  GroupPair& groups = groups_of(first);
  check_sequence(groups.shard, first, "reduce_scatter together with the previous units", bytes);
  PendingReduction record{&first, at::Tensor(), outputs.front(), CommWork(), CommWork()};
  record.shard_work = groups.scatter().reduce_scatter_sum_coalesced(outputs, inputs);
  for (std::size_t i = 1; i < deferred.size(); ++i) record.together.emplace_back(deferred[i].unit, outputs[i]);
  reductions_.push_back(std::move(record));
}

void Scheduler::issue_reduction(FlatParamHandle& unit, at::Tensor flat_grad) {
  const double predivide = unit.predivide();
  GroupPair& groups = groups_of(unit);  // (its replicate group checked by reduce_grad)
  make_room_for_reduction();  // see [Note: Reductions in flight]
  PendingReduction record{&unit, std::move(flat_grad), at::Tensor(), CommWork(), CommWork()};
  const c10::Stream compute = current_stream();
  stream_wait(reduce_scatter_stream_, compute);
  c10::StreamGuard stream_guard(reduce_scatter_stream_);
  if (predivide != 1.0) record.flat_grad.div_(predivide);
  if (unit.is_replicated()) {
    record.grad_shard = record.flat_grad;
    if (groups.shard.size() > 1) {
      RECORD_USER_SCOPE(unit.all_reduce_range());
      check_sequence(groups.shard, unit, "all_reduce", record.grad_shard.nbytes());
      unit.count_collective(FlatParamHandle::kAllReduced, static_cast<std::int64_t>(record.grad_shard.nbytes()));
      record.shard_work = groups.shard.all_reduce_sum(record.grad_shard);
    }
  } else if (unit.reduce_prefix() >= 0 && !unit.reduce_scatters_prefix()) {  // see [Note: Trainable prefix]
    RECORD_USER_SCOPE(unit.all_reduce_range());
    check_sequence(groups.shard, unit, "all_reduce of the trainable prefix", record.flat_grad.nbytes());
    unit.count_collective(FlatParamHandle::kAllReduced, static_cast<std::int64_t>(record.flat_grad.nbytes()));
    record.prefix_only = true;
    record.shard_work = groups.shard.all_reduce_sum(record.flat_grad);
  } else {
    RECORD_USER_SCOPE(unit.reduce_scatter_range());
    // (With a dim-0 trainable prefix, the prefix of the shard: padded with zeros once reduced.)
    record.grad_shard = at::empty({record.flat_grad.numel() / unit.layout().shard_factor()}, record.flat_grad.options());
    Collectives& scatter = groups.scatter();
    // (Checked on the shard group, the same ranks as `scatter`: with every check of a unit on one group, ranks that
    // diverge meet in the same check and raise, rather than wait in checks on two groups.)
    check_sequence(groups.shard, unit, "reduce_scatter", record.flat_grad.nbytes());
    unit.count_collective(FlatParamHandle::kReduceScattered, static_cast<std::int64_t>(record.flat_grad.nbytes()));
    record.shard_work = scatter.reduce_scatter_sum(record.grad_shard, record.flat_grad);
    // The collective holds the input itself (gloo) and drops it when done,
    // rather than when the host next completes reductions.
    if (scatter.holds_reduce_scatter_input(record.flat_grad.device())) record.flat_grad = at::Tensor();
  }
  reductions_.push_back(std::move(record));
}

void Scheduler::post_backward(FlatParamHandle& unit, const std::vector<at::Tensor>& grads, bool reduce,
                              bool uses_done, bool reshard_unit) {
  TORCH_INTERNAL_ASSERT(uses_done || !(reduce || reshard_unit), "flatshard: unit '", unit.name(),
                        "': a post-backward reduces or reshards while a use of the unit is left");
  if (reduce) make_room_for_reduction();
  // Every use's backward ran: the parameters go before the flat gradient comes.
  if (reshard_unit) reshard(unit);
  unit.accumulate_grad(grads);
  if (uses_done) unit.end_backward_grad();  // every use of this backward is in (see [Note: FSDP2's gradient sums])
  if (reduce) reduce_grad(unit);
}

void Scheduler::set_max_reductions_in_flight(std::int64_t n) {
  TORCH_CHECK(n >= 1, "flatshard: at most ", n, " reductions in flight: expected at least 1");
  max_reductions_in_flight_ = n;
}

void Scheduler::make_room_for_reduction() {
  while (static_cast<std::int64_t>(reductions_.size()) >= max_reductions_in_flight_) complete_shard_reduction();
}

void Scheduler::complete_shard_reduction() {
  PendingReduction record = std::move(reductions_.front());
  reductions_.pop_front();
  {
    c10::StreamGuard stream_guard(reduce_scatter_stream_);
    wait_for(record.shard_work, *record.unit, "gradient reduction");
    if (record.prefix_only) {  // this rank's part of the reduced prefix; zeros for the frozen rest
      const std::int64_t size = record.unit->layout().shard_numel();
      const std::int64_t begin = record.unit->rank() * size;
      const std::int64_t n = std::clamp<std::int64_t>(record.flat_grad.numel() - begin, 0, size);
      record.grad_shard = at::zeros({size}, record.flat_grad.options());
      if (n > 0) record.grad_shard.narrow(0, 0, n).copy_(record.flat_grad.narrow(0, begin, n));
    }
  }
  // The input was allocated on the compute stream and read on the reduce-
  // scatter stream: the compute stream waits for that before the memory can
  // go back to its pool (no record_stream).
  stream_wait(current_stream(), reduce_scatter_stream_);
  record.flat_grad = at::Tensor();  // (replicated: the output is the same tensor and lives on)
  // The units reduced in the same collective (see [Note: Small units reduced together]): none needs a replica stage.
  for (auto& [unit, grad_shard] : record.together) {
    finish_reduction(PendingReduction{unit, at::Tensor(), std::move(grad_shard), CommWork(), CommWork()});
  }
  record.together.clear();
  std::optional<Collectives>& replicate = groups_of(*record.unit).replicate;
  // (A replicate group of one rank is HSDP still: its micro-batches wait for the all-reduce's, which moves nothing.)
  if (record.unit->all_reduce_replicas()) {
    at::Tensor& partial = record.unit->partial_replica_sum();  // see [Note: Reduce-scatter only]
    if (!record.unit->requires_all_reduce()) {
      c10::StreamGuard stream_guard(reduce_scatter_stream_);
      if (partial.defined()) {
        partial.add_(record.grad_shard);
      } else {
        partial = record.grad_shard;
      }
      stream_wait(current_stream(), reduce_scatter_stream_);
      return;
    }
    if (partial.defined()) {
      c10::StreamGuard stream_guard(reduce_scatter_stream_);
      record.grad_shard.add_(partial);
      partial = at::Tensor();
    }
    if (replicate->size() > 1) {
      while (!replica_reductions_.empty()) complete_replica_reduction();
      stream_wait(all_reduce_stream_, reduce_scatter_stream_);
      c10::StreamGuard stream_guard(all_reduce_stream_);
      RECORD_USER_SCOPE(record.unit->all_reduce_range());
      check_sequence(*replicate, *record.unit, "replica all_reduce", record.grad_shard.nbytes());
      record.unit->count_collective(FlatParamHandle::kReplicaAllReduced,
                                    static_cast<std::int64_t>(record.grad_shard.nbytes()));
      record.replica_work = replicate->all_reduce_sum(record.grad_shard);
    }
  }
  if (!record.replica_work.defined()) {
    finish_reduction(std::move(record));
    return;
  }
  replica_reductions_.push_back(std::move(record));
}

void Scheduler::complete_replica_reduction() {
  PendingReduction record = std::move(replica_reductions_.front());
  replica_reductions_.pop_front();
  finish_reduction(std::move(record));
}

void Scheduler::finish_reduction(PendingReduction record) {
  stream_wait(all_reduce_stream_, reduce_scatter_stream_);
  c10::StreamGuard stream_guard(all_reduce_stream_);
  wait_for(record.replica_work, *record.unit, "replica all-reduce");
  at::Tensor& shard_grad = record.grad_shard;
  // See [Note: The all-reduce hook]: it gets the rows reduced (with a dim-0 trainable prefix, the trainable
  // parameters' only). Should it raise, the compute stream still waits for this stream before the shard's memory
  // goes back to its pool.
  const FlatParamHandle::GradShardHook& hook = record.unit->all_reduce_hook();
  const auto run_hook = [&] {
    try {
      hook(shard_grad);
    } catch (...) {
      stream_wait(current_stream(), all_reduce_stream_);
      throw;
    }
  };
  if (hook && !record.unit->hook_after_postdivide()) run_hook();
  if (record.unit->postdivide() != 1.0) shard_grad.div_(record.unit->postdivide());
  if (hook && record.unit->hook_after_postdivide()) run_hook();
  if (shard_grad.numel() < record.unit->layout().shard_numel()) {  // a dim-0 trainable prefix: zeros after it
    at::Tensor shard = at::zeros({record.unit->layout().shard_numel()}, shard_grad.options());
    shard.narrow(0, 0, shard_grad.numel()).copy_(shard_grad);
    shard_grad = std::move(shard);
  }
  record.unit->accumulate_grad_shard(shard_grad);
  if (record.unit->has_offloaded_grads()) offloaded_.insert(record.unit);
  // `.grad` is read, and a dropped shard_grad's memory reused, in compute-stream order.
  stream_wait(current_stream(), all_reduce_stream_);
}

void Scheduler::accumulate_reduced_grad(FlatParamHandle& unit, const at::Tensor& grad_shard) {
  TORCH_CHECK(grad_shard.numel() == (unit.is_replicated() ? unit.layout().padded_numel() : unit.layout().shard_numel()),
              "flatshard: unit '", unit.name(), "': a communication hook's output has ", grad_shard.numel(),
              " elements but the gradient shard has ",
              unit.is_replicated() ? unit.layout().padded_numel() : unit.layout().shard_numel());
  unit.accumulate_grad_shard(grad_shard.detach());
  if (unit.has_offloaded_grads()) offloaded_.insert(&unit);
}

at::Tensor Scheduler::gather_full_precision(FlatParamHandle& unit) {
  const at::Tensor& shard = unit.local_shard();
  at::Tensor input = shard.detach().to(unit.compute_device());
  if (unit.is_replicated()) return counted(input.data_ptr() == shard.data_ptr() ? input.clone() : input);
  RECORD_USER_SCOPE(unit.all_gather_range());
  at::Tensor full = at::empty({unit.layout().padded_numel()}, input.options());
  check_sequence(groups_of(unit).shard, unit, "full-precision all_gather", input.nbytes());
  CommWork work = groups_of(unit).shard.all_gather(full, input);
  wait_for(work, unit, "full-precision all-gather");
  return counted(std::move(full));
}

void Scheduler::finish_grad_sync() {
  RECORD_USER_SCOPE("flatshard::finish_grad_sync");
  reduce_deferred();
  complete_issued_reductions();
}

bool Scheduler::reduction_deferred(const FlatParamHandle& unit) const {
  return std::any_of(deferred_.begin(), deferred_.end(), [&](const DeferredReduction& d) { return d.unit == &unit; });
}

void Scheduler::complete_issued_reductions() {
  if (reductions_.empty() && replica_reductions_.empty() && offloaded_.empty()) return;
  RECORD_USER_SCOPE("flatshard::complete_issued_reductions");
  while (!reductions_.empty()) complete_shard_reduction();
  while (!replica_reductions_.empty()) complete_replica_reduction();
  if (offloaded_.empty()) return;
  // See [Note: Mixed precision and offload]: the copies were issued on the
  // all-reduce stream, which the current stream waited for; one wait for all.
  current_stream().synchronize();
  for (FlatParamHandle* unit : offloaded_) unit->add_offloaded_grads();
  offloaded_.clear();
}

void Scheduler::check_sequence(Collectives& group, const FlatParamHandle& unit, const char* op, std::size_t bytes) {
  if (!sequence_check_ || group.size() < 2) return;
  std::int64_t& count = sequence_[group.group().get()];
  ++count;
  const std::string what = std::string(op) + " of unit '" + (unit.name().empty() ? "<root>" : unit.name()) +
                           "' (" + std::to_string(bytes) + " bytes)";
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(device_);
  at::Tensor mine = at::empty({2}, at::kLong);
  mine.data_ptr<std::int64_t>()[0] = static_cast<std::int64_t>(std::hash<std::string>{}(what));
  mine.data_ptr<std::int64_t>()[1] = count;
  at::Tensor input = mine.to(device_);
  at::Tensor all = at::empty({2 * group.size()}, on_device);
  {
    CommWork work = group.all_gather(all, input);
    wait_for(work, unit, "strict sequence check before the " + std::string(op));
  }
  at::Tensor host = all.cpu();
  const std::int64_t* rows = host.data_ptr<std::int64_t>();
  bool same = true;
  for (std::int64_t r = 1; r < group.size(); ++r) same = same && rows[2 * r] == rows[0] && rows[2 * r + 1] == rows[1];
  if (same) return;
  // Every rank of the group saw the difference: all of them exchange what they were about to do.
  constexpr std::int64_t kText = 160;
  at::Tensor text = at::zeros({kText}, at::kByte);
  std::memcpy(text.data_ptr(), what.data(), std::min<std::size_t>(what.size(), kText - 1));
  at::Tensor text_input = text.to(device_);
  at::Tensor texts = at::empty({kText * group.size()}, at::TensorOptions().dtype(at::kByte).device(device_));
  {
    CommWork work = group.all_gather(texts, text_input);
    wait_for(work, unit, "strict sequence check before the " + std::string(op));
  }
  at::Tensor host_texts = texts.cpu();
  std::string message = "flatshard: ranks issue different collectives (FLATSHARD_RANK_GUARD=strict, see [Note: "
                        "Collective sequence check]): ";
  for (std::int64_t r = 0; r < group.size(); ++r) {
    const char* begin = reinterpret_cast<const char*>(host_texts.data_ptr<std::uint8_t>()) + r * kText;
    message += (r ? "; " : "") + std::string("rank ") + std::to_string(r) + " of the group, collective #" +
               std::to_string(rows[2 * r + 1]) + ": " + std::string(begin, strnlen(begin, kText));
  }
  throw RankDivergence(message);
}

std::pair<bool, bool> Scheduler::drain(double timeout_seconds) {
  std::vector<const CommWork*> works;
  for (auto* queue : {&reductions_, &replica_reductions_}) {
    for (const PendingReduction& record : *queue) works.insert(works.end(), {&record.shard_work, &record.replica_work});
  }
  for (const auto& [unit, work] : all_gathers_) works.push_back(work.get());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  bool had_any = false;
  for (const CommWork* work : works) {
    had_any = had_any || !work->is_completed();
    while (!work->is_completed()) {
      if (std::chrono::steady_clock::now() > deadline) return {false, had_any};
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return {true, had_any};
}

void Scheduler::abort_grad_sync() {
  deferred_.clear();  // never issued: dropped as the unsharded gradients are
  deferred_bytes_ = 0;
  for (auto* queue : {&reductions_, &replica_reductions_}) {
    for (PendingReduction& record : *queue) {
      wait_for(record.shard_work, *record.unit, "gradient reduction");
      wait_for(record.replica_work, *record.unit, "replica all-reduce");
    }
    queue->clear();
  }
  for (auto& [unit, work] : all_gathers_) wait_for(*work, *unit, "all-gather");
  for (FlatParamHandle* unit : offloaded_) unit->drop_offloaded_grads();
  offloaded_.clear();
  stream_wait(current_stream(), reduce_scatter_stream_);
  stream_wait(current_stream(), all_reduce_stream_);
}

}  // namespace flatshard
