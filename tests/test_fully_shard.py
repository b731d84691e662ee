"""``flatshard.fully_shard`` against torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same script.

The oracle is torch's FSDP2 itself: each case builds the same model twice on every rank, shards one with
torch's ``fully_shard`` and one with flatshard's (blocks first, then the root, as FSDP2 users do), trains both
three Adam steps on the same rows of the same global batch, and compares per-step losses, the last step's
gradients (each rank's local tensor of each DTensor ``.grad``) and the final parameters (each rank's local
tensor). Results are bit-equal, fp32 and bf16 (``MixedPrecisionPolicy``) alike: both lay each parameter's
dim-0 chunks out the same way (see [Note: Dim-0 layout] in csrc/flatshard/layout.h), cast them the same way,
sum them with gloo's reduce-scatter and divide by a power of two.

``compiled_blocks`` compiles each block after sharding it, as torchtitan does, with dynamo and AOT autograd
(``backend="aot_eager"``): what meets flatshard's hooks is dynamo's tracing and the compiled forward and
backward graphs; inductor's code generation inside a block is the same for either FSDP and costs tens of
seconds on two cores (run by hand with ``backend="inductor"`` at W = 2, 2026-11-27: bit-equal too).

``cpu_offload`` (``CPUOffloadPolicy``) goes through the front-end's path and the runtime's offload flag; on a
CPU the host is the device, so no copy is made, by torch or by flatshard: the copies run on a GPU
(tests/test_gpu.py).

The GPT has a vocabulary of 67 rows and a position table of 10: neither divides by 2 or 4, so ranks hold
padded chunks, and at W = 4 the position table's last rank holds 1 row of 3. Every case of one world size
runs in one process start (see [Note: One process start per world size] in tests/_cases.py).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from _cases import CaseRun
from models import ATOL, RTOL, gpt_loss, local_slice, make_batch, make_gpt

VOCAB, SEQ, STEPS, LR = 67, 10, 3, 1e-2
CASES = ["reshard_after_forward=None", "reshard_after_forward=True", "reshard_after_forward=False",
         "no_gradient_sync", "checkpointed_blocks", "frozen_embedding", "ignored_position_table", "meta_then_to_empty",
         "bf16_params_fp32_reduce", "bf16_params_and_reduce", "bf16_fp32_outputs", "fp16_params_and_reduce",
         "bf16_params_fp32_reduce_no_gradient_sync", "compiled_blocks", "cpu_offload", "frozen_base_weights",
         "tail_group", "tail_group_resharding", "tail_group_bf16_params_fp32_reduce", "explicit_prefetch",
         "divide_factor_summed", "kept_after_backward", "kept_after_backward_synced", "cast_to_float64_after",
         "matrices_on_dim_1", "all_reduce_hook", "fp16_all_reduce_hook", "half_model"]
WORLD_SIZES = [1, 2, 4]
# At W = 1 a unit is replicated (nothing gathered, no copy-out): the cases whose code differs there.
W1_CASES = ["reshard_after_forward=None", "no_gradient_sync", "bf16_params_fp32_reduce", "meta_then_to_empty"]
# At W = 4 every unit's last rank holds fewer rows than the others (the position table's 1 row of 3): the cases
# whose code or arithmetic depends on the world size beyond that (the gathers and reductions of each resharding
# and precision path, no_sync, sharding on meta; fp16's divide factors); the rest (frozen, ignored and
# checkpointed parameters, bf16 outputs) go through the same code at W = 2.
W4_CASES = ["reshard_after_forward=None", "reshard_after_forward=False", "no_gradient_sync", "meta_then_to_empty",
            "bf16_params_fp32_reduce", "fp16_params_and_reduce", "frozen_base_weights", "reshard_after_forward=2",
            "reshard_after_forward=2_bf16", "matrices_on_dim_1", "half_model_all_reduce_hook"]
# At W = 4 only: HSDP on a 2x2 mesh (replicate, shard), resharding after forward or not.
HSDP_CASES = ["hsdp_2x2", "hsdp_2x2_reshard_after_forward=False", "hsdp_2x2_reduce_scatter_only",
              "hsdp_2x2_all_reduce_hook"]


def _cases_at(world_size: int) -> list[str]:
    return {1: W1_CASES, 2: CASES, 4: W4_CASES + HSDP_CASES}[world_size]


def _build(impl: str, case: str) -> nn.Module:
    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    if case == "meta_then_to_empty":  # torchtitan's way: shard on meta, to_empty, then initialize in place
        with torch.device("meta"):
            model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
    else:
        model = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
    kwargs = {}
    if case.startswith("reshard_after_forward="):  # (=2: to pairs of ranks, at W = 4)
        kwargs["reshard_after_forward"] = {"None": None, "True": True, "False": False, "2": 2,
                                           "2_bf16": 2}[case.split("=")[1]]
    if case.endswith("_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case.startswith("bf16") or case.startswith("tail_group_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if "fp32_reduce" in case else None,
            output_dtype=torch.float32 if case == "bf16_fp32_outputs" else None)
    if case.startswith("fp16"):  # reduced in fp16: divided before and after the SUM, as torch's
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16)
    if case.startswith("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kwargs["reshard_after_forward"] = not case.endswith("=False")
    if case.startswith("kept_after_backward"):  # (torch's own test pairs set_reshard_after_backward with this)
        kwargs["reshard_after_forward"] = False
    if case == "matrices_on_dim_1":  # every matrix's chunk along dim 1 (its columns divide by 2 and 4), 1-D ones on 0
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    if case == "cpu_offload":  # (no pinning without a GPU, torch's and ours)
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if case.startswith("half_model"):  # no policy: reduced in the parameters' fp16, divided before and after the SUM, as
        model.half()  # torch's (at W = 4 by 2 and 2: where the hook runs shows)
    if case == "frozen_embedding":
        model.embed.weight.requires_grad_(False)
    if case == "frozen_base_weights":  # LoRA's shape: each block's projection weights frozen, the rest trained
        for block in model.blocks:
            for linear in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.out):
                linear.weight.requires_grad_(False)
    if case == "ignored_position_table":
        kwargs["ignored_params"] = {model.pos}
    if case == "checkpointed_blocks":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    block_kwargs = {k: v for k, v in kwargs.items() if k != "ignored_params"}
    if case == "bf16_fp32_outputs":  # the root's outputs only (a block's fp32 output would meet bf16 weights)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        block_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case == "compiled_blocks":
        import torch._dynamo as dynamo

        dynamo.reset()
    for i, block in enumerate(model.blocks):
        fully_shard(block, **block_kwargs)
        if case == "compiled_blocks":  # torchtitan's way: each block compiled after fully_shard (see the docstring)
            model.blocks[i] = torch.compile(block, backend="aot_eager")
    if case.startswith("tail_group"):  # accelerate's FSDP2 tail: one unit of the final norm and the tied embedding
        # and head (a list of modules); torch's holds it from the first member's forward to the last one's, ours
        # gathers it again for a member after another resharded it (see [Note: A list of modules])
        # (bf16: the tied weight's two uses summed in bf16 before the fp32 reduction, as torch's autograd sums them
        # on its unsharded parameter: see [Note: FSDP2's gradient sums] in csrc/flatshard/flat_param.h)
        fully_shard([model.ln_f, model.embed, model.head], reshard_after_forward=case.endswith("resharding"),
                    **{k: v for k, v in kwargs.items() if k == "mp_policy"})
    fully_shard(model, **kwargs)
    if case == "explicit_prefetch":  # torchtitan's: each block gathers the next in forward, the previous in backward
        for i, block in enumerate(model.blocks):
            block.set_modules_to_forward_prefetch(list(model.blocks[i + 1:i + 2]))
            block.set_modules_to_backward_prefetch(list(model.blocks[max(i - 1, 0):i]))
    if case.endswith("all_reduce_hook"):  # torchft's use: each reduced shard changed in place; scaled and shifted, so
        # that where it runs against the division shows (after it in fp32, where torch divides inside its collectives;
        # before it in fp16, where torch sums, then divides)
        model.hook_calls = []
        for m in [model, *model.blocks]:
            m.set_all_reduce_hook(functools.partial(_scale_and_shift, model.hook_calls))
    if case == "divide_factor_summed":  # SUM, then divided by 3 (torch's PREMUL_SUM, unforced, is NCCL's alone)
        for m in [model, *model.blocks]:
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(3.0)
    if case == "cast_to_float64_after":  # the shards, their gradients and the parameters' DTensors follow
        model.to(torch.float64)
    if case == "meta_then_to_empty":
        from torch.distributed.tensor import distribute_tensor

        model.to_empty(device="cpu")
        reference = make_gpt(vocab=VOCAB, seq=SEQ, seed=0)
        with torch.no_grad():
            for p, want in zip(model.parameters(), reference.parameters()):
                p.copy_(distribute_tensor(want, p.device_mesh, p.placements))
            for b, want in zip(model.buffers(), reference.buffers()):
                b.copy_(want)
    return model


def _scale_and_shift(calls: list, reduce_output: torch.Tensor) -> None:
    calls.append((str(reduce_output.dtype), reduce_output.numel()))
    reduce_output.mul_(0.5).add_(1e-3)


def _train(model: nn.Module, case: str, rank: int, world_size: int) -> dict:
    # (fp16 parameters: SGD, as Adam's eps underflows in fp16 and both runs would be NaN from the second step)
    opt = (torch.optim.SGD if case.startswith("half_model") else torch.optim.Adam)(
        [p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = local_slice(make_batch(batch=8, seq=SEQ, vocab=VOCAB, seed=step), rank, world_size)
        if case.endswith(("no_gradient_sync", "kept_after_backward", "kept_after_backward_synced", "reduce_scatter_only")):
            # Two micro-batches, the first without reduction (kept: its parameters kept unsharded too, so that the
            # second forward gathers nothing; reduce-scatter only: HSDP's all-reduce left to the second)
            first_flags, last_flags = _accumulation_flags(case)
            for setter, value in first_flags:
                getattr(model, setter)(value)
            loss = gpt_loss(model, tokens[:, :5], targets[:, :5]) / 2
            loss.backward()
            for setter, value in last_flags:
                getattr(model, setter)(value)
            second = gpt_loss(model, tokens[:, 5:], targets[:, 5:]) / 2
            second.backward()
            loss = loss + second
        else:
            loss = gpt_loss(model, tokens, targets)
            loss.backward()
        grads = [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": [_local(p).detach().clone() for p in model.parameters()],
            "names": [n for n, _ in model.named_parameters()]}


def _accumulation_flags(case: str) -> tuple[list, list]:
    """The FSDPModule setters called before the first micro-batch and before the last (torch's gradient
    accumulation test's)."""
    setter = {"kept_after_backward": "set_reshard_after_backward", "kept_after_backward_synced": "set_reshard_after_backward",
              "reduce_scatter_only": "set_requires_all_reduce"}.get(case.split("_2x2_")[-1])
    # (kept, synced: each micro-batch reduced, the parameters kept unsharded between them)
    alone = setter == "set_requires_all_reduce" or case == "kept_after_backward_synced"
    flags = [setter] if alone else ["set_requires_gradient_sync"] + [setter] * bool(setter)
    return [(f, False) for f in flags], [(f, True) for f in flags]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _parity(rank: int, world_size: int, case: str) -> list[str]:
    """Problems found (empty: flatshard's run equals torch FSDP2's bit for bit)."""
    from flatshard import _C

    torch_model = _build("torch", case)
    theirs = _train(torch_model, case, rank, world_size)
    model = _build("flatshard", case)
    problems = []
    if case == "explicit_prefetch" and world_size > 1:  # block 1's all-gather issued in block 0's pre-forward
        def check(_module, _args):
            if model.blocks[1]._unit_state.handle.state == _C.ShardedState.SHARDED:
                problems.append("block 0's forward did not prefetch block 1")

        model.blocks[0].register_forward_pre_hook(check)
    ours = _train(model, case, rank, world_size)
    if ours["names"] != theirs["names"]:
        problems.append(f"parameter names {ours['names']} != torch's {theirs['names']}")
    if ours["losses"] != theirs["losses"]:
        problems.append(f"losses {ours['losses']} != torch's {theirs['losses']}")
    for what in ("grads", "params"):
        for name, a, b in zip(theirs["names"], ours[what], theirs[what]):
            if (a is None) != (b is None) or (a is not None and not (a.shape == b.shape and torch.equal(a, b))):
                diff = "" if a is None or b is None or a.shape != b.shape else f", max |diff| {(a - b).abs().max():.2e}"
                problems.append(f"{what[:-1]} {name}: {None if a is None else tuple(a.shape)} vs torch's "
                                f"{None if b is None else tuple(b.shape)}{diff}")
    if _C.unsharded_bytes() != 0:
        problems.append(f"{_C.unsharded_bytes()} bytes unsharded between iterations")
    if case.startswith("reshard_after_forward=2"):
        # Each step gathers each unit twice: in forward its 1/W shard over all W ranks, in backward the 2/W it kept
        # over its pair of ranks (see [Note: Reshard to a smaller group] in csrc/flatshard/flat_param.h).
        element = 2 if case.endswith("bf16") else 4
        for name, unit in [("root", model)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]:
            handle = unit._unit_state.handle
            want = STEPS * 3 * handle.layout.shard_numel * element
            if handle.collective_bytes["all_gather"] != want:
                problems.append(f"{name} all-gathered {handle.collective_bytes['all_gather']} bytes in {STEPS} steps, "
                                f"not {want} (its shard in forward, twice that in backward)")
    if case.endswith("all_reduce_hook") and sorted(model.hook_calls) != sorted(torch_model.hook_calls):
        problems.append(f"the all-reduce hooks saw {sorted(model.hook_calls)}, torch's {sorted(torch_model.hook_calls)}")
    if case == "matrices_on_dim_1":
        dims = {p.placements[-1].dim for p in model.parameters() if p.ndim == 2}
        if dims != {1}:
            problems.append(f"the matrices are sharded on dims {dims}, not 1")
    if case == "cast_to_float64_after":
        dtypes = {str(t.dtype) for t in ours["grads"] + ours["params"]} | {str(p.dtype) for p in model.parameters()}
        if dtypes != {"torch.float64"}:
            problems.append(f"after .to(torch.float64) the parameters and gradients are {sorted(dtypes)}")
    if case in ("kept_after_backward", "hsdp_2x2_reduce_scatter_only") and world_size > 1:
        # Kept after backward: each unit gathered once a step, in the first micro-batch's forward. Reduce-scatter
        # only: each unit reduce-scattered in both micro-batches, all-reduced over the replicas once a step.
        for name, unit in [("root", model)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]:
            handle = unit._unit_state.handle
            shard_bytes = handle.layout.shard_numel * 4
            got, shard_factor = handle.collective_bytes, handle.layout.shard_factor
            want = ({"all_gather": STEPS * shard_bytes} if case == "kept_after_backward" else
                    {"reduce_scatter": 2 * STEPS * shard_bytes * shard_factor, "replica_all_reduce": STEPS * shard_bytes})
            for kind, n in want.items():
                if got[kind] != n:
                    problems.append(f"{name}: {kind} moved {got[kind]} bytes in {STEPS} steps, not {n}")
    if case == "frozen_base_weights" and world_size > 1:
        # Only the trainable parameters' rows are reduce-scattered (their padded rows on every rank), as torch's.
        for i, block in enumerate(model.blocks):
            handle, layout = block._unit_state.handle, block._unit_state.handle.layout
            rows = sum(layout.rows_per_shard(j) * layout.row_numel(j) for j, p in
                       enumerate(block._unit_state.orig_params) if p.requires_grad)
            got = handle.collective_bytes["reduce_scatter"]
            if got != STEPS * rows * world_size * 4:
                problems.append(f"block {i} reduce-scattered {got} bytes in {STEPS} steps, not "
                                f"{STEPS} x {rows * world_size * 4} (its trainable rows)")
    return problems


def _cases_of(world_size: int):
    return world_size, [(case, case) for case in _cases_at(world_size)]


RUNS = CaseRun(_parity, _cases_of, timeout=300.0, pg_timeout=30.0)


@pytest.mark.parametrize("case, world_size", [(c, w) for w in WORLD_SIZES for c in _cases_at(w)])
def test_same_training_as_torch_fsdp2(case, world_size):
    problems = [f"rank {rank}: " + "\n  ".join(p) for rank, p in enumerate(RUNS.results(world_size, case)) if p]
    assert not problems, f"{case} at W={world_size}:\n" + "\n".join(problems)


# ------------------------------------------------------------------ what users see


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
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        out[impl] = (scores, loss.item(), [_local(p.grad).clone() for p in model.parameters()])
    return out


def test_register_fsdp_forward_method_as_torch():
    """torch's own function wraps a flatshard module's method (see [Note: Forward methods] in _fully_shard.py): the
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
    with pytest.raises(NotImplementedError, match="dp_mesh_dims .* is not supported"):
        fully_shard(fresh(), dp_mesh_dims=object())
    with pytest.raises(ValueError, match="expected an nn.Module or a non-empty list of them but got an empty list"):
        fully_shard([])
    tied = nn.ModuleDict({"embed": nn.Embedding(6, 4), "head": nn.Linear(4, 6, bias=False)})
    tied.head.weight = tied.embed.weight
    fully_shard(tied.embed)
    with pytest.raises(ValueError, match=r"Parameter 'weight' is shared with a parameter already managed by another "
                                         r"FSDP group \('weight', .*use fully_shard\(\[module_a, module_b\]\)"):
        fully_shard(tied.head)  # (torch's type and phrase; torch's raises at the first forward)
    twice = fresh()
    with pytest.raises(ValueError, match="the list of modules names one module twice"):
        fully_shard([twice.ln_f, twice.ln_f])
    model = fresh()
    fully_shard(model)
    with pytest.raises(AssertionError, match="can only be applied to a module once. fully_shard has already been "
                                             "applied to FSDPGPT"):
        fully_shard(model)
    with pytest.raises(ValueError, match="fully_shard doesn't support scalar parameters. Change scale to a 1D tensor"):
        scalar = nn.Linear(2, 2)
        scalar.scale = nn.Parameter(torch.tensor(1.0))
        fully_shard(scalar)
    with pytest.raises(NotImplementedError, match=r"FSDP does not support non-contiguous parameters yet: .*'weight' "
                                                  r"of Conv2d"):
        conv = nn.Conv2d(4, 4, 3)
        conv.weight = nn.Parameter(conv.weight.detach().to(memory_format=torch.channels_last))
        fully_shard(conv)
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
    assert early.blocks[0].ln1.weight.shape == (16,) and type(early.blocks[0].ln1.weight) is torch.Tensor
    early.blocks[0].reshard()
    early(torch.zeros(2, SEQ, dtype=torch.long))
    handle = early.blocks[0].unshard(async_op=True)
    handle.wait()
    assert early.blocks[0].ln1.weight.shape == (16,) and type(early.blocks[0].ln1.weight) is torch.Tensor
    early.blocks[0].reshard()
    assert type(early.blocks[0].ln1.weight).__name__ == "DTensor"
    early.reshard()  # (the root keeps its parameters after forward, registered unsharded: as torch's)
    before = [p.to_local().clone() for p in early.parameters()]
    with pytest.raises(NotImplementedError, match=r"moving FSDPGPT to meta after fully_shard is not supported"):
        early.to("meta")
    assert all(p.dtype == torch.float32 and torch.equal(p.to_local(), b) for p, b in zip(early.parameters(), before))
    early(torch.zeros(2, SEQ, dtype=torch.long)).sum().backward()  # (still trains)
    with pytest.raises(NotImplementedError, match=r"FSDPModule.set_custom_all_gather: not supported"):
        model.set_custom_all_gather(lambda *args: None)
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


# ------------------------------------------------------------------ checkpoints


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
    follows = all(p.to_local().untyped_storage().data_ptr() == unit._unit_state.flat_param.untyped_storage().data_ptr()
                  for unit in units for p in unit.parameters(recurse=False))
    losses += _steps(model, opt, range(2, 4), rank, world_size)
    reference = _build("torch", "reshard_after_forward=None")
    return losses, _steps(reference, torch.optim.Adam(reference.parameters(), lr=LR), range(4), rank, world_size), follows


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
    import gc
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
