"""``flatshard.fully_shard``'s gradients against torch's FSDP2 beyond one backward a step: parameters a forward left
out, ``set_reduce_scatter_unused_params`` and the guard, backwards that create a graph, gradients set to None,
kept or replaced, micro-batches without sync, ``zero_grad`` after the forward, an auxiliary loss on its own.

Split from tests/test_fully_shard.py (whose ``_build`` makes the models), as it was.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models import gpt_loss, local_slice, make_batch, make_gpt
from test_fully_shard import LR, SEQ, VOCAB, _build, _local


class _SkippableHead(nn.Module):
    """torch's test_double_partial_forward_then_backward's model: a forward that may leave the head out."""

    def __init__(self, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(vocab, dim), nn.Linear(dim, dim, bias=False)
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _untouched_parameters(rank: int, world_size: int) -> dict:
    """Two forwards that leave the head out, one backward: each parameter's gradient (None stays None), torch's
    and flatshard's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("flatshard", fully_shard)):
        torch.manual_seed(0)
        model = _SkippableHead()
        shard([model.norm, model.head])
        shard(model)
        tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(rank))
        (model(tokens, skip_head=True).sum() + model(tokens, skip_head=True).sum()).backward()
        out[impl] = {n: None if p.grad is None else p.grad.to_local().clone() for n, p in model.named_parameters()}
    return out


def test_a_parameter_a_forward_left_out_keeps_no_gradient_as_torch():
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_untouched_parameters, 2, timeout=120)):
        theirs, ours = out["torch"], out["flatshard"]
        assert theirs["head.weight"] is None and ours["head.weight"] is None, f"rank {rank}: {ours['head.weight']}"
        for name, want in theirs.items():
            assert (ours[name] is None) == (want is None) and (want is None or torch.equal(ours[name], want)), (
                f"rank {rank}: {name}")


