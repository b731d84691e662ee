"""Collectives that will never complete: every rank raises within seconds, naming who left and where.

[Note: Stalled waits]
The rank guard stops ranks that are *about to* run different collectives. What it cannot
stop is a rank that leaves a step after its collectives began: its forward or backward
raised, it caught the error and went on to the next batch, while its peers wait in that
step's next all-gather, which it will never issue (and it waits for them in the next step's
guard); or two models over the same ranks (an RL trainer's policy and reference) run in one
order on one rank and the other order on another. Then every rank waits until the group's
timeout (gloo's default: 30 minutes; torch's FSDP1 hangs the same way).

So a host wait that has not completed after FIRST_SECONDS (C++: CommWork::wait; Python: the
guard's exchange, ``wait``) publishes where this rank is, in the store the process group
already has: which root (model), which step (the guard's count of forwards), which phase,
what it waits for, and, if this rank's last forward raised, where and with what. Then every
EVERY_SECONDS it reads where its peers are. The verdict is conclusive, never a guess about
slowness:
- waiting in a collective of step N while a peer is at a later step or phase of the same
  model: that peer left step N, and the collective will never be issued by it;
- waiting in the guard of step N while a peer waits in a collective of an earlier step or
  phase (one this rank has left; checked only where the collective's group holds this rank:
  not with hybrid sharding's shard groups);
- waiting in one model while a peer waits in another model of the same ranks: the two run in
  different orders;
- waiting in the guard of a phase every rank must call (``state_dict()``, say) while a peer,
  not in any phase of that model since, has issued more collectives on the default process
  group than this rank: it is inside a collective of its own (the rank-0-only save followed by
  ``dist.barrier()``). Each rank's heartbeat (a thread) publishes that count and its position,
  since a rank blocked in torch's collective cannot publish anything: every HEARTBEAT_SECONDS,
  but only once some rank's wait has stalled (see [Note: A quiet heartbeat]);
  the blocked rank itself cannot raise (its thread is inside torch's barrier): its heartbeat
  prints the reason, and its collective fails when the raising rank's process ends.
A rank that reaches a verdict raises RankDivergenceError and marks the group poisoned in the
store (its collectives will never pair again); every rank waiting anywhere sees the mark at
its next look and raises too, with the first rank's explanation. Unlike the guard's errors
this one is not recoverable: a process that raised it refuses every later forward, backward
or state-dict call of its models with ProcessGroupGivenUpError (a RuntimeError, not a
RankDivergenceError, so that a loop catching divergences to skip a batch ends), which names
the first error, rather than issue collectives that would pair with the abandoned ones. A peer whose connection
closed (its process died) is named by a roll call, and raised as PeerGoneError (a RuntimeError, not a
RankDivergenceError either): the ranks that answer within
ROLL_CALL_SECONDS are alive, the others are gone. A live rank answers at its next look if it
waits in flatshard, and from its heartbeat otherwise (a rank blocked in a collective of its
own, or busy in its own code), so the call waits a few heartbeats, not one look.

The store is the one the default process group was made with (torchrun's agent hosts it, or
rank 0's process): if it is unreachable too, the error says so.

A rank that is merely slow (a long evaluation of its own, a checkpoint written to a slow
disk) publishes nothing that triggers a verdict: its peers wait, as before, until it comes
or the group's timeout. Off with the guard (FLATSHARD_RANK_GUARD=0) and under the fake
process group (no store, no peers).
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from flatshard import _C
from flatshard._guard_links import gloo_host
from flatshard._wakeup import Wakeup, wake

if TYPE_CHECKING:
    from flatshard._rank_guard import RankGuard

FIRST_SECONDS = 1.0
EVERY_SECONDS = 0.5
# A live rank answers within a heartbeat or two; on a loaded host (two cores, two test workers of several ranks each)
# one took over 5 s and was named among the gone. Only a roll call with a dead rank waits the whole time, once, as the
# job ends.
ROLL_CALL_SECONDS = 15.0
HEARTBEAT_SECONDS = 1.0
_PREFIX = "flatshard/stall/"
_GIVEN_UP = ("The process group now holds collectives that will never pair: end the job (checkpoints saved before "
             "this step are intact).")
_ORDER = {"forward": 0, "backward": 1}  # other phases (state_dict() and the like) come after both


# A peer gone while this rank waited for it (see flatshard::PeerGone in csrc/flatshard/collectives.h): a
# RuntimeError that is not a RankDivergenceError, raised from C++ waits and Python ones alike.
PeerGoneError = _C.PeerGoneError


class _Gone(str):
    """A verdict that a peer is gone: raised as PeerGoneError, not RankDivergenceError."""


def error_for(verdict: str) -> RuntimeError:
    """The exception a verdict is raised as."""
    return PeerGoneError(verdict) if isinstance(verdict, _Gone) else _C.RankDivergenceError(verdict)


class ProcessGroupGivenUpError(RuntimeError):
    """This process's group was given up (a stalled wait's verdict): no flatshard collective can run on it again.
    Not a RankDivergenceError, so that a loop that catches divergences to skip a batch stops here."""


class _Watch:
    """This process's publication (one per process: a rank is in one place at a time)."""

    def __init__(self) -> None:
        self.store: Any = None
        self.default_store: Any = None  # the default group's store it was made for (a new group: a new watch)
        self.given_up: str | None = None  # the verdict this process raised or saw first
        self.rank = -1
        self.position: dict[str, Any] = {}
        self.abandoned: str | None = None
        self.seq = 0
        self.suspect: tuple[Any, ...] | None = None  # a verdict seen at the last look, not yet confirmed
        self.told = False  # the heartbeat printed the group's poisoning
        self.heart: threading.Thread | None = None
        self.alarmed: dict[int, str | None] = {}  # the peers this process alarmed: their wake-up addresses
        self.wakeup: Any = None  # this rank's _wakeup.Wakeup, or None (see [Note: A quiet heartbeat])
        self.waits_quietly = False  # the heartbeat waits without store traffic (see [Note: A quiet heartbeat])
        self.stop = threading.Event()

    @property
    def active(self) -> bool:
        return self.store is not None


