"""Ranks that disagree raise, every one of them, with a message naming the ranks and what differs
(see [Note: Rank-divergence guard]); none hangs, none aborts, none trains on.

Each case runs with a run deadline (DEADLINE) under the process group's timeout (PG_TIMEOUT): a
case that only ended at the group's timeout, or hung, fails as a hang; a process abort fails too
(the harness reports the signal). The deadline bounds a hang, it is no speed claim: it is
generous, so that a loaded machine fails no case, and no case measures its time (each rank's
error type and message show that the guard, not a timeout, ended it). Without the guard these runs hang or abort (torch FSDP1 does
the same; tests/test_robustness.py has the cases the guard does not need).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import MLP, Block, gpt_loss, local_slice, make_batch, make_gpt

DEADLINE = 120.0
PG_TIMEOUT = 300.0


def _model(rank, **changes):
    from flatshard import FullyShardedDataParallel as FSDP

    layers = changes.get("n_layers", 3)
    dim = changes.get("dim", 16)
    model = make_gpt(n_layers=layers, dim=dim)
    if changes.get("double"):
        model = model.double()
    policy = ModuleWrapPolicy(changes.get("wrap", {Block}))
    return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                sharding_strategy=changes.get("strategy", ShardingStrategy.FULL_SHARD))


def _trained_one_step(rank, world_size):
    """A model (and its optimizer) after one step on every rank: the guard has passed once."""
    model = _model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world_size)
    return model, opt


def _step(model, opt, step, rank, world_size, **kwargs):
    loss = gpt_loss(model, *local_slice(make_batch(seed=step), rank, world_size))
    loss.backward(**kwargs)
    opt.step()
    opt.zero_grad()


MODEL_CASES = {
    "wrap_policy": ({"wrap": {Block, MLP}}, r"the models are wrapped differently: rank 1 has 7 FSDP units \(<root>, "
                                            r"blocks.0, blocks.0.mlp.*while rank 0 has 4 FSDP units"),
    "width": ({"dim": 32}, r"FSDP unit 0 \('<root>' on rank 0\) differs in shapes: rank 1 has \[\[16, 32\], \[64, 32\]"),
    "dtype": ({"double": True}, r"differs in dtype: rank 1 has 'torch.float64' while rank 0 has 'torch.float32'"),
    "block_count": ({"n_layers": 4}, r"rank 1 has 5 FSDP units .* while rank 0 has 4 FSDP units"),
    "strategy": ({"strategy": ShardingStrategy.SHARD_GRAD_OP},
                 r"differs in strategy: rank 1 has 'SHARD_GRAD_OP' while rank 0 has 'FULL_SHARD'"),
}


def _model_case(rank, world_size, case):
    from flatshard import RankDivergenceError

    model = _model(rank, **(MODEL_CASES[case][0] if rank == 1 else {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RankDivergenceError, match=MODEL_CASES[case][1]):
        _step(model, opt, 0, rank, world_size)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_ranks_with_different_models_raise(case):
    run_distributed(_model_case, 2, case, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _no_sync_on_one_rank(rank, world_size):
    from flatshard import RankDivergenceError

    model, opt = _trained_one_step(rank, world_size)
    with pytest.raises(RankDivergenceError, match=r"rank 1 runs forward 2 with grad inside no_sync\(\) while "
                                                  r"rank 0 runs forward 2 with grad outside no_sync\(\)"):
        if rank == 1:
            with model.no_sync():
                gpt_loss(model, *make_batch(seed=1)).backward()
        else:
            _step(model, opt, 1, rank, world_size)


def _no_grad_forward_on_one_rank(rank, world_size):
    from flatshard import RankDivergenceError

    model, opt = _trained_one_step(rank, world_size)
    with pytest.raises(RankDivergenceError, match=r"rank 0 runs forward 2 without grad while ranks 1, 2, 3 run "
                                                  r"forward 2 with grad"):
        if rank == 0:  # an evaluation on rank 0 only
            with torch.no_grad():
                model(make_batch()[0])
        _step(model, opt, 1, rank, world_size)


def _skips_batch_after_backward_raised(rank, world_size):
    from flatshard import RankDivergenceError

    model, opt = _trained_one_step(rank, world_size)
    with pytest.raises(RankDivergenceError, match=r"rank 1 runs forward 3 with grad while rank 0 is at the "
                                                  r"backward of forward 2"):
        for step in (1, 2):
            loss = gpt_loss(model, *local_slice(make_batch(seed=step), rank, world_size))
            if rank == 1 and step == 1:
                loss.register_hook(lambda grad: (_ for _ in ()).throw(FloatingPointError("loss is not finite")))
            try:
                loss.backward()
            except FloatingPointError:
                continue  # skip the batch
            opt.step()
            opt.zero_grad()


def _skips_a_whole_step(rank, world_size):
    from flatshard import RankDivergenceError

    model = _model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RankDivergenceError, match=r"rank 1 is at state_dict\(\) after 3 forwards while rank 0 "
                                                  r"runs forward 4 with grad"):
        for step in range(4):
            if rank == 1 and step == 2:
                continue  # e.g. a batch this rank's loader could not produce
            _step(model, opt, step, rank, world_size)
        model.state_dict()  # the checkpoint at the end


def _uneven_accumulation_gathering(rank, world_size):
    """Inside no_sync() (by default, as torch's FSDP1) units are gathered in every forward: ranks that
    accumulate different numbers of micro-batches run different collectives."""
    from flatshard import RankDivergenceError

    model, opt = _trained_one_step(rank, world_size)
    with pytest.raises(RankDivergenceError, match=r"rank 1 runs forward 4 with grad inside no_sync\(\) while rank 0 "
                                                  r"runs forward 4 with grad outside no_sync\(\)"):
        with model.no_sync():
            for step in range(2 + rank):
                gpt_loss(model, *local_slice(make_batch(seed=10 + step), rank, world_size)).backward()
        _step(model, opt, 5, rank, world_size)


def _fully_shard_model(dim=16):
    from flatshard import fully_shard

    model = make_gpt(n_layers=3, dim=dim)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _fully_shard_cases(rank, world_size):
    """fully_shard's models are guarded as the class's: another width on one rank, then (on equal models) a
    no-grad evaluation forward and a step without gradient sync (FSDP2's no_sync) on one rank."""
    from flatshard import RankDivergenceError

    model, opt = _fully_shard_model(dim=32 if rank == 1 else 16)
    with pytest.raises(RankDivergenceError, match=r"FSDP unit 0 \('<root>' on rank 0\) differs in shapes: rank 1 "
                                                  r"has \[\[16, 32\], \[64, 32\]"):
        _step(model, opt, 0, rank, world_size)
    model, opt = _fully_shard_model()
    _step(model, opt, 0, rank, world_size)
    with pytest.raises(RankDivergenceError, match=r"rank 1 runs forward 2 with grad while rank 0 runs forward 2 "
                                                  r"without grad"):
        if rank == 0:
            with torch.no_grad():
                model(make_batch()[0])
        _step(model, opt, 1, rank, world_size)
    model, opt = _fully_shard_model()
    _step(model, opt, 0, rank, world_size)
    with pytest.raises(RankDivergenceError, match=r"rank 1 runs forward 2 with grad inside no_sync\(\) while "
                                                  r"rank 0 runs forward 2 with grad outside no_sync\(\)"):
        model.set_requires_gradient_sync(rank == 0)
        _step(model, opt, 1, rank, world_size)


CASES = {"no_sync_on_one_rank": (_no_sync_on_one_rank, 2),
         "fully_shard_models": (_fully_shard_cases, 2),
         "uneven_accumulation_inside_no_sync": (_uneven_accumulation_gathering, 2),
         "no_grad_forward_on_one_rank": (_no_grad_forward_on_one_rank, 4),
         "rank_skips_batch_after_its_backward_raised": (_skips_batch_after_backward_raised, 2),
         "rank_skips_a_whole_step": (_skips_a_whole_step, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_run_differently_raise(case):
    fn, world_size = CASES[case]
    run_distributed(fn, world_size, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _guard_off(rank, world_size, value):
    import os

    os.environ["FLATSHARD_RANK_GUARD"] = value
    try:
        model = _model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, opt, 0, rank, world_size)
        return model._unit_state.root.guard is not None
    finally:
        del os.environ["FLATSHARD_RANK_GUARD"]


def test_guard_can_be_turned_off():
    assert run_distributed(_guard_off, 2, "0", timeout=DEADLINE, pg_timeout=PG_TIMEOUT) == [False, False]
    assert run_distributed(_guard_off, 2, "1", timeout=DEADLINE, pg_timeout=PG_TIMEOUT) == [True, True]


def _flatshard_warnings() -> list[str]:
    """The messages of flatshard's warnings from here on, in this process."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    logging.getLogger("flatshard").addHandler(Collect())
    return messages


def _links_and_their_fallback(rank, world_size):
    """[Note: The guard's links]: each round's partner is a TCP connection of the guard's own; where one cannot be
    made (here: rank 3 cannot connect to anyone), that pair falls back to a two-rank gloo group, on both ends, and the
    guard still says who differs."""
    import socket

    from flatshard import RankDivergenceError, _guard_links

    if rank == 3:
        def refuse(*args, **kwargs):
            raise ConnectionRefusedError("no route (the test's)")

        socket.create_connection = refuse
    warnings = _flatshard_warnings()
    model, opt = _trained_one_step(rank, world_size)
    kinds = [type(link).__name__ for _, link in model._unit_state.root.guard._rounds]
    # Each fallback says why, on both ends: the OSError of the end that could not connect.
    fallbacks = [w for w in warnings if "falls back to a gloo pair" in w]
    assert len(fallbacks) == kinds.count("GlooLink"), warnings
    assert all("no route (the test's)" in w for w in fallbacks), fallbacks
    # rounds: with 1 (k = 1) and with 2 (k = 2); rank 3's are with 2 and 1, both through gloo
    expected = {0: ["SocketLink", "SocketLink"], 1: ["SocketLink", "GlooLink"], 2: ["GlooLink", "SocketLink"],
                3: ["GlooLink", "GlooLink"]}[rank]
    assert kinds == expected, kinds
    assert all(isinstance(link, (_guard_links.SocketLink, _guard_links.GlooLink))
               for _, link in model._unit_state.root.guard._rounds)
    _step(model, opt, 1, rank, world_size)  # agreeing ranks pass
    with pytest.raises(RankDivergenceError, match=r"rank 2 runs forward 3 without grad while ranks 0, 1, 3 run "
                                                  r"forward 3 with grad"):
        if rank == 2:
            with torch.no_grad():
                model(make_batch()[0])
        _step(model, opt, 2, rank, world_size)


def test_guard_links_fall_back_to_gloo_where_no_connection_can_be_made():
    run_distributed(_links_and_their_fallback, 4, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _intruders_at_the_guards_port(rank, world_size):
    """[Note: The guard's links]: while rank 0's end of a link waits for rank 1, two other connections reach its port
    first, one with the old constant greeting, one with garbage: both refused and reported, and the guard works on
    (it still says who differs)."""
    import socket

    from flatshard import RankDivergenceError, _guard_links

    if rank == 1:
        real_connect = _guard_links._connect

        def connect_after_intruders(store, deadline):
            if _guard_links._first_of(store, ["address"], deadline) == "address":
                host, port = store.get("address").decode().split("|")
                for greeting in (b"flatshard-guard-link\n", b"\x00garbage" * 8):
                    with socket.create_connection((host, int(port))) as intruder:
                        intruder.sendall(greeting)
                        try:
                            intruder.shutdown(socket.SHUT_WR)
                            assert intruder.recv(1) == b""  # closed by the listener
                        except OSError:  # (closed with the garbage's rest unread: a reset, before or at the shutdown)
                            pass
            return real_connect(store, deadline)

        _guard_links._connect = connect_after_intruders
    model, opt = _trained_one_step(rank, world_size)
    assert [type(link).__name__ for _, link in model._unit_state.root.guard._rounds] == ["SocketLink"]
    with pytest.raises(RankDivergenceError, match=r"rank 1 runs forward 2 without grad while rank 0 runs forward 2 "
                                                  r"with grad"):
        if rank == 1:
            with torch.no_grad():
                model(make_batch()[0])
        _step(model, opt, 1, rank, world_size)
    return list(_guard_links.refused)


def test_guard_links_refuse_connections_without_the_pairs_secret():
    refused = run_distributed(_intruders_at_the_guards_port, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    assert len(refused[0]) == 2 and refused[1] == [], refused


def _state_dict_in_forward(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    class LogsInForward(nn.Module):  # a logging callback that saves the weights mid-forward
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            root.state_dict()
            return self.lin(x)

    root = FSDP(LogsInForward())
    opt = torch.optim.SGD(root.parameters(), lr=0.1)
    for call in ("state_dict", "optim_state_dict", "load_state_dict"):
        if call == "optim_state_dict":
            LogsInForward.forward = lambda self, x: (FSDP.optim_state_dict(root, opt), self.lin(x))[1]
        if call == "load_state_dict":
            saved = root.state_dict()
            LogsInForward.forward = lambda self, x: (root.load_state_dict(saved), self.lin(x))[1]
        with pytest.raises(RuntimeError, match=r"called during forward or backward; call it between iterations"):
            root(torch.ones(1, 2))


def test_state_dict_functions_inside_forward_raise():
    run_distributed(_state_dict_in_forward, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _unit_skipped_on_one_rank(rank, world_size):
    """Rank 1 skips blocks.1 in its forward (as data-dependent routing can): every phase agrees, so the
    per-phase guard passes; blocks.1 and blocks.2 gather the same number of bytes, so without the
    strict mode their all-gathers would pair up and train wrong. The strict mode names them, with the guard's
    error type (issue 22, item 3)."""
    import os

    os.environ["FLATSHARD_RANK_GUARD"] = "strict"
    model, opt = _trained_one_step(rank, world_size)
    if rank == 1:
        block = model.module.blocks[1]
        block.forward = lambda x, *args, **kwargs: x
    from flatshard import RankDivergenceError

    with pytest.raises(RankDivergenceError, match=r"ranks issue different collectives \(FLATSHARD_RANK_GUARD=strict.*"
                                           r"rank 0 of the group, collective #\d+: all_gather of unit 'blocks.1' "
                                           r"\(\d+ bytes\); rank 1 of the group, collective #\d+: all_gather of "
                                           r"unit 'blocks.2'"):
        _step(model, opt, 1, rank, world_size)


def test_strict_mode_names_mismatched_collectives():
    run_distributed(_unit_skipped_on_one_rank, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _backward_skipped_on_one_rank_with_a_reduce_scatter_group(rank, world_size):
    """fully_shard with the reduce-scatters over a group of their own (set_separate_reduce_scatter_group), strict mode:
    rank 1's loss does not reach blocks.1 (its output detached there), so in backward rank 0 gathers blocks.0 where
    rank 1 reduce-scatters the root. Both checks run on the shard group and raise; before, the reduce-scatter's ran
    on its own group, and the two ranks waited in checks on two groups until the group's timeout."""
    import os

    os.environ["FLATSHARD_RANK_GUARD"] = "strict"
    # One all-gather and one reduce-scatter per unit, so that the ranks meet at the reduce-scatter (gathered together,
    # rank 0's backward group of blocks.0 and the root meets rank 1's root alone at an all-gather's check instead).
    os.environ["FLATSHARD_GATHER_TOGETHER_BYTES"] = "0"
    from flatshard import RankDivergenceError, fully_shard

    model = make_gpt(seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_separate_reduce_scatter_group()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world_size)
    if rank == 1:
        model.blocks[1].register_forward_hook(lambda module, args, output: output.detach())
    with pytest.raises(RankDivergenceError, match=r"ranks issue different collectives \(FLATSHARD_RANK_GUARD=strict.*"
                                           r"reduce_scatter of unit"):
        _step(model, opt, 1, rank, world_size)


def test_strict_mode_meets_on_one_group_with_a_separate_reduce_scatter_group():
    run_distributed(_backward_skipped_on_one_rank_with_a_reduce_scatter_group, 2, timeout=DEADLINE, pg_timeout=30.0)


# Legitimate scripts the guard must let through (found by a review: each failed or hung before).

def _asymmetric_groups(rank, world_size):
    import torch.distributed as dist

    dist.new_group([0])  # a group only rank 0 belongs to (logging, embeddings): group counts differ
    model, opt = _trained_one_step(rank, world_size)
    _step(model, opt, 1, rank, world_size)


def _first_forward_in_inference_mode(rank, world_size):
    model = _model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.inference_mode():  # evaluating the untrained model first makes the guard
        model(make_batch()[0])
    _step(model, opt, 0, rank, world_size)


def _no_shard_eval_on_rank0(rank, world_size):
    model = _model(rank, strategy=ShardingStrategy.NO_SHARD)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, world_size)
    if rank == 0:  # NO_SHARD: a forward issues no collective, so one rank may run it alone (as with torch)
        with torch.no_grad():
            model(make_batch()[0])
    _step(model, opt, 1, rank, world_size)


def _uneven_accumulation(rank, world_size):
    model, opt = _trained_one_step(rank, world_size)
    # rank 1 accumulates one micro-batch more: no collective inside no_sync(keep_parameters_unsharded=True)
    with model.no_sync(keep_parameters_unsharded=True):
        for step in range(2 + rank):
            gpt_loss(model, *local_slice(make_batch(seed=10 + step), rank, world_size)).backward()
    _step(model, opt, 5, rank, world_size)


LEGITIMATE = {"asymmetric_process_groups": _asymmetric_groups,
              "first_forward_in_inference_mode": _first_forward_in_inference_mode,
              "no_shard_evaluation_on_one_rank": _no_shard_eval_on_rank0,
              "uneven_accumulation_keeping_parameters_unsharded": _uneven_accumulation}


@pytest.mark.parametrize("case", list(LEGITIMATE))
def test_guard_lets_legitimate_scripts_through(case):
    run_distributed(LEGITIMATE[case], 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)


def _recover(rank, world_size, diverge):
    """Every rank catches the error, skips the batch and goes on (issue 22, item 2). With ``diverge`` rank 1 runs
    an evaluation forward of its own at step 2; without it every rank skips step 2 of its own accord: the
    losses after must be the same."""
    from flatshard import RankDivergenceError

    model, opt = _trained_one_step(rank, world_size)
    losses, caught = [], 0
    for step in range(1, 6):
        try:
            if step == 2 and not diverge:
                continue
            if step == 2 and rank == 1:
                with torch.no_grad():
                    model(make_batch(seed=99)[0])
            loss = gpt_loss(model, *local_slice(make_batch(seed=step), rank, world_size))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        except RankDivergenceError:
            caught += 1
        opt.zero_grad()
    return losses, caught


def test_training_goes_on_after_a_caught_divergence():
    skipped = run_distributed(_recover, 2, False, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    recovered = run_distributed(_recover, 2, True, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    for rank in range(2):
        assert recovered[rank][1] == 1 and skipped[rank][1] == 0, (recovered, skipped)
        assert recovered[rank][0] == skipped[rank][0], f"rank {rank}: {recovered[rank][0]} vs {skipped[rank][0]}"
