#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "flatshard/rate_limiter.h"

using flatshard::Fence;
using flatshard::RateLimiter;

namespace {

// A fence completed by hand; records the order in which the limiter waited.
struct FakeFence final : Fence {
  FakeFence(int id, bool* done, std::vector<int>* waits) : id(id), done(done), waits(waits) {}
  bool is_completed() const override { return *done; }
  void wait() override {
    waits->push_back(id);
    *done = true;
  }
  int id;
  bool* done;
  std::vector<int>* waits;
};

}  // namespace

TEST(RateLimiter, UnboundedNeverWaits) {
  RateLimiter limiter(0);
  bool done = false;
  std::vector<int> waits;
  for (int i = 0; i < 10; ++i) limiter.record_free(std::make_unique<FakeFence>(i, &done, &waits));
  EXPECT_FALSE(limiter.would_block());
  EXPECT_EQ(limiter.acquire(), 0);
  EXPECT_TRUE(waits.empty());
}

TEST(RateLimiter, WaitsOnOldestFenceFirst) {
  RateLimiter limiter(2);
  bool done[4] = {false, false, false, false};
  std::vector<int> waits;
  EXPECT_EQ(limiter.acquire(), 0);
  limiter.record_free(std::make_unique<FakeFence>(0, &done[0], &waits));
  EXPECT_EQ(limiter.acquire(), 0);  // one pending < 2
  limiter.record_free(std::make_unique<FakeFence>(1, &done[1], &waits));
  EXPECT_TRUE(limiter.would_block());
  EXPECT_EQ(limiter.acquire(), 1);  // two pending: waits on the oldest
  EXPECT_EQ(waits, (std::vector<int>{0}));
  EXPECT_EQ(limiter.pending(), 1);
  limiter.record_free(std::make_unique<FakeFence>(2, &done[2], &waits));
  EXPECT_EQ(limiter.acquire(), 1);
  EXPECT_EQ(waits, (std::vector<int>{0, 1}));
  EXPECT_EQ(limiter.stalls(), 2);
}

TEST(RateLimiter, CompletedFencesCostNoStall) {
  RateLimiter limiter(1);
  bool done0 = false, done1 = false;
  std::vector<int> waits;
  limiter.record_free(std::make_unique<FakeFence>(0, &done0, &waits));
  done0 = true;  // the device got there on its own
  EXPECT_FALSE(limiter.would_block());
  EXPECT_EQ(limiter.acquire(), 0);
  limiter.record_free(std::make_unique<FakeFence>(1, &done1, &waits));
  EXPECT_EQ(limiter.acquire(), 1);
  EXPECT_EQ(waits, (std::vector<int>{1}));
}

TEST(RateLimiter, RejectsNegativeLimit) { EXPECT_THROW(RateLimiter(-1), std::invalid_argument); }
