"""Every collective flatshard issues runs inside a ``flatshard::`` profiler range.

A profiled step at W = 2 (forward, backward with the rank guard, ``clip_grad_norm_``, the
optimizer step) followed by FULL and SHARDED ``state_dict()``, ``optim_state_dict`` and a
FULL ``load_state_dict``: every collective in the trace must start inside a range whose
name starts with ``flatshard::``, on the same thread. A collective is seen as its
dispatcher op (``c10d::allreduce_``, ``c10d::_allgather_base_``, ...), recorded on the
thread that issues it, the C++ scheduler's included (``ProcessGroup``'s methods dispatch
to these ops); gloo's own ``gloo:`` events are recorded on its worker threads when the
work runs, so they say nothing about who issued it. The control is a collective the test
issues itself, outside flatshard (a ``dist.all_reduce`` of the loss): it must be the one
found outside every range, or the check could not fail.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.profiler import profile

from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt

COLLECTIVE_PREFIXES = ("c10d::",)


def _trace(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    gpt_loss(model, *batch).backward()  # the first step builds the root (its groups: not a step's collectives)
    opt.step()
    opt.zero_grad()
    with profile() as prof:
        loss = gpt_loss(model, *batch)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        full = model.state_dict()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
            model.state_dict()
        FSDP.optim_state_dict(model, opt)
        model.load_state_dict(full)
        control = loss.detach().clone()
        dist.all_reduce(control)  # the test's own collective: outside every flatshard range
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = [(e["tid"], e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
              if e["name"].startswith("flatshard::")]
    outside, inside = [], 0
    for e in events:
        if not e["name"].startswith(COLLECTIVE_PREFIXES):
            continue
        if any(tid == e["tid"] and begin <= e["ts"] <= end for tid, begin, end, _ in ranges):
            inside += 1
        else:
            outside.append(e["name"])

    names = sorted({e["name"] for e in events if e["name"].startswith(COLLECTIVE_PREFIXES)})
    return {"inside": inside, "outside": outside, "ranges": sorted({r[3].split(" ")[0] for r in ranges}),
            "collectives": names}


def test_every_collective_in_a_flatshard_range():
    for rank, got in enumerate(run_distributed(_trace, 2)):
        assert got["outside"] == ["c10d::allreduce_"], (rank, got)  # the control, and nothing else
        assert got["inside"] > 20, (rank, got)
        for what in ("flatshard::all_gather", "flatshard::reduce_scatter", "flatshard::clip_grad_norm_",
                     "flatshard::rank_guard", "flatshard::optim_state_dict"):
            assert what in got["ranges"], (rank, what, got["ranges"])
