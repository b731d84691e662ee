#include "flatshard/rate_limiter.h"

#include <stdexcept>
#include <string>

namespace flatshard {

RateLimiter::RateLimiter(std::int64_t max_in_flight) : max_in_flight_(max_in_flight) {
  if (max_in_flight < 0) {
    throw std::invalid_argument("RateLimiter: expected max_in_flight >= 0 but got " +
                                std::to_string(max_in_flight));
  }
}

void RateLimiter::drop_completed() {
  while (!fences_.empty() && fences_.front()->is_completed()) fences_.pop_front();
}

bool RateLimiter::would_block() {
  if (max_in_flight_ == 0) return false;
  drop_completed();
  return pending() >= max_in_flight_;
}

std::int64_t RateLimiter::acquire() {
  if (max_in_flight_ == 0) return 0;
  std::int64_t waited = 0;
  drop_completed();
  while (pending() >= max_in_flight_) {
    fences_.front()->wait();
    fences_.pop_front();
    ++waited;
  }
  stalls_ += waited;
  return waited;
}

void RateLimiter::record_free(std::unique_ptr<Fence> fence) {
  if (max_in_flight_ == 0 || fence == nullptr) return;
  fences_.push_back(std::move(fence));
}

}  // namespace flatshard
