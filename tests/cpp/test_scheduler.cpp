// Scheduler and FlatParamHandle logic over a real c10d ProcessGroup whose backend is
// `ThreadBackend`: ranks are threads of this process that meet at a barrier
// (torch's wheel ships no gloo headers to build a gloo group from C++). Calls
// go through the same c10d dispatch as gloo or NCCL.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "flatshard/collectives.h"
#include "flatshard/flat_param.h"
#include "flatshard/scheduler.h"

using flatshard::Collectives;
using flatshard::FlatParamHandle;
using flatshard::FlatParamLayout;
using flatshard::FlatParamOptions;
using flatshard::Scheduler;
using flatshard::ShardedState;

namespace {

// What the ranks of one group share: one input slot per rank and a barrier.
struct Rendezvous {
  explicit Rendezvous(int size) : size(size), inputs(size) {}
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex);
    const int gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
  int size;
  std::vector<at::Tensor> inputs;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  int generation = 0;
};

// Collectives complete before they return.
class DoneWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

class ThreadBackend : public c10d::Backend {
 public:
  ThreadBackend(int rank, std::shared_ptr<Rendezvous> rv) : Backend(rank, rv->size), rv_(std::move(rv)) {}
  const std::string getBackendName() const override { return "thread"; }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    exchange(in);
    out.copy_(at::cat(rv_->inputs));
    rv_->barrier();
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                 std::vector<at::Tensor>& ins,
                                                                 const c10d::AllgatherOptions& opts) override {
    ++coalesced_all_gathers;
    for (std::size_t i = 0; i < ins.size(); ++i) _allgather_base(outs[i], ins[i], opts);
    return c10::make_intrusive<DoneWork>();
  }
  int coalesced_all_gathers = 0;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& opts) override {
    EXPECT_EQ(opts.reduceOp, c10d::ReduceOp::SUM);
    exchange(in);
    at::Tensor sum = at::stack(rv_->inputs).sum(0);
    out.copy_(sum.chunk(rv_->size)[getRank()]);
    rv_->barrier();
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    EXPECT_EQ(opts.reduceOp, c10d::ReduceOp::SUM);
    exchange(tensors[0]);
    at::Tensor sum = at::stack(rv_->inputs).sum(0);
    rv_->barrier();
    tensors[0].copy_(sum);
    return c10::make_intrusive<DoneWork>();
  }

 private:
  void exchange(const at::Tensor& in) {
    rv_->inputs[getRank()] = in.clone();
    rv_->barrier();
  }
  std::shared_ptr<Rendezvous> rv_;
};

// Runs fn(rank, group) on `size` threads, each with its own ProcessGroup.
void run_ranks(int size, const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto rv = std::make_shared<Rendezvous>(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank]() {
      auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                        c10::make_intrusive<ThreadBackend>(rank, rv));
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
      fn(rank, group);
    });
  }
  for (auto& t : threads) t.join();
}

// Runs fn(rank, shard group, replicate group) on 4 threads as HSDP's 2x2 mesh: shard groups {0, 1} and {2, 3},
// replicate groups {0, 2} and {1, 3}; each group its own rendezvous.
void run_hsdp_ranks(
    const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<Rendezvous>> shards{std::make_shared<Rendezvous>(2), std::make_shared<Rendezvous>(2)};
  std::vector<std::shared_ptr<Rendezvous>> replicas{std::make_shared<Rendezvous>(2), std::make_shared<Rendezvous>(2)};
  const auto group = [&](int rank_in_group, const std::shared_ptr<Rendezvous>& rv) {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank_in_group, 2);
    pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                   c10::make_intrusive<ThreadBackend>(rank_in_group, rv));
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
    return pg;
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank]() {
      fn(rank, group(rank % 2, shards[rank / 2]), group(rank / 2, replicas[rank % 2]));
    });
  }
  for (auto& t : threads) t.join();
}

// Two parameters of 3x2 and 5 elements: 11 elements, padded to 12 for F = 2.
std::vector<at::Tensor> params() {
  return {at::arange(6, at::kFloat).view({3, 2}), at::arange(6, 11, at::kFloat)};
}

}  // namespace

