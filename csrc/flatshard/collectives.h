#pragma once
// The one place that calls c10d. Everything else sees `Collectives` and
// `CommWork`, so c10d's heavy headers stay in collectives.cpp and the bindings.
//
// Contract: Collectives is movable, not copyable, not thread-safe; it shares
// ownership of the process group it was given (never creates one).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}

namespace flatshard {

// Ranks about to issue different collectives, or waiting in collectives their peers will never
// issue (the strict sequence check, [Note: Collective sequence check]; a stalled wait,
// [Note: Stalled waits]): Python sees flatshard.RankDivergenceError, as for the guard's own checks.
class RankDivergence : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A peer that is gone (its connection closed: its process ended) while this rank waited for it, named by the
// stall watch's roll call: Python sees flatshard.PeerGoneError, a RuntimeError that is not a
// RankDivergenceError, so that a loop catching divergences to skip a batch does not catch it.
class PeerGone : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Ctrl-C (KeyboardInterrupt) or sys.exit() raised in the stall hook while a wait stalls: the wait
// ends and Python sees that exception itself (the bindings translate it back), not a backend error.
class Interrupted : public std::exception {
 public:
  explicit Interrupted(bool exit) : exit_(exit) {}
  bool exit() const { return exit_; }
  const char* what() const noexcept override { return exit_ ? "SystemExit" : "KeyboardInterrupt"; }

 private:
  bool exit_;
};

// [Note: The stall hook] (what it is for: [Note: Stalled waits] in python/flatshard/_stall_watch.py)
// A host wait on a collective that has not completed after `first_seconds` calls the stall hook
// (set from Python: python/flatshard/_stall_watch.py), then again every `every_seconds`, with
// what is waited for ("the all-gather of unit 'blocks.3'") and for how long, and once more if the
// wait fails (with the error: a peer's connection closed, say). The hook publishes
// where this rank is and reads where its peers are; a non-empty answer is the verdict that the
// collective will never complete (a peer left the step, or waits in another model's step), thrown
// as RankDivergence, or that a peer is gone, thrown as PeerGone (for a failed wait: in place of the backend's error). No hook (the default), or a wait that completes within `first_seconds`,
// costs nothing more than a plain wait. Only waits that block the host (gloo's) can stall here.
// The hook's answer: empty, or the verdict and whether it is that a peer is gone (thrown as PeerGone).
struct StallVerdict {
  std::string message;
  bool peer_gone = false;
};
using StallHook =
    std::function<StallVerdict(const std::string& what, double waited_seconds, const std::string& error)>;
void set_stall_hook(StallHook hook, double first_seconds, double every_seconds);

// A collective in flight. wait() blocks the host until the result is usable
// on the current stream (gloo), or makes the current stream wait for it
// without blocking the host (NCCL). Safe to call twice; throws the
// collective's error (c10::Error, or the backend's) if it failed or timed out.
class CommWork {
 public:
  CommWork() = default;
  CommWork(std::function<void()> wait, std::function<bool()> is_completed,
           std::function<bool(double)> wait_seconds = {})
      : wait_(std::move(wait)), is_completed_(std::move(is_completed)), wait_seconds_(std::move(wait_seconds)) {}
  bool defined() const { return static_cast<bool>(wait_); }
  // `what`: what the wait is for, for the stall hook (see [Note: Stalled waits]).
  void wait(const std::string& what = "");
  bool is_completed() const { return !wait_ || waited_ || is_completed_(); }

 private:
  std::function<void()> wait_;
  std::function<bool()> is_completed_;
  std::function<bool(double)> wait_seconds_;  // waits at most that long; true once completed (host waits only)
  bool waited_ = false;
};

// [Note: Collective byte counters]
// Every collective the runtime issues adds the bytes of its input (an all-gather: this rank's
// shard; a reduce-scatter: the whole unsharded gradient; an all-reduce: the tensor) and one
// call to counters of its kind, per process group (by c10d's group name), so that what ran
// can be checked against what flatshard.plan predicts. One relaxed atomic add per call: the
// counters are found once, when the group's Collectives is made. Collectives issued from
// Python (state dicts, the rank guard) are not counted here.
enum class CollectiveKind : int { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2 };
constexpr int kCollectiveKinds = 3;

struct CollectiveCount {
  std::int64_t calls = 0;
  std::int64_t bytes = 0;
};

// group name -> counts per CollectiveKind, since the last reset.
std::vector<std::pair<std::string, std::vector<CollectiveCount>>> collective_counts();
void reset_collective_counts();

class Collectives {
 public:
  explicit Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~Collectives();
  Collectives(Collectives&&) noexcept;
  Collectives& operator=(Collectives&&) noexcept;

  std::int64_t rank() const;
  std::int64_t size() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const;

  // Every rank's `input` (same numel) into `output` (size() * input.numel()),
  // rank-major, on the current stream. Non-blocking.
  CommWork all_gather(at::Tensor& output, at::Tensor& input);
  // all_gather of every (outputs[i], inputs[i]) pair as one collective (see [Note: Small units gathered together]
  // in scheduler.h): one exchange on two gloo ranks, c10d's coalesced all-gather elsewhere (gloo: one
  // collective; NCCL: one group). Every input of one dtype. Counted as one all-gather per pair. Non-blocking.
  CommWork all_gather_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs);
  // SUM over ranks of `input` (size() * output.numel()), chunk r to rank r.
  // Non-blocking. Callers divide explicitly: gloo's AVG is not trustworthy here.
  CommWork reduce_scatter_sum(at::Tensor& output, at::Tensor& input);
  // Whether a reduce-scatter on `device` keeps what it needs of its input
  // alive by itself, so the caller may drop the input when
  // reduce_scatter_sum returns (gloo: see [Note: gloo's temporaries]). The
  // input's contents are undefined afterwards either way.
  bool holds_reduce_scatter_input(const c10::Device& device) const;
  // Whether reduce_scatter_sum_coalesced sums every element as reduce_scatter_sum of its pair alone would, bit for
  // bit, on `device`: two gloo ranks (one exchange; a sum of two is the same whichever comes first). Elsewhere a
  // reduction of the pairs end to end could add in another order (gloo's ring all-reduce splits the buffer by size),
  // so callers reduce them one by one there.
  bool reduce_scatters_together_exactly(const c10::Device& device) const;
  // reduce_scatter_sum of every (outputs[i], inputs[i]) pair in one exchange; only where
  // reduce_scatters_together_exactly. Counted as one reduce-scatter per pair. Non-blocking; the inputs need not be
  // kept (as holds_reduce_scatter_input).
  CommWork reduce_scatter_sum_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs);
  // SUM over ranks, in place. Non-blocking.
  CommWork all_reduce_sum(at::Tensor& tensor);

 private:
  bool is_cpu_gloo(const c10::Device& device) const;
  bool without_backends() const;  // see [Note: A group without c10d backends]

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flatshard
