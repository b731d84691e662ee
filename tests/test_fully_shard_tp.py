"""``flatshard.fully_shard`` over tensor-parallel blocks (TP beneath FSDP) against torch's FSDP2 on the same script.

TP first, then FSDP, as torchtitan and accelerate's ParallelismConfig apply them: ``parallelize_module`` makes each
block's linears DTensors over the mesh's ``tp`` dim, then ``fully_shard(block, mesh=mesh["dp"])`` shards their local
tensors over its ``dp`` dim (see [Note: Tensor-parallel parameters] in python/flatshard/_tensor_parallel.py). The
oracle is torch's FSDP2 running the same script on the same ranks: per-step losses, the last step's gradients and the
final parameters (each rank's local tensor of each DTensor), and each parameter's mesh, placements and global shape,
all equal bit for bit (both shard the same local tensors the same way and run the same TP collectives).

The models:
- ``stack``: torch's own FSDP2+TP test model (three MLPs, 3x, 4x and 3x wide, column- then row-wise parallel, and a
  LayerNorm under sequence parallelism, whose replicated weight gets a Partial gradient that the TP mesh all-reduces);
  at width 5 its 15-wide layers split 8/7 over TP and every matrix is padded over FSDP;
- ``stack_accumulated_bf16`` (a micro-batch without gradient sync before each step's) and ``stack_two_forwards`` (two
  forwards a backward): the norm's Partial gradient summed as torch's sums it, and all-reduced over TP once, when the
  unit reduces (see [Note: Partial gradients of tensor-parallel parameters]);
- ``stack_frozen_norm_bias``: the norm's bias frozen, so that the root unit reduces a trainable prefix, the norm's
  weight and its Partial gradient in it;
- ``stack_compiled``: each MLP ``torch.compile``d after ``fully_shard`` (its second MLP, of other widths, compiles
  again: see [Note: Tensor-parallel parameters under torch.compile]);
- ``stack_matrices_on_dim_1``: the same with ``shard_placement_fn`` sharding each local matrix on dim 1 (torch's
  2-D transformer init test's way: FSDP cuts the dim TP does not, and strided where row-wise TP cuts it too);
- ``gpt``: the suite's GPT (tied embedding, a parameter on the root, a vocabulary of 67 rows) with TP on each block's
  MLP only: units mixing parameters over the dp mesh alone and over both.

At W = 4 on a 2x2 (dp, tp) mesh, HSDP's 2x1x2 (replicate, shard, tp) and a (4, 1) mesh for the refusal that needs a
shard group of 4; at W = 2 on 1x2 (one data-parallel rank: the unit replicated, TP only). DCP checkpoints interchange
with torch's both ways. Every case of one world size runs in one process start (see [Note: One process start per
world size] in tests/_cases.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _cases import CaseRun
from models import gpt_loss, local_slice, make_batch, make_gpt

STEPS, LR, VOCAB, SEQ = 3, 1e-2, 67, 10
CASES_W4 = ["stack_uneven", "stack_checkpointed_kept", "stack_bf16", "stack_meta_to_empty", "stack_hsdp_2x1x2",
            "stack_matrices_on_dim_1", "stack_compiled", "stack_accumulated_bf16", "stack_two_forwards",
            "stack_frozen_norm_bias", "gpt_tp_mlp",
            "dcp_torch_to_flatshard",
            "dcp_flatshard_to_torch", "refusals"]
CASES_W2 = ["stack_uneven_1x2"]


class _MLP(nn.Module):
    def __init__(self, dim: int, multiplier: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, multiplier * dim)
        self.out_proj = nn.Linear(multiplier * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


class _Stack(nn.Sequential):
    """torch's MLPStack(dim, with_seq_parallel=True) (torch/testing/_internal/common_fsdp.py); ``norm_bias``: its
    LayerNorm with a bias."""

    def __init__(self, dim: int, norm_bias: bool = False) -> None:
        super().__init__(_MLP(dim, 3), _MLP(dim, 4), _MLP(dim, 3), nn.LayerNorm(dim, bias=norm_bias))


def _fully_shard(impl: str):
    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def _stack_plan() -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {}
    for i in range(3):  # (DTensor outputs between the MLPs keep their uneven widths, as torch's test does)
        plan[f"{i}.in_proj"] = ColwiseParallel(use_local_output=False)
        plan[f"{i}.out_proj"] = RowwiseParallel(use_local_output=False) if i < 2 else RowwiseParallel(
            output_layouts=Shard(1))
    plan["3"] = SequenceParallel(sequence_dim=1)
    return plan


def _build(impl: str, case: str, meshes: dict) -> tuple[nn.Module, int]:
    """The model of ``case`` with TP then ``impl``'s fully_shard; and this rank's data-parallel rank."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fully_shard = _fully_shard(impl)
    mesh = meshes["hsdp" if "hsdp" in case else "1x2" if case.endswith("1x2") else "2x2"]
    dp = mesh["replicate", "shard"] if "hsdp" in case else mesh["dp"]
    coordinate = dp.get_coordinate()  # (HSDP's data-parallel rank: replicate-major)
    dp_rank = coordinate[0] * dp.size(1) + coordinate[1] if dp.ndim == 2 else coordinate[0]
    kwargs = {}
    if "bf16" in case:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "kept" in case:
        kwargs["reshard_after_forward"] = False
    if case == "stack_matrices_on_dim_1":  # (sees the DTensors: FSDP shards dim 1 of each local matrix, strided where
        from torch.distributed.tensor import Shard  # TP shards it too, row-wise)

        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    if case.startswith("stack"):
        torch.manual_seed(42)
        dim = 16 if case in ("stack_checkpointed_kept", "stack_meta_to_empty", "stack_matrices_on_dim_1",
                             "stack_compiled") else 5
        if "meta" in case:  # torchtitan's way: on meta, parallelized and sharded, to_empty, then initialized
            with torch.device("meta"):
                model = _Stack(dim)
        else:
            model = _Stack(dim, norm_bias="frozen" in case)
        parallelize_module(model, mesh["tp"], _stack_plan())
        if "frozen" in case:  # (the root unit: a trainable prefix, the norm's Partial weight gradient within it)
            model[3].bias.requires_grad_(False)
        for module in model:
            if isinstance(module, nn.LayerNorm):
                continue
            if "checkpointed" in case:
                checkpoint(module)
            fully_shard(module, mesh=dp, **kwargs)
        fully_shard(model, mesh=dp, **kwargs)
        if "compiled" in case:  # torchtitan's way: each block after fully_shard (see test_fully_shard.py's backend)
            import torch._dynamo as dynamo

            dynamo.reset()
            for i in range(3):
                model[i] = torch.compile(model[i], backend="aot_eager")
        if "meta" in case:
            model.to_empty(device="cpu")
            torch.manual_seed(42)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        return model, dp_rank
    model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
        fully_shard(block, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    return model, dp_rank


def _loss(model: nn.Module, case: str, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    if case.startswith("stack"):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        dim = model[0].in_proj.in_features
        if case == "stack_two_forwards":  # (the root's norm used twice in one backward)
            first = model(torch.randn((8, 4, dim), generator=g)).sum()
            return first + model(torch.randn((8, 4, dim), generator=g)).sum()
        return model(torch.randn((8, 4, dim), generator=g)).sum()
    return gpt_loss(model, *local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=step), dp_rank, dp_size))