_watch = _Watch()


def attach(guard: RankGuard) -> None:
    """Called when a root's guard is made (collective-free): the store, this rank's key, the C++ hook."""
    if guard.simulated or len(guard.ranks) < 2:
        return
    default_store = dist.distributed_c10d._get_default_store()
    if _watch.active and _watch.default_store is not default_store:  # the job made its process group anew
        _reset()
    if not _watch.active:
        _watch.default_store = default_store
        _watch.store = dist.PrefixStore(_PREFIX, default_store)
        _watch.rank = dist.get_rank()
        _C.set_stall_hook(_on_stall, FIRST_SECONDS, EVERY_SECONDS)
        _watch.store.set(f"beat/{_watch.rank}", _beat())
        try:  # see [Note: Waking a heartbeat without a connection] in _wakeup.py
            _watch.wakeup = Wakeup(gloo_host())
            _watch.store.set(f"wake/{_watch.rank}", _watch.wakeup.address)
        except OSError:
            _watch.wakeup = None
        _watch.heart = threading.Thread(target=_heartbeat, name="flatshard-heartbeat", daemon=True)
        _watch.heart.start()
        atexit.register(_stop_heartbeat)
    _publish({})  # (every rank's key exists from here on: peers read them all at once)


def _reset() -> None:
    """Forgets the watch of a process group that is gone (destroyed; a new one is made)."""
    global _watch
    _stop_heartbeat()
    _C.set_stall_hook(None)
    _watch = _Watch()


def _given_up(verdict: str) -> str:
    """Notes ``verdict`` (if any) as the reason this process's group was given up; returns it."""
    if verdict and _watch.given_up is None:
        _watch.given_up = verdict
    return verdict


def refuse_if_given_up(doing: str) -> None:
    """Raises ProcessGroupGivenUpError if this process's group was given up (see the Note)."""
    if _watch.given_up is not None:
        raise ProcessGroupGivenUpError(
            f"flatshard: rank {_watch.rank} cannot {doing}: its process group was given up when a wait could never "
            f"complete, and holds collectives that will never pair. The first error: "
            f"{_watch.given_up.splitlines()[0][:600]}")


def enter(guard: RankGuard, label: str, phase: str, step: int) -> None:
    """The root of ``guard`` starts ``phase`` of ``step`` (its count of forwards): where a stalled wait says it is."""
    if phase == "backward":
        _watch.abandoned = None  # (the step went on)
    _watch.position = {"root": guard.key, "label": label, "ranks": guard.ranks, "hybrid": guard.hybrid,
                       "step": step, "phase": phase}


