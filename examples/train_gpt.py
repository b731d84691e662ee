"""Train a small character-level GPT with flatshard's FullyShardedDataParallel.

flatshard is a drop-in replacement for torch.distributed.fsdp.FullyShardedDataParallel:
the only flatshard-specific line below is the import. Pass `--impl torch` to run the
very same script on torch's own FSDP and compare.

Two ways to run it:

    # 1) Plain python: spawns --nproc CPU processes itself (gloo backend).
    python examples/train_gpt.py                      # 2 ranks, 50 steps
    python examples/train_gpt.py --nproc 4 --impl torch

    # 2) torchrun: uses RANK/WORLD_SIZE/LOCAL_RANK from the environment
    #    (NCCL on cuda:LOCAL_RANK when CUDA is available, otherwise gloo on CPU).
    torchrun --nproc-per-node 2 examples/train_gpt.py

Each rank trains on its own slice of every global batch, so the run sees the same
data as a single process with `--batch-size` sequences per step.
"""

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from tqdm import tqdm

from corpus import generate


# --------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:  # GPT-2 style: small weights, zero biases
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- training
def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    if args.impl == "flatshard":
        from flatshard import FullyShardedDataParallel as FSDP
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # Char-level data, identical on every rank.
    text = generate()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    assert args.batch_size % world_size == 0, "--batch-size must be divisible by the world size"
    local_bs = args.batch_size // world_size

    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(len(chars), args.seq_len, args.dim, args.layers, args.heads)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    batch_gen = torch.Generator().manual_seed(1234)  # same global batch on every rank
    losses = []
    bar = tqdm(range(args.steps), desc=f"train ({args.impl})", disable=rank != 0)
    for _ in bar:
        starts = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=batch_gen)
        starts = starts[rank * local_bs : (rank + 1) * local_bs]  # this rank's slice
        x = torch.stack([data[s : s + args.seq_len] for s in starts]).to(device)
        y = torch.stack([data[s + 1 : s + 1 + args.seq_len] for s in starts]).to(device)

        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()

        avg = loss.detach().clone()
        dist.all_reduce(avg)  # SUM (gloo has no AVG), then divide
        losses.append(avg.item() / world_size)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()

    if rank == 0:
        print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {args.steps} steps", flush=True)

    held = sum(p.numel() * p.element_size() for p in model.parameters())  # local shards
    for r in range(world_size):  # print in rank order
        if r == rank:
            print(
                f"rank {rank}: holds {held:,} parameter bytes (sharded) of "
                f"{full_bytes:,} unsharded ({100 * held / full_bytes:.1f}%)",
                flush=True,
            )
        dist.barrier()


# --------------------------------------------------------------------------- launch
TIMEOUT = datetime.timedelta(minutes=3)  # a broken run fails instead of hanging


def spawned_worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """Entry point of each process started by plain `python train_gpt.py`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        train(rank, world_size, torch.device("cpu"), args)
    finally:
        dist.destroy_process_group()


def torchrun_main(args: argparse.Namespace) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    dist.init_process_group(backend, timeout=TIMEOUT)
    try:
        train(rank, world_size, device, args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=["flatshard", "torch"], default="flatshard",
                   help="which FullyShardedDataParallel to import")
    p.add_argument("--nproc", type=int, default=2, help="CPU processes to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, split across ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        torchrun_main(args)
        return 0
    try:
        mp.spawn(spawned_worker, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        # A rank failed (spawn has stopped the others); e holds that rank's traceback.
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
