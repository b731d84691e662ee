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
