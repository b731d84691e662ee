"""The correctness guard: a peer is timed only if it trains like the local run.

[Note: The guard]
Before any timing, every data-parallel peer trains ``GUARD_STEPS`` = 4 steps on
the same global batches as a single-process reference run (plain model, whole
global batch, same init, same AdamW), and must match it on:

- the loss after 3 optimizer steps (the 4th step's forward; ranks' losses on
  their equal slices averaged), within ``LOSS_RTOL``;
- the global gradient norm after the first backward (sharded peers: shards'
  squares summed over ranks), within ``GRAD_RTOL``.

The loss alone would not do: AdamW normalizes gradients, so a peer whose
gradients are W times too large (a reduce-scatter that sums where it should
average) trains to almost the same loss. The gradient norm sees it at once.
A peer that fails is reported as failed and not timed.

The ``local`` peer is the per-rank baseline (it trains on its slice without
communication), so at W > 1 it is not expected to match; at W = 1 it *is* the
reference.
"""

from __future__ import annotations

import math

import torch

from fsbench.dist_env import Ctx, error_text
from fsbench.models import ModelSpec, local_slice
from fsbench.peers import LR, WEIGHT_DECAY, Peer

GUARD_STEPS = 4
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-4
# bf16 peers against the fp32 reference: a few bf16 roundings (2^-9 each) add up to
# ~1e-2; a gradient off by a factor of W (or summed where it should be averaged) is
# off by 50% or more.
BF16_LOSS_RTOL = 3e-2
BF16_GRAD_RTOL = 5e-2


def tolerance(precision: str) -> dict:
    """The guard's tolerances for a workload's precision: {"loss_rtol": ..., "grad_rtol": ...}."""
    if precision == "bf16":
        return {"loss_rtol": BF16_LOSS_RTOL, "grad_rtol": BF16_GRAD_RTOL}
    return {"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL}


def reference(spec: ModelSpec, batches: list, device: torch.device) -> dict:
    """The single-process run on whole global batches: losses and first gradient norm."""
    model = spec.build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, grad_norm = [], 0.0
    for i in range(GUARD_STEPS):
        x, y = (t.to(device) for t in batches[i % len(batches)])
        loss = spec.loss(model(x), y)
        loss.backward()
        if i == 0:
            grad_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norm": grad_norm}


def check(peer: Peer, ref: dict, batches: list, ctx: Ctx, loss_rtol: float = LOSS_RTOL,
          grad_rtol: float = GRAD_RTOL) -> dict:
    """Runs the guard on ``peer`` (collective); returns its verdict with the numbers."""
    losses, grad_norm, error = [], float("nan"), None
    try:
        for i in range(GUARD_STEPS):
            x, y = (t.to(ctx.device) for t in local_slice(batches[i % len(batches)], ctx.rank, ctx.world_size))
            loss = peer.forward_backward(x, y)
            if i == 0:
                grad_norm = math.sqrt(peer.grad_sq_norm(ctx))
            peer.optimizer_step()
            losses.append(ctx.all_reduce([float(loss)])[0] / ctx.world_size)
    except Exception as e:  # noqa: BLE001 - a failing peer is a result
        error = error_text(e)
    if not ctx.agree(error is None):
        return {"passed": False, "error": error or "failed on another rank"}
    loss_err = abs(losses[-1] - ref["losses"][-1]) / abs(ref["losses"][-1])
    grad_err = abs(grad_norm - ref["grad_norm"]) / ref["grad_norm"]
    passed = loss_err <= loss_rtol and grad_err <= grad_rtol
    verdict = {
        "passed": passed,
        "loss_after_3_steps": losses[-1],
        "reference_loss_after_3_steps": ref["losses"][-1],
        "loss_rel_err": loss_err,
        "grad_norm": grad_norm,
        "reference_grad_norm": ref["grad_norm"],
        "grad_norm_rel_err": grad_err,
    }
    if not passed:
        verdict["error"] = (
            f"guard: loss after 3 steps {losses[-1]:.6f} vs local {ref['losses'][-1]:.6f} "
            f"(rel {loss_err:.1e}, tol {loss_rtol:.0e}); first grad norm {grad_norm:.6g} vs local "
            f"{ref['grad_norm']:.6g} (ratio {grad_norm / ref['grad_norm']:.3f}, tol {grad_rtol:.0e})"
        )
    return verdict
