"""Questions the package asks of a call and its model — what kind of batch it is, what stock would do with it —
answered without judging it (the refusals are `refusals.py`'s) and without deciding anything (`plan.py` decides).

The batch is read once per forward, in one pass (`read_batch`), into the `BatchReading` the plan is built from:

* first what decides its path: whether it is a **packed row** in the documented convention and whether stock would
  get that row right (read of every call, so cheap; where stock may run the batch and gets it right, the reading
  stops there);
* then its shape, its real tokens, where its placeholder tokens are, where its samples start — from each source a
  packed row gives them by — and where stock restarts attention inside a row. A fact a malformed batch does not let
  be read is None: the rule that judges it (`refusals.py`) says why.

Where the text positions restart (`layout.starts_of`) is computed at most once per reading (`TextPositions`): on a
GPU each question of it is a host sync. Nothing after the reading asks the batch again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..attention.heads import has_deltanet
from ..layout import starts_of
from .arguments import CACHE_KEYWORDS, VISION

# ---------------------------------------------------------------------------------------------------------
# The call


def batch_reference(call: dict) -> torch.Tensor | None:
    """`input_ids`, else `inputs_embeds` (or None): the tensor that fixes a forward's batch shape and device."""
    return call["input_ids"] if call.get("input_ids") is not None else call.get("inputs_embeds")


def batch_device(call: dict) -> torch.device:
    """Where a forward's batch lives: small control tensors for collectives go there (NCCL takes no CPU ones)."""
    reference = batch_reference(call)
    return reference.device if reference is not None else torch.device("cpu")


def given_cache(call: dict):
    """The KV cache a call was given, under whichever spelling (None when there is none)."""
    return next((call[k] for k in CACHE_KEYWORDS if call.get(k) is not None), None)


def has_vision(call: dict) -> bool:
    """Whether a call carries images or videos (pixels or grids)."""
    return any(call.get(key) is not None for _, pixels, grid, _ in VISION for key in (pixels, grid))


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


class TextPositions:
    """The call's text positions (`text_positions`) and where they restart, each computed at most once."""

    def __init__(self, call: dict):
        self.values = text_positions(call)

    @functools.cached_property
    def starts(self) -> torch.Tensor | None:
        """Same shape as the positions: True where a sample starts (`layout.starts_of`); None without positions."""
        return None if self.values is None else starts_of(self.values)

    @functools.cached_property
    def restart_inside(self) -> bool:
        """Whether the positions restart after a row's first token (one host sync on a GPU)."""
        return self.values is not None and bool(self.starts[..., 1:].any())


def is_packed_row(call: dict, text: TextPositions | None = None) -> bool:
    """The packed-row convention — the only batch that takes the package's path at P=1: one row and either
    no `attention_mask` with 2D text positions that restart (`DataCollatorWithFlattening`, optionally with
    `cu_seq_lens_q/k`) or `cu_seq_lens_q` of several samples, or an `attention_mask` holding the row's 1D
    cumulative sample lengths [0, l1, l1 + l2, ...] (the official Qwen3-VL fine-tuning script's packing). `text`:
    the call's `TextPositions` where the caller holds them."""
    reference = batch_reference(call)
    if reference is None or reference.ndim < 2 or reference.shape[0] != 1:
        return False
    if cumulative_lengths_mask(call):
        return True
    if call.get("attention_mask") is not None:
        return False
    positions = call.get("position_ids")
    if positions is not None and positions.ndim == 2 and (text or TextPositions(call)).restart_inside:
        return True
    cu = call.get("cu_seq_lens_q")
    return cu is not None and cu.numel() > 2


def stock_gets_packed_row_right(model, call: dict, text: TextPositions) -> bool:
    """Whether stock's forward on a packed row (`is_packed_row`) equals its samples run one by one — then the row
    runs stock at P=1. Stock attends within each sample (flash-attention on its restarting positions or
    `cu_seq_lens`; sdpa and eager on restarting positions when no KV cache is built), but it runs Qwen3.5's DeltaNet
    layers across the samples, computes no per-sample 3D mRoPE for pictures from 2D text positions, and cannot read
    the official fine-tuning script's cumulative-lengths mask."""
    config = model.config.get_text_config()
    if has_deltanet(config) or cumulative_lengths_mask(call):
        return False
    positions = call.get("position_ids")
    if has_vision(call) and (positions is None or positions.ndim == 2):
        return False
    if config._attn_implementation == "flash_attention_2":
        return True
    # sdpa and eager: stock's restarts where it builds no cache
    return text.values is not None and stock_restarts(model, call, text, text.values.shape[0]) is not None


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


