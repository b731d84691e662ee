"""GPU checks: the parity suite on CUDA tensors with real streams and events.

Skipped without CUDA (CI has none); run them on a GPU machine with
``bash scripts/test.sh -m gpu``. NCCL at world size 1 (a NCCL group beside the
harness's gloo one) and gloo at world size 2 with both ranks on one GPU. GPU
kernels round differently from the CPU reference and between batch shapes, so
the tolerance is rtol 1e-4 / atol 1e-5 with TF32 off (CPU tests use 1e-5 / 1e-6).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _dist import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt, param_mismatches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RTOL, ATOL = 1e-4, 1e-5
STEPS = 5


def _parity_on_gpu(rank, world_size, backend, strategy, prefetch):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _C

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if backend == "nccl" else None
    batch = tuple(t.to(device) for t in make_batch())
    reference = make_gpt().to(device)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    model = FSDP(
        make_gpt(),
        process_group=group,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy,
        backward_prefetch=prefetch,
        forward_prefetch=True,
        device_id=device,
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    local = local_slice(batch, rank, world_size)
    for _ in range(STEPS):
        gpt_loss(reference, *batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gpt_loss(model, *local).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        assert _C.unsharded_bytes() == 0
    with FSDP.summon_full_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = {n: p.detach() for n, p in reference.named_parameters()}
    problems = param_mismatches(full, want, RTOL, ATOL)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
@pytest.mark.parametrize(
    "strategy, prefetch",
    [
        (ShardingStrategy.FULL_SHARD, BackwardPrefetch.BACKWARD_PRE),
        (ShardingStrategy.SHARD_GRAD_OP, BackwardPrefetch.BACKWARD_POST),
        (ShardingStrategy.NO_SHARD, None),
    ],
)
def test_parity_on_gpu(backend, world_size, strategy, prefetch):
    run_distributed(_parity_on_gpu, world_size, backend, strategy, prefetch, timeout=240)
