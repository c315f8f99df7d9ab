"""Property-based tests of the pure layout functions, over random sizes (hypothesis)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcp_patch.collator import pack_into_bins
from vlmcp_patch.context import CPContext, RowLayout
from vlmcp_patch.distributed import CPGroup
from vlmcp_patch.forward.agreement import tensor_fingerprint
from vlmcp_patch.layout import (
    VisionShare,
    contiguous_ranks,
    kv_replication_factor,
    positions_restarting_at,
    round_up,
    segments_from_lengths,
    segments_of,
    shard_slice,
    split_into_units,
    starts_of,
)

sizes = st.integers(min_value=1, max_value=8)
lengths = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=8)
FAST = settings(max_examples=60, deadline=None)


def _contexts(lengths_: list[int], size: int) -> list[CPContext]:
    return [CPContext(cp=CPGroup(group=None, rank=r, size=size), segments=segments_from_lengths(lengths_))
            for r in range(size)]


@FAST
@given(length=st.integers(min_value=1, max_value=500), size=sizes)
def test_rank_slices_tile_the_padded_sequence(length, size):
    slices = [shard_slice(length, size, r) for r in range(size)]
    assert slices[0].start == 0 and slices[-1].stop == round_up(length, size)
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
    assert len({s.stop - s.start for s in slices}) == 1
    assert round_up(length, size) - length < size


@FAST
@given(lengths_=lengths, size=sizes, width=st.integers(min_value=1, max_value=3))
def test_shards_of_all_ranks_concatenate_to_the_padded_row(lengths_, size, width):
    ctxs = _contexts(lengths_, size)
    row = torch.randn(1, sum(lengths_), width)
    shards = torch.cat([ctx.shard(row, dim=1) for ctx in ctxs], dim=1)
    assert torch.equal(shards[:, : row.shape[1]], row)
    assert torch.equal(shards[:, row.shape[1]:], torch.zeros_like(shards[:, row.shape[1]:]))
    assert ctxs[0].attention_segments[-1][1] == ctxs[0].padded_len
    assert ctxs[0].cu_seqlens("cpu").tolist()[-1] == ctxs[0].padded_len


@FAST
@given(lengths_=lengths)
def test_packed_boundaries_round_trip(lengths_):
    segments = segments_from_lengths(lengths_)
    positions = positions_restarting_at(segments)[None]
    starts = starts_of(positions)[0].nonzero().flatten().tolist()
    assert segments_of(starts, positions.shape[1]) == segments
    assert [b - a for a, b in segments] == lengths_


@FAST
@given(rows=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=5), extra=st.integers(0, 3))
def test_padding_free_rows_round_trip(rows, extra):
    width = max(rows) + extra or 1
    mask = torch.arange(width)[None] < torch.tensor(rows)[:, None]
    layout = RowLayout.of_mask(mask)
    x = torch.randn(len(rows), width, 2)
    row = layout.to_row(x)
    assert row.shape == (1, sum(rows), 2)
    back = layout.to_caller(row)
    assert torch.equal(back, x * mask[..., None])
    positions = torch.randn(3, len(rows), width)
    assert torch.equal(layout.to_row(positions, batch_dim=1)[:, 0], positions[:, mask])
    assert layout.lengths() == rows


@FAST
@given(costs=st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=20), size=sizes)
def test_assignment_is_contiguous_and_as_balanced_as_runs_allow(costs, size):
    ranks = contiguous_ranks(costs, size)
    assert all(0 <= r < size for r in ranks)
    assert ranks == sorted(ranks), "each rank's units are one run"
    loads = [sum(c for c, r in zip(costs, ranks) if r == rank) for rank in range(size)]
    assert max(loads) <= sum(costs) / size + max(costs)
    assert max(loads) == _lightest_busiest_run(costs, size)


def _lightest_busiest_run(costs: list[int], size: int) -> int:
    """The smallest busiest-run load over every split of `costs` into at most `size` contiguous runs (by DP)."""
    prefix = [0, *itertools.accumulate(costs)]
    best = [0] + [float("inf")] * len(costs)  # best[end]: units [0, end) in the runs so far
    for _ in range(size):
        best = [min(best[end], *(max(best[start], prefix[end] - prefix[start]) for start in range(end))) if end else 0
                for end in range(len(costs) + 1)]
    return best[-1]


@FAST
@given(grid=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([2, 4, 6]), st.sampled_from([2, 4])),
                     min_size=1, max_size=6), size=sizes)
def test_vision_units_cover_every_patch_once_in_order(grid, size):
    grid = [list(g) for g in grid]
    share = VisionShare.of(grid, merge=2, size=size)
    rows = [share.patch_rows(r) for r in range(size)]
    patches = torch.cat([torch.arange(r.start, r.stop) for r in rows])
    assert patches.tolist() == list(range(sum(t * h * w for t, h, w in grid))), "consecutive ranges, rank by rank"
    # Each rank's tower output holds one merged token per `merge_unit` of its patches, in the order of its units:
    # `held` names them, and over all ranks every merged token is held exactly once (the feature exchange relies
    # on it).
    for rank in range(size):
        mine = torch.arange(rows[rank].start, rows[rank].stop)
        assert torch.equal(share.held(rank), mine[:: share.merge_unit] // share.merge_unit)
    held = torch.cat([share.held(r) for r in range(size)])
    assert sorted(held.tolist()) == list(range(sum(t * h * w for t, h, w in grid) // share.merge_unit))
    units = split_into_units([t * h * w for t, h, w in grid], [t for t, _, _ in grid], size)
    assert [u[0] for u in units] == sorted(u[0] for u in units)


@FAST
@given(kv=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 3, 4]), size=st.sampled_from([1, 2, 4, 8]))
def test_kv_replication_factor_is_the_smallest_exact_one(kv, group, size):
    heads = kv * group
    k = kv_replication_factor(heads, kv, size)
    if heads % size:
        assert k is None
        return
    assert group % k == 0 and (kv * k) % size == 0
    assert all(not (group % j == 0 and (kv * j) % size == 0) for j in range(1, k))


@FAST
@given(lengths_=st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=30))
def test_first_fit_bins_respect_the_budget_and_cannot_merge(lengths_):
    budget = 100
    bins = pack_into_bins(lengths_, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths_)))
    loads = [sum(lengths_[i] for i in b) for b in bins]
    assert max(loads) <= budget
    assert all(a + b > budget for i, a in enumerate(loads) for b in loads[i + 1:])


@FAST
@given(shape=st.lists(st.integers(min_value=2, max_value=5), min_size=1, max_size=3), seed=st.integers(0, 1000),
       floating=st.booleans())
def test_fingerprint_sees_a_permutation_along_every_dimension(shape, seed, floating):
    g = torch.Generator().manual_seed(seed)
    t = torch.randperm(int(torch.tensor(shape).prod()), generator=g).reshape(shape)
    t = t.float() if floating else t
    assert tensor_fingerprint(t) == tensor_fingerprint(t.clone())
    for dim in range(t.ndim):
        assert tensor_fingerprint(t) != tensor_fingerprint(t.flip(dim))
    assert tensor_fingerprint(t) != tensor_fingerprint(t.to(torch.float64 if floating else torch.int32))
