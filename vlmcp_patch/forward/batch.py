"""Questions the package asks of a call and its model — what kind of batch it is, what stock would do with it —
answered without judging it (the refusals are `refusals.py`'s) and without deciding anything (`plan.py` decides).

* the model: does it have DeltaNet layers, what is U of its P = U x R layout;
* the batch: its text positions, whether its mask holds cumulative sample lengths, whether it is a **packed row**
  in the documented convention and whether stock would get that row right, where its placeholder tokens are,
  whether each row's real tokens are one run, where stock restarts attention inside a row.
"""

from __future__ import annotations

import torch

from ..layout import starts_of, ulysses_degree
from .arguments import batch_reference, has_vision

# ---------------------------------------------------------------------------------------------------------
# The model


def has_deltanet(text_config) -> bool:
    return bool(getattr(text_config, "linear_num_value_heads", None))


def ulysses_of(text_config, size: int) -> int:
    """U of the P = U x R layout for a model: the largest divisor of P that splits its query heads (and its DeltaNet
    value heads); the rest of P is a ring (`layout.Split`)."""
    heads = [text_config.num_attention_heads]
    if has_deltanet(text_config):
        heads.append(text_config.linear_num_value_heads)
    return ulysses_degree(size, heads)


# ---------------------------------------------------------------------------------------------------------
# Which batch takes the package's path at P=1: the packed-row convention


def text_positions(call: dict) -> torch.Tensor | None:
    """The text position ids stock builds its attention mask from: 2D `position_ids`, or the first of 4 rows."""
    positions = call.get("position_ids")
    if positions is None or positions.ndim not in (2, 3):
        return None
    if positions.ndim == 2:
        return positions
    return positions[0] if positions.shape[0] == 4 else None


def cumulative_lengths_mask(call: dict) -> bool:
    """Whether the call's `attention_mask` holds the 1D cumulative sample lengths of a packed row."""
    mask = call.get("attention_mask")
    return torch.is_tensor(mask) and mask.ndim == 1 and not mask.is_floating_point() and mask.dtype != torch.bool


def is_packed_row(call: dict) -> bool:
    """The packed-row convention — the only batch that takes the package's path at P=1: one row and either
    no `attention_mask` with 2D text positions that restart (`DataCollatorWithFlattening`, optionally with
    `cu_seq_lens_q/k`) or `cu_seq_lens_q` of several samples, or an `attention_mask` holding the row's 1D
    cumulative sample lengths [0, l1, l1 + l2, ...] (the official Qwen3-VL fine-tuning script's packing)."""
    reference = batch_reference(call)
    if reference is None or reference.ndim < 2 or reference.shape[0] != 1:
        return False
    if cumulative_lengths_mask(call):
        return True
    if call.get("attention_mask") is not None:
        return False
    positions = call.get("position_ids")
    if positions is not None and positions.ndim == 2 and bool(starts_of(positions)[..., 1:].any()):
        return True
    cu = call.get("cu_seq_lens_q")
    return cu is not None and cu.numel() > 2


def stock_gets_packed_row_right(model, call: dict) -> bool:
    """Whether stock's forward on a packed row (`is_packed_row`) equals its samples run one by one — then the row
    runs stock at P=1. Stock attends within each sample (flash-attention on its restarting positions or
    `cu_seq_lens`; sdpa and eager on restarting positions when no KV cache is built), but it runs Qwen3.5's DeltaNet
    layers across the samples, computes no per-sample 3D mRoPE for pictures from 2D text positions, and cannot read
    the official fine-tuning script's cumulative-lengths mask."""
    text = model.config.get_text_config()
    if has_deltanet(text) or cumulative_lengths_mask(call):
        return False
    positions = call.get("position_ids")
    if has_vision(call) and (positions is None or positions.ndim == 2):
        return False
    if text._attn_implementation == "flash_attention_2":
        return True
    use_cache = call.get("use_cache")
    restarting = text_positions(call)
    return not (text.use_cache if use_cache is None else use_cache) and restarting is not None and bool(
        starts_of(restarting)[..., 1:].any())


# ---------------------------------------------------------------------------------------------------------
# Tokens and rows


def placeholder_tokens(model, call: dict, token_id: int) -> torch.Tensor:
    """(batch, seq) bool: the placeholder tokens of `token_id`, found as stock finds them — by id, or by embedding
    when only `inputs_embeds` come."""
    if call.get("input_ids") is not None:
        return call["input_ids"] == token_id
    embeds = call["inputs_embeds"]
    token = model.get_input_embeddings()(torch.tensor(token_id, device=embeds.device))
    return (embeds == token).all(-1)


def real_tokens_are_one_run(real: torch.Tensor) -> bool:
    """Whether each row's real tokens (batch, seq) bool form one run (left, right or both-sided padding, no
    holes)."""
    edges = torch.diff(real.int(), dim=-1, prepend=torch.zeros_like(real[:, :1], dtype=torch.int))
    return bool(((edges == 1).sum(-1) <= 1).all())


def stock_restarts(model, call: dict, text: torch.Tensor, batch: int) -> torch.Tensor | None:
    """(batch, seq) bool: where stock starts a new attention sequence inside a row from its text positions when
    there is no mask — sdpa without a KV cache (where positions do not continue by +1), flash-attention on one
    row (at the smallest position) — or None when it attends over each whole row."""
    config = model.config.get_text_config()
    text = text.expand(batch, -1)
    if config._attn_implementation == "flash_attention_2":
        if batch != 1 or not bool(((torch.arange(text.shape[-1], device=text.device) + text.min()) != text).any()):
            return None
        return text == text.min()
    use_cache = call.get("use_cache")
    if (config.use_cache if use_cache is None else use_cache) or not bool(starts_of(text)[..., 1:].any()):
        return None
    return starts_of(text)
