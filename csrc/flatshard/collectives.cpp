#include "flatshard/collectives.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace flatshard {

struct Collectives::Impl {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

namespace {

CommWork wrap(c10::intrusive_ptr<c10d::Work> work) {
  return CommWork([work]() { work->wait(); }, [work]() { return work->isCompleted(); });
}

}  // namespace

void CommWork::wait() {
  if (!wait_ || waited_) return;
  wait_();
  waited_ = true;
}

Collectives::Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : impl_(std::make_unique<Impl>(Impl{std::move(group)})) {
  TORCH_CHECK(impl_->group, "flatshard: expected a process group but got None");
}
Collectives::~Collectives() = default;
Collectives::Collectives(Collectives&&) noexcept = default;
Collectives& Collectives::operator=(Collectives&&) noexcept = default;

std::int64_t Collectives::rank() const { return impl_->group->getRank(); }
std::int64_t Collectives::size() const { return impl_->group->getSize(); }
const c10::intrusive_ptr<c10d::ProcessGroup>& Collectives::group() const { return impl_->group; }

CommWork Collectives::all_gather(at::Tensor& output, at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(output.numel() == input.numel() * size());
  return wrap(impl_->group->_allgather_base(output, input));
}

CommWork Collectives::reduce_scatter_sum(at::Tensor& output, at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(input.numel() == output.numel() * size());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return wrap(impl_->group->_reduce_scatter_base(output, input, opts));
}

CommWork Collectives::all_reduce_sum(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return wrap(impl_->group->allreduce(tensors, opts));
}

}  // namespace flatshard