TEST(Scheduler, UnshardWaitReshardAndIdempotence) {
  run_ranks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    FlatParamLayout layout({{3, 2}, {5}}, 2);
    FlatParamHandle unit("unit", layout, rank, params());
    EXPECT_EQ(unit.local_shard().numel(), 6);
    EXPECT_TRUE(at::equal(unit.local_shard(), at::arange(rank * 6, rank * 6 + 6, at::kFloat)
                                                  .masked_fill(at::arange(rank * 6, rank * 6 + 6) >= 11, 0)));
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), /*max_in_flight=*/2);
    EXPECT_EQ(unit.state(), ShardedState::kSharded);
    EXPECT_FALSE(unit.has_unsharded_storage());
    scheduler.unshard(unit);
    scheduler.unshard(unit);  // safe to call twice
    EXPECT_EQ(unit.state(), ShardedState::kUnsharding);
    scheduler.wait_for_unshard(unit);
    scheduler.wait_for_unshard(unit);
    EXPECT_EQ(unit.state(), ShardedState::kUnsharded);
    auto views = unit.views();
    EXPECT_TRUE(at::equal(views[0], params()[0]));
    EXPECT_TRUE(at::equal(views[1], params()[1]));
    scheduler.reshard(unit);
    scheduler.reshard(unit);  // safe to call twice
    EXPECT_EQ(unit.state(), ShardedState::kSharded);
    EXPECT_FALSE(unit.has_unsharded_storage());
    EXPECT_EQ(unit.unsharded().storage().nbytes(), 0u);
    // wait_for_unshard alone issues the all-gather too.
    scheduler.wait_for_unshard(unit);
    EXPECT_TRUE(at::equal(unit.views()[1], params()[1]));
    // Resharding while the all-gather is in flight waits for it first.
    scheduler.reshard(unit);
    scheduler.unshard(unit);
    scheduler.reshard(unit);
    EXPECT_EQ(scheduler.pending_all_gathers(), 0);
    EXPECT_FALSE(unit.has_unsharded_storage());
  });
}

// See [Note: Small units gathered together] in scheduler.h.
TEST(Scheduler, UnshardTogetherGathersTheRunOfUnitsThatFitInOneCollective) {
  run_ranks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    auto* backend = static_cast<ThreadBackend*>(group->getBackend(c10::DeviceType::CPU).get());
    std::vector<std::unique_ptr<FlatParamHandle>> units;
    for (int i = 0; i < 5; ++i) {
      FlatParamOptions options;
      if (i == 3) options.param_dtype = at::kDouble;  // another all-gather dtype: cannot join the others
      std::vector<at::Tensor> ps = params();
      for (at::Tensor& p : ps) p.add_(10 * i);
      units.push_back(std::make_unique<FlatParamHandle>("unit" + std::to_string(i), FlatParamLayout({{3, 2}, {5}}, 2),
                                                        rank, ps, options));
    }
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), /*max_in_flight=*/2);
    std::vector<FlatParamHandle*> all;
    for (auto& unit : units) all.push_back(unit.get());
    // Off (the default): the first unit alone, as unshard.
    EXPECT_EQ(scheduler.unshard_together(all), 1);
    EXPECT_EQ(backend->coalesced_all_gathers, 0);
    EXPECT_EQ(scheduler.unshard_together(all), 0);  // the first one's all-gather is in flight: nothing issued
    scheduler.reshard(*units[0]);
    // 12 fp32 elements (48 bytes) a unit: three fit in 150 bytes; the cap stops the run there.
    scheduler.set_coalesce_bytes(150);
    EXPECT_EQ(scheduler.unshard_together(all), 3);
    EXPECT_EQ(backend->coalesced_all_gathers, 1);
    EXPECT_EQ(scheduler.pending_all_gathers(), 3);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(units[i]->state(), ShardedState::kUnsharding);
      scheduler.wait_for_unshard(*units[i]);
      EXPECT_TRUE(at::equal(units[i]->views()[1], params()[1] + 10 * i)) << "unit " << i;
    }
    EXPECT_EQ(units[3]->state(), ShardedState::kSharded);
    // Room for all: the run stops at unit 3, whose dtype differs.
    scheduler.set_coalesce_bytes(1 << 20);
    for (int i = 0; i < 3; ++i) scheduler.reshard(*units[i]);
    EXPECT_EQ(scheduler.unshard_together(all), 3);
    EXPECT_EQ(scheduler.unshard_together({units[3].get(), units[4].get()}), 1);  // fp64 then fp32: alone
    EXPECT_EQ(scheduler.unshard_together({units[4].get(), units[4].get()}), 1);  // the same unit once
    for (auto& unit : units) scheduler.wait_for_unshard(*unit);
    EXPECT_TRUE(at::equal(units[3]->views()[0], (params()[0] + 30).to(at::kDouble)));
    EXPECT_TRUE(at::equal(units[4]->views()[0], params()[0] + 40));
    EXPECT_EQ(backend->coalesced_all_gathers, 2);
    // Resharding a unit of a group in flight waits for the group's collective.
    for (auto& unit : units) scheduler.reshard(*unit);
    EXPECT_EQ(scheduler.unshard_together({units[0].get(), units[1].get()}), 2);
    scheduler.reshard(*units[1]);
    scheduler.reshard(*units[0]);
    EXPECT_EQ(scheduler.pending_all_gathers(), 0);
    EXPECT_THROW(scheduler.set_coalesce_bytes(-1), c10::Error);
  });
}

