"""Small public helpers."""

from __future__ import annotations

import torch

from .collectives import gather_keep_local_grad
from .distributed import get_cp_group


def gather_sequence(tensor: torch.Tensor, dim: int = 1, length: int | None = None) -> torch.Tensor:
    """Gather a sequence-sharded tensor (e.g. the local `logits` returned with labels) over the CP group.

    Each rank holds a contiguous slice of the sequence padded to a multiple of the CP size; the result
    is the concatenation in rank order, cut to `length` (pass the unpadded sequence length, e.g.
    `input_ids.shape[1]`). Backward keeps each rank's own slice of the gradient: call it on every rank
    and compute the same thing from the result, as with the loss. With CP off it returns `tensor`.
    """
    cp = get_cp_group()
    if cp is None:
        return tensor
    full = gather_keep_local_grad(tensor, dim, cp.group, cp.size, cp.rank)
    return full if length is None else full.narrow(dim, 0, length)
