"""``fully_shard`` composed with torch's ``replicate`` (its composable DDP) on one model, against torch's FSDP2 composed
the same way: each leaves the other's modules' parameters alone (see [Note: Composing with torch's replicate] in
_torch_facade/fsdp2_state.py).
"""

from __future__ import annotations

import torch
from torch import nn


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.seq = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(torch.relu(self.lin(x)))


class _Model(nn.Module):
    """Two composite units and a parameter of the model's own (torch's CompositeParamModel's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 6)
        self.u1, self.u2 = _Unit(), _Unit()
        self.p = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u2(self.u1(self.l(x))) @ self.p


# Bottom-up, a comma between levels: f fully_shard, r replicate (torch's test_fully_shard_compose.py's configs).
CONFIGS = ("1f,1r", "1r,1f", "1r1f,1f", "1f1f,1r1r,1f")


def _trained(rank: int, impl: str, config: str) -> dict:
    from torch.distributed._composable import replicate

    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = _Model()
    if config == "1f,1r":
        fully_shard(model.u1)
        replicate(model)
    elif config == "1r,1f":
        replicate(model.u1)
        fully_shard(model)
    elif config == "1r1f,1f":
        replicate(model.u1)
        fully_shard(model.u2)
        fully_shard(model)
    else:
        fully_shard(model.u1.seq)
        fully_shard(model.u2.seq)
        replicate(model.u1)
        replicate(model.u2)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.item())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # (a data path: the full state dict of the composed model, its keys and values)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "state_dict": {k: v.clone() for k, v in full.items()}}


def _all(rank: int, world_size: int) -> dict:
    return {(impl, config): _trained(rank, impl, config) for config in CONFIGS for impl in ("torch", "flatshard")}


def test_fully_shard_and_replicate_compose_as_torch():
    """Losses and the full state dict equal to torch's (rtol 1e-6: the replicated gradients' all-reduce and the sharded
    ones' reduce-scatter in another order). Before the registry marks: the first config failed at lazy init ("Cannot
    swap t1 and t2 if they have different slots": replicate had taken the sharded child's parameters), the others
    sharded the replicated child's parameters too."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_all, 2, timeout=180)):
        for config in CONFIGS:
            have, want = out["flatshard", config], out["torch", config]
            torch.testing.assert_close(have["losses"], want["losses"], rtol=1e-6, atol=0, msg=f"rank {rank} {config}")
            assert list(have["state_dict"]) == list(want["state_dict"]), (rank, config, list(have["state_dict"]))
            for key, value in want["state_dict"].items():
                torch.testing.assert_close(have["state_dict"][key], value, rtol=1e-6, atol=1e-7,
                                           msg=f"rank {rank} {config}: {key}")