TEST(Scheduler, ReduceGradAveragesAccumulatesAndWritesGradShard) {
  run_ranks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    FlatParamLayout layout({{3, 2}, {5}}, 2);
    FlatParamOptions options;
    options.predivide = 2.0;  // the average over 2 ranks, all divided before the SUM
    FlatParamHandle unit("unit", layout, rank, params(), options);
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), 2);
    const float r = static_cast<float>(rank + 1);  // rank 0 sends 1s, rank 1 sends 2s
    // Two uses before the reduction: the flat gradient accumulates (2r), the
    // second parameter's gradient is missing (zeros) in the first use.
    unit.accumulate_grad({at::full({3, 2}, r), at::Tensor()});
    unit.accumulate_grad({at::full({3, 2}, r), at::full({5}, r)});
    scheduler.reduce_grad(unit);
    EXPECT_FALSE(unit.has_unsharded_grad());
    EXPECT_EQ(scheduler.pending_reductions(), 1);
    scheduler.finish_grad_sync();
    EXPECT_EQ(scheduler.pending_reductions(), 0);
    // Average over ranks: param 0 = (2 + 4) / 2 = 3, param 1 = (1 + 2) / 2 = 1.5, padding 0.
    at::Tensor expected = at::cat({at::full({6}, 3.0f), at::full({5}, 1.5f), at::zeros({1})});
    const at::Tensor& grad = unit.local_shard().grad();
    ASSERT_TRUE(grad.defined());
    EXPECT_TRUE(at::allclose(grad, expected.narrow(0, rank * 6, 6)));
    // A second reduction accumulates into .grad (accumulation with communication).
    unit.accumulate_grad({at::full({3, 2}, r), at::full({5}, r)});
    scheduler.reduce_grad(unit);
    scheduler.finish_grad_sync();
    scheduler.finish_grad_sync();  // nothing pending: a no-op
    at::Tensor twice = expected + at::cat({at::full({11}, 1.5f), at::zeros({1})});
    EXPECT_TRUE(at::allclose(unit.local_shard().grad(), twice.narrow(0, rank * 6, 6)));
    // A gradient of another element count is refused (the first use's flatten, a later use's add), never broadcast;
    // one of the same count in another shape lands in its place.
    EXPECT_THROW(unit.accumulate_grad({at::ones({2, 2}), at::Tensor()}), c10::Error);
    unit.accumulate_grad({at::full({2, 3}, r), at::Tensor()});
    EXPECT_THROW(unit.accumulate_grad({at::ones({4}), at::ones({5})}), c10::Error);
    unit.accumulate_grad({at::Tensor(), at::full({5}, r)});
    EXPECT_TRUE(at::equal(unit.unsharded_grad(), at::cat({at::full({11}, r), at::zeros({1})})));
    unit.drop_unsharded_grad();
  });
}