def _train(model: nn.Module, case: str, dp_rank: int, dp_size: int, steps: range, opt=None) -> dict:
    opt = opt or torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        if case == "stack_accumulated_bf16":  # a micro-batch without gradient sync first
            model.set_requires_gradient_sync(False)
            _loss(model, case, step + 100, dp_rank, dp_size).backward()
            model.set_requires_gradient_sync(True)
        loss = _loss(model, case, step, dp_rank, dp_size)
        loss.backward()
        grads = [None if p.grad is None else p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": [p.to_local().detach().clone() for p in model.parameters()],
            "specs": [(n, p.device_mesh.mesh_dim_names, tuple(p.placements), tuple(p.shape))
                      for n, p in model.named_parameters()], "opt": opt}


def _dp_size(case: str) -> int:
    return 1 if case.endswith("1x2") else 2


def _parity(case: str, meshes: dict) -> list[str]:
    from flatshard import _C

    torch_model, dp_rank = _build("torch", case, meshes)
    theirs = _train(torch_model, case, dp_rank, _dp_size(case), range(STEPS))
    model, _ = _build("flatshard", case, meshes)
    ours = _train(model, case, dp_rank, _dp_size(case), range(STEPS))
    problems = []
    if ours["specs"] != theirs["specs"]:
        problems += [f"{a} != torch's {b}" for a, b in zip(ours["specs"], theirs["specs"]) if a != b]
    if not any(len(spec[1]) > (2 if "hsdp" in case else 1) for spec in ours["specs"]):
        problems.append("no parameter is over the tp dim")
    if case == "stack_matrices_on_dim_1" and not any(
            type(spec[2][0]).__name__ == "_StridedShard" and spec[2][0].dim == 1 for spec in ours["specs"]):
        problems.append("no matrix is strided-sharded on dim 1")
    if ours["losses"] != theirs["losses"]:
        problems.append(f"losses {ours['losses']} != torch's {theirs['losses']}")
    for what in ("grads", "params"):
        for (name, *_), a, b in zip(theirs["specs"], ours[what], theirs[what]):
            if a is None or b is None:  # (a frozen parameter's gradient)
                if (a is None) != (b is None):
                    problems.append(f"{what[:-1]} {name}: {a is None and 'None'} vs torch's {b is None and 'None'}")
                continue
            if not (a.shape == b.shape and torch.equal(a, b)):
                diff = f", max |diff| {(a - b).abs().max():.2e}" if a.shape == b.shape else ""
                problems.append(f"{what[:-1]} {name}: {tuple(a.shape)} vs torch's {tuple(b.shape)}{diff}")
    if case == "gpt_tp_mlp":  # the placements mean what torch's do: the full tensors are the same
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        for n, p in torch_model.named_parameters():
            if not torch.equal(full[n], p.full_tensor()):
                problems.append(f"{n}: its full tensor differs from torch's")
    if _C.unsharded_bytes() != 0:
        problems.append(f"{_C.unsharded_bytes()} bytes unsharded between iterations")
    if case == "stack_uneven_1x2":  # after unshard(): the modules' parameters as torch's (DTensor nn.Parameters)
        seen = [_unsharded_parameters(m) for m in (model, torch_model)]
        if seen[0] != seen[1]:
            problems.append(f"after unshard(): {seen[0]} != torch's {seen[1]}")
    return problems