def stock_restarts(model, call: dict, text: TextPositions, batch: int) -> torch.Tensor | None:
    """(batch, seq) bool: where stock starts a new attention sequence inside a row from its text positions when
    there is no mask — sdpa without a KV cache (where positions do not continue by +1), flash-attention on one
    row (at the smallest position) — or None when it attends over each whole row."""
    config = model.config.get_text_config()
    positions = text.values.expand(batch, -1)
    if config._attn_implementation == "flash_attention_2":
        continuing = torch.arange(positions.shape[-1], device=positions.device) + positions.min()
        if batch != 1 or not bool((continuing != positions).any()):
            return None
        return positions == positions.min()
    use_cache = call.get("use_cache")
    if (config.use_cache if use_cache is None else use_cache) or not text.restart_inside:
        return None
    return text.starts.expand(batch, -1)


# ---------------------------------------------------------------------------------------------------------
# The reading


@dataclass(frozen=True)
class BatchReading:
    """What a batch says, read once (`read_batch`) before any rule judges it. Tensors on the batch's device.

    `packed`: the batch is a packed row (`is_packed_row`). `stock_gets_it_right`: stock may run the batch (CP off,
    no caller asked for the package's path) and its forward equals the package's — then nothing else is read.
    `device`: where the batch lives (control tensors of collectives go there). `shape`: (batch, seq) of its
    tokens. `cache_given`: a KV cache came with the call; `carries_vision`: pixels or grids did;
    `cumulative_mask`: its `attention_mask` when that holds a packed row's cumulative lengths. `real`: (batch, seq)
    bool, the real tokens of a 2D padding mask (None: no such mask). `placeholders`: (batch, seq) bool per modality
    the call carries pixels for, `grids` its `grid_thw`. `cumulative`: a packed row's cumulative lengths in the
    order they are checked, (argument name, tensor, its (1, seq) sample starts or None where they are not well
    formed). `text_starts`: (1, seq) where its text positions restart. `restarts`: where stock restarts attention
    inside the rows of an ordinary batch without a mask. `starts`: the row's sample starts on the caller's layout
    — a packed row's from its last source, an ordinary batch's first real token of each row and stock's restarts.
    `segments`: the samples of the packed row those starts make (the real tokens back to back), and
    `placeholder_rows` each modality's placeholder tokens' positions in it, in their order (1D; -1: a placeholder
    on padding, `_row_positions`)."""

    device: torch.device
    packed: bool = False
    stock_gets_it_right: bool = False
    shape: tuple[int, int] | None = None
    cache_given: bool = False
    carries_vision: bool = False
    cumulative_mask: torch.Tensor | None = None
    real: torch.Tensor | None = None
    placeholders: dict[str, torch.Tensor] = field(default_factory=dict)
    grids: dict[str, torch.Tensor] = field(default_factory=dict)
    cumulative: list[tuple[str, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    text_starts: torch.Tensor | None = None
    restarts: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    segments: list[tuple[int, int]] = field(default_factory=list)
    placeholder_rows: dict[str, torch.Tensor] = field(default_factory=dict)


def read_batch(model, call: dict, stock_allowed: bool) -> BatchReading:
    """The reading of `call`'s batch, in one pass (`BatchReading`, module docstring). `stock_allowed`: stock may run
    it (CP off, and the caller did not ask for the package's path): a batch stock gets right is then read no
    further."""
    device, text = batch_device(call), TextPositions(call)
    packed = is_packed_row(call, text)
    if stock_allowed and (not packed or stock_gets_packed_row_right(model, call, text)):
        return BatchReading(device, packed=packed, stock_gets_it_right=True)
    shape, cache_given = tokens_shape(call), given_cache(call) is not None
    cumulative_mask = call["attention_mask"] if cumulative_lengths_mask(call) else None
    if shape is None:
        return BatchReading(device, packed=packed, cache_given=cache_given, carries_vision=has_vision(call),
                            cumulative_mask=cumulative_mask)
    vision = getattr(model.config, "vision_config", None) is not None
    given = [(kind, grid_key, token_key) for kind, pixels_key, grid_key, token_key in VISION
             if vision and call.get(pixels_key) is not None]
    placeholders = {kind: placeholder_tokens(model, call, getattr(model.config, key)) for kind, _, key in given}
    grids = {kind: call.get(grid_key) for kind, grid_key, _ in given}
    real = text_starts = restarts = None
    cumulative = []
    if packed:
        text_starts = text.starts
        cumulative = [(name, cu, _starts_of_cumulative(cu, shape[1]))
                      for name, cu in _cumulative_lengths(call, cumulative_mask)]
        starts = next((s for s in reversed([text_starts, *(c[2] for c in cumulative)]) if s is not None), None)
    else:
        mask = call.get("attention_mask")
        real = mask.bool() if torch.is_tensor(mask) and tuple(mask.shape) == shape else None
        positions = text.values
        if (mask is None and positions is not None and positions.shape[-2] in (1, shape[0])
                and positions.shape[-1] == shape[1]):
            restarts = stock_restarts(model, call, text, shape[0])
        starts = _first_tokens(shape, real, restarts, device)
    segments = [] if starts is None else _segments(real, starts)
    return BatchReading(
        device, packed=packed, shape=shape, cache_given=cache_given, carries_vision=has_vision(call),
        cumulative_mask=cumulative_mask, real=real, placeholders=placeholders, grids=grids, cumulative=cumulative,
        text_starts=text_starts, restarts=restarts, starts=starts, segments=segments,
        placeholder_rows={kind: _row_positions(found, real) for kind, found in placeholders.items()},
    )


def tokens_shape(call: dict) -> tuple[int, int] | None:
    """(batch, seq) of the call's tokens: 2D `input_ids`, else 3D `inputs_embeds`; None when neither is."""
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    if ids is not None:
        return tuple(ids.shape) if ids.ndim == 2 else None
    return tuple(embeds.shape[:2]) if embeds is not None and embeds.ndim == 3 else None


def _cumulative_lengths(call: dict, cumulative_mask: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    """A packed row's cumulative lengths, given as the mask (the official script; `cumulative_mask`) and / or
    `cu_seq_lens_q`."""
    given = [("attention_mask", cumulative_mask),
             ("cu_seq_lens_q", call.get("cu_seq_lens_q"))]  # in this order: the rules check them so
    return [(name, cu) for name, cu in given if cu is not None]


def _starts_of_cumulative(cu: torch.Tensor, seq: int) -> torch.Tensor | None:
    """(1, seq) bool sample starts from cumulative lengths [0, l1, l1 + l2, ..., seq]; None when `cu` is not that."""
    cumulative = cu.ndim == 1 and cu.numel() >= 2 and int(cu[0]) == 0 and int(cu[-1]) == seq
    if not (cumulative and bool((cu.diff() > 0).all())):
        return None
    starts = torch.zeros(1, seq, dtype=torch.bool, device=cu.device)
    starts[0, cu[:-1].long()] = True
    return starts


def _first_tokens(shape: tuple[int, int], real: torch.Tensor | None, restarts: torch.Tensor | None,
                  device) -> torch.Tensor:
    """(batch, seq) bool: each row's first real token, and stock's restarts inside a row."""
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    first = torch.ones(shape, dtype=torch.bool, device=device) if real is None else real
    starts[torch.arange(shape[0], device=device), first.int().argmax(-1)] = True
    return starts if restarts is None else starts | restarts.to(device)


def _segments(real: torch.Tensor | None, starts: torch.Tensor) -> list[tuple[int, int]]:
    """Segments of the packed row (the real tokens back to back) from sample starts on the caller's layout."""
    flat = starts.reshape(-1) if real is None else starts[real]
    bounds = [*flat.nonzero().flatten().tolist(), int(flat.numel())]
    return list(zip(bounds[:-1], bounds[1:]))


def _row_positions(found: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The row position of each token `found` (batch, seq) bool marks on the caller's layout, in their order there
    (1D): its place among the real tokens (the packed row), or -1 where it is padding. Stock fills every placeholder
    token in that order, padding included, where a feature reaches no loss: LLaMA-Factory's collator gives a batch
    without images a fake image whose tokens are padding, so that data-parallel wrappers see the tower used. Under CP
    such a token's feature goes to no rank (`vision.route_to_owners`)."""
    if real is None:
        return found.reshape(-1).nonzero().flatten()
    in_row = real.reshape(-1).cumsum(0) - 1
    where = found.reshape(-1).nonzero().flatten()
    return torch.where(real.reshape(-1)[where], in_row[where], -1)
