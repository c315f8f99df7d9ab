"""The patched text decoder: its full-row inputs cut to this rank's slice, the CP context riding along."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..context import CTX_KWARG, CPContext, take_for_decoder
from ..distributed import cp_requested
from ..errors import UnsupportedSetupError
from ..settings import cp_size
from ..supported import unsupported_model_message
from .arguments import CACHE_KEYWORDS, call_arguments


def _three_rows(positions: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor:
    """mRoPE position ids (3, batch, seq) from whatever the decoder was given (none, text, 3 or 4 rows)."""
    if positions is None:
        return torch.arange(seq, device=device).view(1, 1, -1).expand(3, batch, -1)
    if positions.ndim == 2:
        return positions[None].expand(3, -1, -1)
    return positions[1:] if positions.shape[0] == 4 else positions


def cut_decoder_inputs(instance, call: dict, ctx: CPContext) -> None:
    """Rewrite the decoder's full-row arguments (in place) as this rank's slice.

    The embeddings and the mRoPE positions are cut; positions are passed as three rows (no text row), so
    the stock decoder builds no attention mask of its own on the slice (the context carries the sample
    boundaries); no cache is built under CP.
    """
    embeds = call.pop("inputs_embeds", None)
    input_ids = call.pop("input_ids", None)
    if embeds is None:
        embeds = instance.embed_tokens(input_ids)
    batch, seq = embeds.shape[:2]
    positions = _three_rows(call.pop("position_ids", None), batch, seq, embeds.device)
    # Copies, not views: a saved view would keep the whole row's tensor alive on every rank until backward.
    call["position_ids"] = ctx.shard(positions, dim=-1).clone()
    call["inputs_embeds"] = ctx.shard(embeds, dim=1).clone()
    call["attention_mask"] = None
    for name in CACHE_KEYWORDS:
        call.pop(name, None)
    call["use_cache"] = False


def text_model_forward(cut_family_inputs: Callable[[dict, CPContext], None] | None = None):
    """The wrapper of a family's text decoder forward. `cut_family_inputs(call, ctx)` cuts any per-token
    input of that family beyond the embeddings and positions (Qwen3-VL's deepstack rows).

    Under CP (and for packed rows at P=1) the decoder runs on this rank's slice: its output is that slice
    (1, local, hidden), returned to the backbone and from there to the caller (`top_level.run_backbone`).
    Called outside a CP forward while CP is on, it raises: the whole sequence would silently run on every
    rank.
    """

    def forward(wrapped, instance, args, kwargs):
        ctx = take_for_decoder()
        if ctx is None:
            if cp_requested():
                raise UnsupportedSetupError(
                    unsupported_model_message(f"{type(instance).__name__} called directly", cp_size())
                )
            return wrapped(*args, **kwargs)
        call = call_arguments(wrapped, args, kwargs)
        cut_decoder_inputs(instance, call, ctx)
        if cut_family_inputs is not None:
            cut_family_inputs(call, ctx)
        call[CTX_KWARG] = ctx
        return wrapped(**call)

    return forward
