"""How attention heads are divided over the CP ranks (U of the P = U x R layout, KV replication), and the tensor axes
the exchanges work on."""

from __future__ import annotations

from typing import NamedTuple

from ..distributed import ulysses_for
from ..errors import UnsupportedSetupError
from ..layout import kv_replication_factor
from ..settings import SETTINGS


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


def has_deltanet(text_config) -> bool:
    """Whether a text config has gated DeltaNet layers (Qwen3.5)."""
    return bool(getattr(text_config, "linear_num_value_heads", None))


def head_counts(text_config) -> list[int]:
    """The head counts the Ulysses degree U must divide: the query heads, and the DeltaNet value heads."""
    heads = [text_config.num_attention_heads]
    if has_deltanet(text_config):
        heads.append(text_config.linear_num_value_heads)
    return heads


def ulysses_of(text_config, size: int) -> int:
    """U of the P = U x R layout for a model: the largest divisor of P that splits its query heads (and its DeltaNet
    value heads), inside a node where the heads allow (`layout.ulysses_degree`); the rest of P is a ring
    (`layout.Split`). At P=1 it is 1, without asking the launcher's environment or the host name."""
    if size == 1:
        return 1
    ulysses = ulysses_for(size, head_counts(text_config))
    if SETTINGS.head_chunks > 1:  # refused here, before any compute, on every rank alike (config only)
        from .head_chunks import check_head_chunks

        check_head_chunks(text_config, ulysses, SETTINGS.head_chunks)
    return ulysses
