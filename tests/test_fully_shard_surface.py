"""What a script sees of a ``flatshard.fully_shard`` model, against torch's FSDP2: the module's class and
parameters, registered forward methods, inner units on their own, the setters, and what is refused by name.

Split from tests/test_fully_shard.py (whose ``_build`` makes the models), as it was.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from models import gpt_loss, local_slice, make_batch, make_gpt
from test_fully_shard import LR, SEQ, VOCAB, _build, _local


def _surface(rank: int, world_size: int) -> dict:
    """What a script sees of a fully_shard model, flatshard's and torch's side by side."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.tensor import DTensor

    out = {}
    for impl in ("torch", "flatshard"):
        model = _build(impl, "reshard_after_forward=None")
        state = model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from flatshard.checkpoint import get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[impl] = {
            "full_state_dict": {k: (type(v).__name__, v.clone()) for k, v in full.items()},
            "class": type(model).__name__,
            "is_fsdp_module": [isinstance(m, TorchFSDPModule) for m in (model, model.blocks[0], model.ln_f)],
            "params": [(n, type(p).__name__, isinstance(p, nn.Parameter), tuple(p.shape), str(p.placements))
                       for n, p in model.named_parameters()],
            "state_dict": {k: (type(v).__name__, _local(v).clone()) for k, v in state.items()},
            "dtensor_grads": None,
        }
        # In forward a unit's parameters() are its unsharded parameters (HF reads `self.dtype` from them)
        seen = []
        model.blocks[0].register_forward_pre_hook(lambda m, _: seen.append(
            [(isinstance(p, DTensor), p.dtype, tuple(p.shape)) for p in m.parameters()]))
        loss = gpt_loss(model, *local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB), rank, world_size))
        out[impl]["in_forward"] = seen
        if impl == "flatshard":  # None: the root keeps its parameters after forward; True, given: it frees them
            out["root_kept"] = model._unit_state.handle.has_unsharded_storage()
            explicit = _build("flatshard", "reshard_after_forward=True")
            explicit_loss = gpt_loss(explicit, *local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB), rank,
                                                             world_size))
            out["root_freed"] = not explicit._unit_state.handle.has_unsharded_storage()
            explicit_loss.backward()
        # with the root's parameters kept after forward (None) a state dict is still of DTensors, as torch's
        out[impl]["state_dict_after_forward"] = {k: (type(v).__name__, _local(v).clone())
                                                 for k, v in model.state_dict().items()}
        loss.backward()
        out[impl]["dtensor_grads"] = [isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                                      for p in model.parameters()]
    return out


def test_a_sharded_model_looks_like_torch_fsdp2s():
    """Class name, FSDPModule instances, DTensor parameters (names, shapes, placements), state_dict (DTensors
    of the same local values), flatshard.checkpoint's full state dict (plain tensors) and DTensor gradients, as
    torch's FSDP2 shows them, at W = 2; the root's parameters after forward kept with reshard_after_forward=None,
    freed with an explicit True, as torch's."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_surface, 2, timeout=120)):
        assert out["root_kept"], f"rank {rank}: reshard_after_forward=None resharded the root after its forward"
        assert out["root_freed"], f"rank {rank}: reshard_after_forward=True kept the root's parameters after forward"
        ours, theirs = out["flatshard"], out["torch"]
        for key in ("class", "is_fsdp_module", "params", "dtensor_grads", "in_forward"):
            assert ours[key] == theirs[key], f"rank {rank}, {key}: {ours[key]} != torch's {theirs[key]}"
        assert ours["state_dict"].keys() == theirs["state_dict"].keys()
        for key in ("state_dict", "full_state_dict", "state_dict_after_forward"):  # (FULL: plain tensors)
            assert ours[key].keys() == theirs[key].keys(), key
            for k, (kind, value) in theirs[key].items():
                assert ours[key][k][0] == kind and torch.equal(ours[key][k][1], value), (key, k)


def _forward_method(rank: int, world_size: int) -> dict:
    """torch's register_fsdp_forward_method on a method that reads the root's own parameters outside its forward
    and calls the forward (as HF generate does), without grad; then a training step. Both FSDP2s."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    def score(self, tokens):
        return float(self(tokens).sum() + self.embed.weight.sum() + self.head.weight.sum())

    out = {}
    for impl in ("torch", "flatshard"):
        model = _build(impl, "reshard_after_forward=None")
        model.score = types.MethodType(score, model)
        register_fsdp_forward_method(model, "score")
        tokens, targets = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB), rank, world_size)
        with torch.no_grad():
            scores = [model.score(tokens), model.score(tokens)]
        # (the method ran the root's forward: torch's reshards the root after it, its parameters DTensors again)
        scores.append([type(p).__name__ for p in model.parameters()])
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        out[impl] = (scores, loss.item(), [_local(p.grad).clone() for p in model.parameters()])
    return out


