"""The rank-divergence guard: ranks that are about to run different collectives raise, all of them,
with an error naming the ranks and what differs, instead of hanging or aborting in the backend.

[Note: Rank-divergence guard]
Collectives pair up by order: if one rank runs a no-grad evaluation forward, enters
``no_sync()``, skips a backward or a whole step, or wraps another model while its peers do
not, its collectives meet theirs mismatched. Then NCCL and gloo hang until the group's
timeout, or gloo kills the process (SIGABRT) on a size mismatch, or, worse, the sizes
happen to agree and training goes on wrong. So before each phase that issues collectives
(every call of the root's forward that will all-gather something: a forward of NO_SHARD units
only, or one inside ``no_sync(keep_parameters_unsharded=True)`` after the first, gathers nothing and is neither
checked nor counted; the first backward hook of an iteration (but inside
``no_sync(keep_parameters_unsharded=True)``, whose backward gathers nothing); and ``state_dict()``, ``load_state_dict()``, ``summon_full_params()``,
``clip_grad_norm_()`` and the optimizer-state-dict functions), every rank exchanges a
fingerprint of what it is about to do: eight int64 values, Python ints (the phase, how many
forwards the root ran, grad enabled, inside ``no_sync()``, which parameters the last backward left without a
gradient (see [Note: Gradients given on some ranks only]), and a hash of the model as
wrapped: every unit's name, parameter shapes, dtype, shard factor, strategy, mixed
precision and offload). The exchange runs over links of the guard's own (a TCP connection
to each round's partner, made at lazy init; a two-rank gloo group where one cannot be made:
[Note: The guard's links] in _guard_links.py), so that it only ever meets other guards'
exchanges: whatever the ranks are doing, the messages pair up and have the same size. It computes the
elementwise minimum and maximum of the vectors over the ranks by recursive doubling (see
[Note: The guard's exchange in log W rounds]); they are equal exactly when every rank's vector
is the same. If any differs, every rank sees it, and all of them gather the
readable descriptions (a second exchange, only then) and raise the same
``RankDivergenceError``, e.g. "rank 1 runs forward without grad while rank 0 runs forward
with grad". ``FLATSHARD_RANK_GUARD=0`` turns it off; its cost per iteration is in
benchmarks/RESULTS.md. ``FLATSHARD_RANK_GUARD=strict`` also checks each collective (see
[Note: Collective sequence check] in csrc/flatshard/scheduler.h).

Every exchange completes before the phase's first collective, the backward's too:
issued at the first backward hook and checked later (overlapping the root's own
layers' backward), it would let that hook's prefetch all-gather go out first, and a
peer that skipped this backward would never pair it: the group would stay poisoned
for whatever the ranks do next (a barrier, a checkpoint). So each exchange blocks, about
2 x log2(W) small-message round trips per step over the guard's own links plus whatever skew between the ranks it
absorbs (which the step's first collective would absorb otherwise); benchmarks/guard_cost.py
measures it.

What it cannot see: ranks that agree on every phase but not within one (a unit run on one
rank only, as data-dependent mixture-of-experts routing can do): the strict mode is for
that. A rank that leaves a step after its collectives began (its forward or backward raised and it
went on alone), two models run in different orders, a peer that died: [Note: Stalled waits].
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from flatshard import _C, _guard_links, _stall_watch
from flatshard._profiling import collective_range

if TYPE_CHECKING:
    from flatshard._state import RootState, UnitState

__all__ = ["RankDivergenceError"]

ENV = "FLATSHARD_RANK_GUARD"
_PHASES = ["forward", "backward", "state_dict()", "load_state_dict()", "summon_full_params()",
           "clip_grad_norm_()", "optim_state_dict()", "optim_state_dict_to_load()"]
_WIDTH = 8  # int64s per rank: phase, forwards, grad, no_sync, model hash (2), gradient pattern, reserved
_PAIR = struct.Struct(f"<{2 * _WIDTH}q")  # a round's message: the minimum and the maximum so far
_LENGTH = struct.Struct("<q")


# [Note: Recovering from a divergence]
# A RankDivergenceError is raised by every rank at the same exchange, before the phase's first
# collective, so no rank is left inside a collective. What still differs is the guard's own count of
# forwards (a rank that ran an extra forward counted it): every rank takes the largest count of the
# rows they all hold, and a training loop that catches the error, skips the batch on every rank
# (zero_grad, next batch) and goes on passes the next checks. A backward check that raised left its
# backward unfinished: the next forward drops that backward's partial gradients (abort_backward).

# [Note: The guard under a fake process group]
# Under torch's fake process group (backend "fake", torch.testing._internal.distributed.fake_pg:
# one process plays one rank of a large job, every collective returns at once and writes
# nothing) there are no peers to disagree with and no store to rendezvous a gloo group on. The
# guard then exchanges over the fake group itself (so that the step issues what it would) and
# takes every peer's fingerprint to be its own: the simulated peers run the same script.

# [Note: The guard's exchange in log W rounds]
# An all-gather of every rank's fingerprint is a ring on gloo: W - 1 steps, each a round trip, so
# at W = 1024 over a thousand latencies per check. What the check needs is only whether all
# vectors are equal: the elementwise minimum and maximum over the ranks say it (equal exactly
# when every vector is), and they combine in any order. So the ranks compute both by recursive
# doubling, point to point over links of their own ([Note: The guard's links] in _guard_links.py): with m the largest power of two <= W, the
# ranks m..W-1 first hand their vector to rank r - m; ranks 0..m-1 then swap and combine with
# rank r XOR 2^k for k = 0..log2(m)-1; the ranks m..W-1 receive the result back. That is
# log2(m) rounds, two more when W is not a power of two: 1 at W = 2, 10 at W = 1024. Each
# round's messages are 128 bytes. Only when minimum and maximum differ do the ranks gather
# their readable descriptions, in the same rounds over the same links (the distinct ones and who
# holds each): nothing else, no group of all ranks, is made for that error path.

_GUARDS_MADE: dict[tuple[int, ...], int] = {}


def _guard_key(ranks: list[int]) -> str:
    """The name every member gives the next guard over ``ranks``: the ranks and how many guards over them this
    process made before (the same on every member, as they build the same roots)."""
    key = tuple(ranks)
    made = _GUARDS_MADE.get(key, 0)
    _GUARDS_MADE[key] = made + 1
    return f"{'-'.join(map(str, ranks))}/{made}"


def _swap_sized(link: Any, data: bytes, wait: Callable) -> bytes:
    """Swaps ``data`` with the partner over ``link`` whatever the two lengths (a link swaps equal sizes): the
    lengths first, then both padded to the longer."""
    (theirs,) = _LENGTH.unpack(link.swap(_LENGTH.pack(len(data)), wait))
    return link.swap(data.ljust(max(len(data), theirs), b"\0"), wait)[:theirs]


# Ranks were about to run different collectives (see [Note: Rank-divergence guard]): a RuntimeError,
# defined by the extension so that the strict sequence check in C++ raises the same type.
RankDivergenceError = _C.RankDivergenceError


def mode(group: Any = None) -> str:
    """``off``, ``on`` (the default) or ``strict``, from FLATSHARD_RANK_GUARD; ``off`` over torch's threaded test
    process group (ranks as threads of one process: the guard, its links and the stall watch are per process, made
    for a rank per process)."""
    if group is not None and _is_threaded(group):
        return "off"
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value == "strict":
        return "strict"
    if value in ("1", "on", "true", "yes", ""):
        return "on"
    raise ValueError(f"{ENV}={value!r}: expected 0 (off), 1 (on, the default) or strict")


def _is_threaded(group: Any) -> bool:
    """Whether ``group`` is torch's threaded test process group (torch.testing's ProcessLocalGroup)."""
    try:
        return dist.get_backend(group) == "threaded"
    except Exception:  # noqa: BLE001 (a group torch.distributed does not know)
        return type(group).__name__ == "ProcessLocalGroup"


def group_timeout(group: Any) -> timedelta:
    """The timeout ``group`` was created with (gloo or NCCL), else torch's default."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return dist.default_pg_timeout


