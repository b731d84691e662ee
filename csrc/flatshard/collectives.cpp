#include "flatshard/collectives.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/version.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <sstream>
#include <mutex>
#include <optional>

// [Note: c10d's names for the single-tensor collectives]
// torch 2.13 renamed ProcessGroup::_allgather_base and _reduce_scatter_base to
// all_gather_single and reduce_scatter_single (torchcomms' names) and marked the
// old ones deprecated: they remain as aliases that call the new ones, and a
// build that uses them warns. torch 2.11 (the GPU machine's) has only the old
// names. So the name is chosen here, once, from the version of the torch being
// compiled against; the two call the same c10d op (_allgather_base_,
// _reduce_scatter_base_), so behaviour is the same either way.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define FLATSHARD_C10D_SINGLE_NAMES 1
#else
#define FLATSHARD_C10D_SINGLE_NAMES 0
#endif

namespace flatshard {

namespace {

// See [Note: Collective byte counters].
struct GroupCounters {
  std::array<std::atomic<std::int64_t>, kCollectiveKinds> calls{};
  std::array<std::atomic<std::int64_t>, kCollectiveKinds> bytes{};
};

std::mutex& counters_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Never freed: a group's counters outlive its Collectives (and are found again by name).
std::map<std::string, std::shared_ptr<GroupCounters>>& counters_by_group() {
  static auto* registry = new std::map<std::string, std::shared_ptr<GroupCounters>>();
  return *registry;
}

// The group's name; a group without one (torch's threaded test groups, whose getGroupName throws) by its address.
std::string group_key(const c10d::ProcessGroup& group) {
  try {
    std::string name = group.getGroupName();
    if (!name.empty()) return name;
  } catch (const c10::Error&) {
  }
  std::ostringstream key;
  key << "unnamed@" << static_cast<const void*>(&group);
  return key.str();
}

std::shared_ptr<GroupCounters> counters_of(const c10d::ProcessGroup& group) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  std::shared_ptr<GroupCounters>& counters = counters_by_group()[group_key(group)];
  if (!counters) counters = std::make_shared<GroupCounters>();
  return counters;
}

}  // namespace

std::vector<std::pair<std::string, std::vector<CollectiveCount>>> collective_counts() {
  std::lock_guard<std::mutex> lock(counters_mutex());
  std::vector<std::pair<std::string, std::vector<CollectiveCount>>> out;
  for (const auto& [name, counters] : counters_by_group()) {
    std::vector<CollectiveCount> kinds(kCollectiveKinds);
    for (int k = 0; k < kCollectiveKinds; ++k) {
      kinds[k].calls = counters->calls[k].load(std::memory_order_relaxed);
      kinds[k].bytes = counters->bytes[k].load(std::memory_order_relaxed);
    }
    out.emplace_back(name, std::move(kinds));
  }
  return out;
}

void reset_collective_counts() {
  std::lock_guard<std::mutex> lock(counters_mutex());
  for (auto& [name, counters] : counters_by_group()) {
    for (int k = 0; k < kCollectiveKinds; ++k) {
      counters->calls[k].store(0, std::memory_order_relaxed);
      counters->bytes[k].store(0, std::memory_order_relaxed);
    }
  }
}

struct Collectives::Impl {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::optional<bool> cpu_backend_is_gloo;  // looked up on first use
  std::optional<bool> without_backends;     // see [Note: A group without c10d backends]
  std::shared_ptr<GroupCounters> counters;  // see [Note: Collective byte counters]

  void count(CollectiveKind kind, const at::Tensor& input) const {
    const int k = static_cast<int>(kind);
    counters->calls[k].fetch_add(1, std::memory_order_relaxed);
    counters->bytes[k].fetch_add(static_cast<std::int64_t>(input.nbytes()), std::memory_order_relaxed);
  }
};