def test_register_fsdp_forward_method_as_torch():
    """torch's own function wraps a flatshard module's method (see [Note: Forward methods] in _fsdp_module.py): the
    same values as torch's FSDP2, and training after it is unchanged."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_forward_method, 2, timeout=120)):
        (t_scores, t_loss, t_grads), (f_scores, f_loss, f_grads) = out["torch"], out["flatshard"]
        assert f_scores == t_scores and f_loss == t_loss, (rank, f_scores, t_scores, f_loss, t_loss)
        assert all(torch.equal(a, b) for a, b in zip(f_grads, t_grads)), rank


def _units_on_their_own(rank: int, world_size: int) -> dict:
    """Two scripts of torch's own FSDP2 tests (test_non_root_forward_backward, test_register_fsdp_forward_method):
    after a step and zero_grad, a backward through one inner unit called on its own (the other units keep None
    gradients, not the last step's); and a registered method of a unit that takes the place of its forward (its
    parameters get their gradients). Each run with torch's FSDP2 and flatshard's."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    out = {}
    for impl in ("torch", "flatshard"):
        model = _build(impl, "reshard_after_forward=None")
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        tokens, targets = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=0), rank, world_size)
        gpt_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        x = torch.randn(*tokens.shape, 16, generator=torch.Generator().manual_seed(rank))  # (the block's own input)
        model.blocks[0](x).sum().backward()
        got = {n: None if p.grad is None else _local(p.grad).clone() for n, p in model.named_parameters()}

        block = model.blocks[1]
        block.features = block.forward  # a method in the place of forward: what the wrapper must gather and track
        register_fsdp_forward_method(block, "features")
        opt.zero_grad()
        block.features(x).sum().backward()
        got_method = {n: None if p.grad is None else _local(p.grad).clone() for n, p in block.named_parameters()}
        out[impl] = (got, got_method)
    return out


def test_inner_units_on_their_own_and_registered_methods_as_torch():
    for rank, out in enumerate(run_distributed_ranks(_units_on_their_own, 2)):
        for which, (ours, theirs) in enumerate(zip(out["flatshard"], out["torch"])):
            assert ours.keys() == theirs.keys()
            for name, want in theirs.items():
                have = ours[name]
                assert (have is None) == (want is None), f"rank {rank}, script {which}, {name}: {have} vs torch's {want}"
                assert have is None or torch.equal(have, want), f"rank {rank}, script {which}, {name}"


def run_distributed_ranks(fn, world_size):
    from flatshard.testing import run_distributed

    return run_distributed(fn, world_size, timeout=120)


def _reshard_setter(rank: int, world_size: int) -> dict:
    """set_reshard_after_forward(False) then (True), between steps: what each forward keeps, and the training."""
    out = {}
    for impl in ("torch", "flatshard"):
        model = _build(impl, "reshard_after_forward=None")
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        losses, kept = [], []
        for step, reshard in enumerate((False, True)):
            model.set_reshard_after_forward(reshard)
            tokens, targets = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=step), rank, world_size)
            loss = gpt_loss(model, tokens, targets)
            if impl == "flatshard":  # after forward: which units still hold their unsharded parameters
                kept.append([m._unit_state.handle.has_unsharded_storage() for m in (model, *model.blocks)])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with pytest.raises(ValueError, match="reshard_after_forward should be a bool, got <class 'int'>"):
            model.set_reshard_after_forward(2)
        out[impl] = (losses, [_local(p).detach().clone() for p in model.parameters()], kept)
    return out


