"""Lay a planned batch out as one packed row of its real tokens, and build the `CPContext` of that row (the plan
comes from `plan.plan_forward`).

Two kinds of batch arrive:

* a **packed row** in the documented convention (`batch.is_packed_row`): its samples as given;
* an **ordinary batch**: rows with an `attention_mask` of any padding pattern, or without one. Its real
  tokens are laid back to back, row by row, so that no rank holds a slice of padding and no (S x S) mask is
  ever built; outputs go back to the caller's layout (`CPContext.rows`).

Positions (given or computed as stock computes them, in the plan) and labels (shifted on the caller's
layout first, so the last real token of a row keeps the target stock gives it) travel with their tokens; with
`logits_to_keep` the labels are those of the kept logits, which the plan holds with them (`keep.KeptLogits`). The
row holds only small integer tensors; `slicing.cut_to_slice` then cuts it to this rank's slice.
"""

from __future__ import annotations

import torch

from ..context import CPContext, RowLayout
from ..loss import shifted_labels
from .arguments import CU_SEQ_LENS
from .plan import ForwardPlan

# Per-token inputs that follow their tokens into the row: (name, index of the batch dimension). Caller-given
# `inputs_embeds` are not among them: only this rank's slice of them is ever built (`slicing.cut_to_slice`).
PER_TOKEN = (("input_ids", 0), ("mm_token_type_ids", 0), ("shift_labels", 0))


def _with_targets(call: dict) -> None:
    """Labels become `shift_labels` on the caller's layout, before any padding is dropped."""
    labels = call.pop("labels", None)
    if call.get("shift_labels") is None and labels is not None:
        call["shift_labels"] = shifted_labels(labels)


def lay_out(call: dict, plan: ForwardPlan) -> CPContext:
    """Rewrite `call` (in place) as the packed row of `plan` and return the forward's context: the row's samples,
    where its tokens came from in the caller's batch, the group, the split, the vision tokens and shares."""
    rows = _to_row(call, plan)
    return CPContext(cp=plan.cp, segments=plan.segments, rows=rows, ulysses=plan.ulysses,
                     vision_tokens=plan.vision_tokens, vision_shares=plan.vision_shares,
                     cumulative_lengths=plan.cumulative_lengths, kept=plan.kept)


def _to_row(call: dict, plan: ForwardPlan) -> RowLayout | None:
    """The packed row in `call`; returns where its tokens came from in the caller's batch (None when the call
    already was that row)."""
    if plan.kept is not None:  # the kept logits' targets are the plan's
        call.pop("labels", None)
        call.pop("shift_labels", None)
    _with_targets(call)
    call["position_ids"] = plan.positions
    call.pop("attention_mask", None)
    for key in CU_SEQ_LENS:
        call.pop(key, None)  # the context carries the boundaries
    if plan.real is None and plan.shape[0] == 1:
        return None
    every_token = plan.real is None
    rows = RowLayout.of_mask(torch.ones(plan.shape, dtype=torch.bool, device=plan.device) if every_token else plan.real)
    for name, batch_dim in PER_TOKEN:
        if call.get(name) is not None:
            call[name] = rows.to_row(call[name], batch_dim)
    positions = plan.positions
    call["position_ids"] = rows.to_row(positions, batch_dim=positions.ndim - 2)
    return rows
