#pragma once
// RateLimiter: bounds how far the host may run ahead issuing all-gathers.
//
// Contract: movable, not copyable, not thread-safe (driven by the thread that
// issues collectives). Torch-free, so it is unit-tested with fake fences.
//
// [Note: Rate limiter]
// A fast host could issue many all-gathers ahead of compute; each in-flight
// unsharded buffer is memory nobody else can use. The limiter keeps, in issue
// order, a "free fence" per buffer: on devices with events, an event recorded
// when the buffer is resharded (the caching allocator can hand the memory out
// again once the device passed it); on the CPU, the all-gather's completion
// (the buffer is busy while the process group's thread writes it). Before
// another all-gather is issued, while `max_in_flight` or more fences are
// pending, the host waits on the oldest one and drops it. With max_in_flight
// == 0 it never waits. A fence that is already complete costs only the check.

#include <cstdint>
#include <deque>
#include <memory>

namespace flatshard {

// Something the host can wait on. wait() blocks the calling thread.
class Fence {
 public:
  virtual ~Fence() = default;
  virtual bool is_completed() const = 0;
  virtual void wait() = 0;
};

class RateLimiter {
 public:
  // max_in_flight: 0 for unbounded, else >= 1. Throws std::invalid_argument if negative.
  explicit RateLimiter(std::int64_t max_in_flight);

  std::int64_t max_in_flight() const { return max_in_flight_; }
  // Fences recorded and not yet known complete.
  std::int64_t pending() const { return static_cast<std::int64_t>(fences_.size()); }
  // True when acquire() would block on a fence that is not complete yet.
  bool would_block();
  // Blocks until fewer than max_in_flight fences are pending, waiting on the
  // oldest ones first. Returns how many fences it had to wait on.
  std::int64_t acquire();
  // Records the free fence of one unsharded buffer.
  void record_free(std::unique_ptr<Fence> fence);
  // Total fences waited on (stalls) since construction.
  std::int64_t stalls() const { return stalls_; }

 private:
  void drop_completed();
  std::int64_t max_in_flight_;
  std::deque<std::unique_ptr<Fence>> fences_;
  std::int64_t stalls_ = 0;
};

}  // namespace flatshard