class RankGuard:
    """One root's guard: its links and what it counted."""

    def __init__(self, root: RootState) -> None:
        top = root.unit._unit_state
        ranks = set(dist.get_process_group_ranks(top.config.process_group))
        if top.config.replicate_group is not None:  # every shard group of the replicas: the whole (replicate, shard) mesh
            theirs: list[Any] = [None] * dist.get_world_size(top.config.replicate_group)
            with collective_range("rank_guard all_gather_object (ranks)"):
                dist.all_gather_object(theirs, sorted(ranks), group=top.config.replicate_group)
            ranks = {r for group in theirs for r in group}
        self.ranks = sorted(ranks)
        self.hybrid = top.config.replicate_group is not None
        self.key = _guard_key(self.ranks)
        self.label = f"{type(top.wrapped_module).__name__} (the model wrapped {_ordinal(int(self.key.rsplit('/', 1)[1]) + 1)})"
        # See [Note: The guard under a fake process group].
        self.simulated = dist.get_backend(top.config.process_group) == "fake"
        self.forwards = 0
        self._model: tuple[list[int], list[Any]] | None = None
        self._links: list[Any] = []
        self._rounds = [] if self.simulated or len(self.ranks) < 2 else self._pair_rounds(
            group_timeout(top.config.process_group))
        _stall_watch.attach(self)  # see [Note: Stalled waits]

    def _pair_rounds(self, timeout: timedelta) -> list[tuple[str, Any]]:
        """(what to do with the partner's vectors, the link to it) per round (see [Note: The guard's exchange in log W
        rounds] and [Note: The guard's links]), the links made now, in round order on every rank."""
        n, me = len(self.ranks), self.ranks.index(dist.get_rank())
        m = 1 << (n.bit_length() - 1)

        def pair(other: int, round_: str) -> Any:
            a, b = sorted((me, other))
            link = _guard_links.make_link(f"flatshard/rank_guard/{self.key}/{round_}/{a}-{b}/", 0 if me == a else 1,
                                          timeout)
            self._links.append(link)
            return link

        if me >= m:
            link = pair(me - m, "extra")
            return [("give", link), ("take", link)]
        rounds = []
        extra = pair(me + m, "extra") if me + m < n else None
        if extra is not None:
            rounds.append(("combine", extra))
        k = 1
        while k < m:
            rounds.append(("combine", pair(me ^ k, f"round{k.bit_length()}")))
            k <<= 1
        if extra is not None:
            rounds.append(("give", extra))
        return rounds

    def model_changed(self) -> None:
        """The units' dtypes changed (a cast after wrapping): describe them again."""
        self._model = None

    @torch._disable_dynamo  # (a compiled forward calls it as it is, a graph break as at every collective; see [Note: Lazy dynamo])
    def check(self, root: RootState, phase: str) -> None:
        """Collective over the root's ranks: raises RankDivergenceError on every rank if any differs."""
        if len(self.ranks) < 2:
            return
        grad = torch.is_grad_enabled() if phase in ("forward", "backward") else False
        no_sync = not root.unit._unit_state.sync_gradients
        words, description = self._model_fingerprint(root)
        mine = (_PHASES.index(phase), self.forwards, int(grad), int(no_sync), *words, root.gradient_pattern, 0)
        doing = self._doing(phase, grad)
        _stall_watch.refuse_if_given_up(f"run {doing} of {self.label}")
        _stall_watch.enter(self, self.label, phase, self.forwards + (phase == "forward"))
        try:
            with collective_range(f"rank_guard exchange ({phase})"):
                low, high = self._min_max(mine, f"its peers before {doing} (the rank-divergence guard's exchange)")
        except (RankDivergenceError, _stall_watch.PeerGoneError):
            raise
        except RuntimeError as e:
            instead = _stall_watch.failed(f"its peers before {doing} (the rank-divergence guard's exchange)", str(e))
            if instead:  # the group was given up, or a peer is gone: say so (see [Note: Stalled waits])
                raise _stall_watch.error_for(instead) from e
            raise RankDivergenceError(
                f"flatshard: rank {dist.get_rank()} waited for its peers before {doing} (the "
                f"rank-divergence guard), and they did not all come within the group's timeout: a peer is stuck "
                f"in other work (e.g. a collective this rank skipped, or a barrier), or has died. ({e})"
            ) from e
        if low == high:
            return
        mine_readable = {"phase": phase, "doing": doing, "forwards": self.forwards, "grad": grad, "no_sync": no_sync,
                         "model": description, "without_grad": root.without_grad}
        with collective_range("rank_guard exchange (descriptions)"):
            message = _explain(self.ranks, self._gather_descriptions(mine_readable))
        # Every rank raises here, from the same maximum: they agree on the count from now on, so that a loop that
        # catches the error and skips the batch on every rank goes on (see [Note: Recovering from a divergence]).
        self.forwards = high[1]
        if low[6] != high[6]:  # told once: the next check compares the next backward's (see [Note: Gradients given ...])
            root.gradient_pattern, root.without_grad = 0, []
        raise RankDivergenceError(message)

    def _min_max(self, mine: tuple[int, ...], what: str) -> tuple[list[int], list[int]]:
        """The elementwise minimum and maximum of every rank's fingerprint ``mine`` (see [Note: The guard's exchange
        in log W rounds]), as Python ints packed into bytes (no tensor: a check is a few microseconds of Python
        besides its round trips). Collective over the guard's links."""
        low, high = list(mine), list(mine)
        if self.simulated:  # every simulated peer does what this rank does
            return low, high

        def wait(ready: Callable[[float], bool]) -> None:
            _stall_watch.wait(ready, what)

        for kind, link in self._rounds:
            theirs = _PAIR.unpack(link.swap(_PAIR.pack(*low, *high), wait))
            if kind == "combine":
                low = [min(a, b) for a, b in zip(low, theirs[:_WIDTH])]
                high = [max(a, b) for a, b in zip(high, theirs[_WIDTH:])]
            elif kind == "take":
                low, high = list(theirs[:_WIDTH]), list(theirs[_WIDTH:])
            # "give": the partner takes this rank's result
        return low, high

    def _gather_descriptions(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's readable description, in rank order, once a divergence was found: over the guard's links,
        in the rounds of its exchange, each message the distinct descriptions met so far and which ranks hold
        each (a few, however many ranks: most hold the same), so that the error path needs no group of its own."""
        if self.simulated:
            return [mine] * len(self.ranks)
        held: dict[bytes, set[int]] = {pickle.dumps(mine): {dist.get_rank()}}

        def wait(ready: Callable[[float], bool]) -> None:
            _stall_watch.wait(ready, "its peers' descriptions (the rank-divergence guard's exchange)")

        for kind, link in self._rounds:
            theirs = pickle.loads(_swap_sized(link, pickle.dumps([(d, sorted(r)) for d, r in held.items()]), wait))
            if kind == "combine":
                for description, ranks in theirs:
                    held.setdefault(description, set()).update(ranks)
            elif kind == "take":
                held = {description: set(ranks) for description, ranks in theirs}
        by_rank = {rank: pickle.loads(d) for d, ranks in held.items() for rank in ranks}
        return [by_rank[rank] for rank in self.ranks]

    def counted_forward(self) -> None:
        self.forwards += 1

    def _doing(self, phase: str, grad: bool) -> str:
        if phase == "forward":
            return f"forward {self.forwards + 1} {'with' if grad else 'without'} grad"
        if phase == "backward":
            return f"the backward of forward {self.forwards}"
        return f"{phase} after {self.forwards} forwards"

    def _model_fingerprint(self, root: RootState) -> tuple[list[int], list[Any]]:
        """The hash of what decides the units' collectives, in unit order (see [Note: What the guard hashes]),
        and the readable description of the units for the error (which names them too)."""
        if self._model is None:
            description = [_describe_unit(u._unit_state) for u in root.units]
            layouts = [{k: d.get(k) for k in _LAYOUT_KEYS} for d in description]
            digest = hashlib.blake2b(repr(layouts).encode(), digest_size=16).digest()
            words = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]
            self._model = (words, description)
        return self._model


# [Note: What the guard hashes]
# Collectives pair up by the units' order and their flat parameters' layouts, not by
# names: ranks may hold different ignored modules (their parameters are never
# flattened, so no collective touches them) and so name the same unit's parameters
# differently (torch's FSDP1 accepts that, and so must the guard: its
# test_diff_ignored_modules_across_ranks). So the model's hash covers, unit by unit in
# the root's order, the number of units and each unit's strategy, shard factor, dtype,
# shapes (in flat order), mixed precision, offload and use_orig_params; the unit's
# name and its parameters' names are in the description only, to say which unit
# differs. Layout keys are named first when explaining a difference.
_LAYOUT_KEYS = ("strategy", "shapes", "shard_dims", "dtype", "shard_factor", "mixed_precision", "cpu_offload",
                "use_orig_params")


def _describe_unit(s: UnitState) -> dict[str, Any]:
    handle = s.handle
    mp = s.config.mixed_precision
    out: dict[str, Any] = {
        "unit": s.label,
        "strategy": s.config.sharding_strategy.name,
        "mixed_precision": None if mp is None else (str(mp.param_dtype), str(mp.reduce_dtype), str(mp.buffer_dtype)),
        "cpu_offload": bool(s.config.offload_params),
        "use_orig_params": bool(s.config.use_orig_params),
    }
    if handle is not None:
        out.update(parameters=list(s.param_local_names), shapes=[list(shape) for shape in handle.layout.shapes],
                   dtype=str(s.flat_param.dtype), shard_factor=handle.layout.shard_factor)
        if s.config.dim0_layout and any(handle.layout.shard_dims):
            out["shard_dims"] = list(handle.layout.shard_dims)
    return out


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _split(ranks: list[int], values: list[Any]) -> list[tuple[Any, list[int]]]:
    """(value, ranks holding it), the largest group last."""
    groups: list[tuple[Any, list[int]]] = []
    for rank, value in zip(ranks, values):
        for v, members in groups:
            if v == value:
                members.append(rank)
                break
        else:
            groups.append((value, [rank]))
    return sorted(groups, key=lambda g: (len(g[1]), -g[1][0]))


def _explain(ranks: list[int], everyone: list[dict[str, Any]]) -> str:
    """Which ranks differ and how: what each is about to do, else how their models differ."""
    head = "flatshard: ranks diverged (the rank-divergence guard stopped them before a mismatched collective): "
    no_sync_differs = len({d["no_sync"] for d in everyone}) > 1

    def doing(d: dict[str, Any]) -> str:
        text = d["doing"] + (f" {'inside' if d['no_sync'] else 'outside'} no_sync()" if no_sync_differs else "")
        return ("runs " if d["phase"] == "forward" else "is at ") + text

    groups = _split(ranks, [doing(d) for d in everyone])
    missing = _split(ranks, [d["without_grad"] for d in everyone])
    if len(groups) == 1 and len(missing) > 1:  # see [Note: Gradients given on some ranks only]
        return head + _explain_without_grad(missing)
    if len(groups) > 1:
        def said(text: str, members: list[int]) -> str:
            if len(members) > 1:  # plural verb
                text = "run " + text[len("runs "):] if text.startswith("runs ") else "are at " + text[len("is at "):]
            return f"{_ranks_text(members)} {text}"
        return head + " while ".join(said(text, members) for text, members in groups) + "."
    return head + _explain_models(ranks, [d["model"] for d in everyone])


# [Note: Gradients given on some ranks only]
# A fully_shard unit reduces its whole gradient on every rank, zeros for the parameters a rank's backward left out, so
# its collectives match whichever parameters each rank used. Which parameters then get a ``.grad`` is torch FSDP2's
# rule: those the rank's backward gave a gradient to (a parameter no rank used keeps None), or, after
# ``set_reduce_scatter_unused_params(True)``, every trainable one. Under the first, ranks that used different
# parameters (data-dependent routing) would hold a ``.grad`` for a parameter on some ranks and None on others: their
# optimizers would step its shards differently, silently (torch's FSDP2 hangs in that reduce-scatter instead). So
# the end of each backward records, when the guard is on, a digest of which trainable parameters of the reduced units
# were left without a gradient (``gradient_pattern``: nothing to hash when every one got one), and the guard's next
# check (the next forward, or clip_grad_norm_, state_dict, ...) compares it with the others' in the fingerprint's
# seventh word: no exchange of its own. Ranks that differ raise, naming the parameters and the fix. Where that check
# is the next forward, the optimizer step between (the user's code) has run on the different gradients; the error
# says so. With gradient accumulation that reduces every micro-batch (FSDP2's default) the check compares each
# backward's parameters, so routing that differs per micro-batch raises even where the sums at the end would give
# every rank the same ones: torch's FSDP2 hangs at the first such micro-batch; the call is the fix for both.


def gradient_gaps(s: UnitState) -> list[int]:
    """The trainable parameters of a reduced fully_shard unit that this rank's backward gave no gradient to."""
    if not s.config.dim0_layout or all(s.orig_grad_seen) or s.flat_param.grad is None:
        return []
    return [i for i, (p, seen, held) in enumerate(zip(s.orig_params, s.orig_grad_seen, s.orig_grad_held))
            if p.requires_grad and not (seen or held)]  # (one held from before keeps its .grad)


def record_gradient_pattern(root: RootState) -> None:
    """At the end of a backward: which trainable parameters of each reduced fully_shard unit this rank's backward gave
    no gradient to (``root.without_grad``: unit label and parameter names, for the error) and its digest
    (``root.gradient_pattern``: unit and parameter indices, as [Note: What the guard hashes] wants; 0 when every one
    got one; set_reduce_scatter_unused_params counts every parameter as given one: see _orig_params.note_grads)."""
    indices, named = [], []
    for position, u in enumerate(root.units):
        s = u._unit_state
        left = s.gradient_gaps if s.grads_handed_out else gradient_gaps(s)
        if left:
            prefix = f"{s.name}." if s.name else ""
            indices.append((position, left))
            named.append((s.label, [prefix + s.param_local_names[i] for i in left]))
    root.without_grad = named
    # (blake2b, not hash(): str hashes differ between processes; these are ints, but the digest must not depend on it)
    root.gradient_pattern = (int.from_bytes(hashlib.blake2b(repr(indices).encode(), digest_size=8).digest(), "little",
                                            signed=True) if indices else 0)


def _explain_without_grad(groups: list[tuple[Any, list[int]]]) -> str:
    parts = []
    for missing, members in groups:
        left = "; ".join(f"{', '.join(names)} of '{unit}'" for unit, names in missing) or "no parameter"
        parts.append(f"{_ranks_text(members)} left {left} without a gradient")
    return ("in the last backward " + " while ".join(parts) + ", so the ranks hold a .grad for different parameters "
            "and their optimizers would step those parameters' shards differently (if an optimizer step ran since that "
            "backward, it did: restore from a checkpoint). Where ranks use different parameters (data-dependent routing), call "
            "set_reduce_scatter_unused_params(True) on the fully_shard modules: every trainable parameter then gets a "
            ".grad, zeros where no rank gave one (torch's FSDP2 needs the same call; without it it hangs there).")


def _explain_models(ranks: list[int], models: list[list[dict[str, Any]]]) -> str:
    counts = _split(ranks, [len(m) for m in models])
    if len(counts) > 1:
        return ("the models are wrapped differently: " + " while ".join(
            f"{_ranks_text(r)} {'has' if len(r) == 1 else 'have'} {n} FSDP units ({', '.join(u['unit'] for u in models[ranks.index(r[0])])})"
            for n, r in counts) + ". Build and wrap the same model on every rank (the same auto_wrap_policy, the "
            "same number of blocks).")
    for i in range(len(models[0])):
        units = [m[i] for m in models]
        for key in (*_LAYOUT_KEYS, "unit", "parameters"):
            groups = _split(ranks, [u.get(key) for u in units])
            if len(groups) > 1:
                return (f"FSDP unit {i} ('{units[0]['unit']}' on rank {ranks[0]}) differs in {key}: " + " while ".join(
                    f"{_ranks_text(r)} {'has' if len(r) == 1 else 'have'} {_short(v)}" for v, r in groups)
                    + ". Build and wrap the same model, with the same settings, on every rank.")
    return "the models differ (their fingerprints do not match)."


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


@torch._disable_dynamo  # (lazy init may run inside a compiled forward: process groups are not traceable; [Note: Lazy dynamo])
def create(root: RootState) -> RankGuard:
    return RankGuard(root)


def check(root: RootState | None, phase: str) -> None:
    """Runs the root's guard for ``phase``, if the guard is on (and lazy init made the root). Collective."""
    if root is not None and root.guard is not None:
        root.guard.check(root, phase)
