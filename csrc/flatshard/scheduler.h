#pragma once

#include <stdexcept>
// Scheduler: the stream-ordered collective runtime shared by every unit under
// one root FullyShardedDataParallel.
//
// Contract: not copyable, not thread-safe; driven by the thread that runs
// forward and backward. The verbs are unshard / wait_for_unshard / reshard /
// reduce_grad / finish_grad_sync. Methods that may block say so; the bindings
// release the GIL around them. Errors from collectives propagate as c10::Error.
//
// [Note: Who owns the units]
// The scheduler borrows the FlatParams it is handed: its pending records (the
// all-gathers in flight, the reductions in flight) point at them and it owns
// none. Their owner is Python: each unit's state holds its FlatParamHandle, and the
// root's RootState holds both this scheduler and every unit of the root, so
// every FlatParamHandle the scheduler can reach lives at least as long as the
// scheduler's use of it. A record is dropped when its collective completed
// (wait_for_unshard, reshard, finish_grad_sync, abort_grad_sync); the
// destructor drops what is left without dereferencing any unit.
//
// [Note: Streams]
// All streams and events live here. On devices with events (CUDA) each
// collective is issued on its own stream after that stream waited on an event
// recorded on the compute stream (so it sees every write queued before it, and
// memory freed by earlier compute can be reused safely); the consumer stream
// then waits on an event recorded after the collective. Buffers that cross
// streams are held in pending records until their consumer has waited, then
// dropped: no record_stream, so memory stays deterministic. On the CPU there
// are no events and one stream: a collective runs on the process group's own
// thread (gloo), overlapping the host's compute, and the consumer waits on the
// collective's work object instead of an event.
//
// Assumptions: forward and backward run on one current stream (a user side
// stream around a unit breaks the ordering above), and ProcessGroupNCCL calls
// recordStream on collective tensors itself unless the environment sets
// TORCH_NCCL_AVOID_RECORD_STREAMS=1; set it for memory that frees exactly
// when flatshard drops a buffer.
//
// [Note: Reductions in flight]
// A reduction holds the unit's unsharded flat gradient (its input) until it
// completes. Keeping them all until the end of backward would hold a whole
// unsharded model gradient, so at most one reduction is in flight per stage:
// issuing the next unit's reduce-scatter first completes the previous one
// (divide, accumulate into `.grad`, drop the input), and likewise for the
// replica all-reduces of hybrid sharding. Unit i's reduction still overlaps
// unit i-1's backward compute. Reductions found complete earlier (unshard()
// checks, without blocking) are completed then. fully_shard's
// set_reduce_scatter_max_input_buffers(N) lets N reduce-scatters be in flight
// (`max_reductions_in_flight`): a unit's backward then waits for the one N
// units back, not for the previous one, when the reduce-scatters are slower
// than the backward compute meant to hide them, at the cost of N inputs held.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "flatshard/collectives.h"
#include "flatshard/flat_param.h"
#include "flatshard/rate_limiter.h"

namespace flatshard {

class Scheduler {
 public:
  // shard: the group the root's units are sharded over. replicate: for hybrid
  // sharding, the group the gradient shards are all-reduced over (nullopt
  // otherwise). These are group pair 0; units sharded over other groups (e.g.
  // mixture-of-experts layers over an expert group) get theirs from add_groups.
  // max_in_flight_all_gathers: 0 for unbounded (limit_all_gathers=False).
  Scheduler(Collectives shard, std::optional<Collectives> replicate, c10::Device device,
            std::int64_t max_in_flight_all_gathers);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  std::int64_t rank() const { return groups_.front().shard.rank(); }
  std::int64_t world_size() const { return groups_.front().shard.size(); }
  // [Note: Groups per unit]
  // Every unit's collectives run over its own group pair (FlatParamHandle::group_index),
  // still from this one scheduler, in one program order: ranks that share a group
  // issue its collectives in the same order because they run the same units in
  // the same order. Returns the new pair's index.
  std::int64_t add_groups(Collectives shard, std::optional<Collectives> replicate);
  // fully_shard's set_separate_reduce_scatter_group: pair `index` reduce-scatters over `group` (a group of
  // the same ranks as its shard group, so that reduce-scatters and all-gathers can progress at once on
  // backends that run one collective at a time per group, NCCL's); nullopt: over the shard group again.
  void set_reduce_scatter_group(std::int64_t index, std::optional<Collectives> group);
  const c10::Device& device() const { return device_; }
  bool has_events() const { return has_events_; }

