"""The patched text decoder: it runs on this rank's slice of the row, the CP context riding along."""

from __future__ import annotations

import torch

from ..attention.foreign import carry_context_into_foreign_attention
from ..context import CTX_KWARG, CPContext, take_for_decoder
from ..distributed import cp_requested
from ..errors import UnsupportedSetupError
from ..patching import cp_size
from ..supported import unsupported_model_message
from .arguments import CACHE_KEYWORDS, call_arguments
from .vision import use_the_routed_deepstack_levels

DEEPSTACK_KWARG = "deepstack_visual_embeds"  # Qwen3-VL's text decoder: the vision levels its first layers add


def _three_rows(positions: torch.Tensor) -> torch.Tensor:
    """mRoPE position ids (3, batch, seq) of the slice from the text, 3 or 4 rows it was given."""
    if positions.ndim == 2:
        return positions[None].expand(3, -1, -1)
    return positions[1:] if positions.shape[0] == 4 else positions


def eager_block_mask(ctx: CPContext, dtype, device) -> torch.Tensor:
    """(1, 1, S, S) additive mask: each token attends causally within its own sample. Eager attention reads no
    sample boundaries from the context; it runs only for a packed row at P=1 (where S is the whole row)."""
    segment = ctx.segment_ids.to(device)
    order = torch.arange(segment.numel(), device=device)
    allowed = (segment[:, None] == segment[None, :]) & (order[:, None] >= order[None, :])
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return blocked[None, None]


def decoder_inputs_of_slice(instance, call: dict, ctx: CPContext) -> None:
    """Rewrite the decoder's arguments (in place) for this rank's slice, which its inputs already are
    (`slicing.cut_to_slice`): positions as three mRoPE rows (no text row), so the stock decoder builds no
    attention mask of its own on the slice (the context carries the sample boundaries; eager attention gets them
    as a mask); no cache under CP."""
    call["position_ids"] = _three_rows(call["position_ids"])
    call["attention_mask"] = None
    if instance.config._attn_implementation == "eager":
        embeds = call.get("inputs_embeds")
        dtype = instance.dtype if embeds is None else embeds.dtype
        call["attention_mask"] = eager_block_mask(ctx, dtype, call["position_ids"].device)
    for name in CACHE_KEYWORDS:
        call.pop(name, None)
    call["use_cache"] = False


def text_model_forward(wrapped, instance, args, kwargs):
    """The wrapper of a family's text decoder forward.

    Under CP (and for packed rows at P=1) the decoder runs on this rank's slice: its output is that slice
    (1, local, hidden), returned to the backbone and from there to the caller (`top_level.run_backbone`).
    Called outside a CP forward while CP is on, it raises: the whole sequence would silently run on every
    rank.
    """
    ctx = take_for_decoder()
    if ctx is None:
        if cp_requested():
            raise UnsupportedSetupError(unsupported_model_message(f"{type(instance).__name__} called directly",
                                                                  cp_size()))
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    decoder_inputs_of_slice(instance, call, ctx)
    if carry_context_into_foreign_attention(instance) and ctx.cumulative_lengths is not None:
        call["attention_mask"] = ctx.cumulative_lengths  # a script's own attention reads the caller's boundaries
    call[CTX_KWARG] = ctx
    use_the_routed_deepstack_levels(call.get(DEEPSTACK_KWARG), ctx)
    return _tied_to_collectives(wrapped(**call), ctx)


def _tied_to_collectives(out, ctx: CPContext):
    """The decoder's output with its hidden state tied to the forward's collectives (`collectives/order.py`, rule
    1): every rank then runs every collective's backward, in the reverse of the forward order."""
    if isinstance(out, tuple):
        return (ctx.order.tie(out[0]), *out[1:])
    out.last_hidden_state = ctx.order.tie(out.last_hidden_state)
    return out
