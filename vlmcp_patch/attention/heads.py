"""How attention heads are divided over the CP ranks."""

from __future__ import annotations

from ..errors import UnsupportedSetupError


def kv_replication(
    num_heads: int, num_kv_heads: int, cp_size: int, what: str = "attention", names: tuple[str, str] = ("query", "KV")
) -> int:
    """Factor by which key/value heads are repeated so each rank gets whole KV heads for its query heads.

    Rank r receives query heads [r*H/P, (r+1)*H/P). With G = H/Hkv query heads per KV head, repeating
    each KV head k times (k dividing G) keeps the grouping exact; we need Hkv*k divisible by P. The
    smallest such k is used (1 when Hkv is already a multiple of P).
    """
    heads, kv_heads = names
    if num_heads % cp_size:
        raise UnsupportedSetupError(
            f"{what}: {num_heads} {heads} heads cannot be split over CP size {cp_size}; "
            f"choose a CP size that divides {num_heads}."
        )
    if num_heads % num_kv_heads:
        raise UnsupportedSetupError(f"{what}: {num_heads} {heads} heads are not a multiple of {num_kv_heads} {kv_heads} heads")
    group = num_heads // num_kv_heads
    for k in range(1, group + 1):
        if group % k == 0 and (num_kv_heads * k) % cp_size == 0:
            return k
    raise UnsupportedSetupError(
        f"{what}: {num_kv_heads} {kv_heads} heads ({num_heads} {heads} heads) cannot be divided over CP size {cp_size} "
        "even with replication; choose a CP size that divides the number of query heads."
    )
