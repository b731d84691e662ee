"""GPU parity: every sharding strategy on CUDA tensors, with real streams and events.

Skipped without CUDA (CI has none); run them on a GPU machine with
``bash scripts/test.sh -m gpu``. Two routes, both against a single-process run of
the same global batch on the same GPU:
- NCCL at world size 1: a NCCL group beside the harness's gloo one. A unit of
  shard factor 1 needs no all-gather, so this exercises the CUDA streams, events,
  views and gradient path, not NCCL's collectives.
- gloo at world size 2, both ranks on one GPU (NCCL refuses two ranks on one
  device). gloo copies each CUDA tensor to pinned host memory on its own stream,
  runs the collective on its CPU thread and copies the result back, then orders
  the waiting stream after those copies: the scheduler's event ordering and
  buffer lifetimes are exercised across real streams, and the collectives run.
Hybrid strategies: at W=1 two NCCL groups of one rank; at W=2 shard groups of one
rank and a replicate group of both (the replica all-reduce stream runs).
GPU kernels round differently from the CPU reference and between batch shapes, so
the tolerance is rtol 1e-4 / atol 1e-5 with TF32 off (CPU tests use 1e-5 / 1e-6).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt, param_mismatches

pytestmark = pytest.mark.gpu

RTOL, ATOL = 1e-4, 1e-5
STEPS = 5
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _process_group(backend, strategy, rank, world_size):
    """The process_group argument for this route and strategy (every rank builds every group)."""
    if backend == "nccl":
        shard = dist.new_group(backend="nccl")
        return (shard, dist.new_group(backend="nccl")) if strategy in HYBRID else shard
    if strategy in HYBRID:
        singles = [dist.new_group([r]) for r in range(world_size)]
        return singles[rank], dist.group.WORLD
    return None


def _parity_on_gpu(rank, world_size, backend, strategy, prefetch):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _C

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = _process_group(backend, strategy, rank, world_size)
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
    assert all(p.is_cuda for p in model.parameters())
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
        (ShardingStrategy.HYBRID_SHARD, BackwardPrefetch.BACKWARD_PRE),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, BackwardPrefetch.BACKWARD_POST),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_parity_on_gpu(backend, world_size, strategy, prefetch):
    run_distributed(_parity_on_gpu, world_size, backend, strategy, prefetch, timeout=240)


def _mixed_and_offload_on_gpu(rank, world_size, backend):
    """bf16 training: flatshard against torch's FSDP1 on the same GPU; flatshard with
    CPUOffload (pinned host shards) against itself without."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    from models import fsdp_class

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if backend == "nccl" else None
    local = local_slice(tuple(t.to(device) for t in make_batch()), rank, world_size)

    def train(impl, offload):
        FSDP = fsdp_class(impl)
        model = FSDP(make_gpt(), process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device,
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                     cpu_offload=CPUOffload(offload_params=offload))
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        losses = []
        for _ in range(STEPS):
            loss = gpt_loss(model, *local).float()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        devices = {p.device.type for p in model.parameters()}
        pinned = all(p.is_pinned() for p in model.parameters()) if offload else None
        return losses, devices, pinned

    theirs, _, _ = train("torch", False)
    ours, devices, _ = train("flatshard", False)
    offloaded, off_devices, pinned = train("flatshard", True)
    assert devices == {"cuda"} and off_devices == {"cpu"} and pinned
    # Same kernels on the same values: measured bit-equal on the CPU (see test_mixed_precision.py).
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-6, atol=0)
    assert offloaded == ours, f"offload changed the losses: {offloaded} vs {ours}"


@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_bf16_and_offload_on_gpu(backend, world_size):
    run_distributed(_mixed_and_offload_on_gpu, world_size, backend, timeout=240)