def note_abandoned(label: str, step: int, error: BaseException) -> None:
    """The root's forward raised: if this rank goes on, its peers learn where it left (see the Note)."""
    if _watch.active:
        _watch.abandoned = f"its forward {step} of {label} raised {type(error).__name__}: {str(error)[:200]}"


def wait(ready: Callable[[float], bool], what: str) -> None:
    """Waits for a Python-side exchange (the guard's): ``ready(seconds)`` waits at most ``seconds`` and says whether
    it is done (it raises itself at the group's timeout); watched between slices (see the Note)."""
    if not _watch.active:
        while not ready(3600.0):
            pass
        return
    waited, slice_ = 0.0, FIRST_SECONDS
    while not ready(slice_):
        if not waited:
            _watch.suspect = None  # (a new wait: nothing seen yet)
        waited += slice_
        slice_ = EVERY_SECONDS
        verdict = _given_up(_look(what, waited, waiting="guard"))
        if verdict:
            raise error_for(verdict)


def _on_stall(what: str, waited: float, error: str) -> tuple[str, bool]:
    """The C++ hook: a collective of the runtime's has waited ``waited`` seconds, or failed with ``error``. Answers
    (verdict or "", whether it is that a peer is gone)."""
    try:
        verdict = failed(what, error) if error else _given_up(_look(what, waited, waiting="collective"))
    except Exception:  # noqa: BLE001 (a failed look must not turn into an error of the wait)
        return "", False
    return str(verdict), isinstance(verdict, _Gone)


def failed(what: str, error: str) -> str:
    """A wait for ``what`` failed with ``error``: the error to raise instead, or '' (the backend's stands): the
    group's poisoned mark (a peer raised first and ended), or, if a peer's connection closed, who is gone."""
    if not _watch.active:
        return ""
    try:
        return _given_up(_failed(what, error))
    except Exception as store_error:  # noqa: BLE001 (the store is unreachable: its host ended)
        return _given_up(_Gone(
            f"flatshard: rank {_watch.rank}'s wait for {what} failed ({error.splitlines()[0][:300]}), and the job's "
            f"store is unreachable too ({str(store_error).splitlines()[0][:200]}): the process that hosts it (rank 0, "
            f"unless torchrun's agent hosts it) has ended. {_GIVEN_UP}"))


def _failed(what: str, error: str) -> str:
    store = _watch.store
    poisoned = int(store.add("poisoned", 0))
    # A closed connection after the group was given up for a divergence is the divergence's consequence (a
    # peer raised and ended): that is what to say. Else it is a peer's death: who is gone.
    if connection_closed(error) and (not poisoned or store.check(["poisoned/gone"])):
        return _gone(what, f"lost its connection to a peer while waiting for {what}", error.splitlines()[0][:300])
    if poisoned:
        store.set(f"roll_call/{_watch.rank}", "here")
        first = store.get("poisoned/1").decode()
        return (f"flatshard: rank {_watch.rank}'s wait for {what} failed ({error.splitlines()[0][:300]}) after the "
                f"process group was given up. {first} {_GIVEN_UP}")
    return ""


_CLOSED = ("connection closed", "connection reset", "broken pipe", "connection refused", "end of file")


def connection_closed(error: BaseException | str) -> bool:
    """gloo's errors when a peer's socket closed (its process ended)."""
    text = str(error).lower()
    return any(phrase in text for phrase in _CLOSED)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _world_collectives() -> int:
    """How many collectives this rank issued on the default process group (c10d's sequence number)."""
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 (a backend without sequence numbers, or the group destroyed)
        return -1


def _beat() -> str:
    return json.dumps({"collectives": _world_collectives(), "position": _watch.position, "t": time.time()})


# [Note: A quiet heartbeat]
# While training is healthy the watch makes no store operation at all and opens no connection:
# each rank's heartbeat thread blocks on a UDP socket of its own until a peer wakes it (see
# [Note: Waking a heartbeat without a connection] in _wakeup.py). A rank whose wait stalls past
# FIRST_SECONDS wakes the peers it looks at (``_raise_alarm``: their addresses read once, a
# datagram each at every look, and their ``alarm/<rank>`` keys set once; O(W) operations, on that
# path only); from then on the heartbeats publish and look every HEARTBEAT_SECONDS as the verdicts
# need. Where no UDP socket can be bound, the heartbeat blocks on its ``alarm/<rank>`` key through
# a store client of its own (``Store.clone()``: a second connection to the job's TCPStore, the same
# file for a FileStore, renewed every ALARM_WAIT_SECONDS), and a store that has no second client
# keeps it polling every ALARM_POLL_SECONDS (``_watch.waits_quietly`` says whether it waits without
# store traffic). At exit a rank wakes its own heartbeat, so that the thread is not inside a wait
# when the interpreter ends.
ALARM_WAIT_SECONDS = 300.0
ALARM_POLL_SECONDS = 10.0


