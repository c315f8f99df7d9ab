"""The packed row cut to this rank's slice before the backbone runs.

Under CP the backbone never sees the whole row: the multimodal model looks up the embeddings of this rank's
slice only, places only the vision features of the placeholder tokens inside it (`forward/vision.py` routes
each feature to the rank whose slice holds its token), and hands the text decoder that slice. What stays whole
are the small integer tensors of the contract — ids, labels and positions of the row — from which the slice and
each vision token's owner are read.
"""

from __future__ import annotations

import torch

from ..context import CPContext, RowLayout, SliceIndex
from .arguments import VISION

# Per-token inputs of the row that the backbone reads, cut to the slice: (name, CP padding value). The ids'
# padding value is chosen per model (`_text_token`); the padded tokens form a segment of their own after every
# real token, so what they hold never reaches a real one.
SLICED = (("input_ids", None), ("mm_token_type_ids", 0))


def _text_token(config) -> int:
    """A token id that is no vision placeholder: the CP padding of the ids (a placeholder there would be counted
    as a vision token)."""
    placeholders = {getattr(config, key, None) for _, _, _, key in VISION}
    return next(i for i in range(len(placeholders) + 1) if i not in placeholders)


def _embeddings_of_slice(embeds: torch.Tensor, index: SliceIndex, rows: RowLayout | None) -> torch.Tensor:
    """This rank's slice (1, local, hidden) of caller-given embeddings: read from the caller's layout (`rows`; None:
    the call is the row already), CP padding zero."""
    if rows is None:
        return index.take(embeds, dim=1).clone()
    return index.padded(rows.take(embeds, index.positions), dim=1)


def cut_to_slice(model, call: dict, ctx: CPContext) -> None:
    """Rewrite the laid-out row in `call` (in place) as this rank's slice: ids, token types, embeddings and
    positions (1, local, ...). The context is asked once which tokens the slice holds (`CPContext.slice_index`);
    every tensor is cut by that index. Labels stay whole (the loss reads this rank's slice of them); the vision
    inputs stay as given, each rank encoding its share (`forward/vision.py`). Copies, not views: a view would keep
    the row's tensor alive until backward."""
    index = ctx.slice_index
    for name, fill in SLICED:
        if call.get(name) is not None:
            fill = _text_token(model.config) if fill is None else fill
            call[name] = index.take(call[name], dim=1, value=fill).clone()
    if call.get("inputs_embeds") is not None:
        call["inputs_embeds"] = _embeddings_of_slice(call["inputs_embeds"], index, ctx.rows)
    call["position_ids"] = index.take(call["position_ids"], dim=-1).clone()
