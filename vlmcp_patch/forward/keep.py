"""`logits_to_keep` in a training forward under CP: the logits stock keeps, and its loss over them.

Stock slices the decoder output with `logits_to_keep` before its head (`slice_logits_to_keep`; before that helper, the
same slice inline): an int keeps the last `k` positions of every row (0: all of them), a tensor the positions it names
(a 2D one per row, a boolean one as a mask). Its loss then pairs the kept logits, flattened, one to one with the
labels, flattened after their own shift (`ForCausalLMLoss`: labels moved one step left along their last dimension, or
`shift_labels` as given): the labels a caller gives with `logits_to_keep` are those of the kept positions (ms-swift
cuts them so). The returned logits have the kept shape.

Under CP the plan applies stock's own slice to the caller's flat token positions (`kept_positions`), so the kept
positions, their order, repeats and the output shape are stock's by construction, and maps each to its place in the
packed row (`KeptLogits`). Each rank then scores the kept positions that fall in its slice (`local`): the loss is the
sum over the group of each rank's kept rows against their targets, over the count of the targets (or
`num_items_in_batch`), as stock's; the logits, when returned, are each rank's kept rows placed in the kept shape and
summed over the group (zero where another rank holds the position; zeros at padding, which is not computed).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..collectives.differentiable import sum_keep_local_grad
from ..context import CPContext


def keeps_every_logit(keep) -> bool:
    """Whether `logits_to_keep` is stock's default: the int 0 (every position, the caller's labels' shape)."""
    return isinstance(keep, int) and keep == 0


def _stock_slice(model):
    """The slice stock's top-level forward of `model` applies: `slice_logits_to_keep` where the transformers module
    defining that forward uses it, else the inline slice of the releases before it."""
    for cls in type(model).__mro__:
        if "forward" in vars(cls) and cls.__module__.startswith("transformers.models."):
            found = getattr(sys.modules.get(cls.__module__), "slice_logits_to_keep", None)
            if found is not None:
                return found
            break

    def inline(hidden_states, logits_to_keep):
        indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, indices, :]

    return inline


def kept_positions(model, keep, shape: tuple[int, int]) -> torch.Tensor:
    """The flat caller positions (b * seq + s) of the logits stock keeps, in the shape of its logits less the
    vocabulary (e.g. (batch, kept) for an int); on the CPU. Raises what stock's slice raises."""
    batch, seq = shape
    grid = torch.arange(batch * seq).view(batch, seq, 1)
    if torch.is_tensor(keep):
        keep = keep.cpu()
    return _stock_slice(model)(grid, keep)[..., 0]


@dataclass(frozen=True, eq=False)
class KeptLogits:
    """The logits a forward keeps (`logits_to_keep`): `shape` the kept shape (stock's logits less the vocabulary);
    `rows` (N,) the packed-row position of each kept logit in stock's flattened order, -1 at padding (CPU); `targets`
    (N,) the target of each (stock's shifted labels, flattened; -100: none), or None without labels."""

    shape: tuple[int, ...]
    rows: torch.Tensor
    targets: torch.Tensor | None

    @classmethod
    def of(cls, flat: torch.Tensor, real: torch.Tensor | None, targets: torch.Tensor | None) -> KeptLogits:
        """From the kept flat caller positions `flat` and the caller's real tokens `real` (batch, seq) bool (None:
        every token; the row then is the batch in row-major order)."""
        positions = flat.reshape(-1)
        if real is not None:
            real = real.reshape(-1).cpu()
            row_of = torch.where(real, real.long().cumsum(0) - 1, -1)
            positions = row_of[positions]
        return cls(shape=tuple(flat.shape), rows=positions, targets=targets)

    def local(self, ctx: CPContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(entries, rows): the kept logits this rank holds — their indices in the flattened kept order, and their
        rows in this rank's slice (CPU)."""
        held = ctx.slice_index.positions
        if not held.numel():
            empty = torch.zeros(0, dtype=torch.long)
            return empty, empty
        at = torch.searchsorted(held, self.rows.clamp(min=0))
        mine = (self.rows >= 0) & (at < held.numel())
        mine &= held[at.clamp(max=held.numel() - 1)] == self.rows
        entries = mine.nonzero().flatten()
        return entries, at[entries]


def kept_logits(hidden: torch.Tensor, head: torch.nn.Module, ctx: CPContext, kept: KeptLogits) -> torch.Tensor:
    """Stock's kept logits (kept shape, vocabulary) from this rank's slice (1, local, H): the head on the kept rows this
    rank holds, placed among zeros and summed over the group (backward keeps each rank's own rows)."""
    entries, rows = kept.local(ctx)
    mine = head(hidden[0].index_select(0, rows.to(hidden.device)))
    out = mine.new_zeros(kept.rows.numel(), mine.shape[-1]).index_copy(0, entries.to(mine.device), mine)
    return sum_keep_local_grad(out, ctx.cp.group, ctx.cp.size).reshape(*kept.shape, mine.shape[-1])
