"""One rank of a run whose backward raises on every rank, and the script lets it propagate: the
process must exit with the traceback and status 1 (tests/test_exit.py starts it). Environment:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's)."""

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402

from flatshard import FullyShardedDataParallel as FSDP  # noqa: E402
from models import Block, gpt_loss, local_slice, make_batch, make_gpt  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank, world_size = dist.get_rank(), dist.get_world_size()
model = FSDP(make_gpt(n_layers=4), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
batch = local_slice(make_batch(), rank, world_size)
gpt_loss(model, *batch).backward()
opt.step()
opt.zero_grad()


class Stop(Exception):
    pass


def raise_in_backward(grad):  # between two blocks' backwards: reductions and prefetches in flight
    raise Stop("the backward raised (on every rank)")


hidden = {}
model.module.blocks[1].register_forward_hook(lambda m, i, o: hidden.update(out=o))
loss = gpt_loss(model, *batch)
hidden["out"].register_hook(raise_in_backward)
loss.backward()  # raises Stop: the interpreter exits with the traceback, status 1
