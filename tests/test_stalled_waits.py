"""Ranks that can no longer meet raise, every one of them, within seconds (issue 22, items 4, 5 and 8; see
[Note: Stalled waits]).

Each rank checks the error's type and message: that is what shows the stall watch found the cause. Without it
every case would wait until the process group's timeout, set here (PG_TIMEOUT) above the run's deadline
(DEADLINE), so such a run fails as a hang, never as gloo's timeout error passing for a verdict. The deadline is
generous (the watch decides within seconds on an idle machine) so that a loaded machine cannot fail a case; no
case measures its time. Where a case needs a rank to be somewhere (waiting in a collective, interrupted), it
waits for that event, read from the stall watch's own records in the store, never for a guessed duration.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import abandon_group, run_distributed
from flatshard.testing._probes import counting_file_store, established_tcp_connections
from models import Block, gpt_loss, local_slice, make_batch, make_gpt

DEADLINE = 120.0  # a hang's bound, not a speed claim (see the docstring)
PG_TIMEOUT = 300.0  # above DEADLINE: a verdict that never comes is a hang


def _watch_record(rank: int) -> dict:
    """What ``rank``'s stall watch last published (see [Note: Stalled waits]): its position, "waiting" while it
    waits, and "seq", one more at every look."""
    import torch.distributed as dist

    from flatshard import _stall_watch

    store = dist.PrefixStore(_stall_watch._PREFIX, dist.distributed_c10d._get_default_store())
    return json.loads(store.get(str(rank)))


def _until_watched(rank: int, waiting: str, phase: str, step: int, looks: int = 3) -> None:
    """Returns once ``rank``'s stall watch has looked ``looks`` times while waiting in a ``waiting`` ("guard" or
    "collective") in ``phase`` ("forward", "backward") of its ``step``-th forward (counted from 1): ``rank`` is
    stalled there, and its watch has seen this rank where it is. Polls the store."""
    deadline = time.monotonic() + DEADLINE
    first, record = None, {}
    while time.monotonic() < deadline:
        record = _watch_record(rank)
        if (record.get("waiting"), record.get("phase"), record.get("step")) == (waiting, phase, step):
            first = record["seq"] if first is None else first
            if record["seq"] - first >= looks - 1:
                return
        time.sleep(0.02)
    raise AssertionError(f"rank {rank}'s stall watch never looked {looks} times waiting in a {waiting} in {phase} "
                         f"{step}: {record}")


def _model():
    from flatshard import FullyShardedDataParallel as FSDP

    return FSDP(make_gpt(n_layers=3), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))


def _step(model, opt, step, rank, world_size):
    gpt_loss(model, *local_slice(make_batch(seed=step), rank, world_size)).backward()
    opt.step()
    opt.zero_grad()


class _BadBatch(Exception):
    pass


def _skips_after_forward_raised(rank, world_size, where):
    """Rank 1's forward (or backward) raises partway, after collectives of the step were issued; it skips the
    batch and goes on, as "skip the bad batch" loops do, while its peers go on with the step."""
    from flatshard import RankDivergenceError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world_size)
    block = model.blocks[1].module if hasattr(model.blocks[1], "module") else model.blocks[1]
    with pytest.raises(RankDivergenceError) as caught:
        for step in (1, 2):
            try:
                if rank == 1 and step == 1:
                    if where == "forward":
                        handle = block.register_forward_hook(lambda *_: (_ for _ in ()).throw(_BadBatch("bad")))
                    else:
                        handle = block.register_full_backward_hook(
                            lambda *_: (_ for _ in ()).throw(_BadBatch("bad")))
                else:
                    handle = None
                try:
                    _step(model, opt, step, rank, world_size)
                finally:
                    if handle is not None:
                        handle.remove()
            except _BadBatch:
                opt.zero_grad()
                continue  # skip the batch: on this rank only
    # A loop that catches divergences to skip the batch goes on: the group is given up, so the next step refuses at
    # once (no collective issued), with its own type, naming the first error.
    from flatshard import ProcessGroupGivenUpError

    from flatshard import _C

    issued = _C.collective_counts()
    with pytest.raises(ProcessGroupGivenUpError, match=r"cannot run forward \d+ with grad of GPT \(the model wrapped "
                                                       r"1st\): its process group was given up .* rank 1 left"):
        _step(model, opt, 3, rank, world_size)
    assert _C.collective_counts() == issued, "the refused step issued a collective"
    assert not issubclass(ProcessGroupGivenUpError, RankDivergenceError)
    abandon_group()
    message = str(caught.value)
    # Every rank names rank 1 as the one that left the step, and where, and the collective a peer waits for in
    # vain. A forward that raised says with what.
    assert "rank 1 left" in message and "which rank 1 will never issue" in message, message
    assert f"rank 1 left {where} 2 of GPT (the model wrapped 1st) before its end" in message, message
    assert "The process group now holds collectives that will never pair: end the job" in message, message
    if where == "forward":
        assert "_BadBatch: bad" in message, message


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_that_skips_a_batch_alone_fails_every_rank(where, world_size):
    run_distributed(_skips_after_forward_raised, world_size, where, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _ctrl_c_in_a_stalled_wait(rank, world_size):
    """Rank 1 is slow inside its forward (a hook that waits); rank 0 waits in that forward's all-gather, inside
    the runtime's C++ wait, and the user presses Ctrl-C there: rank 0 gets its KeyboardInterrupt, not a backend
    error, not a wait that goes on; its process ends, and rank 1 is told that rank 0 is gone. Events, not
    durations: the signal is sent once rank 0's stall watch has published that it waits in a collective (it is
    inside the C++ wait), and rank 1's hook holds the forward until rank 0 has been interrupted."""
    import threading

    import torch.distributed as dist

    from flatshard import PeerGoneError, RankDivergenceError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world_size)
    store = dist.distributed_c10d._get_default_store()  # (a file: it outlives rank 0's process)
    block = model.blocks[1].module if hasattr(model.blocks[1], "module") else model.blocks[1]
    if rank == 1:
        handle = block.register_forward_pre_hook(lambda *_: store.wait(["test/rank0_interrupted"]))
        with pytest.raises(PeerGoneError, match=r"rank 0 is gone \(its connection closed") as raised:
            _step(model, opt, 1, rank, world_size)
        assert not isinstance(raised.value, RankDivergenceError)  # (a loop skipping divergent batches must stop)
        handle.remove()
        abandon_group()
        return None

    def interrupt_when_stalled():
        _until_watched(0, "collective", "forward", 2, looks=1)
        os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C in a terminal reaches Python's handler; a test command started in the background (nohup, a CI
    # runner) may have SIGINT ignored, and every process it starts inherits that: put the terminal's back.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    threading.Thread(target=interrupt_when_stalled, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        _step(model, opt, 1, rank, world_size)
    store.set("test/rank0_interrupted", "1")
    abandon_group()
    return _watch_record(0).get("what")


