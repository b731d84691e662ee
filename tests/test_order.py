"""Order of collectives in a profiler trace: prefetch, no_sync and the rate limiter.

Acceptance (DESIGN.md mechanisms 6-8), from ``torch.profiler`` traces at world size
2 of the GPT (units ``blocks.0``..``blocks.2`` and the root), FULL_SHARD:
- BACKWARD_PRE: in backward, the all-gather of the unit that runs next starts before
  the reduce-scatter of the unit that just finished.
- BACKWARD_POST: it starts after that reduce-scatter starts, and before the next
  unit's backward reaches it (so it was prefetched); with ``backward_prefetch=None``
  it starts only once the next unit's backward reached it.
- forward_prefetch=True: the all-gather of ``blocks.(i+1)`` starts before
  ``blocks.i``'s forward ends (the order comes from the previous iteration, so the
  second iteration is profiled); with forward_prefetch=False it starts after.
- no_sync(): no reduce-scatter or all-reduce in a backward inside the context, whose
  units are all-gathered again (parameters reshard as outside it, as torch's FSDP1);
  with ``keep_parameters_unsharded=True`` no collective at all in such a backward, nor
  an all-gather in a second forward inside it. Either way the first backward outside
  reduces every unit exactly once.
- Whatever the prefetch mode, each unit is all-gathered once per forward and once per
  backward (none for the root in backward: it stays unsharded until the end).
- With ``limit_all_gathers=False`` the trace holds no ``flatshard::rate_limit_wait``
  range and ``model._unit_state.root.scheduler.limiter_stalls`` does not grow. (A unit's all-gather
  is waited on before the next one is prefetched, so training never has two in
  flight on the CPU; test_limiter_memory.py makes the limiter stall directly.)

[Note: Markers]
Collective ranges come from flatshard (``flatshard::<what> <unit>``; the root's have
no suffix). The test adds its own zero-length ``record_function`` markers, emitted by
hooks on each inner ``Block``:
- ``test::fwd_end blocks.i``: the Block's forward returned (forward hook);
- ``test::grad_ready blocks.i``: the gradient w.r.t. the Block's output is there,
  i.e. that unit's backward begins (a tensor hook on the output, registered before
  FSDP's own pre-backward hook on the same tensor, so it fires just before it).
Phases are ``test::<phase>`` ranges around the forward and the backward calls. When
both are ready, the autograd engine runs the node with the higher sequence number
first: flatshard's post-backward of ``blocks.i`` (the backward of ``_UnshardedViews``,
created in its pre-forward) before the output node of ``blocks.(i-1)`` (created
earlier), so "before ``grad_ready blocks.(i-1)``" means "issued ahead of that unit's
own pre-backward", i.e. prefetched.

All scenarios run in one process start (see [Note: One process start per world size]
in tests/_cases.py); each test reads the events of its scenario. The prefetch checks
were validated against torch's FSDP1 (its ``c10d::allgather_`` /
``c10d::_reduce_scatter_base_`` ranges mapped to unit names by order): it passes the
BACKWARD_PRE, backward_prefetch=None, forward-prefetch (on and off) and gathered-once
checks, and fails the BACKWARD_POST one on the CPU, where its post-backward hook fires
only after the next unit's pre-backward gathered it, so its BACKWARD_POST prefetch
never happens there. The limiter checks and ``keep_parameters_unsharded`` are flatshard's
semantics.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed

from _cases import CaseRun
from models import Block, gpt_loss, local_slice, make_batch, make_gpt

WORLD_SIZE = 2
N_LAYERS = 3
BLOCKS = [f"blocks.{i}" for i in range(N_LAYERS)]
ROOT = ""  # the root unit's ranges carry no name
LR = 1e-2
COLLECTIVES = ("flatshard::all_gather", "flatshard::reduce_scatter", "flatshard::all_reduce")


def _scenario(name, *, bwd="PRE", fwd=False, limit=True, env_limit=None, no_sync=False):
    return dict(name=name, bwd=bwd, fwd=fwd, limit=limit, env_limit=env_limit, no_sync=no_sync)


SCENARIOS = [
    _scenario("pre"),
    _scenario("post_fwd_prefetch", bwd="POST", fwd=True),
    _scenario("no_prefetch", bwd=None),
    _scenario("no_sync", no_sync="default"),
    _scenario("no_sync_unsharded", no_sync="unsharded"),
    _scenario("no_limit", fwd=True, limit=False),
]

# ------------------------------------------------------------------ rank side


def _mark(name: str) -> None:
    """A zero-length profiler range: a point in time in the trace."""
    with torch.profiler.record_function(name):
        pass


def _install_markers(model) -> None:
    """See [Note: Markers]."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == N_LAYERS, f"expected {N_LAYERS} Blocks but found {len(blocks)}"
    for i, block in enumerate(blocks):

        def post_hook(_module, _args, output, i=i):
            _mark(f"test::fwd_end blocks.{i}")
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda _grad, i=i: _mark(f"test::grad_ready blocks.{i}"))

        block.register_forward_hook(post_hook)