def _second_client() -> Any:
    """A client of its own to the job's store (``Store.clone``: a second connection to a TCPStore, the same file for
    a FileStore), so that the heartbeat's blocking wait holds neither the main thread's client nor its lock; None
    for a store that cannot be cloned."""
    try:
        return dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store().clone())
    except Exception:  # noqa: BLE001 (a store class without clone())
        return None


def _wait_for_alarm() -> bool:
    """Blocks until this rank's alarm is raised (True), or the watch stops (False). No store operation but the one
    pending wait (see [Note: A quiet heartbeat])."""
    if _watch.wakeup is not None:  # (the usual way: see [Note: Waking a heartbeat without a connection])
        _watch.waits_quietly = True
        return _watch.wakeup.wait(_watch.stop)
    key = f"alarm/{_watch.rank}"
    client = _second_client()
    _watch.waits_quietly = client is not None
    while not _watch.stop.is_set():
        if client is None:  # poll, slowly
            if _watch.stop.wait(ALARM_POLL_SECONDS):
                return False
            try:
                if _watch.store.check([key]):
                    return True
            except Exception:  # noqa: BLE001 (the store is gone: the job is ending)
                return False
            continue
        try:
            client.wait([key], timedelta(seconds=ALARM_WAIT_SECONDS))
            return not _watch.stop.is_set()
        except Exception as e:  # noqa: BLE001
            if "time" not in str(e).lower():  # (not the wait's timeout: the store is gone, the job is ending)
                return False
    return False


def _raise_alarm(ranks: list[int]) -> None:
    """Wakes the heartbeats of ``ranks``: a wait of this rank stalled. Their keys are set and their addresses read
    once; a datagram goes to each at every call (one may be lost: see [Note: A quiet heartbeat])."""
    for rank in ranks:
        if rank not in _watch.alarmed:
            _watch.store.set(f"alarm/{rank}", "1")
        if _watch.alarmed.get(rank) is None:  # (read again at the next look until the peer has published it)
            key = f"wake/{rank}"
            _watch.alarmed[rank] = _watch.store.get(key).decode() if _watch.store.check([key]) else None
    for rank in ranks:
        if _watch.alarmed[rank] is not None:
            wake(_watch.alarmed[rank])


def _heartbeat() -> None:
    """Once a peer's wait stalled (see [Note: A quiet heartbeat]): this rank's default-group collective count and
    position, every HEARTBEAT_SECONDS; prints the group's poisoning once, for a main thread blocked outside
    flatshard. Ends with the store."""
    if not _wait_for_alarm():
        return
    store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
    answered = False
    while True:
        try:
            store.set(f"beat/{_watch.rank}", _beat())
            if not _watch.told and int(store.add("poisoned", 0)):
                _watch.told = True
                print(f"flatshard (rank {_watch.rank}): the process group was given up: "
                      f"{store.get('poisoned/1').decode()} {_GIVEN_UP}", file=sys.stderr, flush=True)
            if _watch.told and not answered and store.check(["poisoned/gone"]):
                store.set(f"roll_call/{_watch.rank}", "here")  # (alive, wherever the main thread is: see roll_call)
                answered = True
        except Exception:  # noqa: BLE001 (the store is gone: the job is ending)
            return
        if _watch.stop.wait(HEARTBEAT_SECONDS):
            return


def _stop_heartbeat() -> None:
    """At exit, before the interpreter's finalization: a daemon thread woken then, inside the store's C++ code, would
    be ended by a forced unwind through it, which aborts the process (std::terminate). Its own alarm wakes it from
    its wait (see [Note: A quiet heartbeat])."""
    _watch.stop.set()
    if _watch.wakeup is not None and _watch.heart is not None and _watch.heart.is_alive():
        wake(_watch.wakeup.address)
    elif _watch.store is not None and _watch.heart is not None and _watch.heart.is_alive():
        try:
            _watch.store.set(f"alarm/{_watch.rank}", "1")
        except Exception:  # noqa: BLE001 (the store is gone: so is the thread's wait)
            pass
    if _watch.heart is not None:
        _watch.heart.join(timeout=2 * HEARTBEAT_SECONDS)
    if _watch.wakeup is not None:
        _watch.wakeup.close()


