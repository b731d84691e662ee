"""``flatshard.fully_shard`` models' state against torch's FSDP2: DCP checkpoints both ways (and resharded), a forward
that raises, ``load_state_dict(assign=True)``, shards moved to the host and back, sharding on the meta device.

Split from tests/test_fully_shard.py (whose ``_build`` makes the models), as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import ATOL, RTOL, gpt_loss, local_slice, make_batch, make_gpt
from test_fully_shard import LR, SEQ, VOCAB, _build


def _steps(model: nn.Module, opt, steps: range, rank: int, world_size: int) -> list[float]:
    losses = []
    for step in steps:
        loss = gpt_loss(model, *local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save_then_go_on(rank: int, world_size: int, impl: str, path: str | None) -> list[float]:
    """Two steps, a DCP checkpoint of model and optimizer through torch's state_dict helpers (into ``path``,
    if any), two more steps: their losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _build(impl, "reshard_after_forward=None")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _steps(model, opt, range(2), rank, world_size)
    if path is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _steps(model, opt, range(2, 4), rank, world_size)


def _load_then_go_on(rank: int, world_size: int, impl: str, path: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with torch.random.fork_rng():
        torch.manual_seed(7)  # other weights than the checkpoint's: the load must replace every one
        model = _build(impl, "reshard_after_forward=None")
        for p in model.parameters():
            p.data.uniform_()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _steps(model, opt, range(2, 4), rank, world_size)


@pytest.mark.parametrize("saved_at, loaded_at", [(2, 2), (2, 4)], ids=["W2", "W2to4"])
@pytest.mark.parametrize("saver, loader", [("torch", "flatshard"), ("flatshard", "torch")])
def test_checkpoints_interchange_with_torch_fsdp2(saver, loader, saved_at, loaded_at, tmp_path):
    """A DCP checkpoint (model and Adam state, through torch.distributed.checkpoint.state_dict) saved by one
    implementation and loaded by the other goes on as the saver's own run does: bit for bit at the same world
    size; resharded to 4 ranks, the global loss (the mean of the ranks' means over equal rows) within the
    parity tolerance of models.py (the reductions add in another order)."""
    from flatshard.testing import run_distributed

    path = str(tmp_path / "ckpt")
    went_on = run_distributed(_save_then_go_on, saved_at, saver, path, timeout=120)
    resumed = run_distributed(_load_then_go_on, loaded_at, loader, path, timeout=120)
    what = f"{saver} saved at W={saved_at}, {loader} resumed at W={loaded_at}"
    if saved_at == loaded_at:
        assert resumed == went_on, what
    else:
        torch.testing.assert_close(torch.tensor(resumed).mean(0), torch.tensor(went_on).mean(0), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {m}")


def _forward_raises_then_trains(rank: int, world_size: int) -> tuple[float, float]:
    """The root's forward raises (a bad input, after its parameters were gathered); the next step, run inside the
    caller's except block, trains as a fresh model's first step does."""
    batch = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB), rank, world_size)
    fresh = _build("flatshard", "reshard_after_forward=None")
    want = gpt_loss(fresh, *batch)
    want.backward()
    model = _build("flatshard", "reshard_after_forward=None")
    try:
        model(batch[0].float())  # the root's forward raises (an embedding needs integer tokens)
    except RuntimeError:
        got = gpt_loss(model, *batch)
        got.backward()
    grads_equal = all(torch.equal(a.grad.to_local(), b.grad.to_local())
                      for a, b in zip(model.parameters(), fresh.parameters()))
    return got.item(), want.item(), grads_equal


def test_a_forward_that_raises_leaves_the_model_usable():
    from flatshard.testing import run_distributed

    for rank, (got, want, grads_equal) in enumerate(run_distributed(_forward_raises_then_trains, 2, timeout=120)):
        assert got == want and grads_equal, f"rank {rank}: loss {got} vs a fresh model's {want}, grads {grads_equal}"


