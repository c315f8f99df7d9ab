"""The causal-LM loss over a sequence whose logits are spread over the CP group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import sum_keep_local_grad
from .context import CPContext

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels moved one step left on the *full* sequence, as stock `ForCausalLMLoss` does."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def sharded_causal_lm_loss(
    local_logits: torch.Tensor,
    ctx: CPContext,
    vocab_size: int,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Per-token mean over the whole sequence; the same value on every rank of the group.

    Labels are shifted before slicing, so the target of a slice's last token comes from the next
    rank's slice. The number of valid tokens is counted over the group (or taken from
    `num_items_in_batch` when the caller normalises across gradient-accumulation steps, like stock).
    """
    if shift_labels is None:
        shift_labels = shifted_labels(labels)
    local_labels = ctx.shard(shift_labels.to(local_logits.device), dim=1, value=IGNORE_INDEX)
    local_sum = F.cross_entropy(
        local_logits.float().reshape(-1, vocab_size),
        local_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    total = sum_keep_local_grad(local_sum, ctx.cp.group, ctx.cp.size)
    if num_items_in_batch is None:
        count = (shift_labels != IGNORE_INDEX).sum()
    else:
        count = num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count