// [Note: gloo's temporaries]
// gloo runs each collective on a worker thread of its own, with temporaries
// that live as long as the work object: a flat copy of an all-gather's
// output, and for reduce-scatter (an all-reduce of a clone of the input, this
// rank's chunk copied out when the host waits) the clone. Holding the work
// until the host next waits would keep them over the whole unit of compute
// the collective overlaps, and on the host side nothing runs between a
// unit's pre-backward and post-backward. So on gloo (more than two ranks; two exchange halves, see
// [Note: Two gloo ranks exchange halves]):
// - all-gather and all-reduce are tracked through their future only: once
//   gloo's worker finishes, it drops the last reference to the work, and the
//   temporaries go at once. The future completes after the result is written
//   and carries the collective's error.
// - reduce-scatter is an all-reduce in place of the input (what gloo does on
//   a clone) whose completion callback, on gloo's thread, copies this rank's
//   chunk into the output and drops the input; a failed all-reduce fails the
//   returned work instead. The caller need not keep the input
//   (holds_reduce_scatter_input). Should the input still have a Python object,
//   dropping it there takes the GIL: every scheduler binding releases it.
// Other backends (NCCL) keep the work: its wait() orders streams.
//
// [Note: Two gloo ranks exchange halves]
// Between two ranks an all-gather and a reduce-scatter are each one exchange: a rank sends the
// half the other one needs (its shard; the other rank's half of its gradient) and keeps its own
// (copies its shard into its rows; adds its half of the gradient to what it received). gloo's
// all-to-all does it in one round without temporaries, measured here on 300 floats at 0.4 ms,
// against 0.8 ms for gloo's all-gather (which gathers into a flat copy first) and 2.3 ms for its
// all-reduce (a ring of two rounds through a scratch buffer; gloo's own reduce-scatter, 1.8 ms,
// is an all-reduce of a clone). The received half lands in the output; the own half is copied or
// added in the completion callback, on gloo's thread. A sum of two is the same number whichever
// comes first (IEEE addition commutes; in bf16 and fp16 both round the same float sum), so the
// reduction is bit-equal to the all-reduce's, and to torch FSDP1's and FSDP2's on gloo. At more
// ranks the order of the additions shows in the last bit, and torch's order is gloo's ring's,
// so the all-reduce stays; so does gloo's all-gather (an all-to-all would need the shard sent
// from a copy per rank).
namespace {

CommWork track_work(c10::intrusive_ptr<c10d::Work> work) {
  return CommWork([work]() { work->wait(); }, [work]() { return work->isCompleted(); });
}

// A waiter's wake-up on a future's completion: the callback is added once, at the first wait that
// would block (i.e. only for the stall hook's slices, see [Note: The stall hook] in collectives.h), and serves every
// later slice of the same wait.
struct CompletionSignal {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  bool armed = false;
};

// Waits for `future` at most `seconds`.
bool wait_future_for(const c10::intrusive_ptr<c10::ivalue::Future>& future,
                     const std::shared_ptr<CompletionSignal>& signal, double seconds) {
  if (future->completed()) return true;
  bool arm = false;
  {
    std::lock_guard<std::mutex> lock(signal->mutex);
    arm = !signal->armed;
    signal->armed = true;
  }
  if (arm) {
    future->addCallback([signal](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> lock(signal->mutex);
        signal->done = true;
      }
      signal->cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(signal->mutex);
  return signal->cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return signal->done; });
}

CommWork track_future(c10::intrusive_ptr<c10::ivalue::Future> future) {
  auto signal = std::make_shared<CompletionSignal>();
  return CommWork([future]() { future->waitAndThrow(); }, [future]() { return future->completed(); },
                  [future, signal](double seconds) { return wait_future_for(future, signal, seconds); });
}

// See [Note: c10d's names for the single-tensor collectives].
c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input) {
#if FLATSHARD_C10D_SINGLE_NAMES
  return group.all_gather_single(output, input);
#else
  return group._allgather_base(output, input);
#endif
}

c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input,
                                                 std::vector<std::int64_t> output_splits,
                                                 std::vector<std::int64_t> input_splits) {
#if FLATSHARD_C10D_SINGLE_NAMES
  return group.all_to_all_single(output, input, output_splits, input_splits);
#else
  return group.alltoall_base(output, input, output_splits, input_splits);
#endif
}