class _Routed(nn.Module):
    """A block whose second layer only rank 0 runs (data-dependent routing, as mixture-of-experts does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(y) if use_b else y


class _RoutedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Routed()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.out(self.block(x, use_b))


def _routed_steps(impl: str, rank: int, unused: bool | None, steps: int) -> tuple[list, dict]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    torch.manual_seed(0)
    model = _RoutedModel()
    shard = torch_fully_shard if impl == "torch" else fully_shard
    shard(model.block)
    shard(model)
    if unused is not None:
        model.set_reduce_scatter_unused_params(unused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x, use_b=rank == 0).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads = {n: None if p.grad is None else p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _unused_parameters_reduced(rank: int, world_size: int) -> dict:
    return {impl: _routed_steps(impl, rank, True, 3) for impl in ("torch", "flatshard")}


def test_set_reduce_scatter_unused_params_as_torch():
    """Rank 1 never runs the block's second layer: with set_reduce_scatter_unused_params(True) every rank holds a
    .grad for it (zeros from rank 1's side of the sum), and training is torch's FSDP2's, bit for bit (without the
    call torch's FSDP2 hangs in that reduce-scatter)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_unused_parameters_reduced, 2, timeout=120)):
        (their_losses, their_grads, their_params), (our_losses, our_grads, our_params) = out["torch"], out["flatshard"]
        assert our_losses == their_losses, (rank, our_losses, their_losses)
        assert their_grads["block.b.weight"] is not None
        for name, want in their_grads.items():
            assert (our_grads[name] is None) == (want is None) and (want is None or torch.equal(our_grads[name], want)), (
                f"rank {rank}: {name}")
        for name, want in their_params.items():
            assert torch.equal(our_params[name], want), f"rank {rank}: {name}"


def _unused_parameters_left_without_grad(rank: int, world_size: int) -> tuple[list, str, list]:
    from flatshard import RankDivergenceError, fully_shard

    torch.manual_seed(0)
    model = _RoutedModel()
    fully_shard(model.block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x, use_b=rank == 0).square().mean().backward()
    without = [n for n, p in model.named_parameters() if p.grad is None]
    opt.step()
    opt.zero_grad()
    with pytest.raises(RankDivergenceError) as raised:  # the guard's next check: the next forward
        model(x, use_b=rank == 0)
    # Told once; with the call the ranks agree again and train on.
    model.set_reduce_scatter_unused_params(True)
    losses = []
    for _ in range(2):
        loss = model(x, use_b=rank == 0).square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    # Without it, ranks that all leave the same parameters out agree (the digest is the same in every process).
    model.set_reduce_scatter_unused_params(False)
    for _ in range(2):
        loss = model(x, use_b=False).square().mean()
        loss.backward()
        losses.append(loss.item())
        assert model.block.b.weight.grad is None
        opt.step()
        opt.zero_grad()
    return without, str(raised.value), losses


def test_ranks_that_give_different_parameters_a_gradient_are_stopped_by_the_guard():
    """[Note: Gradients given on some ranks only]: without set_reduce_scatter_unused_params, rank 1's .grad of the
    second layer is None where rank 0's is not; the guard's next check raises on both ranks, naming the parameters
    and the fix, and the loop goes on once the call is made."""
    from flatshard.testing import run_distributed

    out = run_distributed(_unused_parameters_left_without_grad, 2, timeout=120)
    assert out[0][0] == [] and out[1][0] == ["block.b.weight", "block.b.bias"], out
    for without, message, losses in out:
        assert ("rank 1 left block.b.weight, block.b.bias of 'block' without a gradient while rank 0 left no "
                "parameter without a gradient") in message, message
        assert "set_reduce_scatter_unused_params(True)" in message, message
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses


_PATTERN_OF_A_FAKE_ROOT = """
from types import SimpleNamespace as NS
from flatshard import _rank_guard
p = NS(requires_grad=True, grad=None)
s = NS(config=NS(dim0_layout=True), reduce_unused=False, orig_grad_seen=[True, False], orig_grad_held=[False, False],
       grads_handed_out=False,
       flat_param=NS(grad=object()),
       name="block", param_local_names=["a.weight", "b.weight"], orig_params=[p, p], label="block")
root = NS(units=[NS(_unit_state=s)])
_rank_guard.record_gradient_pattern(root)
print(root.gradient_pattern, root.without_grad)
"""


def test_the_gradient_pattern_is_the_same_in_every_process():
    """Ranks are processes of their own (torchrun's, on other hosts), each with its own string-hash seed: the digest the
    guard compares must not depend on it (see [Note: Gradients given on some ranks only])."""
    import os
    import subprocess
    import sys

    digests = [subprocess.run([sys.executable, "-c", _PATTERN_OF_A_FAKE_ROOT], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")]
    assert digests[0] == digests[1] and digests[0].endswith("[('block', ['block.b.weight'])]"), digests
    assert not digests[0].startswith("0 "), digests


def _create_graph_backward(rank: int, world_size: int) -> list[tuple[str, bool]]:
    """The same step with backward(create_graph=True) and with a plain backward: the same gradients (the block's rows
    divide by 2: its gradients are flattened by one cat, which refuses inputs that require grad; the root's do not)."""
    from flatshard import fully_shard

    grads = []
    for create_graph in (False, True):
        torch.manual_seed(0)
        model = _RoutedModel()
        fully_shard(model.block)
        fully_shard(model)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        model(x, use_b=True).square().mean().backward(create_graph=create_graph)
        grads.append({n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()})
    return [(n, torch.equal(g, grads[1][n])) for n, g in grads[0].items()]


def test_a_backward_that_creates_a_graph_gives_the_same_gradients():
    from flatshard.testing import run_distributed

    for same in run_distributed(_create_graph_backward, 2, timeout=120):
        assert all(equal for _, equal in same), same


def _gradient_lifetimes(rank: int, world_size: int) -> dict:
    """Each parameter's gradient after each of: a backward that keeps its graph; a zero_grad (and whether every
    gradient's memory is freed then); a second backward through the kept graph (from zero); a third without zero_grad
    (adding into the second's); an optimizer step and a new iteration without zero_grad (adding into those); a new
    iteration after half the gradients were set to None; one whose zero_grad comes after its forward; one after
    gradients were set to None while the script holds them (which must stay as they were) and others replaced.
    torch's and flatshard's (see [Note: A gradient set to None
    is freed] in flatshard/_orig_params.py). The GPT: the root holds parameters itself, the blocks are units inside
    it, the vocabulary's 67 rows do not divide by 2 (padding)."""
    import weakref

    out = {}
    for impl in ("torch", "flatshard"):
        model = _build(impl, "reshard_after_forward=None")
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR)
        snaps = {}

        def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            return local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=seed), rank, world_size)

        def snap(name: str) -> None:
            snaps[name] = [None if p.grad is None else _local(p.grad).clone() for p in params]

        loss = gpt_loss(model, *batch(0))
        loss.backward(retain_graph=True)
        snap("first backward")
        bases = [weakref.ref(t if t._base is None else t._base) for p in params if p.grad is not None
                 for t in [p.grad._local_tensor]]
        opt.zero_grad(set_to_none=True)
        freed = _released(bases)
        loss.backward(retain_graph=True)
        snap("a backward through the kept graph after zero_grad")
        loss.backward()
        snap("another, without zero_grad")
        opt.step()
        gpt_loss(model, *batch(1)).backward()
        snap("an iteration after a step, without zero_grad")
        for p in params[::2]:
            p.grad = None
        gpt_loss(model, *batch(2)).backward()
        snap("an iteration after half the gradients were set to None")
        loss = gpt_loss(model, *batch(3))
        opt.zero_grad()
        loss.backward()
        snap("an iteration with zero_grad between its forward and its backward")
        held = [p.grad for p in params[::3]]  # set to None, but held: torch's leaves them as they are
        values = [_local(g).clone() for g in held]
        for p in params[::3]:
            p.grad = None
        for p in params[1::3]:
            p.grad = p.grad * 0.5
        gpt_loss(model, *batch(4)).backward()
        snap("an iteration after gradients were set to None while held, and others replaced")
        untouched = all(torch.equal(_local(g), v) for g, v in zip(held, values))
        out[impl] = {"freed": freed, "grads": snaps, "held untouched": untouched}
    return out