TEST(Scheduler, KeepsUpToMaxReductionsInFlight) {
  // See [Note: Reductions in flight]: the oldest reductions complete when a new one would exceed the limit, in
  // the order they were issued, and each gradient shard is the same whatever the limit.
  run_ranks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    FlatParamLayout layout({{3, 2}, {5}}, 2);
    FlatParamOptions options;
    options.predivide = 2.0;
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), 2);
    EXPECT_EQ(scheduler.max_reductions_in_flight(), 1);
    EXPECT_THROW(scheduler.set_max_reductions_in_flight(0), c10::Error);
    for (std::int64_t limit : {1, 2, 3}) {
      scheduler.set_max_reductions_in_flight(limit);
      std::vector<std::unique_ptr<FlatParamHandle>> units;
      for (int i = 0; i < 3; ++i) {
        units.push_back(std::make_unique<FlatParamHandle>("unit" + std::to_string(i), layout, rank, params(), options));
        const float g = static_cast<float>((rank + 1) * (i + 1));  // unit i: rank 0 sends i+1, rank 1 2(i+1)
        units.back()->accumulate_grad({at::full({3, 2}, g), at::full({5}, g)});
        scheduler.reduce_grad(*units.back());
        EXPECT_EQ(scheduler.pending_reductions(), std::min<std::int64_t>(i + 1, limit)) << "limit " << limit;
        // The ones completed to make room hold their gradient shard already, the others not yet.
        for (int j = 0; j <= i; ++j) {
          EXPECT_EQ(units[j]->local_shard().grad().defined(), j <= i - limit) << "limit " << limit << " unit " << j;
        }
      }
      scheduler.finish_grad_sync();
      EXPECT_EQ(scheduler.pending_reductions(), 0);
      for (int i = 0; i < 3; ++i) {  // the average over ranks: 1.5 (i + 1), padding 0
        at::Tensor expected = at::cat({at::full({11}, 1.5f * static_cast<float>(i + 1)), at::zeros({1})});
        EXPECT_TRUE(at::allclose(units[i]->local_shard().grad(), expected.narrow(0, rank * 6, 6)));
      }
    }
  });
}

TEST(Scheduler, AUnitWithoutReplicasIsNotQueuedBehindAnotherUnitsReplicaAllReduce) {
  // An HSDP unit and units over the shard group alone (experts beside HSDP blocks): the latter's gradient shards
  // are written as their reduce-scatters complete, not after the HSDP unit's pending all-reduce.
  run_hsdp_ranks([](int rank, c10::intrusive_ptr<c10d::ProcessGroup> shard,
                    c10::intrusive_ptr<c10d::ProcessGroup> replicate) {
    FlatParamLayout layout({{3, 2}, {5}}, 2);
    FlatParamOptions hybrid;
    hybrid.all_reduce_replicas = true;
    Scheduler scheduler(Collectives(shard), Collectives(replicate), c10::Device(c10::kCPU), 2);
    const std::int64_t alone = scheduler.add_groups(Collectives(shard), std::nullopt);
    const int shard_rank = rank % 2;
    FlatParamHandle a("a", layout, shard_rank, params(), hybrid);
    FlatParamHandle b("b", layout, shard_rank, params(), FlatParamOptions());
    FlatParamHandle c("c", layout, shard_rank, params(), FlatParamOptions());
    b.set_group_index(alone);
    c.set_group_index(alone);
    for (FlatParamHandle* unit : {&a, &b, &c}) {
      unit->accumulate_grad({at::ones({3, 2}), at::ones({5})});
      scheduler.reduce_grad(*unit);
    }
    // c's reduce-scatter completed b's: b is finished; a still waits for its replica all-reduce's completion.
    EXPECT_TRUE(b.local_shard().grad().defined());
    EXPECT_FALSE(a.local_shard().grad().defined());
    EXPECT_EQ(scheduler.pending_reductions(), 2);
    scheduler.finish_grad_sync();
    EXPECT_EQ(scheduler.pending_reductions(), 0);
    const auto expected = [&](float sum) {  // summed over the ranks that reduced it, padding 0
      return at::cat({at::full({11}, sum), at::zeros({1})}).narrow(0, shard_rank * 6, 6);
    };
    EXPECT_TRUE(at::allclose(a.local_shard().grad(), expected(4.0f)));
    EXPECT_TRUE(at::allclose(b.local_shard().grad(), expected(2.0f)));
    EXPECT_TRUE(at::allclose(c.local_shard().grad(), expected(2.0f)));
  });
}