def _publish(position: dict[str, Any]) -> None:
    _watch.seq += 1
    _watch.store.set(str(_watch.rank), json.dumps({**position, "seq": _watch.seq, "abandoned": _watch.abandoned,
                                                   "t": time.time()}))


def _gone(what: str, happened: str, error: str) -> str:
    """A peer's process ended: who is gone, by a roll call."""
    gone = roll_call(_watch.position.get("ranks") or [])
    who = (_ranks_text(gone) + (" is" if len(gone) == 1 else " are") + " gone" if gone else "a peer is gone")
    return _Gone(f"flatshard: rank {_watch.rank} {happened}: {who} (its connection closed: the process ended, e.g. "
                 f"killed or out of memory; ranks that did not answer a roll call within {ROLL_CALL_SECONDS:.0f} s). "
                 f"The job cannot go on without it: restart it from the last checkpoint. ({error})")


def _look(what: str, waited: float, waiting: str) -> str:
    """Publishes this rank's position, reads its peers'; the error to raise, or ''."""
    store = _watch.store
    poisoned = int(store.add("poisoned", 0))
    if poisoned and store.check(["poisoned/gone"]):
        return _gone(what, f"gave up waiting for {what} after {waited:.0f} s", store.get("poisoned/1").decode())
    if poisoned:
        store.set(f"roll_call/{_watch.rank}", "here")  # (alive: see roll_call)
        first = store.get("poisoned/1").decode()
        return f"flatshard: rank {_watch.rank} gave up waiting for {what} after {waited:.0f} s. {first} {_GIVEN_UP}"
    me = {**_watch.position, "waiting": waiting, "what": what}
    _publish(me)
    if "root" not in me:
        return ""
    peers = partners(me["ranks"], _watch.rank)  # (see [Note: A look reads log W records])
    _raise_alarm(peers)  # their heartbeats publish from now on (see [Note: A quiet heartbeat])
    beats = store.multi_get([f"beat/{r}" for r in peers]) if waiting == "guard" else [None] * len(peers)
    for rank, raw, beat in zip(peers, store.multi_get([str(r) for r in peers]), beats):
        theirs = json.loads(raw)
        reason = _diverged(me, theirs, rank) or (_elsewhere(me, json.loads(beat), rank) if beat else "")
        if not reason:
            continue
        # Confirmed only at the next look, with this wait still pending and the peer where it was (a wait starved
        # of the CPU for a moment must not end a healthy job).
        suspect = (rank, reason.split(":")[0], theirs.get("root"), theirs.get("step"), theirs.get("phase"),
                   theirs.get("what"), what, me.get("step"), me.get("phase"))
        confirmed, _watch.suspect = _watch.suspect == suspect, suspect
        if confirmed:
            message = f"flatshard: ranks can no longer meet (see [Note: Stalled waits]): {reason} {_GIVEN_UP}"
            if int(store.add("poisoned", 1)) == 1:
                store.set("poisoned/1", f"Rank {_watch.rank} found: {reason}")
            return message
        return ""
    _watch.suspect = None
    return ""


# [Note: A look reads log W records]
# A stalled rank reads the records of its guard partners only (the ranks at XOR distances 1, 2, 4, ... of its
# place among the model's ranks, and the extra pair of a W that is not a power of two: the guard's rounds), not
# of every peer: log2(W) keys a look instead of W, which at W = 1024 with every rank stalled is 20 k reads a look
# instead of a million. A verdict needs one rank that sees the rank that left or waits elsewhere; every rank has
# log2(W) partners, and the first verdict poisons the group, which every waiting rank reads in one key. The roll
# call after a peer's death still asks every rank, once.
def partners(ranks: list[int], rank: int) -> list[int]:
    """``rank``'s partners among ``ranks`` in the guard's rounds (see the Note above)."""
    n, me = len(ranks), ranks.index(rank)
    m = 1 << (n.bit_length() - 1)
    if me >= m:
        return [ranks[me - m]]
    out = [ranks[me + m]] if me + m < n else []
    k = 1
    while k < m:
        out.append(ranks[me ^ k])
        k <<= 1
    return out