  // Issues the all-gather of `unit`'s shards into its unsharded buffer. A no-op
  // unless the unit is sharded (safe to call twice, e.g. prefetch then
  // pre-forward); a replicated unit (shard factor 1) just becomes unsharded.
  // May block in the rate limiter (see [Note: Rate limiter]).
  void unshard(FlatParamHandle& unit);
  // [Note: Small units gathered together]
  // Every collective costs the backend's latency however few bytes it moves (on gloo between two processes here,
  // about 0.5 ms), so a model of many small units spends its step waiting on latencies: each unit is all-gathered
  // in forward and again in backward. Where a unit's all-gather is prefetched, the units that will run after it
  // (in the learned forward order, or the backward's) can come along: unshard_together gathers `units[0]` and
  // the run of units after it that are sharded, alike (the same group pair and all-gather dtype, not replicated,
  // not holding a post-forward shard) and small (their unsharded bytes together at most coalesce_bytes()), in one
  // collective, each into its own unsharded buffer. Nothing else changes: each unit is waited for, copied out,
  // resharded and reduced as alone, and its buffer is only allocated earlier, by up to coalesce_bytes() in all.
  // The rate limiter counts the group as one all-gather (one fence: the collective's completion on the CPU,
  // the reshard of the group's last unit on devices with events). Ranks choose the same groups as long as they pass
  // the same candidates (the front-end's part: see [Note: The orders hold units that gather] in
  // python/flatshard/_prefetch.py) and their states and sizes are the same. A no-op unless `units[0]` is sharded
  // (a prefetch of a unit whose gather is in flight); with coalesce_bytes() == 0 (the default) or no second unit to
  // take, unshard(units[0]).
  // Returns how many units, from `units[0]` on, it gathered (0, 1 or more). The front-end chooses the candidates
  // and the bytes (python/flatshard/_prefetch.py's _gather_group).
  std::int64_t unshard_together(const std::vector<FlatParamHandle*>& units);
  void set_coalesce_bytes(std::int64_t bytes);
  std::int64_t coalesce_bytes() const { return coalesce_bytes_; }
  // Makes the unsharded buffer usable on the current stream: blocks the host
  // until the all-gather completes (CPU), or makes the current stream wait
  // (devices with events). Issues the all-gather first if it was not. Safe to
  // call twice.
  void wait_for_unshard(FlatParamHandle& unit);
  // Frees the unsharded buffer. If an all-gather into it is still in flight,
  // blocks until it completes first. Safe to call twice. With `after_forward`
  // (the reshard that ends a forward), a unit with a post-forward group keeps
  // its chunk for that group first; any other reshard drops it (see [Note:
  // Reshard to a smaller group] in flat_param.h).
  void reshard(FlatParamHandle& unit, bool after_forward = false);
  // Takes the unit's unsharded flat gradient (FlatParamHandle::accumulate_grad) and
  // issues its reduction: reduce-scatter over the shard group (all-reduce if
  // the unit is replicated), then, with `all_reduce_replicas`, all-reduce of
  // the shard over the replicate group. The gradient is divided by
  // `predivide` before the SUM and by `postdivide` after it (torch FSDP1's
  // factors, see [Note: Mixed precision and offload]), then accumulated into
  // the local shard's `.grad`. See [Note: Reductions in flight]: first
  // completes the oldest reductions until fewer than
  // max_reductions_in_flight() are pending, which may block.
  // The divide factors and the replica all-reduce are the unit's own
  // (FlatParamOptions).
  // Where the reduce-scatters of small units can go together exactly (Collectives::reduce_scatters_together_exactly)
  // and coalesce_bytes() > 0, a small unit's reduce-scatter waits for the next ones' instead, and they go in one
  // exchange once their gradients come to coalesce_bytes(), at a unit that cannot join them, or at
  // finish_grad_sync (see [Note: Small units reduced together]).
  void reduce_grad(FlatParamHandle& unit);
  // A unit's post-backward in one call: with `reshard_unit`, reshards it
  // first; accumulates `grads` (one per original parameter, undefined for
  // none) into its unsharded flat gradient; with `uses_done` (no use of the
  // unit is left in this backward), ends this backward's sum; with `reduce`
  // (implies `uses_done`), issues its reduction (reduce_grad), after
  // completing the previous one (the oldest ones beyond
  // max_reductions_in_flight() - 1), so that the parameters and that
  // reduction's buffers are gone before new ones are allocated. May block on
  // that reduction. `reshard_unit` is `uses_done` unless the unit keeps its
  // parameters after backward (fully_shard's set_reshard_after_backward).
  void post_backward(FlatParamHandle& unit, const std::vector<at::Tensor>& grads, bool reduce, bool uses_done,
                     bool reshard_unit);
  // The whole flat parameter in the shard's own (full) precision on the
  // compute device, for summon_full_params and state dicts of units that
  // compute in another dtype or keep their shard on the host: a fresh tensor,
  // all-gathered (copied when replicated) on the current stream, counted by
  // MemoryCounter until freed. Collective for sharded units; blocks the host
  // until done on the CPU.
  at::Tensor gather_full_precision(FlatParamHandle& unit);
  // A gradient shard reduced outside the scheduler (a communication hook, on
  // the current stream) into the unit's `.grad`, as the scheduler's own
  // reductions are (cast, keep_low_precision_grads, offload).
  void accumulate_reduced_grad(FlatParamHandle& unit, const at::Tensor& grad_shard);
  // Waits for every pending reduction and writes the gradient shards (to the
  // host for offloaded units, waiting for those copies). Blocks.
  void finish_grad_sync();
  // finish_grad_sync for the reductions already issued, in a post-backward (fully_shard's post-accumulate-grad
  // hooks): small units' reductions waiting to go together stay waiting, so that no rank's exchanges are grouped
  // otherwise than its peers' because of what runs on it alone. Blocks.
  void complete_issued_reductions();
  // Whether `unit`'s reduction waits to go together with the next units' (not issued yet).
  bool reduction_deferred(const FlatParamHandle& unit) const;
  // After a backward that raised: waits for every pending reduction (the
  // collectives were issued and must complete) and discards its result.
  // Blocks. `.grad` keeps what earlier completed reductions wrote.
  void abort_grad_sync();
  // At interpreter exit (see [Note: Exit] in python/flatshard/_exit.py):
  // waits, up to `timeout_seconds`, for every collective this scheduler has in
  // flight, without changing any state; returns whether they all completed and
  // whether there were any (as {completed, had_any}). Blocks; never throws for
  // a collective's failure (a failed one counts as completed).
  std::pair<bool, bool> drain(double timeout_seconds);
  // [Note: Collective sequence check]
  // FLATSHARD_RANK_GUARD=strict: before each collective, the ranks of its group
  // all-gather (hash of "op of unit 'name' (bytes)", the group's collective
  // count); if any differs they exchange the descriptions and every rank
  // throws c10::Error naming each rank's collective, instead of pairing
  // mismatched collectives (a hang, or gloo's SIGABRT on a size mismatch).
  // Catches what the per-phase guard cannot (a unit that runs on one rank
  // only). Costs one small blocking collective per collective (a device
  // synchronize on GPUs): for debugging. See [Note: Rank-divergence guard].
  // Limit: the check runs on the collective's own group (a reduce-scatter over
  // a separate group's: on its shard group, the same ranks), so ranks that skip
  // a unit over a subgroup (experts) while their peers run it can block in
  // checks on different groups until the groups' timeouts; the error then
  // names the unit and the check.
  void set_sequence_check(bool on) { sequence_check_ = on; }
  // How many shard-group reductions may be in flight (see [Note: Reductions in flight]); >= 1, else
  // c10::Error. Default 1.
  void set_max_reductions_in_flight(std::int64_t n);
  std::int64_t max_reductions_in_flight() const { return max_reductions_in_flight_; }
  std::int64_t pending_reductions() const {
    return static_cast<std::int64_t>(reductions_.size() + replica_reductions_.size());
  }
  std::int64_t pending_all_gathers() const { return static_cast<std::int64_t>(all_gathers_.size()); }
  const RateLimiter& limiter() const { return limiter_; }