def _released(refs: list, deadline_s: float = 10.0) -> bool:
    """Whether every referent dies once nothing of ours holds it. gloo's worker thread drops the last collective's
    work (and the buffers it holds) just after the host saw it complete, not before (see [Note: gloo's temporaries]
    in csrc/flatshard/collectives.cpp): so the release is waited for, up to a deadline that only a leak reaches."""
    import gc
    import time

    end = time.monotonic() + deadline_s
    while True:
        gc.collect()
        if all(ref() is None for ref in refs):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.001)


def test_gradients_set_to_none_are_freed_and_kept_ones_accumulate_as_torch():
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_gradient_lifetimes, 2, timeout=120)):
        theirs, ours = out["torch"], out["flatshard"]
        assert theirs["freed"], f"rank {rank}: torch's FSDP2 kept gradient memory after zero_grad"
        assert ours["freed"], f"rank {rank}: a gradient shard outlived zero_grad(set_to_none=True)"
        assert theirs["held untouched"], f"rank {rank}: torch's FSDP2 wrote into a .grad set to None"
        assert ours["held untouched"], f"rank {rank}: a .grad set to None and held by the user was written into"
        for when, want in theirs["grads"].items():
            have = ours["grads"][when]
            for i, (h, w) in enumerate(zip(have, want)):
                same = (h is None) == (w is None) and (w is None or torch.equal(h, w))
                assert same, f"rank {rank}, {when}, param {i}: {h is not None} vs torch's {w is not None}"


def _accumulation_after_gradients_dropped(rank: int, world_size: int) -> dict:
    """A synced backward; the block's second layer's gradients set to None; a micro-batch without gradient sync that
    runs that layer, then a synced one that does not: the layer's gradient is the first micro-batch's, the rest sums
    all three; again with a zero_grad between the two micro-batches (torch's and flatshard's)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("flatshard", fully_shard)):
        torch.manual_seed(0)
        model = _RoutedModel()
        shard(model.block)
        shard(model)
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * i + rank)) for i in range(3)]
        for zeroed_between in (False, True):
            model(xs[0], use_b=True).square().mean().backward()
            model.block.b.weight.grad = model.block.b.bias.grad = None
            model.set_requires_gradient_sync(False)
            model(xs[1], use_b=True).square().mean().backward()
            if zeroed_between:  # a zero_grad inside the accumulation: what the micro-batch before saw stays
                model.zero_grad()
            model.set_requires_gradient_sync(True)
            model(xs[2], use_b=False).square().mean().backward()
            out[impl, zeroed_between] = {n: None if p.grad is None else p.grad.to_local().clone()
                                         for n, p in model.named_parameters()}
            model.zero_grad()
    return out


def test_a_micro_batch_without_sync_keeps_what_it_saw_after_gradients_were_dropped():
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_accumulation_after_gradients_dropped, 2, timeout=120)):
        for zeroed_between in (False, True):
            theirs, ours = out["torch", zeroed_between], out["flatshard", zeroed_between]
            assert theirs["block.b.weight"] is not None, f"rank {rank}: torch's gave the layer no gradient"
            for name, want in theirs.items():
                have = ours[name]
                same = (have is None) == (want is None) and (want is None or torch.equal(have, want))
                assert same, f"rank {rank}, zeroed between: {zeroed_between}, {name}: {have} vs torch's {want}"


def _zero_grad_after_forward_resharded_to_pairs(rank: int, world_size: int) -> dict:
    """Three steps whose model.zero_grad() comes between the forward and the backward, at W = 4: torch's FSDP2 with
    reshard_after_forward=True, and flatshard's with reshard_after_forward=2 (to pairs of ranks) and True. Each
    rank's parameter shards after the steps (as full tensors)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    out = {}
    for impl, shard, reshard in (("torch", torch_fully_shard, True), ("flatshard", fully_shard, 2),
                                 ("flatshard", fully_shard, True)):
        model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
        for block in model.blocks:
            shard(block, reshard_after_forward=reshard)
        shard(model, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(3):
            loss = gpt_loss(model, *local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=step), rank, world_size))
            model.zero_grad()
            loss.backward()
            opt.step()
        out[impl, reshard] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