def _load_with_assign(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    """A trained model's state dict (DTensors) loaded with ``assign=True`` into another model: it goes on as the
    trained one does (the new parameters' values reach the shards)."""
    trained = _build("flatshard", "reshard_after_forward=None")
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    _steps(trained, opt, range(2), rank, world_size)
    state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    went_on = _steps(trained, opt, range(2, 4), rank, world_size)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = _build("flatshard", "reshard_after_forward=None")
    model.load_state_dict(state, assign=True)
    resumed = _steps(model, torch.optim.SGD(model.parameters(), lr=LR), range(2, 4), rank, world_size)
    return went_on, resumed


def test_load_state_dict_with_assign_reaches_the_shards():
    from flatshard.testing import run_distributed

    for rank, (went_on, resumed) in enumerate(run_distributed(_load_with_assign, 2, timeout=120)):
        assert resumed == went_on, f"rank {rank}"


def _shards_moved(rank: int, world_size: int) -> tuple[list[float], list[float], bool]:
    """Two steps, then ``move_shards_to_host`` / ``move_shards_to_device`` with the optimizer (verl's loop; on a CPU
    the host is the device and nothing moves), then each unit's shard replaced by a copy as a move replaces it (so
    that the DTensor parameters and gradients must follow the new storage), two more steps; against a model never
    moved. The GPU move itself: tests/test_gpu.py::test_shards_to_host_and_back_on_gpu."""
    import flatshard
    from flatshard import _runtime

    model = _build("flatshard", "reshard_after_forward=None")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = _steps(model, opt, range(2), rank, world_size)
    flatshard.move_shards_to_host(model, opt)
    flatshard.move_shards_to_device(model, opt)
    units = [model, *model.blocks]
    with torch.no_grad():
        for unit in units:
            s = unit._unit_state
            s.flat_param.data = s.flat_param.data.clone()
            _runtime.after_shard_cast(s)
    follows = all(_on_the_shard(unit._unit_state) for unit in units)
    losses += _steps(model, opt, range(2, 4), rank, world_size)
    # No shard moves during an iteration, nor with a gradient accumulated unreduced; every unit is checked before any
    # moves (_host_offload.move_shards), so a refusal leaves every shard where it was.
    tokens, targets = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=9), rank, world_size)
    loss = gpt_loss(model, tokens, targets)
    with pytest.raises(RuntimeError, match=r"its shard cannot move during a forward/backward iteration"):
        flatshard.move_shards_to_host(model, opt)
    loss.backward()
    opt.zero_grad()
    model.set_requires_gradient_sync(False)
    gpt_loss(model, tokens, targets).backward()
    with pytest.raises(RuntimeError, match=r"holds a gradient accumulated inside no_sync\(\) that is not reduced yet"):
        flatshard.move_shards_to_host(model, opt)
    model.set_requires_gradient_sync(True)
    reference = _build("torch", "reshard_after_forward=None")
    return losses, _steps(reference, torch.optim.Adam(reference.parameters(), lr=LR), range(4), rank, world_size), follows


def _on_the_shard(s) -> bool:
    """Whether each DTensor parameter's local tensor is its rows of the unit's current shard (same memory)."""
    from flatshard._dtensor_params import _rows

    flat = s.flat_param
    return bool(s.orig_params) and all(
        p.to_local().data_ptr() == flat.data_ptr() + start * flat.element_size()
        for p, (start, *_rest) in zip(s.orig_params, _rows(s)))


def test_shards_moved_and_replaced_train_on_as_torch():
    from flatshard.testing import run_distributed

    for rank, (moved, never, follows) in enumerate(run_distributed(_shards_moved, 2, timeout=120)):
        assert follows, f"rank {rank}: a DTensor parameter still views the replaced shard"
        assert moved == never, f"rank {rank}: {moved} vs torch FSDP2's never moved {never}"


def _meta_init_allocations(rank: int, world_size: int) -> tuple[int, int]:
    """The largest memory any tensor made on a real device holds while ``fully_shard`` shards a model built on meta,
    and the largest unit's shard, in bytes (see [Note: A shard from meta parameters] in csrc/flatshard/flat_param.h;
    a storage with no memory behind it, [Note: Buffers made without memory], holds none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flatshard import fully_shard

    class Largest(TorchDispatchMode):  # (sees the C++ runtime's allocations too: they go through the dispatcher)
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    try:
                        memory = t.untyped_storage().nbytes() if t.untyped_storage().data_ptr() != 0 else 0
                    except RuntimeError:  # ("an invalid python storage": a size and no memory)
                        memory = 0
                    Largest.nbytes = max(Largest.nbytes, memory)
            return out

    with torch.device("meta"):
        model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
    with Largest():
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    shards = [u._unit_state.handle.layout.shard_numel * 4 for u in [model, *model.blocks]]
    return Largest.nbytes, max(shards)


def test_sharding_a_meta_model_never_makes_a_whole_unit():
    """torchtitan's meta init: no tensor larger than a shard exists on the device while fully_shard runs (torch's
    FSDP2 allocates the shard at to_empty; flatshard allocates it at fully_shard, uninitialized)."""
    from flatshard.testing import run_distributed

    for rank, (largest, shard) in enumerate(run_distributed(_meta_init_allocations, 2, timeout=120)):
        assert largest <= shard, f"rank {rank}: a tensor of {largest} bytes while the largest shard has {shard}"


class _Skippable(nn.Module):
    """Three blocks, any of which a forward may skip (a unit not run every iteration: a tower used on some batches,
    a shorter generation)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)  # (the root's own: its pre-forward prefetches block 0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = torch.tanh(block(x))
        return x