 private:
  struct PendingReduction {
    FlatParamHandle* unit;
    at::Tensor flat_grad;   // reduction input, held until the reduction completed
    at::Tensor grad_shard;  // reduction output
    CommWork shard_work;    // reduce-scatter (or all-reduce) over the shard group
    CommWork replica_work;  // all-reduce over the replicate group
    bool prefix_only = false;  // flat_grad is the trainable prefix, all-reduced (see [Note: Trainable prefix])
    // Reduced in the same collective (see [Note: Small units reduced together]): each unit and its gradient shard.
    std::vector<std::pair<FlatParamHandle*, at::Tensor>> together;
  };
  // [Note: Small units reduced together]
  // The reduce-scatter's half of [Note: Small units gathered together]: a unit's reduction that could join others
  // (coalesce_bytes() > 0; no replica all-reduce, all-reduce hook or trainable prefix; sharded; its gradient at most
  // coalesce_bytes(); a group whose reduce-scatters go together exactly) is deferred, its unsharded gradient held,
  // and the deferred ones of one group pair and dtype go in one collective when they reach coalesce_bytes() or
  // kMaxReducedTogether units, before any reduction that cannot join them (so every rank issues the same
  // collectives in the same order), and at finish_grad_sync. Each unit's gradient shard is what its own
  // reduce-scatter would have made; it reaches `.grad` as one would, when the collective is completed. The record
  // in flight is one, for the group: the first unit's, with the others in `together`.
  static constexpr std::size_t kMaxReducedTogether = 16;
  struct DeferredReduction {
    FlatParamHandle* unit;
    at::Tensor flat_grad;
  };
  std::vector<DeferredReduction> deferred_;
  std::int64_t deferred_bytes_ = 0;
  bool can_defer_reduction(FlatParamHandle& unit, const at::Tensor& flat_grad);
  void reduce_deferred();
  void issue_reduction(FlatParamHandle& unit, at::Tensor flat_grad);