def _unsharded_parameters(model: nn.Module) -> list[tuple]:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    seen = [(n, type(p).__name__, isinstance(p, nn.Parameter), p.is_leaf, p.requires_grad)
            for n, p in model.named_parameters()]
    for m in units:
        m.reshard()
    return seen


def _interchange(case: str, meshes: dict) -> list[str]:
    """Two steps, a DCP checkpoint of model and Adam state (torch's state_dict helpers) by one implementation, two
    steps more; the other implementation, built with other weights, loads it and takes the same two steps: the same
    losses, bit for bit."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saver, loader = ("torch", "flatshard") if case == "dcp_torch_to_flatshard" else ("flatshard", "torch")
    path = [tempfile.mkdtemp(prefix="flatshard-tp-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    model, dp_rank = _build(saver, "gpt_tp_mlp", meshes)
    run = _train(model, "gpt_tp_mlp", dp_rank, 2, range(2))
    model_sd, optim_sd = get_state_dict(model, run["opt"])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path[0])
    went_on = _train(model, "gpt_tp_mlp", dp_rank, 2, range(2, 4), run["opt"])["losses"]
    other, _ = _build(loader, "gpt_tp_mlp", meshes)
    with torch.no_grad():
        for p in other.parameters():
            p.to_local().uniform_()
    opt = torch.optim.Adam(other.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(other, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(other, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = _train(other, "gpt_tp_mlp", dp_rank, 2, range(2, 4), opt)["losses"]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    return [] if resumed == went_on else [f"{loader} resumed {saver}'s checkpoint with losses {resumed}, {saver} went "
                                          f"on with {went_on}"]


def _refusals(meshes: dict) -> list[str]:
    """What flatshard does not support is refused by name, before the module is changed."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from flatshard import fully_shard

    problems = []

    def expect(make, call, kind, *phrases):
        module = make()
        before = [(n, p) for n, p in module.named_parameters()]
        try:
            call(module)
        except kind as e:
            missing = [ph for ph in phrases if ph not in str(e)]
            if missing:
                problems.append(f"{kind.__name__} {str(e)!r} lacks {missing}")
            if [(n, p) for n, p in module.named_parameters()] != before or hasattr(module, "_unit_state"):
                problems.append(f"the refused module was changed: {str(e)[:60]}")
        else:
            problems.append(f"no {kind.__name__} for {phrases}")

    def tp_linear(mesh):
        linear = nn.Linear(5, 8)
        parallelize_module(linear, mesh["tp"], ColwiseParallel())
        return linear

    mesh = meshes["2x2"]  # (the local weight is 4 x 5: its dim 1 does not divide by the dp mesh's 2)
    expect(lambda: tp_linear(mesh), lambda m: fully_shard(m, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1)),
           NotImplementedError, "'weight'", "uneven sharding on dim 1")

    def over_dp():  # a DTensor over the data-parallel mesh itself: torch's SPMD path
        linear = nn.Linear(4, 8)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh["dp"], [Replicate()]))
        return linear

    expect(over_dp, lambda m: fully_shard(m, mesh=mesh["dp"]), NotImplementedError, "'weight'", "dp_mesh_dims")
    from torch.distributed.fsdp import DataParallelMeshDims

    expect(lambda: tp_linear(mesh), lambda m: fully_shard(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
           ValueError, "Expected param's DTensor mesh to be the same mesh passed to fully_shard", "'weight'")
    wide = meshes["4x1"]  # (a shard group of 4: resharding to pairs after forward)
    expect(lambda: tp_linear(wide), lambda m: fully_shard(m, mesh=wide["dp"], reshard_after_forward=2),
           NotImplementedError, "'weight'", "reshard_after_forward=2")
    return problems


def _case(rank: int, world_size: int, case: str, meshes: dict) -> list[str]:
    if case.startswith("dcp"):
        return _interchange(case, meshes)
    if case == "refusals":
        return _refusals(meshes)
    return _parity(case, meshes)


def _meshes(rank: int, world_size: int, cases: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if world_size == 2:
        return {"1x2": init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))}
    return {"2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            "hsdp": init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp")),
            "4x1": init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))}


def _cases_of(world_size: int):
    return world_size, [(case, case) for case in (CASES_W4 if world_size == 4 else CASES_W2)]


RUNS = CaseRun(_case, _cases_of, setup=_meshes, timeout=300.0, pg_timeout=30.0)


@pytest.mark.parametrize("case, world_size", [(c, 4) for c in CASES_W4] + [(c, 2) for c in CASES_W2])
def test_tensor_parallel_blocks_as_torch_fsdp2(case, world_size):
    problems = [f"rank {rank}: " + "\n  ".join(p) for rank, p in enumerate(RUNS.results(world_size, case)) if p]
    assert not problems, f"{case} at W={world_size}:\n" + "\n".join(problems)
