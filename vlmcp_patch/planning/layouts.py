"""Layouts: the U x R splits a model's heads allow, the one the package picks, its KV replication, the P a plan
tries — the package's own rules (`vlmcp_patch.layout`), imported when a plan is made (torch at call time only)."""

from __future__ import annotations

from .dims import ModelDims


def layouts(dims: ModelDims, size: int) -> list[tuple[int, int]]:
    """Every (U, R) with U x R = `size` and U dividing the heads (the package picks the largest U:
    `layout.ulysses_degree`)."""
    from ..layout import ulysses_choices  # torch at call time only

    return [(u, size // u) for u in reversed(ulysses_choices(size, dims.head_counts()))]


def package_ulysses(dims: ModelDims, size: int, gpus_per_node: int | None = None) -> int:
    """The U the package chooses at P = `size` on nodes of `gpus_per_node` (its own rule,
    `vlmcp_patch.layout.ulysses_degree`: the subgroups kept inside a node where the heads allow)."""
    from ..layout import ulysses_degree  # torch at call time only

    return ulysses_degree(size, dims.head_counts(), node_size=gpus_per_node)


def replicated(heads: int, query_heads: int, ulysses: int) -> int:
    """KV heads (or DeltaNet key heads) after the package's replication for U (its own rule,
    `layout.kv_replication_factor`: the smallest factor of the group size that makes them divisible by U)."""
    from ..layout import kv_replication_factor  # torch at call time only

    return heads * kv_replication_factor(query_heads, heads, ulysses)


def candidate_sizes(gpus_per_node: int, max_gpus: int) -> list[int]:
    """P = 1, 2, 4, ... up to a node, then whole nodes (multiples of the node), up to `max_gpus`."""
    sizes = [p for p in (1, 2, 4, 8, 16, 32) if p < gpus_per_node]
    sizes += [gpus_per_node * k for k in range(1, max_gpus // gpus_per_node + 1)
              if k in (1, 2, 3, 4, 6) or k % 4 == 0]
    return sorted({p for p in sizes if p <= max_gpus})