// See [Note: Two gloo ranks exchange halves]: `sent` to the peer, the peer's half into `received`; then `finish`
// (the own half copied or added), on gloo's thread once the exchange completed. `finish` holds what it needs (the
// input among it) until then, and lets go of it when it returns, or when the exchange failed, whose error the
// returned work carries.
CommWork exchange_with_peer(c10d::ProcessGroup& group, std::int64_t me, at::Tensor received, at::Tensor sent,
                            std::function<void()> finish) {
  const std::int64_t n = sent.numel();
  std::vector<std::int64_t> splits{me == 0 ? 0 : n, me == 0 ? n : 0};
  auto future = all_to_all_single(group, received, sent, splits, splits)->getFuture();
  auto pending = std::make_shared<std::function<void()>>(std::move(finish));
  return track_future(future->then(
      [pending](c10::ivalue::Future& exchange) {
        std::function<void()> finish = std::move(*pending);
        if (exchange.hasError()) std::rethrow_exception(exchange.exception_ptr());
        finish();
        return c10::IValue();
      },
      c10::NoneType::get()));
}

c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                     at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
#if FLATSHARD_C10D_SINGLE_NAMES
  return group.reduce_scatter_single(output, input, opts);
#else
  return group._reduce_scatter_base(output, input, opts);
#endif
}

// [Note: A group without c10d backends]
// A process group written in Python (torch's threaded test group, ProcessLocalGroup, whose ranks
// are threads of one process) registers no c10d backend: ProcessGroup's single-tensor calls go
// through the c10d op, which asks for the backend of the tensor's device and fails ("No backend
// type associated with device type cpu"). Such a group overrides the virtual methods instead,
// which the Python trampoline forwards to its Python ones, and of the single-tensor collectives
// only the coalesced forms are virtual. So a group with no backend at all gets its all-gather and
// reduce-scatter as a coalesced call of one tensor; every other group takes the single-tensor path.
c10::intrusive_ptr<c10d::Work> all_gather_one_coalesced(c10d::ProcessGroup& group, at::Tensor& output,
                                                        at::Tensor& input) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
#if FLATSHARD_C10D_SINGLE_NAMES
  return group.all_gather_single_coalesced(outputs, inputs);
#else
  return group.allgather_into_tensor_coalesced(outputs, inputs);
#endif
}

c10::intrusive_ptr<c10d::Work> reduce_scatter_one_coalesced(c10d::ProcessGroup& group, at::Tensor& output,
                                                            at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
#if FLATSHARD_C10D_SINGLE_NAMES
  return group.reduce_scatter_single_coalesced(outputs, inputs, opts);
#else
  return group.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
#endif
}

}  // namespace

namespace {
struct StallWatch {
  std::mutex mutex;
  StallHook hook;
  double first_seconds = 0;
  double every_seconds = 0;
};
StallWatch& stall_watch() {
  static StallWatch* watch = new StallWatch();  // (never destroyed: waits may run during interpreter exit)
  return *watch;
}
}  // namespace

namespace {
void throw_verdict(const StallVerdict& verdict) {
  if (verdict.message.empty()) return;
  if (verdict.peer_gone) throw PeerGone(verdict.message);
  throw RankDivergence(verdict.message);
}
}  // namespace

void set_stall_hook(StallHook hook, double first_seconds, double every_seconds) {
  TORCH_CHECK(!hook || (first_seconds > 0 && every_seconds > 0), "flatshard: the stall hook's intervals must be "
              "positive but got ", first_seconds, " and ", every_seconds);
  StallWatch& watch = stall_watch();
  std::lock_guard<std::mutex> lock(watch.mutex);
  watch.hook = std::move(hook);
  watch.first_seconds = first_seconds;
  watch.every_seconds = every_seconds;
}

void CommWork::wait(const std::string& what) {
  if (!wait_ || waited_) return;
  if (wait_seconds_) {  // see [Note: The stall hook] in collectives.h
    StallHook hook;
    double first = 0, every = 0;
    {
      StallWatch& watch = stall_watch();
      std::lock_guard<std::mutex> lock(watch.mutex);
      hook = watch.hook;
      first = watch.first_seconds;
      every = watch.every_seconds;
    }
    double waited = 0;
    if (hook && !wait_seconds_(first)) {
      waited = first;
      for (;;) {
        throw_verdict(hook(what, waited, ""));
        if (wait_seconds_(every)) break;
        waited += every;
      }
    }
    if (hook) {
      try {
        wait_();
      } catch (const std::exception& e) {
        throw_verdict(hook(what, waited, e.what()));
        throw;
      }
      waited_ = true;
      return;
    }
  }
  wait_();
  waited_ = true;
}