def test_set_reshard_after_forward_as_torch():
    """False keeps every unit's parameters after forward, True frees them, the root's too (as torch's setter); the
    training equals torch FSDP2's doing the same."""
    from flatshard.testing import run_distributed

    for rank, out in enumerate(run_distributed(_reshard_setter, 2, timeout=120)):
        (t_losses, t_params, _), (f_losses, f_params, kept) = out["torch"], out["flatshard"]
        assert kept == [[True] * 4, [False] * 4], (rank, kept)
        assert f_losses == t_losses and all(torch.equal(a, b) for a, b in zip(f_params, t_params)), rank


def _refusals(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import flatshard
    from flatshard import fully_shard

    def fresh():
        return make_gpt(vocab=VOCAB, seq=SEQ)

    with pytest.raises(AssertionError, match=r"Shard dim 1 is invalid for 1D tensor: torch.Size\(\[16\]\) \(parameter "
                                             r"'ln1.weight'\)"):  # (torch's type and phrase)
        fully_shard(fresh().blocks[0], shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(NotImplementedError, match=r"FSDP does not support uneven sharding on dim 1: torch.Size\(\[4, "
                                                  r"6\]\) \(world size: 4\) \(parameter 'weight'\)"):
        fully_shard(nn.Linear(6, 4), shard_placement_fn=lambda p: Shard(-1))
    with pytest.raises(ValueError, match=r"fully_shard expects a 1D or 2D DeviceMesh but got .*a 3-D mesh \(1, 2, 2\)"):
        fully_shard(fresh(), mesh=init_device_mesh("cpu", (1, 2, 2)))
    for bad, message in ((3, r"it should be a factor of 4, not 3"), (8, "a factor of 4, not 8"),
                         (0, "a factor of 4, not 0"), ("2", r"should be a bool or an int .* not '2'")):
        with pytest.raises(ValueError, match=r"fully_shard\(GPT\): .*" + message):  # (torch's phrases)
            fully_shard(fresh(), reshard_after_forward=bad)
    with pytest.warns(UserWarning, match=r"reshard_after_forward=1 \(int\) means resharding parameters to world size 1"):
        one = fully_shard(fresh(), reshard_after_forward=1)
    assert not one._unit_state.config.reshard_after_forward  # (1: kept after forward, as False)
    assert fully_shard(fresh(), reshard_after_forward=4)._unit_state.config.post_forward_group is None  # (4: True)
    with pytest.raises(TypeError, match=r"fully_shard\(GPT\): offload_policy must be an OffloadPolicy .* but got "
                                        r"CPUOffload"):
        fully_shard(fresh(), offload_policy=flatshard.CPUOffload(offload_params=True))  # (FSDP1's, by mistake)
    from torch.distributed.fsdp import CPUOffloadPolicy

    if not torch.accelerator.is_available():  # (torch's type and phrase: it cannot pin the shards; with a GPU it can)
        with pytest.raises(RuntimeError, match=r"Cannot access accelerator device when none is available: "
                                               r"fully_shard\(Linear\) .* pass CPUOffloadPolicy\(pin_memory=False\)"):
            fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
    fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(nn.ReLU(), offload_policy=CPUOffloadPolicy())  # (no parameter to pin: torch's builds it too)
    from torch.distributed.fsdp import DataParallelMeshDims

    with pytest.raises(ValueError, match=r"fully_shard\(GPT\): dp_mesh_dims names dims of the mesh given as mesh=, "
                                         r"and none was given"):  # (what it supports: tests/test_fully_shard_spmd.py)
        fully_shard(fresh(), dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    with pytest.raises(ValueError, match="expected an nn.Module or a non-empty list of them but got an empty list"):
        fully_shard([])
    for bad in (3, [nn.Linear(2, 2), 3]):
        with pytest.raises(ValueError, match="fully_shard: expected an nn.Module but got int"):
            fully_shard(bad)
    tied = nn.ModuleDict({"embed": nn.Embedding(6, 4), "head": nn.Linear(4, 6, bias=False)})
    tied.head.weight = tied.embed.weight
    fully_shard(tied.embed)
    with pytest.raises(ValueError, match=r"Parameter 'weight' is shared with a parameter already managed by another "
                                         r"FSDP group \('weight', .*use fully_shard\(\[module_a, module_b\]\)"):
        fully_shard(tied.head)  # (torch's type and phrase; torch's raises at the first forward)
    twice = fresh()
    with pytest.raises(ValueError, match="the list of modules names one module twice"):
        fully_shard([twice.ln_f, twice.ln_f])
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for shard in (torch_fully_shard, fully_shard):  # a list's unit run as a root: torch's type and phrase
        pair = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        shard([pair[0], pair[1]])
        with pytest.raises(RuntimeError, match=r"FSDP requires a single root module but got \(FSDPLinear"):
            pair[0](torch.ones(2, 4))
    model = fresh()
    fully_shard(model)
    with pytest.raises(AssertionError, match="can only be applied to a module once. fully_shard has already been "
                                             "applied to FSDPGPT"):
        fully_shard(model)
    with pytest.raises(AssertionError, match="can only be applied to a module once. fully_shard has already been "
                                             "applied to"):  # (torch's, over flatshard's: its registry says so)
        torch_fully_shard(model)
    with pytest.raises(ValueError, match="fully_shard doesn't support scalar parameters. Change scale to a 1D tensor"):
        scalar = nn.Linear(2, 2)
        scalar.scale = nn.Parameter(torch.tensor(1.0))
        fully_shard(scalar)
    with pytest.raises(NotImplementedError, match=r"FSDP does not support non-contiguous parameters yet: .*'weight' "
                                                  r"of Conv2d"):
        conv = nn.Conv2d(4, 4, 3)
        conv.weight = nn.Parameter(conv.weight.detach().to(memory_format=torch.channels_last))
        fully_shard(conv)
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' of Linear is a TwoTensor, a tensor subclass; "
                                                  r"flatshard's fully_shard shards plain tensors and DTensors only"):
        from torch.testing._internal.two_tensor import TwoTensor

        wrapped = nn.Linear(2, 2)  # (torchao's float8 / NF4 weights are such subclasses: flattened, they would be lost)
        wrapped.weight = nn.Parameter(TwoTensor(torch.ones(2, 2), torch.zeros(2, 2)))
        fully_shard(wrapped)
    with pytest.raises(ValueError, match="fully_shard does not support containers that do not implement forward: "
                                         "ModuleList"):
        fully_shard(fresh().blocks)
    with pytest.raises(AssertionError, match="Please init the 2D mesh for HSDP with mesh_dim_names specified"):
        fully_shard(fresh(), mesh=init_device_mesh("cpu", (2, 2)))
    top_down = fresh()
    fully_shard(top_down)
    with pytest.raises(ValueError, match=r"parameter 'ln1.weight' is already sharded .* call fully_shard bottom-up"):
        fully_shard(top_down.blocks[0])

    with pytest.raises(NotImplementedError, match="was sharded with fully_shard: call its unshard"):
        with flatshard.summon_full_params(model):
            pass
    with pytest.raises(ValueError, match="move_shards_to_host: Linear has no flatshard units; wrap it .* or shard "
                                         "it \\(fully_shard\\) first"):
        flatshard.move_shards_to_host(nn.Linear(2, 2))
    mixed = fresh()
    mixed.blocks[0] = flatshard.FullyShardedDataParallel(mixed.blocks[0])
    fully_shard(mixed)
    with pytest.raises(ValueError, match="unit 'blocks.0' was made by FullyShardedDataParallel and its root by "
                                         "fully_shard; one model uses one of the two APIs"):
        mixed(torch.zeros(2, SEQ, dtype=torch.long))
    early = fresh()
    fully_shard(early.blocks[0])
    fully_shard(early)
    early.blocks[0].unshard()  # before any forward: the model's root is set up first (torch's own test does this)
    assert early._unit_state.is_root and not early.blocks[0]._unit_state.is_root
    # Unsharded until a forward, as torch's: nn.Parameters that require grad as the sharded ones do
    assert early.blocks[0].ln1.weight.shape == (16,) and type(early.blocks[0].ln1.weight) is nn.Parameter
    assert all(type(p) is nn.Parameter and p.requires_grad for p in early.blocks[0].parameters())
    assert sum(p.numel() for p in early.blocks[0].parameters()) == sum(p.numel() for p in make_gpt(
        vocab=VOCAB, seq=SEQ).blocks[0].parameters())
    early.blocks[0].reshard()
    early(torch.zeros(2, SEQ, dtype=torch.long))
    early.blocks[0].ln1.weight.requires_grad_(False)  # (a frozen one stays frozen unsharded)
    handle = early.blocks[0].unshard(async_op=True)
    handle.wait()
    assert early.blocks[0].ln1.weight.shape == (16,) and type(early.blocks[0].ln1.weight) is nn.Parameter
    assert not early.blocks[0].ln1.weight.requires_grad and early.blocks[0].ln1.bias.requires_grad
    early.blocks[0].unshard()  # (unsharded already: nothing changes, as torch's)
    assert not early.blocks[0].ln1.weight.requires_grad
    early.blocks[0].reshard()
    assert type(early.blocks[0].ln1.weight).__name__ == "DTensor"
    early.blocks[0].ln1.weight.requires_grad_(True)
    early.reshard()  # (the root keeps its parameters after forward, registered unsharded: as torch's)
    before = [p.to_local().clone() for p in early.parameters()]
    with pytest.raises(NotImplementedError, match=r"moving FSDPGPT to meta after fully_shard: flatshard moves a "
                                                  r"fully_shard model.s shards to the host and back"):
        early.to("meta")
    assert all(p.dtype == torch.float32 and torch.equal(p.to_local(), b) for p, b in zip(early.parameters(), before))
    early(torch.zeros(2, SEQ, dtype=torch.long)).sum().backward()  # (still trains)
    with pytest.raises(NotImplementedError, match=r"FSDPModule.set_custom_all_gather: not supported"):
        model.set_custom_all_gather(lambda *args: None)
    # torch's staging-buffer allocators: accepted (torchtitan's enable_symm_mem sets one on every module), warned
    # about once per process (see [Note: Where torch's staging buffers come from])
    import warnings

    from torch.distributed.fsdp import FSDPModule

    with pytest.warns(UserWarning, match=r"FSDPModule.set_symm_mem_for_comm\('NCCL'\): flatshard's runtime .* no "
                                         r"effect \(it never changes results\)"):
        model.set_symm_mem_for_comm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in model.modules():  # (as torchtitan calls it: no second warning)
            if isinstance(m, FSDPModule):
                m.set_symm_mem_for_comm()
                m.set_allocate_memory_from_process_group_for_comm(False)
    with pytest.warns(UserWarning, match=r"set_allocate_memory_from_process_group_for_comm\(True\)"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    # torch's refusals, types and phrases (True is not 1); recurse=False: the module alone; the root's scheduler
    # takes the largest of its units', also when set after its first forward
    capped = fresh()
    for block in capped.blocks:
        fully_shard(block)
    fully_shard(capped)
    with pytest.raises(TypeError, match="^max_input_buffers must be an int, got bool$"):
        capped.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="^max_input_buffers must be a positive int, got 0$"):
        capped.set_reduce_scatter_max_input_buffers(0)
    capped(torch.zeros(2, SEQ, dtype=torch.long)).sum().backward()
    assert capped._unit_state.root.scheduler.max_reductions_in_flight == 1
    capped.blocks[1].set_reduce_scatter_max_input_buffers(3, recurse=False)
    assert [b._unit_state.reduce_scatters_in_flight for b in capped.blocks] == [1, 3, 1]
    assert capped._unit_state.root.scheduler.max_reductions_in_flight == 3
    # A reduce-scatter group of their own: one for all (the same ranks), kept by a second call; False: the shard group
    capped.set_separate_reduce_scatter_group()
    scatter = capped._unit_state.reduce_scatter_group
    assert scatter is not None and torch.distributed.get_process_group_ranks(scatter) == [0, 1, 2, 3]
    capped.set_separate_reduce_scatter_group()
    capped.blocks[0].set_separate_reduce_scatter_group(False, recurse=False)
    assert [u._unit_state.reduce_scatter_group for u in (capped, *capped.blocks)] == [scatter, None, scatter, scatter]
    capped(torch.zeros(2, SEQ, dtype=torch.long)).sum().backward()
    assert all(p.grad is not None for p in capped.parameters())
    hsdp = fully_shard(fresh(), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match="^stream cannot be set when using native HSDP$"):  # (torch's type and phrase)
        hsdp.set_all_reduce_hook(lambda reduce_output: None, stream=object())

    def fails(reduce_output):
        raise RuntimeError("the hook's own error")

    hooked = fully_shard(fresh())
    hooked.set_all_reduce_hook(fails)
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    with pytest.raises(RuntimeError, match="the hook's own error"):  # (out of the backward, as torch's)
        hooked(tokens).sum().backward()
    # That backward's gradients are dropped (none half-reduced left for the next step), and training goes on
    assert all(p.grad is None for p in hooked.parameters())
    hooked.set_all_reduce_hook(None)
    hooked(tokens).sum().backward()
    assert all(p.grad is not None for p in hooked.parameters())
    # The runtime holds the hook weakly: a hook that refers to its model keeps nothing alive
    import gc
    import weakref

    cyclic = fully_shard(fresh())
    cyclic.set_all_reduce_hook(lambda reduce_output, model=cyclic: None)
    gone = weakref.ref(cyclic)
    del cyclic
    gc.collect()
    assert gone() is None, "a model whose all-reduce hook refers to it was never collected"
    with pytest.raises(ValueError, match=r"set_modules_to_forward_prefetch: expects FSDPModules .* but got Linear"):
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])


