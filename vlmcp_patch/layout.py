"""Pure layout arithmetic: how a sequence is padded and cut over the CP ranks, where packed samples start,
and how vision items are spread over the ranks (`VisionShare`). No torch.distributed, no model: property-tested
alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

Segment = tuple[int, int]  # [start, end) of one sample in the packed row
# Items balance when the busiest rank carries at most this much more than a perfect split.
BALANCED = 1.1
# How the ranks of a CP group share a modality's vision work (`VisionShare.method`).
BY_ITEMS, BY_PATCHES, EVERY_ITEM = "by items", "by patches", "every item on every rank"


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def shard_slice(length: int, size: int, rank: int) -> slice:
    """The contiguous slice rank `rank` of `size` holds of a sequence of `length`, padded to a multiple of `size`."""
    local = round_up(length, size) // size
    return slice(rank * local, (rank + 1) * local)


def starts_of(text_positions: torch.Tensor) -> torch.Tensor:
    """Boolean, same shape as `text_positions` (..., S): True where a sample starts, i.e. where the position
    does not continue the previous one by +1 (the first token always starts one)."""
    first = torch.ones(*text_positions.shape[:-1], 1, dtype=torch.bool, device=text_positions.device)
    return torch.cat([first, torch.diff(text_positions, dim=-1) != 1], dim=-1)


def segments_of(starts: Sequence[int], length: int) -> list[Segment]:
    """Consecutive [start, end) segments from sorted start offsets (the first must be 0) up to `length`."""
    bounds = [*starts, length]
    return list(zip(bounds[:-1], bounds[1:]))


def segments_from_lengths(lengths: Sequence[int]) -> list[Segment]:
    """Back-to-back segments of the given (positive) lengths."""
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


def positions_restarting_at(segments: Sequence[Segment]) -> torch.Tensor:
    """Text positions 0, 1, ... restarting at every segment start: shape (sum of lengths,)."""
    return torch.cat([torch.arange(b - a) for a, b in segments]) if segments else torch.zeros(0, dtype=torch.long)


def cu_seqlens_of(segments: Sequence[Segment]) -> list[int]:
    """Cumulative boundaries [0, end_1, end_2, ...] of back-to-back segments."""
    return [0] + [b for _, b in segments]


def split_into_units(costs: Sequence[int], frames: Sequence[int], size: int) -> list[tuple[int, int, int]]:
    """Vision work units: (item, first frame, frame count). An item stays whole unless its cost exceeds the
    fair share of one rank (total / size); then it is split into its frames (temporal patch groups), which
    the vision tower encodes independently."""
    fair = sum(costs) / size if size else 0
    units = []
    for item, (cost, n) in enumerate(zip(costs, frames)):
        if n > 1 and cost > fair:
            units += [(item, f, 1) for f in range(n)]
        else:
            units.append((item, 0, n))
    return units


def contiguous_ranks(costs: Sequence[int], size: int) -> list[int]:
    """Rank of each unit, in runs: rank 0 takes the first units, rank 1 the next, ... (ranks never decrease), with
    the busiest rank as light as any split into `size` contiguous runs allows.

    Contiguous runs let a rank read its share of the pixel rows as one range (a view where no copy is needed).
    The bottleneck is found by bisection, each candidate filled greedily; deterministic from the costs alone, so
    every rank computes the same assignment without communicating. Bound: the busiest rank carries at most
    total / size + max(costs) (a greedy fill at that bottleneck closes each run above total / size).
    """
    if not costs:
        return []

    def runs_needed(bottleneck: int) -> int:
        runs, load = 1, 0
        for cost in costs:
            if load + cost > bottleneck:
                runs, load = runs + 1, 0
            load += cost
        return runs

    low, high = max(costs), sum(costs)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if runs_needed(middle) <= size else (middle + 1, high)
    ranks, rank, load = [], 0, 0
    for cost in costs:
        if load + cost > low:
            rank, load = rank + 1, 0
        ranks.append(rank)
        load += cost
    return ranks


def kv_replication_factor(num_heads: int, num_kv_heads: int, size: int) -> int | None:
    """Smallest k dividing the query-to-KV group size with num_kv_heads * k divisible by `size`.

    Rank r receives query heads [r*H/P, (r+1)*H/P); repeating each KV head k times keeps the grouping exact.
    Such a k exists (at worst the group size itself) whenever `size` divides the query heads and the KV
    heads divide them; otherwise None.
    """
    if num_heads % size or num_heads % num_kv_heads:
        return None
    group = num_heads // num_kv_heads
    return next(k for k in range(1, group + 1) if group % k == 0 and (num_kv_heads * k) % size == 0)


def ulysses_choices(size: int, divisible: Sequence[int]) -> list[int]:
    """Every U the heads allow at CP size `size`, ascending: the divisors of `size` that divide each head count."""
    return [u for u in range(1, size + 1) if size % u == 0 and all(n % u == 0 for n in divisible)]


def ulysses_degree(size: int, divisible: Sequence[int], node_size: int | None = None,
                   override: int | None = None) -> int:
    """U of the P = U x R layout; R = size // U ranks then form a ring.

    U divides `size` and every head count in `divisible` (the query heads of softmax attention; the DeltaNet value
    heads). Without `override` it is the largest such U that also divides `node_size` (ranks per node; None: one
    node holds everything): ranks are numbered node by node and every Ulysses subgroup is U consecutive ranks
    starting at a multiple of U, so U | node_size is exactly what keeps each subgroup's all-to-all — the exchange of
    every layer, the heavy one — inside a node, while the ring (R - 1 point-to-point hops) strides across nodes.
    When a CP group lies inside one node (size divides node_size) this is the largest U the heads allow, as without
    nodes. `override` (VLMCP_ULYSSES_SIZE) is returned as given once it divides `size`, the heads and the node size
    (or is a multiple of the node size dividing `size`: whole nodes per subgroup, an all-to-all over the network by
    choice); otherwise UnsupportedSetupError, raised before any compute. At size 1 U is 1 whatever the override."""
    if override is not None and size > 1:
        return _checked_override(size, divisible, node_size, override)
    node = size if node_size is None else node_size
    return max(u for u in ulysses_choices(size, divisible) if node % u == 0)


def _checked_override(size: int, divisible: Sequence[int], node_size: int | None, override: int) -> int:
    """`override` as U if it is a valid one (`ulysses_degree`), else UnsupportedSetupError saying which are."""
    from .errors import UnsupportedSetupError

    allowed = ulysses_choices(size, divisible)
    problem = None
    if override not in allowed:
        problem = (f"it must divide the CP size {size} and the head counts {list(divisible)}; the Ulysses sizes "
                   f"these allow: {allowed}")
    elif node_size is not None and node_size % override and override % node_size:
        fits = [u for u in allowed if node_size % u == 0 or u % node_size == 0]
        problem = (f"a subgroup of {override} consecutive ranks would straddle nodes of {node_size} ranks (the "
                   f"launcher's LOCAL_WORLD_SIZE); choose among {fits}")
    if problem:
        raise UnsupportedSetupError(f"VLMCP_ULYSSES_SIZE={override} (enable(ulysses_size=...)) cannot be used: "
                                    f"{problem}, or unset it to let the layout choose.")
    return override


def hybrid_rank_lists(world: int, size: int, ulysses: int) -> list[tuple[list[list[int]], list[list[int]]]]:
    """The rank numbering of the P = U x R layout (`distributed.hybrid_groups` creates its groups in this order):
    for each CP block of `size` consecutive ranks of `world`, its Ulysses subgroups (`ulysses` consecutive ranks) and
    its rings (the block's ranks of stride U, one per position in a subgroup)."""
    return [([list(range(start, start + ulysses)) for start in range(block, block + size, ulysses)],
             [list(range(block + member, block + size, ulysses)) for member in range(ulysses)])
            for block in range(0, world, size)]


def node_spans(size: int, ulysses: int, node_size: int, world: int | None = None) -> dict[str, bool]:
    """How the groups of the P = U x R layout over `world` ranks (default: one CP group) sit on nodes of
    `node_size` consecutive ranks: `ulysses_inside_node` — every Ulysses subgroup lies inside one node;
    `ring_crosses_nodes` — some ring has members on two nodes (`hybrid_rank_lists`)."""
    blocks = hybrid_rank_lists(size if world is None else world, size, ulysses)
    subgroups = [ranks for block, _ in blocks for ranks in block]
    rings = [ranks for _, block in blocks for ranks in block]
    return {"ulysses_inside_node": all(len({r // node_size for r in g}) == 1 for g in subgroups),
            "ring_crosses_nodes": any(len({r // node_size for r in g}) > 1 for g in rings)}


@dataclass(frozen=True)
class Split:
    """How a row of `seq_len` tokens is spread over `size` ranks in the P = U x R layout (`ulysses` = U).

    Ranks are numbered so that each Ulysses subgroup is consecutive: rank = g * U + u, subgroup g of R, member u.
    With R = 1 the row is padded to a multiple of P and rank r holds the contiguous slice [r L, (r + 1) L). With
    R > 1 it is padded to a multiple of 2P and cut into 2R equal chunks; subgroup g holds chunks g and 2R-1-g (one
    early, one late: every subgroup has the same causal attention work), and member u the u-th of U equal parts of
    those two chunks side by side. Within every rank, and within every subgroup, positions ascend; the CP padding
    (the row's tail) is the end of the ranks that hold it.
    """

    seq_len: int
    size: int
    ulysses: int

    @property
    def ring(self) -> int:
        return self.size // self.ulysses

    @property
    def padded_len(self) -> int:
        return round_up(self.seq_len, self.size if self.ring == 1 else 2 * self.size)

    @property
    def local_len(self) -> int:
        return self.padded_len // self.size

    @property
    def chunk_len(self) -> int:
        return self.padded_len // (2 * self.ring)

    def chunks_of(self, subgroup: int) -> tuple[int, ...]:
        """The chunks a subgroup holds, in row order (R = 1: the whole row is one subgroup's)."""
        return (subgroup, 2 * self.ring - 1 - subgroup)

    def subgroup_positions(self, subgroup: int) -> torch.Tensor:
        """Row positions (padded row) of a subgroup's tokens, ascending: after the Ulysses exchange a member holds
        them all, for its share of the heads."""
        if self.ring == 1:
            return torch.arange(self.padded_len)
        return torch.cat([torch.arange(c * self.chunk_len, (c + 1) * self.chunk_len) for c in self.chunks_of(subgroup)])

    def positions(self, rank: int) -> torch.Tensor:
        """Row positions (padded row) of the tokens `rank` holds, ascending."""
        subgroup, member = divmod(rank, self.ulysses)
        return self.subgroup_positions(subgroup).tensor_split(self.ulysses)[member]

    def owners(self) -> torch.Tensor:
        """(padded_len,) the rank holding each position."""
        owner = torch.empty(self.padded_len, dtype=torch.long)
        for rank in range(self.size):
            owner[self.positions(rank)] = rank
        return owner


@dataclass(frozen=True)
class VisionShare:
    """How the ranks share one modality's vision work, decided from its `grid_thw` alone (`decide`).

    `method` is one of: `BY_ITEMS` — the units (whole items, or the temporal patch groups of an item larger than
    a rank's fair share) in contiguous runs, rank 0 first, so each rank's units are one range of patch rows;
    `BY_PATCHES` — the patches of all items cut into `size` equal contiguous runs of whole merged tokens (when the
    items cannot balance); `EVERY_ITEM` — vision data parallelism off, every rank encodes everything.
    """

    units: list[tuple[int, int, int, int, int]]  # (first patch, patches, frames, height, width), in order
    ranks: list[int]
    merge_unit: int  # patches per merged token
    size: int
    method: str = BY_ITEMS

    @classmethod
    def of(cls, grid: list[list[int]], merge: int, size: int) -> VisionShare:
        """The share by items (`BY_ITEMS`) of a grid [(t, h, w), ...] over `size` ranks, merge size `merge`."""
        costs = [t * h * w for t, h, w in grid]
        offsets = [sum(costs[:i]) for i in range(len(costs))]
        units = []
        for item, first, frames in split_into_units(costs, [t for t, _, _ in grid], size):
            _, h, w = grid[item]
            units.append((offsets[item] + first * h * w, frames * h * w, frames, h, w))
        return cls(units, contiguous_ranks([u[1] for u in units], size), merge * merge, size)

    @classmethod
    def decide(cls, grid: list[list[int]], merge: int, size: int, heads: int, data_parallel: bool,
               patch_slices: bool = True) -> VisionShare:
        """The share a CP forward uses: by items when they balance, by patches when they do not, the tower's
        `heads` split over the ranks (every vision attention then exchanges sequence for heads) and the tower can
        encode a slice of patches (`patch_slices`), by items anyway otherwise; every item on every rank without
        vision data parallelism."""
        share = cls.of(grid, merge, size)
        if not data_parallel:
            return replace(share, method=EVERY_ITEM)
        if share.balanced() or heads % size or not patch_slices:
            return share
        return replace(share, method=BY_PATCHES)

    @classmethod
    def decide_each(cls, grids: dict[str, torch.Tensor], vision_config, size: int, data_parallel: bool,
                    patch_slices: bool = True) -> dict[str, VisionShare]:
        """`decide` for each modality's grid (items, 3); `vision_config` gives the merge size and the tower's heads
        (unread when there is no grid)."""
        return {kind: cls.decide(grid.tolist(), vision_config.spatial_merge_size, size, vision_config.num_heads,
                                 data_parallel, patch_slices) for kind, grid in grids.items()}

    def mine(self, rank: int) -> list[int]:
        return [i for i, r in enumerate(self.ranks) if r == rank]

    def patches_per_rank(self) -> list[int]:
        loads = [0] * self.size
        for (_, patches, *_), rank in zip(self.units, self.ranks):
            loads[rank] += patches
        return loads

    def balanced(self) -> bool:
        loads = self.patches_per_rank()
        return max(loads) * self.size <= BALANCED * sum(loads)

    def patch_rows(self, rank: int) -> slice:
        """The pixel rows of rank `rank`'s units (by items): one contiguous range (empty when it has none)."""
        mine = self.mine(rank)
        if not mine:
            return slice(0, 0)
        first, (start, patches, *_) = self.units[mine[0]][0], self.units[mine[-1]]
        return slice(first, start + patches)

    def local_grid(self, rank: int, device) -> torch.Tensor:
        return torch.tensor([self.units[i][2:] for i in self.mine(rank)], device=device)

    def held(self, rank: int) -> torch.Tensor:
        """The merged tokens (indices in the modality's token order) rank `rank` encodes by items, in its output
        order."""
        spans = [torch.arange(self.units[i][0], self.units[i][0] + self.units[i][1], self.merge_unit) // self.merge_unit
                 for i in self.mine(rank)]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)

    @property
    def merged_tokens(self) -> int:
        return sum(patches for _, patches, *_ in self.units) // self.merge_unit

    @functools.cached_property
    def held_by_ranks(self) -> list[torch.Tensor]:
        """The merged tokens each rank encodes, in its output order (every token exactly once over the ranks):
        by patches, equal contiguous runs (the last one short). Built once per share: a vision call reads it where
        it encodes and where it routes."""
        if self.method == BY_ITEMS:
            return [self.held(r) for r in range(self.size)]
        per_rank = round_up(self.merged_tokens, self.size) // self.size
        return [torch.arange(r * per_rank, min((r + 1) * per_rank, self.merged_tokens)) for r in range(self.size)]