Collectives::Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : impl_(std::make_unique<Impl>(Impl{std::move(group), std::nullopt, std::nullopt, nullptr})) {
  TORCH_CHECK(impl_->group, "flatshard: expected a process group but got None");
  impl_->counters = counters_of(*impl_->group);
}
Collectives::~Collectives() = default;
Collectives::Collectives(Collectives&&) noexcept = default;
Collectives& Collectives::operator=(Collectives&&) noexcept = default;

std::int64_t Collectives::rank() const { return impl_->group->getRank(); }
std::int64_t Collectives::size() const { return impl_->group->getSize(); }
const c10::intrusive_ptr<c10d::ProcessGroup>& Collectives::group() const { return impl_->group; }

bool Collectives::is_cpu_gloo(const c10::Device& device) const {
  if (device.type() != c10::DeviceType::CPU) return false;
  if (!impl_->cpu_backend_is_gloo.has_value()) {
    bool gloo = false;
    for (const c10::Device& d : impl_->group->getDeviceTypes()) {
      if (d.type() == c10::DeviceType::CPU) {
        gloo = impl_->group->getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
      }
    }
    impl_->cpu_backend_is_gloo = gloo;
  }
  return *impl_->cpu_backend_is_gloo;
}

bool Collectives::without_backends() const {
  if (!impl_->without_backends.has_value()) impl_->without_backends = impl_->group->getDeviceTypes().empty();
  return *impl_->without_backends;
}

bool Collectives::holds_reduce_scatter_input(const c10::Device& device) const { return is_cpu_gloo(device); }

CommWork Collectives::all_gather(at::Tensor& output, at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(output.numel() == input.numel() * size());
  impl_->count(CollectiveKind::kAllGather, input);
  if (without_backends()) return track_work(all_gather_one_coalesced(*impl_->group, output, input));
  if (is_cpu_gloo(output.device()) && size() == 2) {  // see [Note: Two gloo ranks exchange halves]
    const std::int64_t me = rank();
    at::Tensor rows = output.view({2, input.numel()});
    at::Tensor sent = input.view(-1);
    return exchange_with_peer(*impl_->group, me, rows.select(0, 1 - me), sent,
                              [mine = rows.select(0, me), sent] { mine.copy_(sent); });
  }
  auto work = all_gather_single(*impl_->group, output, input);
  return is_cpu_gloo(output.device()) ? track_future(work->getFuture()) : track_work(std::move(work));
}

CommWork Collectives::all_gather_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs) {
  TORCH_INTERNAL_ASSERT(!inputs.empty() && outputs.size() == inputs.size());
  if (inputs.size() == 1) return all_gather(outputs.front(), inputs.front());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    TORCH_INTERNAL_ASSERT(outputs[i].numel() == inputs[i].numel() * size() &&
                          inputs[i].scalar_type() == inputs.front().scalar_type());
    impl_->count(CollectiveKind::kAllGather, inputs[i]);
  }
  if (is_cpu_gloo(outputs.front().device()) && size() == 2) {  // see [Note: Two gloo ranks exchange halves]
    // One exchange of the shards end to end; each unit's rows filled from it once it completed.
    std::vector<at::Tensor> flat;
    flat.reserve(inputs.size());
    for (const at::Tensor& input : inputs) flat.push_back(input.view(-1));
    at::Tensor sent = at::cat(flat);
    at::Tensor received = at::empty_like(sent);
    const std::int64_t me = rank();
    return exchange_with_peer(*impl_->group, me, received, sent, [outputs, flat = std::move(flat), received, me] {
      std::int64_t offset = 0;
      for (std::size_t i = 0; i < flat.size(); ++i) {
        const std::int64_t n = flat[i].numel();
        at::Tensor rows = outputs[i].view({2, n});
        rows.select(0, me).copy_(flat[i]);
        rows.select(0, 1 - me).copy_(received.narrow(0, offset, n));
        offset += n;
      }
    });
  }
