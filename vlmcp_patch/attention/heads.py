"""How attention heads are divided over the CP ranks, and the tensor axes the exchanges work on."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import UnsupportedSetupError
from ..layout import kv_replication_factor


class Axes(NamedTuple):
    seq: int
    heads: int


BHSD = Axes(seq=2, heads=1)  # q/k/v handed to transformers' attention functions: (batch, heads, seq, dim)
BSHD = Axes(seq=1, heads=2)  # attention outputs and the DeltaNet tensors: (batch, seq, heads, dim)


def kv_replication(
    num_heads: int, num_kv_heads: int, cp_size: int, what: str = "attention", names: tuple[str, str] = ("query", "KV")
) -> int:
    """Factor by which key/value heads are repeated so each rank gets whole KV heads for its query heads
    (see `layout.kv_replication_factor`); raises `UnsupportedSetupError` when the query heads do not split."""
    heads, kv_heads = names
    if num_heads % cp_size:
        raise UnsupportedSetupError(
            f"{what}: {num_heads} {heads} heads cannot be split over CP size {cp_size}; "
            f"choose a CP size that divides {num_heads}."
        )
    if num_heads % num_kv_heads:
        raise UnsupportedSetupError(
            f"{what}: {num_heads} {heads} heads are not a multiple of {num_kv_heads} {kv_heads} heads"
        )
    return kv_replication_factor(num_heads, num_kv_heads, cp_size)