  // Completes, without blocking, the reductions whose collectives are done, so
  // their buffers go as early as the host notices (on gloo the input is gone
  // already: [Note: gloo's temporaries]). Called from unshard(). Issues no
  // collective: a reduction that still needs its replica all-reduce waits for
  // the next fixed point (post_backward, reduce_grad, finish_grad_sync).
  void reap_completed_reductions();
  // Shard-group reduction done: divide, or hand over to the replica all-reduce.
  void complete_shard_reduction();
  // The oldest replica all-reduce done: finish_reduction.
  void complete_replica_reduction();
  // A reduction's last stage done: the all-reduce hook, the post-divide, accumulate into `.grad`. One that
  // needs no replica all-reduce is finished as its shard-group stage completes, not queued behind another
  // unit's replica all-reduce (a unit over other groups beside HSDP ones would wait for it, and wait to be
  // finished until the next reduction).
  void finish_reduction(PendingReduction record);
  // Makes `waiter` wait for everything queued so far on `signaller`.
  void stream_wait(const c10::Stream& waiter, const c10::Stream& signaller);
  c10::Stream current_stream() const;

  struct GroupPair {
    Collectives shard;
    std::optional<Collectives> replicate;
    std::optional<Collectives> reduce_scatter;  // see set_reduce_scatter_group; nullopt: `shard`
    Collectives& scatter() { return reduce_scatter.has_value() ? *reduce_scatter : shard; }
  };
  GroupPair& groups_of(const FlatParamHandle& unit);
  GroupPair& group_pair(const FlatParamHandle& unit, std::int64_t index);
  std::vector<GroupPair> groups_;  // see [Note: Groups per unit]
  c10::Device device_;
  bool has_events_;
  // See [Note: Streams]. On the CPU all of them are the one CPU stream.
  c10::Stream all_gather_stream_;      // lets the next unit's all-gather overlap this unit's compute
  c10::Stream reduce_scatter_stream_;  // lets gradient reduction overlap earlier layers' backward
  c10::Stream all_reduce_stream_;      // lets the replica all-reduce overlap the next reduce-scatter
  RateLimiter limiter_;
  // Shared so that the limiter's fences can watch them weakly.
  std::unordered_map<const FlatParamHandle*, std::shared_ptr<CommWork>> all_gathers_;
  // See [Note: Small units gathered together]: a gathered group's units not yet resharded (devices with events:
  // the group's free fence is recorded at the last one's reshard), shared by the group's units.
  std::unordered_map<const FlatParamHandle*, std::shared_ptr<std::int64_t>> gathered_together_;
  bool joins_group(const FlatParamHandle& unit, const FlatParamHandle& first) const;
  // The rate limiter's wait before an all-gather (see [Note: Rate limiter]).
  void make_room_for_all_gather();
  // `units` unsharding by `work` (one collective): its free fence, their pending records and states.
  void track_all_gather(const std::vector<FlatParamHandle*>& units, std::shared_ptr<CommWork> work);
  std::int64_t coalesce_bytes_ = 0;
  // Completes the oldest shard-group reductions until fewer than max_reductions_in_flight_ are pending.
  void make_room_for_reduction();
  std::int64_t max_reductions_in_flight_ = 1;
  std::deque<PendingReduction> reductions_;          // shard-group stage, at most max_reductions_in_flight_
  std::deque<PendingReduction> replica_reductions_;  // replicate-group stage, at most one
  // Offloaded units whose reduced gradient waits for the end of backward to reach the host.
  std::unordered_set<FlatParamHandle*> offloaded_;
  // See [Note: Collective sequence check]; counts per process group.
  void check_sequence(Collectives& group, const FlatParamHandle& unit, const char* op, std::size_t bytes);
  bool sequence_check_ = false;
  std::unordered_map<const void*, std::int64_t> sequence_;
};

}  // namespace flatshard