#if FLATSHARD_C10D_SINGLE_NAMES
  auto work = impl_->group->all_gather_single_coalesced(outputs, inputs);
#else
  auto work = impl_->group->allgather_into_tensor_coalesced(outputs, inputs);
#endif
  return is_cpu_gloo(outputs.front().device()) ? track_future(work->getFuture()) : track_work(std::move(work));
}

CommWork Collectives::reduce_scatter_sum(at::Tensor& output, at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(input.numel() == output.numel() * size());
  impl_->count(CollectiveKind::kReduceScatter, input);
  if (is_cpu_gloo(output.device()) && size() == 2) {  // see [Note: Two gloo ranks exchange halves]
    const std::int64_t me = rank();
    at::Tensor rows = input.view({2, output.numel()});
    at::Tensor received = output.view(-1);
    return exchange_with_peer(*impl_->group, me, received, rows.select(0, 1 - me),
                              [received, mine = rows.select(0, me)] { received.add_(mine); });
  }
  if (is_cpu_gloo(output.device())) {
    // See [Note: gloo's temporaries].
    std::vector<at::Tensor> tensors{input};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    auto future = impl_->group->allreduce(tensors, opts)->getFuture();
    // Mutable through the pointer: the callback is called as const.
    auto chunk = std::make_shared<at::Tensor>(input.view({size(), output.numel()}).select(0, rank()));
    auto done = future->then(
        [chunk, output](c10::ivalue::Future& all_reduce) {
          at::Tensor input = std::move(*chunk);  // goes when this returns, on gloo's thread
          // then() calls back on failure too: pass the error on, never a half-reduced chunk.
          if (all_reduce.hasError()) std::rethrow_exception(all_reduce.exception_ptr());
          output.view(-1).copy_(input);
          return c10::IValue();
        },
        c10::NoneType::get());
    return track_future(std::move(done));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  if (without_backends()) return track_work(reduce_scatter_one_coalesced(*impl_->group, output, input, opts));
  return track_work(reduce_scatter_single(*impl_->group, output, input, opts));
}

bool Collectives::reduce_scatters_together_exactly(const c10::Device& device) const {
  return is_cpu_gloo(device) && size() == 2;
}

CommWork Collectives::reduce_scatter_sum_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs) {
  TORCH_INTERNAL_ASSERT(!inputs.empty() && outputs.size() == inputs.size() &&
                        reduce_scatters_together_exactly(outputs.front().device()));
  if (inputs.size() == 1) return reduce_scatter_sum(outputs.front(), inputs.front());
  // See [Note: Two gloo ranks exchange halves]: the peer's halves of every gradient end to end in one exchange;
  // each output is then what reduce_scatter_sum makes of its pair alone (the peer's half, plus this rank's).
  const std::int64_t me = rank();
  std::vector<at::Tensor> theirs, mine;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    TORCH_INTERNAL_ASSERT(inputs[i].numel() == outputs[i].numel() * 2 &&
                          inputs[i].scalar_type() == inputs.front().scalar_type());
    impl_->count(CollectiveKind::kReduceScatter, inputs[i]);
    at::Tensor rows = inputs[i].view({2, outputs[i].numel()});
    theirs.push_back(rows.select(0, 1 - me));
    mine.push_back(rows.select(0, me));
  }
  at::Tensor sent = at::cat(theirs);
  at::Tensor received = at::empty_like(sent);
  return exchange_with_peer(*impl_->group, me, received, sent, [outputs, mine = std::move(mine), received] {
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const std::int64_t n = mine[i].numel();
      at::Tensor out = outputs[i].view(-1);
      out.copy_(received.narrow(0, offset, n));
      out.add_(mine[i]);
      offset += n;
    }
  });
}

CommWork Collectives::all_reduce_sum(at::Tensor& tensor) {
  impl_->count(CollectiveKind::kAllReduce, tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  auto work = impl_->group->allreduce(tensors, opts);
  return is_cpu_gloo(tensor.device()) ? track_future(work->getFuture()) : track_work(std::move(work));
}

}  // namespace flatshard
