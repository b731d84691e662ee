"""One rank of a run where the last rank is killed (SIGKILL, as the kernel's OOM killer does) between two
steps, or with PEER_KILLED_WHERE=mid inside a step while its peers wait in a collective (tests/test_stalled_waits.py
starts it, as torchrun would): every survivor must raise
PeerGoneError (not a RankDivergenceError) naming the rank that is gone, and exit status 3 having printed it. Environment: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's)."""

import os
import signal
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402

from flatshard import FullyShardedDataParallel as FSDP  # noqa: E402
from flatshard import PeerGoneError, RankDivergenceError  # noqa: E402
from models import Block, gpt_loss, local_slice, make_batch, make_gpt  # noqa: E402

torch.set_num_threads(1)
# 30 s: a survivor that learned of the death only from gloo's timeout would raise gloo's error, not PeerGoneError
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
WHERE = os.environ.get("PEER_KILLED_WHERE", "between")  # "between" steps, or "mid": inside step 1's forward
rank, world_size = dist.get_rank(), dist.get_world_size()
model = FSDP(make_gpt(n_layers=3), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(seed):
    gpt_loss(model, *local_slice(make_batch(batch=12, seed=seed), rank, world_size)).backward()
    opt.step()
    opt.zero_grad()


step(0)
if rank == world_size - 1:
    if WHERE == "between":
        os.kill(os.getpid(), signal.SIGKILL)
    else:  # in the second block's pre-forward: the survivors wait in that block's all-gather meanwhile
        model.blocks[1].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
store = dist.distributed_c10d._get_default_store()
try:
    try:
        step(1)
    except RankDivergenceError:  # (a loop that skips divergent batches: a dead peer must not end up here)
        print("caught as a RankDivergenceError", flush=True)
        os._exit(4)
except PeerGoneError as e:
    print(f"PeerGoneError: {e}", flush=True)
    store.set(f"test/reported/{rank}", "1")
    if rank == 0:  # rank 0 hosts the store: it stays up until every survivor has reported (roll call included)
        store.wait([f"test/reported/{r}" for r in range(world_size - 1)], timedelta(seconds=60))
    os._exit(3)
print("no error", flush=True)
os._exit(0)