def test_what_is_not_supported_yet_is_refused_by_name():
    from flatshard.testing import run_distributed

    run_distributed(_refusals, 4, timeout=120)


_WITHOUT_A_GROUP = """
import sys, torch, torch.distributed as dist
from torch import nn
if sys.argv[1] == "flatshard":
    from flatshard import fully_shard
else:
    from torch.distributed.fsdp import fully_shard
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
fully_shard(model[0])
fully_shard(model)
model(torch.ones(2, 4)).sum().backward()
print(dist.is_initialized(), dist.get_world_size(), type(model[0].weight.grad).__name__)
dist.destroy_process_group()
"""


def test_fully_shard_without_a_process_group_initializes_it_as_torch():
    """torchrun's environment set and no init_process_group call: torch's fully_shard (mesh=None) initializes the
    default group itself (env://); flatshard's raised "torch.distributed is not initialized" (torch's
    test_fully_shard_logging.py's child script runs so)."""
    import socket
    import subprocess
    import sys

    outs = {}
    for impl in ("torch", "flatshard"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        done = subprocess.run([sys.executable, "-c", _WITHOUT_A_GROUP, impl], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 0, (impl, done.stderr[-3000:])
        outs[impl] = done.stdout.strip().splitlines()[-1]
    assert outs["flatshard"] == outs["torch"] == "True 1 DTensor", outs