def test_ctrl_c_ends_a_stalled_wait():
    waited_for = run_distributed(_ctrl_c_in_a_stalled_wait, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)[0]
    assert "all-gather" in waited_for or "all_gather" in waited_for, waited_for


def _two_models_in_different_orders(rank, world_size):
    """An RL trainer's policy and reference model over the same ranks, run in one order on rank 0 and the other
    on rank 1."""
    from flatshard import RankDivergenceError

    policy, reference = _model(), _model()
    tokens = local_slice(make_batch(seed=0), rank, world_size)[0]
    with torch.no_grad():  # both initialized (lazy init is collective too)
        policy(tokens), reference(tokens)
    with pytest.raises(RankDivergenceError, match=r"two models over the same ranks run in different orders"):
        with torch.no_grad():
            for model in ((policy, reference) if rank == 0 else (reference, policy)):
                model(tokens)
    abandon_group()


def test_two_models_run_in_different_orders_fail():
    run_distributed(_two_models_in_different_orders, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


@pytest.mark.parametrize("where", ["between", "mid"])
def test_a_dead_peer_is_named_not_called_a_divergence(where):
    """Three ranks as torchrun starts them (forked by tests/scripts/fork_ranks.py); the last is killed between
    steps, or inside a step while the others wait in a collective: the survivors raise PeerGoneError saying which
    rank is gone (not a RankDivergenceError: a loop that catches divergences to skip a batch does not catch it).
    The script's group timeout (30 s) bounds when: a survivor that only failed at gloo's timeout exits 1, not 3."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, os.path.join(here, "scripts", "fork_ranks.py"), "1", "3",
                           os.path.join(here, "scripts", "peer_killed_between_steps.py")],
                          capture_output=True, text=True, timeout=2 * DEADLINE,
                          env={**os.environ, "PEER_KILLED_WHERE": where})
    assert done.returncode == 0, done.stderr[-4000:]
    outs = {o["rank"]: o for o in map(json.loads, filter(lambda line: line.startswith("{"), done.stdout.splitlines()))}
    assert outs[2]["status"] == -signal.SIGKILL, outs[2]
    both = "\n".join(f"--- rank {r}: exit {outs[r]['status']}\n{outs[r]['output'][-3000:]}" for r in (0, 1))
    for rank in (0, 1):
        out, code = outs[rank]["output"], outs[rank]["status"]
        # (both survivors' outputs on a failure: a rank named gone by its peer's roll call tells why in its own)
        assert code == 3 and "PeerGoneError: flatshard: rank" in out and "rank 2 is gone (its connection closed" in out, \
            f"rank {rank} failed the check\n{both}"


def _state_dict_on_rank_0_only(rank, world_size):
    """Rank-0-only saving code: rank 0 calls state_dict(), rank 1 goes to the barrier after it (issue 22, item 7).
    Rank 0 raises, naming rank 1 and the fix; rank 1, blocked in torch's barrier, fails there when rank 0's
    process ends (its heartbeat prints the reason: see [Note: Stalled waits])."""
    import io

    import torch.distributed as dist

    from flatshard import RankDivergenceError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world_size)
    if rank == 0:
        with pytest.raises(RankDivergenceError, match=r"rank 1 has issued \d+ collectives on the default process "
                                                      r"group where rank 0 issued \d+, and stays out of GPT .*: it is "
                                                      r"inside a collective of its own .*, while rank 0 waits in "
                                                      r"state_dict\(\) after 1 forwards of GPT .*state_dict\(\) is "
                                                      r"collective: call it on every rank"):
            torch.save(model.state_dict(), io.BytesIO())
    else:
        with pytest.raises(RuntimeError, match=r"[Cc]onnection (closed|reset)"):
            dist.barrier()
    abandon_group()


def test_state_dict_on_one_rank_fails():
    run_distributed(_state_dict_on_rank_0_only, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _slow_but_healthy(rank, world_size):
    """Rank 1 is slow, not gone: it holds back before the step (its peer waits in the guard's exchange), inside
    the forward of a block (its peer waits in an all-gather) and at that block's backward (in a reduction or a
    prefetch), each time until rank 0's stall watch has looked three times (two looks confirm a verdict). No
    verdict may come of it: both ranks finish the step, with the losses of a run that was not slowed."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        block = model.blocks[1].module if hasattr(model.blocks[1], "module") else model.blocks[1]
        handles = []
        if step == 1 and rank == 1:
            _until_watched(0, "guard", "forward", 2)
            handles = [block.register_forward_pre_hook(lambda *_: _until_watched(0, "collective", "forward", 2)),
                       block.register_full_backward_pre_hook(
                           lambda *_: _until_watched(0, "collective", "backward", 2))]
        loss = gpt_loss(model, *local_slice(make_batch(seed=step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        for h in handles:
            h.remove()
        losses.append(loss.item())
    return losses


def _not_slowed(rank, world_size):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = gpt_loss(model, *local_slice(make_batch(seed=step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_slow_rank_is_waited_for_not_called_gone():
    slowed = run_distributed(_slow_but_healthy, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    plain = run_distributed(_not_slowed, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    for rank in range(2):
        assert slowed[rank] == pytest.approx(plain[rank], rel=1e-6, abs=1e-7), (slowed, plain)


def _healthy_steps_store_operations(rank, world_size, path, guard):
    """The job's process group made anew over a store that counts its operations: a few steps (the guard and its
    links set up, the stall watch attached), then more steps, whose store operations are counted; with the guard
    on or off (``guard``): (store operations, this rank's TCP connections after them, store clients cloned)."""
    import datetime

    import torch.distributed as dist

    os.environ["FLATSHARD_RANK_GUARD"] = guard
    dist.destroy_process_group()
    store = counting_file_store(path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        _step(model, opt, step, rank, world_size)
    dist.barrier()
    before = store.operations
    for step in range(2, 8):
        _step(model, opt, step, rank, world_size)
    time.sleep(2.5)  # (a second heartbeat, were there one: not a timing assertion, what happens in it is counted)
    from flatshard import _stall_watch

    assert guard == "0" or _stall_watch._watch.waits_quietly  # (its UDP wake-up, not a slow poll of the job's store)
    return store.operations - before, established_tcp_connections(), store.clones


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_healthy_job_makes_no_store_operations_and_log_w_connections(world_size, tmp_path):
    """[Note: A quiet heartbeat]: after the first steps, steps and idle seconds of a healthy job make no operation
    on the job's store, and the guard holds log2(W) connections per rank beyond the process groups' (its links; the
    heartbeats wait on UDP sockets: [Note: Waking a heartbeat without a connection]), counted against the same job
    with the guard off."""
    on = run_distributed(_healthy_steps_store_operations, world_size, str(tmp_path / "on"), "1",
                         timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    off = run_distributed(_healthy_steps_store_operations, world_size, str(tmp_path / "off"), "0",
                          timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    assert [ops for ops, _, _ in on] == [0] * world_size, on
    assert [clones for _, _, clones in on] == [0] * world_size, on  # (no second store client)
    extra = [conns_on - conns_off for (_, conns_on, _), (_, conns_off, _) in zip(on, off)]
    assert max(extra) <= math.log2(world_size) and min(extra) >= 1, (extra, on, off)


def _sequence_numbers(rank, world_size):
    import torch.distributed as dist

    from flatshard import _stall_watch

    before = _stall_watch._world_collectives()
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    return before, _stall_watch._world_collectives()


def test_the_private_c10d_sequence_number_the_watch_reads_still_counts_collectives():
    """The stall watch reads c10d's private per-group sequence number (``_get_sequence_number_for_group``, see
    ``_stall_watch._world_collectives``) to tell a rank blocked in a collective of its own: if torch renames it or
    stops counting, this fails (the watch would quietly lose that verdict: it reads -1 then)."""
    for before, after in run_distributed(_sequence_numbers, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT):
        assert before >= 0 and after == before + 2, (before, after)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 12, 1024])
def test_a_look_reads_its_guard_partners_only(world_size):
    """[Note: A look reads log W records]: at most ceil(log2 W) partners each, partnership mutual, and every rank
    reachable from every other through partners (a verdict seen by one rank's partners reaches all through the
    poisoned mark; here: no rank is left out of the partner graph)."""
    from flatshard._stall_watch import partners

    ranks = [10 + r for r in range(world_size)]  # (global ranks of a subgroup)
    of = {r: partners(ranks, r) for r in ranks}
    assert max(len(p) for p in of.values()) <= (world_size - 1).bit_length()
    assert all(r in of[p] for r in ranks for p in of[r])
    seen, todo = {ranks[0]}, [ranks[0]]
    while todo:
        for p in of[todo.pop()]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    assert seen == set(ranks)


def test_a_heartbeat_wakes_only_to_its_token(caplog):
    """[Note: Waking a heartbeat without a connection]: a datagram without the rank's token (anything that found the
    port: the guard links' old greeting, garbage) leaves the heartbeat waiting and is reported, once per sender; its
    token wakes it; the watch's stop ends the wait."""
    import socket
    import threading

    from flatshard._wakeup import Wakeup, wake

    wakeup, stop, woke = Wakeup("127.0.0.1"), threading.Event(), []
    waiter = threading.Thread(target=lambda: woke.append(wakeup.wait(stop)))
    waiter.start()
    host, port, token = wakeup.address.rsplit(":", 2)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for garbage in (b"flatshard-guard-link\n", b"\0" * 64, token[:-1].encode()):
            sock.sendto(garbage, (host, int(port)))
    deadline = time.monotonic() + 30  # (the reports are what says the datagrams were read: no guessed wait)
    while not [r for r in caplog.records if "without its token" in r.getMessage()] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # (the other two datagrams, from the same sender: read, not reported again)
    assert waiter.is_alive() and not woke, "woken by a datagram without the token"
    reports = [r.getMessage() for r in caplog.records if "without its token" in r.getMessage()]
    assert len(reports) == 1 and "from 127.0.0.1:" in reports[0], reports
    wake(wakeup.address)
    waiter.join(timeout=30)
    assert woke == [True]
    stopped = threading.Thread(target=lambda: woke.append(wakeup.wait(stop)))
    stopped.start()
    stop.set()
    stopped.join(timeout=30)
    assert woke == [True, False]
    wakeup.close()