def _phase(p: dict[str, Any]) -> str:
    """"forward 3 of GPT (...)", "state_dict() after 3 forwards of GPT (...)"."""
    if p["phase"] in _ORDER:
        return f"{p['phase']} {p['step']} of {p['label']}"
    return f"{p['phase']} after {p['step']} forwards of {p['label']}"


def _where(p: dict[str, Any], rank: int) -> str:
    text = f"rank {rank} {'waits in' if p.get('waiting') else 'was last seen at'} {_phase(p)}"
    if p.get("what"):
        text += f", waiting for {p['what']}"
    return text


def _diverged(me: dict[str, Any], theirs: dict[str, Any], rank: int) -> str:
    # A stalled rank republishes every EVERY_SECONDS: an older record is from a wait that has completed since.
    if "root" not in theirs or not theirs.get("waiting") or time.time() - theirs.get("t", 0) > 3 * EVERY_SECONDS:
        return ""
    mine_text, their_text = _where(me, _watch.rank), _where(theirs, rank)
    if theirs["root"] != me["root"]:
        if _watch.rank in theirs["ranks"] and rank in me["ranks"]:
            return (f"{their_text} while {mine_text}: two models over the same ranks run in different orders on "
                    f"different ranks. Run every model's steps in the same order on every rank.")
        return ""
    mine = (me["step"], _ORDER.get(me["phase"], 2))
    their = (theirs["step"], _ORDER.get(theirs["phase"], 2))
    left = f" ({theirs['abandoned']})" if theirs.get("abandoned") else ""
    if me["waiting"] == "collective" and their > mine and not me.get("hybrid"):
        return (f"rank {rank} left {_phase(me)} before its end{left}: {their_text}, "
                f"while {mine_text}, which rank {rank} will never issue. A rank that skips a batch after an error "
                "must not go on alone: every rank must skip it (or none).")
    if me["waiting"] == "guard" and theirs["waiting"] == "collective" and their < mine and not me.get("hybrid"):
        mine_left = f" ({_watch.abandoned})" if _watch.abandoned else ""
        return (f"rank {_watch.rank} left {_phase(theirs)} before its end{mine_left}: {their_text}, which rank {_watch.rank} will never issue, while {mine_text}. A rank "
                "that skips a batch after an error must not go on alone: every rank must skip it (or none).")
    return ""


def _elsewhere(me: dict[str, Any], beat: dict[str, Any], rank: int) -> str:
    """``rank`` is inside a collective of its own while this rank waits in a guard (see the Note)."""
    where = beat.get("position") or {}
    mine = _world_collectives()
    if (me["phase"] in _ORDER or beat.get("collectives", -1) <= mine or mine < 0 or time.time() - beat.get("t", 0) > 3 * HEARTBEAT_SECONDS
            or where.get("root") not in (None, me["root"])):
        return ""
    if where.get("root") is not None and (where["step"], _ORDER.get(where["phase"], 2)) > (
            me["step"], _ORDER.get(me["phase"], 2)):
        return ""
    return (f"rank {rank} has issued {beat['collectives']} collectives on the default process group where rank "
            f"{_watch.rank} issued {mine}, and stays out of {me['label']}: it is inside a collective of its own (a "
            f"barrier, an all_reduce), while {_where(me, _watch.rank)}, which rank {rank} has not called. "
            f"{me['phase']} is collective: call it on every rank (also to save on rank 0 only: "
            f"FullStateDictConfig(rank0_only=True) still needs every rank).")


def roll_call(ranks: list[int]) -> list[int]:
    """After a peer's connection closed: marks the group poisoned, answers, and returns the ranks of ``ranks`` that
    have not answered within ROLL_CALL_SECONDS (a live rank answers at its next look, see ``_look``, or from its
    heartbeat)."""
    if not _watch.active:
        return []
    store = _watch.store
    _raise_alarm([r for r in ranks if r != _watch.rank])  # (a live peer blocked elsewhere answers from its heartbeat)
    store.set("poisoned/gone", "1")
    if int(store.add("poisoned", 1)) == 1:
        store.set("poisoned/1", f"Rank {_watch.rank} lost its connection to a peer (a rank's process ended).")
    store.set(f"roll_call/{_watch.rank}", "here")
    deadline = time.monotonic() + ROLL_CALL_SECONDS
    missing = [r for r in ranks if r != _watch.rank]
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"roll_call/{r}"])]
        if missing:
            time.sleep(0.05)
    return missing
