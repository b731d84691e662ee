"""FlatParamLayout and flatten/views: property tests over random shapes and F in 1..1024."""

import random

import pytest
import torch

from flatshard import _C


def _random_shapes(rng: random.Random) -> list[list[int]]:
    return [[rng.randint(0, 9) for _ in range(rng.randint(0, 3))] for _ in range(rng.randint(1, 10))]


@pytest.mark.parametrize("alignment", [1, 8])
def test_flatten_then_view_round_trips_and_shards_tile(alignment):
    rng = random.Random(alignment)
    for trial in range(200):
        shapes = _random_shapes(rng)
        factor = trial + 1 if trial < 8 else rng.randint(1, 1024)
        layout = _C.FlatParamLayout(shapes, factor, alignment)
        params = [torch.randn(s, dtype=torch.float64) for s in shapes]

        flat = _C.flatten(params, layout)
        assert flat.shape == (layout.padded_numel,)
        assert layout.padded_numel % factor == 0
        assert 0 <= layout.padding_numel < factor
        # Flattening then viewing gives back every parameter exactly.
        views = _C.views_of(flat, layout)
        assert len(views) == len(params)
        for v, p in zip(views, params):
            assert v.shape == p.shape
            assert torch.equal(v, p)
            if p.numel():
                assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        # Everything that is not a parameter is zero padding.
        covered = torch.zeros(layout.padded_numel, dtype=torch.bool)
        for off, n in zip(layout.offsets, layout.numels):
            covered[off : off + n] = True
        assert torch.all(flat[~covered] == 0)
        # Shards tile the flat parameter: concatenated in rank order they are it.
        ranges = [layout.shard_range(r) for r in range(factor)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        shards = [flat[b:e] for b, e in ranges]
        assert torch.equal(torch.cat(shards), flat)
        # shard_slices say which parameter elements each shard holds.
        for r, (b, _) in enumerate(ranges):
            for index, in_param, in_shard, n in layout.shard_slices(r):
                expected = params[index].reshape(-1)[in_param : in_param + n]
                assert torch.equal(shards[r][in_shard : in_shard + n], expected)


def test_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="shard_factor >= 1"):
        _C.FlatParamLayout([[2]], 0)
    with pytest.raises(ValueError, match="negative dimension"):
        _C.FlatParamLayout([[2, -3]], 2)
    with pytest.raises(IndexError, match="0 <= rank < 2"):
        _C.FlatParamLayout([[2]], 2).shard_range(2)


def test_flatten_rejects_wrong_shape():
    layout = _C.FlatParamLayout([[2, 3]], 2)
    with pytest.raises(RuntimeError, match=r"shape \[5\] but the layout expects \[2, 3\]"):
        _C.flatten([torch.zeros(5)], layout)


# ------------------------------------------------------------------ the dim-0 layout (FSDP2's)


def test_dim0_shards_hold_torch_chunk_rows():
    """[Note: Dim-0 layout]: rank r's shard holds, per parameter, ``torch.chunk(p, F)[r]`` (none past the last
    chunk) then zeros up to ``ceil(d0 / F)`` rows; with F = 1 it is the packed flat layout."""
    rng = random.Random(3)
    for trial in range(200):
        shapes = [[rng.randint(0, 9)] + s for s in _random_shapes(rng)]
        factor = trial + 1 if trial < 8 else rng.randint(1, 64)
        layout = _C.FlatParamLayout.dim0(shapes, factor)
        assert layout.kind == _C.LayoutKind.DIM0
        params = [torch.randn(s, dtype=torch.float64) for s in shapes]
        gathered = _C.flatten(params, layout)
        assert gathered.shape == (factor * layout.shard_numel,)
        if factor == 1:
            assert torch.equal(gathered, _C.flatten(params, _C.FlatParamLayout(shapes, 1)))
        for r in range(factor):
            shard = gathered[r * layout.shard_numel : (r + 1) * layout.shard_numel]
            for i, p in enumerate(params):
                chunks = torch.chunk(p, factor) if p.shape[0] else ()
                rows = chunks[r] if r < len(chunks) else p[:0]
                assert layout.rows_of_rank(i, r) == rows.shape[0]
                slot = shard[layout.offsets[i] : layout.offsets[i] + layout.rows_per_shard(i) * layout.row_numel(i)]
                assert torch.equal(slot[: rows.numel()], rows.reshape(-1))
                assert torch.all(slot[rows.numel() :] == 0)


def test_dim0_layout_refuses_a_scalar_and_has_no_views():
    with pytest.raises(ValueError, match="parameter 1 has no dim 0 to shard"):
        _C.FlatParamLayout.dim0([[2], []], 2)
    layout = _C.FlatParamLayout.dim0([[3, 2]], 2)
    with pytest.raises(RuntimeError, match="over several ranks is not a view of the gathered tensor"):
        _C.views_of(torch.zeros(layout.padded_numel), layout)
    with pytest.raises(RuntimeError, match="only the dim-0 layout has rows"):
        _C.FlatParamLayout([[2]], 2).rows_per_shard(0)


def _torch_fsdp2_local_tensors(rank, world_size):
    """What torch's FSDP2 keeps on this rank, and the dim-0 layout's shard of the same parameters."""
    from torch.distributed.fsdp import fully_shard

    from models import Block, make_gpt

    model = make_gpt(vocab=67, seq=10, seed=0)  # 67 and 10 rows: uneven over 2 and 4 ranks
    shapes = [list(p.shape) for p in model.parameters()]
    layout = _C.FlatParamLayout.dim0(shapes, world_size)
    shard = _C.flatten([p.detach() for p in model.parameters()], layout).view(world_size, -1)[rank]
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m)
    fully_shard(model)
    theirs = [p.to_local().detach().clone() for p in model.parameters()]
    ours = []
    for i, shape in enumerate(shapes):
        rows = layout.rows_of_rank(i, rank)
        ours.append(shard[layout.offsets[i] : layout.offsets[i] + rows * layout.row_numel(i)].view([rows] + shape[1:]))
    return theirs, ours


@pytest.mark.parametrize("world_size", [2, 4])
def test_dim0_shard_is_what_torch_fsdp2_keeps_per_rank(world_size):
    """Issue 31's "each rank's local tensor of each parameter equal to torch FSDP2's", at the layout: a GPT
    whose vocabulary (67 rows: 34 + 33 at W = 2, 17 * 3 + 16 at W = 4) and position table (10 rows: 3 * 3 + 1
    at W = 4) do not divide, beside matrices and vectors that do."""
    from flatshard.testing import run_distributed

    for rank, (theirs, ours) in enumerate(run_distributed(_torch_fsdp2_local_tensors, world_size, timeout=60)):
        assert len(theirs) == len(ours)
        for i, (t, o) in enumerate(zip(theirs, ours)):
            assert t.shape == o.shape and torch.equal(t, o), f"rank {rank}, parameter {i}: {t.shape} vs {o.shape}"