TEST(Scheduler, ReplicatedUnitNeedsNoAllGatherAndAllReducesGradients) {
  run_ranks(2, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    FlatParamLayout layout({{3, 2}, {5}}, 1);  // NO_SHARD: shard factor 1
    FlatParamOptions options;
    options.predivide = 2.0;
    FlatParamHandle unit("unit", layout, 0, params(), options);
    EXPECT_TRUE(unit.is_replicated());
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), 2);
    scheduler.unshard(unit);
    EXPECT_EQ(unit.state(), ShardedState::kUnsharded);
    EXPECT_EQ(scheduler.pending_all_gathers(), 0);
    EXPECT_TRUE(at::equal(unit.views()[0], params()[0]));
    // The views alias the shard: an optimizer step on the shard shows in them.
    unit.local_shard().add_(1);
    EXPECT_TRUE(at::equal(unit.views()[1], params()[1] + 1));
    unit.accumulate_grad({at::full({3, 2}, static_cast<float>(rank)), at::full({5}, 4.0f)});
    scheduler.reduce_grad(unit);
    scheduler.finish_grad_sync();
    at::Tensor expected = at::cat({at::full({6}, 0.5f), at::full({5}, 4.0f)});
    EXPECT_TRUE(at::allclose(unit.local_shard().grad(), expected));
  });
}

// What rank's shard of the dim-0 layout holds: per tensor, its torch.chunk rows (at::chunk's), then zero rows
// up to the layout's rows per shard.
static at::Tensor chunk_rows_of_rank(const std::vector<at::Tensor>& tensors, const FlatParamLayout& layout, int rank) {
  std::vector<at::Tensor> slots;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto index = static_cast<std::int64_t>(i);
    const auto chunks = tensors[i].chunk(layout.shard_factor());
    at::Tensor slot = at::zeros({layout.rows_per_shard(index) * layout.row_numel(index)});
    if (rank < static_cast<int>(chunks.size())) slot.narrow(0, 0, chunks[rank].numel()).copy_(chunks[rank].reshape(-1));
    slots.push_back(slot);
  }
  return at::cat(slots);
}

static FlatParamOptions averaged_over(int ranks) {
  FlatParamOptions options;
  options.predivide = static_cast<double>(ranks);
  return options;
}

// A dim-0 unit's shard is each parameter's torch.chunk rows (then zero rows), and once gathered its views are the
// originals.
static void expect_chunk_rows_then_originals(FlatParamHandle& unit, Scheduler& scheduler,
                                             const std::vector<at::Tensor>& originals, const FlatParamLayout& layout,
                                             int rank) {
  EXPECT_TRUE(at::equal(unit.local_shard(), chunk_rows_of_rank(originals, layout, rank)));
  scheduler.wait_for_unshard(unit);
  auto views = unit.views();
  for (std::size_t i = 0; i < originals.size(); ++i) EXPECT_TRUE(at::equal(views[i], originals[i]));
}