def _prefetch_follows_training_order(rank: int, world_size: int) -> tuple[list, list, list]:
    """Five steps of `_Skippable` on flatshard's fully_shard (a CPU mesh: forward prefetch on) and torch's FSDP2: the
    losses of each; for flatshard, the blocks still gathered after each forward, and what block 0's pre-forward
    found gathered of block 1."""
    from flatshard import _C
    from flatshard import fully_shard as flatshard_fully_shard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # (train?, skipped blocks): learn the whole order; a no-grad forward that stops early (block 1 prefetches block
    # 2, which never runs); training that skips block 0 (the root prefetches it); the whole order again, relearned
    plan = [(True, ()), (False, (2,)), (True, (0,)), (True, ()), (True, ())]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    results = {}
    for impl, shard in (("torch", torch_fully_shard), ("flatshard", flatshard_fully_shard)):
        model = _Skippable()
        for block in model.blocks:
            shard(block)
        shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen, gathered, losses = [], [], []
        if impl == "flatshard":
            model.blocks[0].register_forward_pre_hook(lambda *_: seen.append(
                model.blocks[1]._unit_state.handle.state != _C.ShardedState.SHARDED))
        for trains, skip in plan:
            with torch.set_grad_enabled(trains):
                loss = model(x, skip).square().mean()
            if impl == "flatshard":
                gathered.append([i for i, b in enumerate(model.blocks)
                                 if b._unit_state.handle.state != _C.ShardedState.SHARDED])
            if trains:
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        results[impl] = (losses, gathered, seen)
    return results["flatshard"][0], results["torch"][0], results["flatshard"][1], results["flatshard"][2]


def test_forward_prefetch_follows_the_training_order_and_frees_what_did_not_run():
    """See [Note: Forward prefetch] in _prefetch.py: no block stays gathered after a forward that left the learned
    order (before, the prefetched block stayed so until the end of the next backward, or after a no-grad forward
    until its next use); block 1 is prefetched in block 0's pre-forward only once a training iteration ran the whole
    order; the training is torch FSDP2's, bit for bit."""
    from flatshard.testing import run_distributed

    for rank, (ours, theirs, gathered, seen) in enumerate(run_distributed(_prefetch_follows_training_order, 2,
                                                                          timeout=120)):
        assert ours == theirs, f"rank {rank}: losses {ours} != torch FSDP2's {theirs}"
        assert gathered == [[], [], [], [], []], f"rank {rank}: blocks gathered after each forward: {gathered}"
        # Block 0 runs in steps 1, 2, 4, 5: prefetched from a learned order that has block 1 after it (step 1: none
        # learned yet; step 4: step 3's order, without block 0)
        assert seen == [False, True, False, True], f"rank {rank}: block 1 gathered at block 0's pre-forward: {seen}"


class _TwoOnAPlainModule(nn.Module):
    """The root unit's two parameters on a plain submodule (``plain``): the second at an offset in the root's shard,
    for ``plain.state_dict()`` alone."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.plain = nn.Module()
        self.plain.a, self.plain.b = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.plain.a + self.plain.b


SAVED_SHAPES = {"two_on_a_plain_module": (_TwoOnAPlainModule, (nn.Linear,))}


def _shard_shape(impl: str, shape: str) -> nn.Module:
    """A model of ``shape`` (see models.SHAPES, and SAVED_SHAPES) with ``fully_shard`` on each module its class wraps,
    innermost first, then on the root, as FSDP2's users apply it."""
    from models import SHAPES, build_shape

    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    if shape in SAVED_SHAPES:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = SAVED_SHAPES[shape][0]()
    else:
        model = build_shape(shape)
    kinds = tuple({**SHAPES, **SAVED_SHAPES}[shape][1])
    for m in reversed(list(model.modules())):
        if m is not model and isinstance(m, kinds):
            fully_shard(m)
    return fully_shard(model)


def _train_step(model: nn.Module, rank: int, seed: int) -> float:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * seed + rank))
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
                p.grad = None
    return loss.item()


