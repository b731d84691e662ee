"""Streaming full-weight export: flatshard.checkpoint.stream_full_weights (see [Note: Streaming export]).

Its extra memory is measured with the core's counter of unsharded bytes (every gathered
buffer): at most the largest unit's full flat parameter, where a FULL state dict holds
every unit's at once (checked too, so the bound is not vacuous). The slack beyond the
counter is the one yielded copy the caller holds, at most the largest parameter. The
weights it yields must equal the summoned ones, names included.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt


def _export(rank, world_size, mixed: bool):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _C
    from flatshard.checkpoint import stream_full_weights

    model = FSDP(make_gpt(n_layers=4), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mixed else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()
    opt.step()
    units = [u for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None]
    largest_unit = max(u._unit_state.handle.layout.padded_numel * 4 for u in units)  # fp32 full flat parameters
    whole_model = sum(u._unit_state.handle.layout.padded_numel * 4 for u in units)

    _C.reset_peak_unsharded_bytes()
    names, largest_yielded = [], 0
    for name, tensor in stream_full_weights(model, dtype=torch.bfloat16):
        names.append(name)
        largest_yielded = max(largest_yielded, tensor.numel() * tensor.element_size())
        del tensor  # as a caller copying each tensor into an inference engine would
    streamed_peak = _C.peak_unsharded_bytes()
    assert streamed_peak <= largest_unit, (streamed_peak, largest_unit)

    _C.reset_peak_unsharded_bytes()
    full = model.state_dict()
    full_peak = _C.peak_unsharded_bytes()
    if world_size > 1:  # a FULL state dict gathers the whole model (at W=1 the shards are the full parameters)
        assert full_peak >= whole_model > 2 * streamed_peak, (full_peak, whole_model, streamed_peak)

    largest_param = max(v.numel() * 2 for v in full.values())  # bf16
    assert largest_yielded <= largest_param
    # The same names and values as a FULL state dict (which is the summoned parameters and the buffers).
    streamed = dict(stream_full_weights(model, dtype=torch.bfloat16))
    assert sorted(streamed) == sorted(full) and len(names) == len(full), (sorted(streamed), sorted(full))
    for name, value in full.items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert streamed[name].dtype == want.dtype and torch.equal(streamed[name], want), name
    with FSDP.summon_full_params(model):
        summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
    as_stored = dict(stream_full_weights(model, device="cpu"))
    for name, p in summoned.items():
        assert torch.equal(as_stored[name], p), name
    only_rank0 = list(stream_full_weights(model, rank0_only=True))
    assert (len(only_rank0) == len(full)) if rank == 0 else not only_rank0
    return {"streamed_peak": streamed_peak, "largest_unit": largest_unit, "full_peak": full_peak,
            "whole_model": whole_model}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_stream_full_weights_memory_and_values(world_size, mixed):
    results = run_distributed(_export, world_size, mixed, timeout=120)
    print(results[0])