def _phase(name: str, fn):
    with torch.profiler.record_function(f"test::{name}"):
        return fn()


def _profile_one(rank, world_size, scenario) -> dict:
    """The flatshard and test ranges of the second iteration of ``scenario``, and the
    limiter's stall count around it."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.profiler import ProfilerActivity, profile

    from flatshard import FullyShardedDataParallel as FSDP

    tokens, targets = local_slice(make_batch(), rank, world_size)
    old_env = os.environ.get("FLATSHARD_ALL_GATHER_LIMIT")
    if scenario["env_limit"] is not None:
        os.environ["FLATSHARD_ALL_GATHER_LIMIT"] = scenario["env_limit"]
    try:
        model = FSDP(
            make_gpt(n_layers=N_LAYERS),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=None if scenario["bwd"] is None else BackwardPrefetch[f"BACKWARD_{scenario['bwd']}"],
            forward_prefetch=scenario["fwd"],
            limit_all_gathers=scenario["limit"],
        )
        _install_markers(model)
        opt = torch.optim.Adam(model.parameters(), lr=LR)

        def step_plain():
            loss = _phase("forward", lambda: gpt_loss(model, tokens, targets))
            _phase("backward", loss.backward)

        def step_no_sync():
            halves = [local_slice((tokens, targets), j, 2) for j in range(2)]
            with model.no_sync(keep_parameters_unsharded=scenario["no_sync"] == "unsharded"):
                for j in range(2):
                    loss = _phase(f"no_sync_forward.{j}", lambda j=j: gpt_loss(model, *halves[j]))
                    _phase(f"no_sync_backward.{j}", loss.backward)
            loss = _phase("sync_forward", lambda: gpt_loss(model, tokens, targets))
            _phase("sync_backward", loss.backward)

        # Iteration 1 records the forward order forward prefetch uses in iteration 2.
        gpt_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        stalls_before = _stalls(model)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            (step_no_sync if scenario["no_sync"] else step_plain)()
            opt.step()
            opt.zero_grad()
        stalls_after = _stalls(model)
    finally:
        if scenario["env_limit"] is not None:
            if old_env is None:
                os.environ.pop("FLATSHARD_ALL_GATHER_LIMIT", None)
            else:
                os.environ["FLATSHARD_ALL_GATHER_LIMIT"] = old_env
    events = sorted(
        ((e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
         if e.name.startswith(("flatshard::", "test::"))),
        key=lambda e: (e[1], e[2]),
    )
    return {"events": events, "stalls_before": stalls_before, "stalls_after": stalls_after}


def _stalls(model):
    state = getattr(model, "_unit_state", None)  # (torch's FSDP has none)
    return None if state is None or state.root is None else int(state.root.scheduler.limiter_stalls)


# ----------------------------------------------------------------- test side

def _cases_of(world_size: int):
    return world_size, [(s["name"], s) for s in SCENARIOS]


TRACES = CaseRun(_profile_one, _cases_of, timeout=240.0, pg_timeout=30.0)


def _traces(scenario: str) -> list[dict]:
    """Per rank, the events of ``scenario`` (one profiling run for all, cached)."""
    return TRACES.results(WORLD_SIZE, scenario)


class Trace:
    """Events of one rank: (name, start_us, end_us), with lookups used by the checks."""

    def __init__(self, events, rank: int, scenario: str) -> None:
        self.events = [tuple(e) for e in events]
        self.where = f"scenario {scenario!r}, rank {rank}"

    def phase(self, name: str) -> tuple[float, float]:
        spans = [(s, e) for n, s, e in self.events if n == f"test::{name}"]
        assert len(spans) == 1, f"{self.where}: expected one test::{name} range but found {len(spans)}"
        return spans[0]

    def within(self, phase: str) -> list[tuple[str, float, float]]:
        start, end = self.phase(phase)
        return [ev for ev in self.events if start <= ev[1] <= end and not ev[0].startswith(f"test::{phase}")]

    @staticmethod
    def range_name(what: str, unit: str) -> str:
        return f"flatshard::{what} {unit}" if unit else f"flatshard::{what}"

    def first(self, phase: str, name: str) -> float:
        starts = [s for n, s, _ in self.within(phase) if n == name]
        assert starts, f"{self.where}: no {name!r} range in the {phase} phase; phase holds:\n{self.describe(phase)}"
        return starts[0]

    def count(self, phase: str | None, name: str) -> int:
        events = self.events if phase is None else self.within(phase)
        return sum(1 for n, _, _ in events if n == name)

    def describe(self, phase: str) -> str:
        start, _ = self.phase(phase)
        return "\n".join(f"  {s - start:10.1f} us  {n}" for n, s, _ in self.within(phase)) or "  (nothing)"


def _each_rank(scenario: str):
    return [Trace(t["events"], rank, scenario) for rank, t in enumerate(_traces(scenario))]


def _ag(unit):
    return Trace.range_name("all_gather", unit)


def _rs(unit):
    return Trace.range_name("reduce_scatter", unit)


# ------------------------------------------------------------------- the tests


def test_backward_pre_all_gathers_next_unit_before_reduce_scatter():
    for t in _each_rank("pre"):
        for i in range(N_LAYERS - 1, 0, -1):
            ag = t.first("backward", _ag(f"blocks.{i - 1}"))
            rs = t.first("backward", _rs(f"blocks.{i}"))
            assert ag < rs, (
                f"{t.where}: BACKWARD_PRE: all_gather blocks.{i - 1} started {ag - rs:+.1f} us after "
                f"reduce_scatter blocks.{i} started; expected before. Backward:\n{t.describe('backward')}"
            )


def test_backward_post_all_gathers_next_unit_after_reduce_scatter():
    for t in _each_rank("post_fwd_prefetch"):
        for i in range(N_LAYERS - 1, 0, -1):
            ag = t.first("backward", _ag(f"blocks.{i - 1}"))
            rs = t.first("backward", _rs(f"blocks.{i}"))
            ready = t.first("backward", f"test::grad_ready blocks.{i - 1}")
            assert rs < ag, (
                f"{t.where}: BACKWARD_POST: all_gather blocks.{i - 1} started before reduce_scatter "
                f"blocks.{i}; expected after. Backward:\n{t.describe('backward')}"
            )
            assert ag < ready, (
                f"{t.where}: BACKWARD_POST: all_gather blocks.{i - 1} was not prefetched: it started "
                f"only when blocks.{i - 1}'s backward began. Backward:\n{t.describe('backward')}"
            )


def test_no_backward_prefetch_all_gathers_only_when_needed():
    for t in _each_rank("no_prefetch"):
        for i in range(N_LAYERS - 1, 0, -1):
            ag = t.first("backward", _ag(f"blocks.{i - 1}"))
            rs = t.first("backward", _rs(f"blocks.{i}"))
            ready = t.first("backward", f"test::grad_ready blocks.{i - 1}")
            assert rs < ag and ready < ag, (
                f"{t.where}: backward_prefetch=None but all_gather blocks.{i - 1} started before "
                f"reduce_scatter blocks.{i} or before blocks.{i - 1}'s backward began. "
                f"Backward:\n{t.describe('backward')}"
            )


@pytest.mark.parametrize("scenario", ["pre", "post_fwd_prefetch", "no_prefetch"])
def test_each_unit_is_all_gathered_once_per_pass(scenario):
    """Prefetch must not gather a unit twice, nor one that already ran (e.g. a
    BACKWARD_POST prefetch from the root's post-backward, which runs last)."""
    for t in _each_rank(scenario):
        for phase in ("forward", "backward"):
            counts = {unit or "<root>": t.count(phase, _ag(unit)) for unit in [*BLOCKS, ROOT]}
            # FULL_SHARD: every unit is gathered in forward; in backward every unit but
            # the root, which stays unsharded from its forward to the end of backward.
            want = {unit or "<root>": int(phase == "forward" or unit != ROOT) for unit in [*BLOCKS, ROOT]}
            assert counts == want, (
                f"{t.where}: all_gather ranges per unit in the {phase} phase: {counts}, expected "
                f"{want}. {phase.capitalize()}:\n{t.describe(phase)}"
            )


def test_forward_prefetch_all_gathers_next_block_during_current_forward():
    for t in _each_rank("post_fwd_prefetch"):
        for i in range(N_LAYERS - 1):
            ag = t.first("forward", _ag(f"blocks.{i + 1}"))
            end = t.first("forward", f"test::fwd_end blocks.{i}")
            assert ag < end, (
                f"{t.where}: forward_prefetch=True but all_gather blocks.{i + 1} started after "
                f"blocks.{i}'s forward ended. Forward:\n{t.describe('forward')}"
            )


def test_without_forward_prefetch_next_block_is_gathered_after_current_forward():
    for t in _each_rank("pre"):
        for i in range(N_LAYERS - 1):
            ag = t.first("forward", _ag(f"blocks.{i + 1}"))
            end = t.first("forward", f"test::fwd_end blocks.{i}")
            assert end < ag, (
                f"{t.where}: forward_prefetch=False but all_gather blocks.{i + 1} started before "
                f"blocks.{i}'s forward ended. Forward:\n{t.describe('forward')}"
            )


def test_no_sync_backward_reduces_nothing_and_gathers_again():
    for t in _each_rank("no_sync"):
        for j in range(2):
            phase = f"no_sync_backward.{j}"
            found = [n for n, _, _ in t.within(phase) if n.startswith(COLLECTIVES[1:])]
            assert not found, f"{t.where}: gradient collectives in a backward inside no_sync(): {found}"
            for block in BLOCKS:  # resharded after forward, as outside no_sync: gathered again
                t.first(phase, f"test::grad_ready {block}")
                assert t.count(phase, f"flatshard::all_gather {block}") == 1, t.describe(phase)


def test_no_sync_keeping_parameters_unsharded_runs_no_collective():
    for t in _each_rank("no_sync_unsharded"):
        for j in range(2):
            phase = f"no_sync_backward.{j}"
            found = [n for n, _, _ in t.within(phase) if n.startswith(COLLECTIVES)]
            assert not found, f"{t.where}: collectives in a backward inside no_sync(): {found}"
            for block in BLOCKS:  # backward did run there: the markers of every block are in it
                t.first(phase, f"test::grad_ready {block}")
        found = [n for n, _, _ in t.within("no_sync_forward.1") if n.startswith(COLLECTIVES)]
        assert not found, (
            f"{t.where}: the second forward inside no_sync(keep_parameters_unsharded=True) ran {found}; the "
            f"parameters stay unsharded, so it needs no all-gather"
        )


@pytest.mark.parametrize("scenario", ["no_sync", "no_sync_unsharded"])
def test_first_backward_after_no_sync_reduces_every_unit_once(scenario):
    for t in _each_rank(scenario):
        counts = {unit: t.count("sync_backward", _rs(unit)) for unit in [*BLOCKS, ROOT]}
        assert all(c == 1 for c in counts.values()), (
            f"{t.where}: reduce_scatter ranges per unit in the backward after no_sync(): {counts}; "
            f"expected exactly 1 each. Backward:\n{t.describe('sync_backward')}"
        )


def test_no_limiter_never_waits():
    for t, raw in zip(_each_rank("no_limit"), _traces("no_limit")):
        waits = t.count(None, "flatshard::rate_limit_wait")
        stalls = raw["stalls_after"] - raw["stalls_before"]
        assert waits == 0 and stalls == 0, (
            f"{t.where}: limit_all_gathers=False but {waits} rate_limit_wait range(s) and {stalls} "
            f"limiter stall(s) in the profiled iteration"
        )


class _StackWithActivationUnit(torch.nn.Module):
    """8 small blocks; after block 1, on rank 0 only, a unit without parameters (a wrapped activation)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(8))
        self.act = torch.nn.Sequential(torch.nn.Tanh())
        self.use_act = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            if i == 1 and self.use_act:
                x = self.act(x)
        return x


def _unit_without_parameters_on_one_rank(rank, world_size, forward_prefetch):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from flatshard import FullyShardedDataParallel as FSDP

    losses = {}
    for impl, cls in (("torch", TorchFSDP), ("flatshard", FSDP)):
        model = _StackWithActivationUnit()
        kwargs = dict(device_id=torch.device("cpu"), forward_prefetch=forward_prefetch)
        for i in range(len(model.blocks)):
            model.blocks[i] = cls(model.blocks[i], **kwargs)
        model.act = cls(model.act, **kwargs)
        model = cls(model, **kwargs)
        model.module.use_act = rank == 0
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        losses[impl] = []
        for _ in range(3):
            x = torch.randn(4 * world_size, 8, generator=gen).chunk(world_size)[rank]
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(loss.item())
    return losses


@pytest.mark.parametrize("forward_prefetch", [False, True])
def test_a_unit_without_parameters_on_one_rank_leaves_the_prefetch_order_alone(forward_prefetch):
    """See [Note: The orders hold units that gather] in _prefetch.py: the activation's unit, run on rank 0 only, was in
    rank 0's backward order, where its prefetch found nothing to gather; rank 1 all-gathered the next block before
    its reduce-scatter, rank 0 after it, and on two ranks the two equal-sized exchanges paired up: rank 0's losses
    differed from torch FSDP1's from the second step on (0.918 against 0.937)."""
    for rank, losses in enumerate(run_distributed(_unit_without_parameters_on_one_rank, 2, forward_prefetch)):
        assert losses["flatshard"] == losses["torch"], f"rank {rank}: {losses}"