def _saved_with_torch_save(rank: int, world_size: int) -> dict:
    """On every model shape, for flatshard's fully_shard and torch's: one step, ``torch.save(model.state_dict())``
    and ``copy.deepcopy`` of it, what the file holds, and a fresh model (other weights) that loads the file with
    ``load_state_dict`` and steps on."""
    import copy
    import io

    from torch.distributed.tensor import DTensor

    from models import SHAPES

    out = {}
    for shape in [*SHAPES, *SAVED_SHAPES]:
        for impl in ("torch", "flatshard"):
            model = _shard_shape(impl, shape)
            _train_step(model, rank, 0)
            state = model.state_dict()
            buffer = io.BytesIO()
            try:
                torch.save(state, buffer)
                copied = copy.deepcopy(state)
                for sub in model.modules():  # (a submodule's own state dict: a unit's, a plain parent's)
                    torch.save(sub.state_dict(), io.BytesIO())
                params_buffer = io.BytesIO()  # (the parameters themselves: see [Note: A parameter's wrapper at
                torch.save(dict(model.named_parameters()), params_buffer)  # offset 0] in _dtensor_params.py)
                params_copied = {name: copy.deepcopy(p) for name, p in model.named_parameters()}
            except RuntimeError as error:
                out[shape, impl] = {"error": str(error)}
                continue
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            params_buffer.seek(0)
            params_loaded = torch.load(params_buffer, weights_only=False)
            params = dict(model.named_parameters())
            params_saved = {k: (type(v).__name__, isinstance(v, nn.Parameter), v.requires_grad, str(v.placements),
                                v.to_local().tolist(), torch.equal(params_copied[k].to_local(), params[k].to_local()),
                                isinstance(params_copied[k], nn.Parameter))
                            for k, v in params_loaded.items()}
            with torch.no_grad():  # the values share the parameters' memory, as torch's detach() does
                for p in model.parameters():
                    p.to_local().mul_(2)
                shares = all(torch.equal(state[name.replace("_checkpoint_wrapped_module.", "")].to_local(),
                                         p.to_local()) for name, p in model.named_parameters())
                for p in model.parameters():
                    p.to_local().div_(2)
                for value in state.values():  # (a value moved to shared memory: the model must train on as before)
                    if isinstance(value, DTensor):
                        value.to_local().share_memory_()
            with torch.random.fork_rng():
                torch.manual_seed(7)
                fresh = _shard_shape(impl, shape)
                for p in fresh.parameters():
                    p.data.uniform_()
            fresh.load_state_dict(loaded)
            out[shape, impl] = {
                "bytes": buffer.getbuffer().nbytes,
                "loaded": {k: (type(v).__name__, str(getattr(v, "placements", "")), (v.to_local() if isinstance(
                    v, DTensor) else v).tolist()) for k, v in loaded.items()},
                "copied_equal": all(torch.equal(copied[k].full_tensor() if isinstance(v, DTensor) else copied[k],
                                                v.full_tensor() if isinstance(v, DTensor) else v)
                                    for k, v in state.items()),
                "shares": shares,
                "params_saved": params_saved,
                "went_on": [_train_step(model, rank, 1), _train_step(model, rank, 2)],
                "resumed": [_train_step(fresh, rank, 1), _train_step(fresh, rank, 2)],
            }
    return out


def test_torch_save_of_the_state_dict_round_trips_as_torch_fsdp2():
    """``torch.save(model.state_dict())`` and ``copy.deepcopy`` of it (a per-rank checkpoint, a best-model snapshot)
    work as with torch's FSDP2 on every model shape (parameters of the root's own module, leaf units, units under a
    plain parent, a nested unit, padded units, a parameter of one row that some ranks hold nothing of, the root's
    parameters on a plain submodule, whose own state dict is saved too), and so do ``torch.save`` and
    ``copy.deepcopy`` of the parameters themselves (``dict(model.named_parameters())``): the file
    holds torch's values, placements and types, no more bytes than torch's (each parameter's own, not its unit's
    shard; see [Note: A state dict's tensors have storages of their own] in _dtensor_params.py), the values share the
    parameters' memory as torch's, moving them to shared memory leaves training as it was, and a fresh model that
    loads the file goes on as the saved one does, bit for bit, and as torch's."""
    from flatshard.testing import run_distributed

    for rank, got in enumerate(run_distributed(_saved_with_torch_save, 2, timeout=120)):
        for (shape, impl), case in got.items():
            if impl != "flatshard":
                continue
            torch_case = got[shape, "torch"]
            where = f"rank {rank}, shape {shape}"
            assert "error" not in case, f"{where}: {case['error']}"
            assert "error" not in torch_case, f"{where}: torch's FSDP2 failed: {torch_case['error']}"
            assert case["loaded"] == torch_case["loaded"], where
            assert case["params_saved"] == torch_case["params_saved"], where
            assert case["bytes"] <= torch_case["bytes"], (where, case["bytes"], torch_case["bytes"])
            assert case["copied_equal"], where
            assert case["shares"] and torch_case["shares"], where
            assert case["resumed"] == case["went_on"] == torch_case["went_on"], (where, case, torch_case["went_on"])