def _compress_hooks_on_gpu(rank, world_size, hook_name):
    """torch's fp16/bf16 compress hooks (CUDA only: they record streams): same losses as torch's FSDP1."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from models import fsdp_class

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    local = local_slice(tuple(t.to(device) for t in make_batch()), rank, world_size)
    hook = getattr(default_hooks, hook_name)
    losses = {}
    for impl in ("torch", "flatshard"):
        model = fsdp_class(impl)(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)
        model.register_comm_hook(default_hooks.LowPrecisionState(dist.group.WORLD), hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[impl] = []
        for _ in range(STEPS):
            loss = gpt_loss(model, *local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(float(loss))
    torch.testing.assert_close(torch.tensor(losses["flatshard"]), torch.tensor(losses["torch"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("hook_name", ["fp16_compress_hook", "bf16_compress_hook"])
def test_compress_hooks_on_gpu(hook_name):
    run_distributed(_compress_hooks_on_gpu, 2, hook_name, timeout=240)


def _shards_to_host_and_back(rank, world_size, backend, api):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import fully_shard, move_shards_to_device, move_shards_to_host

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)

    def build():
        if api.startswith("fully_shard"):
            gpt = make_gpt().to(device)
            for block in gpt.blocks:
                fully_shard(block)
            return fully_shard(gpt)
        return FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device,
                    use_orig_params=api == "use_orig_params")

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = build()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    batch = tuple(t.to(device) for t in local_slice(make_batch(), rank, world_size))
    losses, ref_losses = [], []
    for step in range(4):
        for m, o, out in ((model, opt, losses), (reference, ref_opt, ref_losses)):
            loss = gpt_loss(m, *batch)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
        if step == 1:  # the rollout's turn: every shard and Adam moment on the host, then back
            before = torch.cuda.memory_allocated()
            if api == "fully_shard_module_to":  # verl's FSDP2 offload: the module moved, the optimizer's state apart
                model.cpu()
                _move_optimizer_state(opt, torch.device("cpu"))
            else:
                move_shards_to_host(model, opt)
            assert all(p.device.type == "cpu" for p in model.parameters())
            assert all(t.device.type == "cpu" for s in opt.state.values() for t in s.values() if t.dim() > 0)
            assert torch.cuda.memory_allocated() < before
            with pytest.raises(RuntimeError, match=r"are in host memory .*move_shards_to_device\(model\)"):
                gpt_loss(model, *batch)
            if api == "fully_shard_module_to":
                model.to(device)
                _move_optimizer_state(opt, device)
            else:
                move_shards_to_device(model, opt)
            assert all(p.device == device for p in model.parameters())
    assert losses == ref_losses, f"{losses} vs {ref_losses} (never moved)"


def _move_optimizer_state(opt, device):
    """verl's offload_fsdp_optimizer / load_fsdp_optimizer: every tensor of the optimizer's state moved."""
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device)


@pytest.mark.parametrize("api", ["flat_params", "use_orig_params", "fully_shard", "fully_shard_module_to"])
def test_shards_to_host_and_back_on_gpu(api):
    """flatshard.move_shards_to_host/device mid-training (verl's offload between rollout and update): memory
    freed on the device, a forward meanwhile refused, training goes on exactly as a model never moved. The class
    with either use_orig_params, and fully_shard (whose DTensor parameters follow their shards); fully_shard moved
    with model.cpu() and model.to(device), as verl's FSDP2 offload does (see [Note: Shards on the host])."""
    run_distributed(_shards_to_host_and_back, 1, "nccl", api, backend="nccl", timeout=240)  # (the default group: NCCL)


def _fully_shard_on_device(rank, world_size, backend, device_type, offload):
    """flatshard's fully_shard (fp32, blocks then root) against a single-process run of the same global batch: the
    dim-0 layout's all-gather and copy-out into each parameter at W = 2 (gloo, both ranks on the GPU), offloaded
    shards on the host (pinned with a GPU). Each rank's local tensor of each DTensor parameter must be its rows of
    the reference's (torch's chunking: ceil(rows / W) per rank, the last ranks fewer or none)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from flatshard import _C, fully_shard

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    group = dist.new_group(backend=backend)
    mesh = DeviceMesh.from_group(group, device_type)
    vocab, seq = 67, 10  # rows that do not divide by 2: padded chunks
    batch = tuple(t.to(device) for t in make_batch(batch=8, seq=seq, vocab=vocab))
    reference = make_gpt(vocab=vocab, seq=seq).to(device)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    model = make_gpt(vocab=vocab, seq=seq).to(device)
    policy = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload else OffloadPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        gpt_loss(reference, *batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gpt_loss(model, *local_slice(batch, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    host = {p.to_local().device.type for p in model.parameters()}
    assert host == ({"cpu"} if offload else {device.type}), host
    if offload and device_type == "cuda":
        assert all(p.to_local().is_pinned() for p in model.parameters())
    problems = []
    for (name, p), want in zip(model.named_parameters(), reference.parameters()):
        chunks = torch.chunk(want.detach(), world_size, dim=0)
        mine = chunks[rank] if rank < len(chunks) else want.new_empty((0, *want.shape[1:]))
        got = p.to_local().detach().to(device)
        if got.shape != mine.shape or not torch.allclose(got, mine, rtol=RTOL, atol=ATOL):
            problems.append(f"{name}: local {tuple(got.shape)} vs the reference's rows {tuple(mine.shape)}")
    assert not problems, f"rank {rank}: " + "; ".join(problems)
    assert _C.unsharded_bytes() == 0


@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload"])
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_fully_shard_on_gpu(backend, world_size, offload):
    run_distributed(_fully_shard_on_device, world_size, backend, "cuda", offload, timeout=240)