// The dim-0 layout over 3 ranks with rows that do not divide (see [Note: Dim-0 layout], [Note: Copy-out]):
// each rank's shard holds its torch.chunk rows of each parameter (then zero rows), the unsharded parameters
// are the originals (and alias no gathered buffer, which is gone after the copy-out), and the gradient
// shard is each rank's chunk rows of the averaged gradient.
TEST(Scheduler, Dim0LayoutGathersCopiesOutAndReduceScattersRows) {
  run_ranks(3, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    const std::vector<at::Tensor> originals = {at::arange(10, at::kFloat).view({5, 2}), at::arange(10, 14, at::kFloat),
                                               at::arange(14, 15, at::kFloat)};
    const FlatParamLayout layout = FlatParamLayout::dim0({{5, 2}, {4}, {1}}, 3);
    FlatParamHandle unit("unit", layout, rank, originals, averaged_over(3));
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), 2);
    // The shard: per parameter, its chunk rows padded to c rows (c = 2, 2, 1).
    expect_chunk_rows_then_originals(unit, scheduler, originals, layout, rank);
    EXPECT_EQ(unit.unsharded().storage().nbytes(), 0u);  // the gathered buffer went with the copy-out
    EXPECT_TRUE(unit.has_unsharded_storage());
    scheduler.reshard(unit);
    EXPECT_FALSE(unit.has_unsharded_storage());
    // Gradients: rank r sends (r + 1) * originals, twice for the first parameter (two uses).
    const float r = static_cast<float>(rank + 1);
    unit.accumulate_grad({originals[0] * r, at::Tensor(), originals[2] * r});
    unit.accumulate_grad({originals[0] * r, originals[1] * r, at::Tensor()});
    scheduler.reduce_grad(unit);
    scheduler.finish_grad_sync();
    // Averaged over ranks: (1 + 2 + 3) / 3 = 2 times each use's originals.
    const std::vector<at::Tensor> averaged = {originals[0] * 4, originals[1] * 2, originals[2] * 2};
    EXPECT_TRUE(at::allclose(unit.local_shard().grad(), chunk_rows_of_rank(averaged, layout, rank)));
  });
}

// The same where every parameter's rows divide by the ranks (see [Note: One copy a unit]): the copy-out is one
// split along the ranks' rows and the first gradient of a backward one concatenation; the values are those of the
// pieces above (checked against torch.chunk's rows), a parameter without elements included.
TEST(Scheduler, Dim0LayoutWhoseRowsDivideCopiesInOneOp) {
  run_ranks(3, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    const std::vector<at::Tensor> originals = {at::arange(12, at::kFloat).view({6, 2}), at::arange(12, 15, at::kFloat),
                                               at::empty({0, 4}), at::arange(15, 24, at::kFloat).view({3, 3})};
    const FlatParamLayout layout = FlatParamLayout::dim0({{6, 2}, {3}, {0, 4}, {3, 3}}, 3);
    ASSERT_TRUE(layout.rows_divide());
    ASSERT_FALSE(FlatParamLayout::dim0({{5, 2}}, 3).rows_divide());
    ASSERT_FALSE(FlatParamLayout::dim0({{3, 6}}, 3, {1}).rows_divide());
    FlatParamHandle unit("unit", layout, rank, originals, averaged_over(3));
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), 2);
    expect_chunk_rows_then_originals(unit, scheduler, originals, layout, rank);
    scheduler.reshard(unit);
    const float r = static_cast<float>(rank + 1);
    // A transposed (non-contiguous) gradient too: reshaped, not viewed.
    const at::Tensor transposed = (originals[3] * r).t().contiguous().t();
    unit.accumulate_grad({originals[0] * r, originals[1] * r, at::zeros({0, 4}), transposed});
    unit.accumulate_grad({originals[0] * r, at::Tensor(), at::Tensor(), at::Tensor()});
    scheduler.reduce_grad(unit);
    scheduler.finish_grad_sync();
    const std::vector<at::Tensor> averaged = {originals[0] * 4, originals[1] * 2, originals[2],
                                              originals[3] * 2};
    EXPECT_TRUE(at::allclose(unit.local_shard().grad(), chunk_rows_of_rank(averaged, layout, rank)));
  });
}