def test_model_zero_grad_after_the_forward_clears_gradients_whatever_the_reshard():
    """torch's FSDP2 (2.13) with an int reshard_after_forward leaves the gradients in (its parameters() yields the
    post-forward shards then); flatshard's trains as with True (the README's difference)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_zero_grad_after_forward_resharded_to_pairs, 4, timeout=120)):
        want = out["torch", True]
        for key in (("flatshard", 2), ("flatshard", True)):
            assert all(torch.equal(a, b) for a, b in zip(out[key], want)), f"rank {rank}: {key} against torch's True"


class _BlockWithAux(nn.Module):
    """A block that keeps an auxiliary loss of its own (a mixture-of-experts' load-balancing loss, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.aux = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.aux = h.pow(2).mean()
        return self.b(h)


def _auxiliary_loss_on_its_own(rank: int, world_size: int) -> dict:
    """Parameters kept after forward; the first block's auxiliary loss backpropagated on its own (it reaches the
    block's and the root's parameters but none of their outputs), then the main loss: each parameter's gradient,
    torch's and flatshard's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("flatshard", fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _BlockWithAux(), _BlockWithAux(), nn.Linear(4, 1))
        shard(model[1], reshard_after_forward=False)
        shard(model[2], reshard_after_forward=False)
        shard(model, reshard_after_forward=False)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        y = model(x)
        model[1].aux.backward(retain_graph=True)
        y.sum().backward()
        out[impl] = {n: None if p.grad is None else p.grad.to_local().clone() for n, p in model.named_parameters()}
    return out


def test_an_auxiliary_loss_backpropagated_on_its_own_as_torch():
    from flatshard.testing import run_distributed

    # (rtol 1e-6: the root's gradient sums the two backwards' reductions in another order than torch's)
    for rank, out in enumerate(run_distributed(_auxiliary_loss_on_its_own, 2, timeout=120)):
        for name, want in out["torch"].items():
            have = out["flatshard"][name]
            assert (have is None) == (want is None), f"rank {rank}: {name}: {have} vs torch's {want}"
            if want is not None:
                torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-8, msg=f"rank {rank}: {name}")


class _TiedHead(nn.Module):
    """An output head that reads another unit's weight (the embedding) through that unit's ``unshard()`` in its
    forward: weight tying across units, as FSDP2 users write it."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = [embed]  # (not a submodule)
        self.bias = nn.Parameter(torch.zeros(embed.num_embeddings))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        embed = self.embed[0]
        embed.unshard()
        return h @ embed.weight.t() + self.bias


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = _TiedHead(self.embed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class _CheckpointedLinear(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin, self.reentrant = nn.Linear(4, 4), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: torch.relu(self.lin(t)), x, use_reentrant=self.reentrant)


def _unshard_by_hand(rank: int, world_size: int) -> dict:
    """A unit's ``unshard()`` called by the user's code where the runtime does not expect it, torch's FSDP2 and
    flatshard's on the same models: inside another unit's forward (a tied weight), and from a backward pre-hook of
    the unit after it (manual backward prefetch) with activation checkpointing (reentrant or not) inside the unit."""
    out = {}
    for impl in ("torch", "flatshard"):
        if impl == "flatshard":
            from flatshard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        tied = _Tied()
        fully_shard(tied.embed)
        fully_shard(tied.head)
        fully_shard(tied)
        tied(torch.tensor([[1, 2, 3], [4, 5, 0]])[rank : rank + 1]).square().sum().backward()
        out[impl, "tied"] = [p.grad.full_tensor() for p in tied.parameters()]
        for reentrant in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), _CheckpointedLinear(reentrant), nn.Linear(4, 2))
            for m in model:
                fully_shard(m)
            fully_shard(model)
            model[2].register_full_backward_pre_hook(lambda *_, m=model: m[1].unshard())
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
            model(x).square().sum().backward()
            out[impl, f"prefetch, reentrant={reentrant}"] = [
                None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
    return out


def test_unshard_called_by_hand_in_forward_or_backward_keeps_the_gradients_as_torch():
    """What flows through the parameters a user's ``unshard()`` put on the modules is reduced as the unit's own
    gradient (before, a weight tied across units lost the head's part, and a unit gathered ahead by hand in backward
    lost its whole gradient under reentrant checkpointing, silently)."""
    from flatshard.testing import run_distributed

    for rank, got in enumerate(run_distributed(_unshard_by_hand, 2, timeout=120)):
        for impl, case in got:
            if impl == "flatshard":
                theirs, ours = got["torch", case], got["flatshard", case]
                assert all(t is not None for t in theirs), (rank, case)
                assert all(o is not None and torch.equal(o, t) for o, t in zip(ours, theirs)), (rank, case, ours, theirs)


class _Twice(nn.Module):
    """A layer called twice in one forward (a weight shared across steps of a recurrence)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cell(torch.tanh(self.cell(x)))


def _one_set_of_unsharded_parameters(rank: int, world_size: int) -> dict:
    """Units kept gathered after forward (reshard_after_forward=False), called more than once before they reshard: a
    list of two modules as one unit and a module called twice. As pipelining's split backward does, the loss is
    differentiated with respect to ``model.parameters()`` after the forward (the unsharded parameters every call used,
    torch's), then backpropagated: both gradients of each parameter, torch's and flatshard's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("flatshard", fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Twice(), nn.Linear(4, 1))
        shard([model[0], model[1]], reshard_after_forward=False)
        shard(model[2], reshard_after_forward=False)
        shard(model)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        loss = model(x).sum()
        names = [n for n, _ in model.named_parameters()]
        by_hand = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        out[impl] = {"by_hand": dict(zip(names, (g.clone() for g in by_hand))),
                     "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}}
    return out


def test_a_unit_called_again_before_it_reshards_uses_the_same_parameters_as_torch():
    """See [Note: One set of unsharded parameters per gathering] in _runtime.py. Before it, the later call's new views
    left the earlier call's parameters out of the graph: "The differentiated Tensor at index 0 appears to not have
    been used in the graph". rtol 1e-6 for the reduced gradients (the two calls' sum in another order)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_one_set_of_unsharded_parameters, 2, timeout=120)):
        for kind in ("by_hand", "grads"):
            want, have = out["torch"][kind], out["flatshard"][kind]
            assert list(have) == list(want), (rank, kind, list(have), list(want))
            for name in want:
                torch.testing.assert_close(have[name], want[name], rtol=1e-6, atol=1e-8,
                                           msg=f"rank {rank}: {kind} {name}")


class _RerunTwice(nn.Module):
    """A block run twice, each run under reentrant checkpointing: its reruns' backwards are backwards of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.block = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        y = self.first(x)
        return checkpoint(self.block, checkpoint(self.block, y, use_reentrant=True), use_reentrant=True)


def _post_accumulate_grad_hooks_that_only_read(rank: int, world_size: int) -> dict:
    """Hooks that only read (gradient logging), registered on rank 0 alone, on small units whose reductions go together
    (gloo, two ranks), and on a unit rerun twice by reentrant checkpointing (two reductions in one backward): each
    parameter's gradient with the hooks and without, and what the hooks saw."""
    import os

    from flatshard import fully_shard

    out = {}
    for together, hooked in [(t, h) for t in ("262144", "0") for h in (False, True)]:
        os.environ["FLATSHARD_GATHER_TOGETHER_BYTES"] = together  # (read by fully_shard: reduced together, or apart)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        twice = _RerunTwice()
        fully_shard(twice.block)
        fully_shard(twice)
        seen = []
        if hooked and rank == 0:
            for name, p in [*model.named_parameters(), *(("twice." + n, p) for n, p in twice.named_parameters())]:
                p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(name))
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()
        twice(x).sum().backward()
        out[together, hooked] = ({n: p.grad.to_local().clone() for n, p in [*model.named_parameters(),
                                                                              *twice.named_parameters()]}, seen)
    os.environ.pop("FLATSHARD_GATHER_TOGETHER_BYTES")
    return out


def test_post_accumulate_grad_hooks_change_no_gradient_and_no_collective():
    """See [Note: Post-accumulate-grad hooks] in _dtensor_params.py. A hook on one rank only must not group that rank's
    reductions otherwise than its peer's (before: rank 0 issued its units' reduce-scatters apart while rank 1 waited to
    send them together), and a unit reduced twice in one backward sums both (before: the second replaced the first
    where a hook was registered). Bit-equal with and without the hooks."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_post_accumulate_grad_hooks_that_only_read, 2, timeout=120,
                                               pg_timeout=30)):
        for together in ("262144", "0"):
            plain, (with_hooks, seen) = out[together, False][0], out[together, True]
            for name, want in plain.items():
                assert torch.equal(with_hooks[name], want), f"rank {rank}, {together}: {name}: {with_hooks[name]} vs " \
                                                            f"{want}"
            if rank == 0:  # (twice.block's: reduced apart, once per rerun's backward; together, once)
                assert sorted(set(seen)) == sorted(["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias",
                                                    "3.weight", "3.bias", "twice.first.weight", "twice.first.bias",
                                                    "twice.block.weight", "twice.block.bias"]), (together, seen)
                assert seen.count("twice.block.weight") == (2 if together == "0" else 1), (together, seen)


def _chunked_loss(rank: int, world_size: int) -> dict:
    """torchtitan's ChunkedLossWrapper (torchtitan/components/loss.py): the model's forward stops before the head; the
    loss runs the head (a unit of the root, kept unsharded, gradient sync off but for the last chunk) on each chunk of
    the detached hidden states with a backward each, then backpropagates the chunks' input gradients through the
    model. Two steps; every parameter's gradient and the losses."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard

    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("flatshard", fully_shard)):
        torch.manual_seed(0)
        model = _SkippableHead()
        shard(model.body)
        shard(model.head)
        shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, losses = [], []
        for step in range(2):
            tokens = torch.randint(16, (4, 6), generator=torch.Generator().manual_seed(10 * step + rank))
            hidden = model(tokens, skip_head=True)
            head = model.head
            head.set_reshard_after_forward(False)
            head.set_reshard_after_backward(False)
            head.set_requires_gradient_sync(False, recurse=False)
            head.unshard()
            chunks = [c.detach().requires_grad_(True) for c in hidden.split(2)]
            total, input_grads = 0.0, []
            for i, (chunk, targets) in enumerate(zip(chunks, tokens.split(2))):
                if i == len(chunks) - 1:
                    head.set_requires_gradient_sync(True, recurse=False)
                loss = nn.functional.cross_entropy(head(chunk).flatten(0, 1), targets.flatten())
                loss.backward()
                input_grads.append(chunk.grad)
                total += loss.item()
            head.set_reshard_after_forward(True)
            head.set_reshard_after_backward(True)
            head.set_requires_gradient_sync(True, recurse=False)
            head.reshard()
            hidden.backward(torch.cat(input_grads))
            grads.append({n: _local(p.grad).clone() for n, p in model.named_parameters()})
            losses.append(total)
            opt.step()
            opt.zero_grad()
        out[impl] = {"grads": grads, "losses": losses}
    return out


def test_torchtitans_chunked_loss_as_torch():
    """Losses and gradients equal to torch's FSDP2's (rtol 1e-6: the head's chunks summed before one reduction)."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_chunked_loss, 2, timeout=120)):
        assert out["flatshard"]["losses"] == pytest.approx(out["torch"]["losses"], rel=1e-6), rank
        for step, (want, have) in enumerate(zip(out["torch"]["grads"], out["flatshard"]["grads"])):
            assert list(have) == list(want), (rank, list(have))
            for name in want:
                torch.testing.assert_close(have[name], want[name], rtol=1e-6, atol=1e-7,
                                           msg=f"rank {rank} step {step}: {name}")
