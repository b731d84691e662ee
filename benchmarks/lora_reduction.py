"""LoRA: gradient bytes reduced and step time, flatshard's trainable-prefix reduction against the whole
flat gradient (what torch FSDP1 reduces), and torch FSDP1 itself.

[Note: LoRA benchmark]
The `gpt` workload's model (8 blocks of width 128) with LoRA adapters of rank 8 on every
block's four Linears, whose base weights are frozen, as are the embeddings and the head;
`use_orig_params=True`, one unit per block. Three peers, built alike and timed interleaved
as in benchmarks/run.py (fsbench.timing): flatshard as it runs (each unit reduces its
trainable prefix, see [Note: Trainable prefix] in csrc/flatshard/flat_param.h), flatshard
with the prefix turned off (the whole flat gradient, zeros included), and torch FSDP1.
Gradient bytes reduced per step are counted from the units' layouts (per rank, as the
collectives' inputs).

    python benchmarks/lora_reduction.py [--world-size 2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import os

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fsbench.dist_env import Ctx, launch  # noqa: E402
from fsbench.models import Block, local_slice, make_batches  # noqa: E402
from fsbench.peers import LR, WEIGHT_DECAY, Peer  # noqa: E402
from fsbench.timing import Plan, Timed, interleaved, summarize  # noqa: E402
from fsbench.workloads import SPECS  # noqa: E402

RANK = 8


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = RANK):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora_model(spec) -> nn.Module:
    model = spec.build()
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for block in model.modules():
            if isinstance(block, Block):
                for name in ("qkv", "proj", "fc", "out"):
                    setattr(block, name, LoRALinear(getattr(block, name)))
    return model


def _peer(name: str, spec, ctx: Ctx) -> tuple[Peer, int]:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from flatshard import FullyShardedDataParallel as FSDP
    model = FSDP(_lora_model(spec), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=ctx.device,
                 use_orig_params=True)
    reduced = 0
    if name != "fsdp1":
        for unit in FSDP.fsdp_modules(model):
            handle = unit._unit_state.handle
            if handle is None or not unit._flat_param.requires_grad:
                continue
            if name == "flatshard-whole":
                handle.set_reduce_prefix(-1)
            reduced += 4 * (handle.reduce_prefix if handle.reduce_prefix >= 0 else handle.layout.padded_numel)
    else:  # the whole flat gradient of each unit with a trainable parameter, as flatshard-whole (padding aside)
        reduced = -1
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    return Peer(name, model, optimizer, spec, replicated=False, units=len(FSDP.fsdp_modules(model))), reduced


def _measure(ctx: Ctx, plan: Plan) -> dict:
    spec = SPECS["gpt"]()
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, 4, 8)]
    peers, reduced = {}, {}
    for name in ("flatshard", "flatshard-whole", "fsdp1"):
        peers[name], reduced[name] = _peer(name, spec, ctx)
        peers[name].step(*batches[0])
    reduced["fsdp1"] = reduced["flatshard-whole"]
    trainable = sum(4 * p.numel() for p in _lora_model(spec).parameters() if p.requires_grad)
    items = {n: Timed(run=lambda i, p=p: p.step(*batches[i % len(batches)])) for n, p in peers.items()}
    samples, errors = interleaved(ctx, items, plan)
    out = {"world_size": ctx.world_size, "trainable_bytes": trainable, "reduced_bytes": reduced, "errors": errors}
    for name in peers:
        if samples.get(name):
            out[name] = summarize(samples[name])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    plan = Plan(warmup=1, rounds=2, steps_per_block=3, drop_per_block=1) if args.quick else \
        Plan(warmup=2, rounds=10, steps_per_block=5, drop_per_block=1)
    r = launch([("lora", _measure, plan)], args.world_size, "cpu")["lora"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    print(f"LoRA reduction, W={args.world_size}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC, commit {commit}")
    if "error" in r:
        print("failed:", r["error"])
        return 1
    print(f"trainable bytes: {r['trainable_bytes']}")
    for name in ("flatshard", "flatshard-whole", "fsdp1"):
        t = r.get(name, {}).get("median_ms", float("nan"))
        print(f"{name:16} reduced {r['reduced_bytes'][name]:>10} B/step   step {t:8.2f} ms   "
              f"vs whole {t / r['flatshard-whole']['median_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