// Rows that do not divide, every parameter on dim 0 (see [Note: One copy a unit]): the parameters' buffer pads each
// one to F c_i rows, as torch's FSDP2 pads its all-gather outputs (so that the copy-out is one split), the views are
// the regions' first rows; the first gradient of a backward, all defined, is one _chunk_cat, its padding rows zero.
// Values as the pieces' (torch.chunk's rows), a parameter with fewer rows than ranks included.
TEST(Scheduler, Dim0LayoutWhoseRowsDoNotDivideCopiesInOneOpToo) {
  run_ranks(3, [](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    const std::vector<at::Tensor> originals = {at::arange(10, at::kFloat).view({5, 2}), at::arange(10, 14, at::kFloat),
                                               at::arange(14, 15, at::kFloat)};
    const FlatParamLayout layout = FlatParamLayout::dim0({{5, 2}, {4}, {1}}, 3);
    ASSERT_TRUE(layout.all_on_dim0());
    ASSERT_FALSE(layout.rows_divide());
    ASSERT_FALSE(FlatParamLayout::dim0({{3, 6}}, 3, {1}).all_on_dim0());
    FlatParamHandle unit("unit", layout, rank, originals, averaged_over(3));
    Scheduler scheduler(Collectives(group), std::nullopt, c10::Device(c10::kCPU), 2);
    expect_chunk_rows_then_originals(unit, scheduler, originals, layout, rank);
    // c = 2, 2, 1 rows of 2, 1, 1 elements: regions of 3 * 4, 3 * 2 and 3 * 1 elements.
    const auto views = unit.views();
    EXPECT_EQ(views[0].storage().nbytes(), 21u * sizeof(float));
    EXPECT_EQ(views[1].storage_offset(), 12);
    EXPECT_EQ(views[2].storage_offset(), 18);
    scheduler.reshard(unit);
    const float r = static_cast<float>(rank + 1);
    unit.accumulate_grad({originals[0] * r, originals[1] * r, originals[2] * r});
    unit.accumulate_grad({originals[0] * r, at::Tensor(), at::Tensor()});
    scheduler.reduce_grad(unit);
    scheduler.finish_grad_sync();
    const std::vector<at::Tensor> averaged = {originals[0] * 4, originals[1] * 2, originals[2] * 2};
    EXPECT_TRUE(at::allclose(unit.local_shard().grad(), chunk_rows_of_rank(averaged, layout, rank)));
  });
}

TEST(FlatParamHandle, RejectsMismatchedShapesAndNamesTheUnit) {
  FlatParamLayout layout({{3, 2}}, 2);
  try {
    FlatParamHandle unit("blocks.3", layout, 0, {at::zeros({7})});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("shape [7] but the layout expects [3, 2]"), std::string::npos);
  }
  try {
    FlatParamHandle unit("blocks.3", layout, 2, {at::zeros({3, 2})});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unit 'blocks.3'"), std::string::npos);
  }
}

TEST(FlatParamHandle, AliasWithOwnStorageSharesMemoryAndKeepsItsOwnerAlive) {
  at::Tensor alias;
  const float* memory = nullptr;
  {
    at::Tensor shard = at::arange(12, at::kFloat);
    at::Tensor rows = shard.narrow(0, 4, 6).view({3, 2});
    memory = rows.const_data_ptr<float>();
    alias = FlatParamHandle::alias_with_own_storage(rows);
    EXPECT_EQ(alias.storage_offset(), 0);
    EXPECT_EQ(alias.storage().nbytes(), 6 * sizeof(float));  // its own elements, not the whole shard
    EXPECT_EQ(alias.sizes(), rows.sizes());
    EXPECT_EQ(alias.strides(), rows.strides());
    EXPECT_EQ(alias.const_data_ptr<float>(), memory);
    alias.mul_(2);  // (an optimizer's in-place step lands in the shard)
    EXPECT_EQ(shard[4].item<float>(), 8.0F);
    EXPECT_EQ(shard[3].item<float>(), 3.0F);
  }
  // The shard's last tensor is gone; its memory lives on with the alias.
  EXPECT_EQ(alias.const_data_ptr<float>(), memory);
  EXPECT_TRUE(at::equal(alias, at::arange(4, 10, at::kFloat).mul(2).view({3, 2})));
}
