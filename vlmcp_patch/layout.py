"""Pure layout arithmetic: how a sequence is padded and cut over the CP ranks, where packed samples start,
and how vision items are spread over the ranks. No torch.distributed, no model: property-tested alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Segment = tuple[int, int]  # [start, end) of one sample in the packed row


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


def assign_to_ranks(costs: Sequence[int], size: int) -> list[int]:
    """Rank of each unit: longest first, each to the least loaded rank (ties: the lowest rank).

    Deterministic from the costs alone, so every rank computes the same assignment without communicating.
    The greedy bound: the busiest rank carries at most (4/3 - 1/(3P)) x the optimum (Graham's LPT).
    """
    ranks = [0] * len(costs)
    loads = [(0, r) for r in range(size)]
    heapq.heapify(loads)
    for unit in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        ranks[unit] = rank
        heapq.heappush(loads, (load + costs[unit], rank))
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    return max(u for u in _divisors(size) if node % u == 0 and all(n % u == 0 for n in divisible))


def _checked_override(size: int, divisible: Sequence[int], node_size: int | None, override: int) -> int:
    """`override` as U if it is a valid one (`ulysses_degree`), else UnsupportedSetupError saying which are."""
    from .errors import UnsupportedSetupError

    allowed = [u for u in _divisors(size) if all(n % u == 0 for n in divisible)]
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


def node_spans(size: int, ulysses: int, node_size: int, world: int | None = None) -> dict[str, bool]:
    """How the groups of the P = U x R layout over `world` ranks (default: one CP group) sit on nodes of
    `node_size` consecutive ranks: `ulysses_inside_node` — every Ulysses subgroup lies inside one node;
    `ring_crosses_nodes` — some ring has members on two nodes. Pure arithmetic on the rank numbering of
    `distributed.hybrid_groups` (CP blocks of `size`, subgroups of `ulysses` consecutive ranks, rings of stride U)."""
    world = size if world is None else world
    node = [r // node_size for r in range(world)]
    subgroups = [range(s, s + ulysses) for s in range(0, world, ulysses)]
    rings = [range(b + m, b + size, ulysses) for b in range(0, world, size) for m in range(ulysses)]
    return {"ulysses_inside_node": all(len({node[r] for r in g}) == 1 for g in subgroups),
            "ring_crosses_nodes": any(len({node[r] for r in g}) > 1 for g in rings)}


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
