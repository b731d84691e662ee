"""The peers: one model trained five ways, with the same units, optimizer and step.

- ``flatshard``: ``flatshard.FullyShardedDataParallel``, one unit per block plus the root
- ``flatshard-fs``: ``flatshard.fully_shard`` (torch FSDP2's API on flatshard's runtime), as ``fsdp2``
- ``fsdp2``:     ``torch.distributed.fsdp.fully_shard`` on each block, then on the root
- ``fsdp1``:     ``torch.distributed.fsdp.FullyShardedDataParallel`` (``use_orig_params=False``)
- ``ddp``:       ``DistributedDataParallel``
- ``local``:     the plain module, no communication (each rank trains on its own slice)

All use AdamW (foreach=True) with the same hyperparameters, ``zero_grad(set_to_none=True)``
after every step, FULL_SHARD for the sharded peers and default prefetching.

[Note: bf16 peers]
With ``precision="bf16"`` every peer trains in bf16 mixed precision as its users
would set it up: flatshard and torch FSDP1 with ``MixedPrecision(param_dtype,
reduce_dtype, buffer_dtype = bf16)``, FSDP2 with ``MixedPrecisionPolicy(param_dtype,
reduce_dtype = bf16)``, DDP and local training under ``torch.autocast`` to bf16
(their parameters and gradients stay fp32). The loss is taken in fp32 for all.

[Note: gloo AVG]
FSDP2 reduce-scatters with ``ReduceOp.AVG`` when it can; on gloo that op is
known to sum instead in some versions, which trains with W-times gradients.
FSDP2 is first built as it comes and guarded; if it fails the guard on gloo,
it is rebuilt to reduce with SUM and divide afterwards
(``set_force_sum_reduction_for_comms(True)``, what flatshard and FSDP1 do),
guarded again, and timed that way, with both verdicts in the report.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsbench.dist_env import Ctx
from fsbench.models import ModelSpec

PEERS = ("flatshard", "flatshard-fs", "fsdp2", "fsdp1", "ddp", "local")
SHARDED = ("flatshard", "flatshard-fs", "fsdp2", "fsdp1")
LABELS = {
    "flatshard": "flatshard",
    "flatshard-fs": "flatshard fully_shard",
    "fsdp2": "torch FSDP2",
    "fsdp1": "torch FSDP1",
    "ddp": "DDP",
    "local": "local (no comm)",
}
LR = 1e-3
WEIGHT_DECAY = 0.01


@dataclass
class Peer:
    """A wrapped model with its optimizer; ``step`` is one full training step."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    spec: ModelSpec
    replicated: bool  # every rank holds every gradient (DDP, local)
    units: int  # FSDP units built (0 for DDP / local)
    notes: list[str] = field(default_factory=list)
    autocast: torch.dtype | None = None  # see [Note: bf16 peers]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.autocast is not None:
            with torch.autocast(x.device.type, dtype=self.autocast):
                out = self.model(x)
        else:
            out = self.model(x)
        loss = self.spec.loss(out.float(), y)
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(x, y)
        self.optimizer_step()
        return loss

    def grad_sq_norm(self, ctx: Ctx) -> float:
        """Squared norm of the full (global) gradient: shards summed over ranks (collective)."""
        local = 0.0
        for p in self.model.parameters():
            g = p.grad
            if g is None:
                continue
            if hasattr(g, "to_local"):  # FSDP2: a DTensor shard
                g = g.to_local()
            local += float(g.detach().double().pow(2).sum())
        total = ctx.all_reduce([local])[0]
        return total / ctx.world_size if self.replicated else total


_MESHES: dict[tuple[str, int], Any] = {}


def _mesh(ctx: Ctx) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (ctx.device.type, ctx.world_size)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(ctx.device.type, (ctx.world_size,))
    return _MESHES[key]


def build_peer(name: str, spec: ModelSpec, ctx: Ctx, *, force_sum: bool = False, precision: str = "fp32") -> Peer:
    """Wraps a fresh, identically initialized model as peer ``name`` (may raise).

    ``force_sum``: FSDP2 reduces with SUM then divides (see [Note: gloo AVG]).
    ``precision``: "fp32" or "bf16" (see [Note: bf16 peers]).
    """
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision: expected 'fp32' or 'bf16' but got {precision!r}")
    bf16 = precision == "bf16"
    model = spec.build()
    notes: list[str] = []
    units = 0
    autocast = None
    if name in ("flatshard", "fsdp1"):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if name == "flatshard":
            from flatshard import FullyShardedDataParallel as FSDP
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                            buffer_dtype=torch.bfloat16) if bf16 else None
        with warnings.catch_warnings():  # torch's FSDP1 warns that it uses NO_SHARD at W=1
            warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({spec.unit_cls}), device_id=ctx.device,
                         mixed_precision=mp)
        units = len(FSDP.fsdp_modules(model))
        if name == "fsdp1" and ctx.world_size == 1:
            notes.append("W=1: torch's FSDP1 switches itself to NO_SHARD")
    elif name in ("fsdp2", "flatshard-fs"):
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if name == "flatshard-fs":
            from flatshard import fully_shard

        model = model.to(ctx.device)
        mesh = _mesh(ctx)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
            else MixedPrecisionPolicy()
        for m in list(model.modules()):
            if isinstance(m, spec.unit_cls):
                fully_shard(m, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        units = len(fsdp_modules)
        if force_sum:
            for m in fsdp_modules:
                m.set_force_sum_reduction_for_comms(True)
            notes.append("reduce-scatter with SUM, then divide (set_force_sum_reduction_for_comms)")
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(ctx.device)
        model = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    elif name == "local":
        model = model.to(ctx.device)
    else:
        raise ValueError(f"unknown peer {name!r}; expected one of {PEERS}")
    if bf16 and name in ("ddp", "local"):
        autocast = torch.bfloat16
    # foreach=True for every peer: torch's default on GPUs, where these peers train; on a CPU torch would pick the
    # single-tensor loop, whose per-tensor dispatch through DTensor (FSDP2, fully_shard) costs milliseconds a
    # parameter there and would stand for the optimizer's code, not the sharding's (see [Note: The forward and
    # backward alone] in workloads.py).
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    return Peer(name, model, optimizer, spec, replicated=name in ("ddp", "local"), units=units, notes=notes,
                autocast=autocast)
