"""Every rule about one forward's batch, in one pass: what cannot run exactly under CP, what stock's compute
would trip on, and — for a batch that runs — the plan `rows.py` lays out as one packed row.

The rules are derived from what stock transformers does with each input:

* tokens: exactly one of `input_ids` (in the vocabulary) and `inputs_embeds`;
* `attention_mask`: none, a 2D (batch, seq) padding mask of any pattern (stock attends causally among each
  row's real tokens, so dropping the padding is exact; Qwen3.5's DeltaNet layers also run through padding
  as zeros, which equals dropping it only where a row's real tokens are contiguous), or — the official
  Qwen3-VL fine-tuning script's packed rows — the 1D cumulative sample lengths of one row. A 4D mask cannot
  be split;
* `position_ids`: none (computed as stock computes them: `compute_3d_position_ids` on the caller's batch,
  else 0, 1, ... per row), 2D text positions, or 3 (mRoPE) / 4 (text + mRoPE) rows, used as given;
* attention segments: each row's real tokens are one sequence, split further where stock splits them —
  at restarting text positions when there is no mask (sdpa without a cache, flash-attention on one row);
* labels: the batch's shape, each in the vocabulary or -100, none at a padding position (padding is not
  computed);
* vision: grids of positive sizes divisible by the merge size, pixel rows matching the grids, as many image
  / video tokens as the grids give.

A **packed row** in the documented convention (`is_packed_row`) takes the package's path at P=1 too where stock's
result would differ from its samples run alone (`stock_gets_packed_row_right`): its samples then run as if alone
(per-sample mRoPE, attention and DeltaNet state restart at every sample).

Each rule yields a `Problem` instead of raising: the ranks of a CP group first agree (one small collective,
`agreement.py`) and then all raise together, so no rank is left waiting in a collective the others never
reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.foreign import foreign_attention_problem
from ..attention.heads import kv_replication
from ..distributed import CPGroup, ulysses_for
from ..errors import CPInputError, UnsupportedSetupError
from ..layout import Segment, starts_of
from ..loss import IGNORE_INDEX, shifted_labels
from ..settings import cp_size
from .arguments import batch_reference, given_cache, has_vision
from .positions import per_sample_mrope, stock_positions

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")
VISION = (("image", "pixel_values", "image_grid_thw", "image_token_id"),
          ("video", "pixel_values_videos", "video_grid_thw", "video_token_id"))
CU_SEQ_LENS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class Problem:
    """A reason this rank cannot run the batch; raised on every rank of the group."""

    error: type
    message: str

    def raise_it(self):
        raise self.error(self.message)


class _Rejected(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


def _reject(message: str, error: type = CPInputError):
    raise _Rejected(Problem(error, message))


def _as_stock_computes(compute, *args):
    """Positions as stock computes them. Stock's own refusal on the way (its ValueError, IndexError or
    RuntimeError, e.g. images without `mm_token_type_ids`) becomes the batch's Problem: the same type and
    message on every rank. Errors anywhere else propagate as they are."""
    try:
        return compute(*args)
    except (ValueError, IndexError, RuntimeError) as exc:
        raise _Rejected(Problem(type(exc), str(exc))) from None


@dataclass(frozen=True)
class BatchPlan:
    """How one forward's batch becomes the packed row, decided once by `plan_batch` for `rows.lay_out`.

    `real` (batch, seq) bool marks the caller's real tokens (None: every token of a single row); the packed
    row is those tokens back to back, row by row. `segments` are its attention segments (the samples), in
    row coordinates. `positions` are the position ids on the caller's layout (..., batch, seq), given or
    computed as stock computes them. `packed`: the documented packed-row convention.
    """

    real: torch.Tensor | None
    segments: list[Segment]
    positions: torch.Tensor
    packed: bool


# ---------------------------------------------------------------------------------------------------------
# The model and the call's options


def check_model_config(text_config, size: int) -> None:
    """Raise `UnsupportedSetupError` if a text config cannot run exactly at CP size `size`."""
    impl = text_config._attn_implementation
    if impl not in SUPPORTED_ATTENTION and not (size == 1 and impl == "eager"):  # eager: a packed row at P=1
        raise UnsupportedSetupError(
            f"attn_implementation={impl!r} is not supported under CP (VLMCP_CP_SIZE={cp_size()}); load the model "
            "with attn_implementation='sdpa' or 'flash_attention_2'."
        )
    ulysses = ulysses_of(text_config, size)
    kv_replication(text_config.num_attention_heads, text_config.num_key_value_heads, ulysses, "softmax attention")
    if has_deltanet(text_config):
        kv_replication(
            text_config.linear_num_value_heads, text_config.linear_num_key_heads, ulysses, "gated DeltaNet",
            ("value", "key"),
        )


def has_deltanet(text_config) -> bool:
    return bool(getattr(text_config, "linear_num_value_heads", None))


def ulysses_of(text_config, size: int) -> int:
    """U of the P = U x R layout for a model: the largest divisor of P that splits its query heads (and its DeltaNet
    value heads); the rest of P is a ring (`layout.Split`)."""
    heads = [text_config.num_attention_heads]
    if has_deltanet(text_config):
        heads.append(text_config.linear_num_value_heads)
    return ulysses_for(size, heads)  # inside a node where the heads allow (layout.ulysses_degree)


def setup_problem(model, cp: CPGroup, call: dict) -> Problem | None:
    """The model and the call's options against CP (attention, heads, cache, logits_to_keep, router loss)."""
    text_config = model.config.get_text_config()
    try:
        check_model_config(text_config, cp.size)
    except UnsupportedSetupError as exc:
        return Problem(UnsupportedSetupError, str(exc))
    foreign = foreign_attention_problem(model) if cp.size > 1 else None  # at P=1 it sees the whole row
    if foreign is not None:
        return Problem(UnsupportedSetupError, foreign)
    if given_cache(call) is not None:
        return Problem(
            UnsupportedSetupError,
            "a past_key_values cache (incremental decoding) cannot be used under CP; generate() runs with CP "
            "bypassed by itself, or run the call inside `with vlmcp_patch.disabled():`.",
        )
    keep = call.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return Problem(
            UnsupportedSetupError,
            "logits_to_keep is not supported under CP (generation uses it; generate() bypasses CP by itself); run "
            "the call inside `with vlmcp_patch.disabled():`.",
        )
    router = call.get("output_router_logits")
    if router is None:
        router = getattr(text_config, "output_router_logits", False)
    if router:
        return Problem(
            UnsupportedSetupError,
            "the MoE router auxiliary loss (output_router_logits=True) is not supported under CP yet; "
            "set config.text_config.output_router_logits=False.",
        )
    return None


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
# Tokens, labels, vision


def _check_tokens(model, call: dict) -> tuple[int, int]:
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        _reject("You must specify exactly one of input_ids or inputs_embeds", ValueError)
    if ids is not None:
        if ids.ndim != 2:
            _reject(f"input_ids must be (batch, seq); got shape {tuple(ids.shape)}")
        vocab = model.get_input_embeddings().num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
            _reject(f"input_ids hold {bad}, outside the vocabulary [0, {vocab}) of the embedding")
        return tuple(ids.shape)
    if embeds.ndim != 3:
        _reject(f"inputs_embeds must be (batch, seq, hidden); got shape {tuple(embeds.shape)}")
    return tuple(embeds.shape[:2])


def _check_labels(model, call: dict, shape: tuple[int, int]) -> None:
    vocab = model.config.get_text_config().vocab_size
    for name in ("labels", "shift_labels"):
        labels = call.get(name)
        if labels is None:
            continue
        if tuple(labels.shape) != shape:
            _reject(f"{name} have shape {tuple(labels.shape)} but the tokens {shape}: give one label per token "
                    "(-100 where there is no target)", ValueError)
        valid = labels[labels != IGNORE_INDEX]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            bad = int(valid.max()) if int(valid.max()) >= vocab else int(valid.min())
            _reject(f"{name} hold {bad}, outside the vocabulary [0, {vocab}) (and not -100): the loss would fail "
                    f"with 'Target {bad} is out of bounds'")


def placeholder_tokens(model, call: dict, token_id: int) -> torch.Tensor:
    """(batch, seq) bool: the placeholder tokens of `token_id`, found as stock finds them — by id, or by embedding
    when only `inputs_embeds` come."""
    if call.get("input_ids") is not None:
        return call["input_ids"] == token_id
    embeds = call["inputs_embeds"]
    token = model.get_input_embeddings()(torch.tensor(token_id, device=embeds.device))
    return (embeds == token).all(-1)


def _check_grid(grid: torch.Tensor, name: str, merge: int) -> None:
    if grid.ndim != 2 or grid.shape[-1] != 3 or grid.is_floating_point():
        _reject(f"{name} must be an integer (items, 3) tensor of (t, h, w) patch counts; got {tuple(grid.shape)}")
    if grid.numel() and (bool((grid < 1).any()) or bool((grid[:, 1:] % merge).any())):
        _reject(f"{name} rows must be positive (t, h, w) with h and w multiples of the merge size {merge}; got "
                f"{grid.tolist()}")


def _check_vision(model, call: dict) -> None:
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    for kind, pixels_key, grid_key, token_key in VISION:
        pixels, grid = call.get(pixels_key), call.get(grid_key)
        if pixels is None:
            continue
        if grid is None:
            _reject(f"{pixels_key} was given without {grid_key}")
        _check_grid(grid, grid_key, merge)
        rows = int(grid.prod(-1).sum())
        if pixels.ndim != 2 or tuple(pixels.shape) != (rows, width):
            _reject(f"{pixels_key} has shape {tuple(pixels.shape)} but {grid_key} {grid.tolist()} asks for "
                    f"({rows}, {width}) patch rows; build both with the same processor")
        expected = rows // merge**2
        found = int(placeholder_tokens(model, call, getattr(model.config, token_key)).sum())
        if expected != found:
            _reject(f"{kind} features and {kind} tokens do not match: {grid_key} gives {expected} {kind} tokens but "
                    f"the tokens hold {found}; build input_ids with the same processor as the {pixels_key}.")


# ---------------------------------------------------------------------------------------------------------
# Masks and positions


def _check_position_shape(call: dict, shape: tuple[int, int]) -> None:
    positions = call.get("position_ids")
    if positions is None:
        return
    batch, seq = shape
    rows_ok = positions.ndim == 2 or (positions.ndim == 3 and positions.shape[0] in (3, 4))
    if not rows_ok or positions.shape[-1] != seq or positions.shape[-2] not in (1, batch):
        _reject(f"position_ids have shape {tuple(positions.shape)}; for tokens {shape} give (batch or 1, seq) text "
                "positions, or (3 or 4, batch or 1, seq) mRoPE positions")


def _check_mask_values(mask: torch.Tensor, shape: tuple[int, int], deltanet: bool) -> torch.Tensor:
    """The real tokens (batch, seq) of a 2D padding mask."""
    if mask.ndim == 4:
        _reject("a 4D attention_mask (a custom attention pattern) cannot be split under CP; pass the 2D padding "
                "mask, or pack samples into one row with restarting position_ids", UnsupportedSetupError)
    if mask.ndim != 2 or tuple(mask.shape) != shape:
        _reject(f"attention_mask has shape {tuple(mask.shape)}; under CP it must be the 2D (batch, seq) padding mask "
                f"for tokens {shape}, or the 1D cumulative sample lengths of a packed row")
    real = mask.bool()
    if deltanet and not bool(((mask == 0) | (mask == 1)).all()):
        _reject("attention_mask holds values other than 0 and 1: the DeltaNet layers scale their inputs by it")
    if not bool(real.any()):
        _reject("the batch holds no token: attention_mask is all zeros")
    return real


def _contiguous(real: torch.Tensor) -> bool:
    """Whether each row's real tokens form one run (left, right or both-sided padding, no holes)."""
    edges = torch.diff(real.int(), dim=-1, prepend=torch.zeros_like(real[:, :1], dtype=torch.int))
    return bool(((edges == 1).sum(-1) <= 1).all())


def _check_padding(call: dict, real: torch.Tensor, deltanet: bool) -> None:
    if deltanet and not _contiguous(real):
        _reject("attention_mask has holes (padding between real tokens of a row): the DeltaNet layers run through "
                "them as zeros, which cannot be split exactly; pad on either side only, or pack the samples")
    targets = call["shift_labels"] if call.get("shift_labels") is not None else (
        None if call.get("labels") is None else shifted_labels(call["labels"]))
    if targets is not None and bool(((targets != IGNORE_INDEX) & ~real.to(targets.device)).any()):
        _reject("labels at padding positions (attention_mask 0) must be -100 under CP: padding is not computed. "
                "Mask them as most collators do (labels[attention_mask == 0] = -100).")


def _stock_restarts(model, call: dict, text: torch.Tensor, batch: int) -> torch.Tensor | None:
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


# ---------------------------------------------------------------------------------------------------------
# The plan


def _segments(real: torch.Tensor | None, starts: torch.Tensor) -> list[Segment]:
    """Segments of the packed row (the real tokens back to back) from sample starts on the caller's layout."""
    flat = starts.reshape(-1) if real is None else starts[real]
    bounds = [*flat.nonzero().flatten().tolist(), int(flat.numel())]
    return list(zip(bounds[:-1], bounds[1:]))


def _packed_row_starts(call: dict, seq: int) -> torch.Tensor:
    """(1, seq) bool sample starts of a packed row, from its text positions and / or cumulative lengths."""
    text = text_positions(call)
    starts = None if text is None else starts_of(text)
    mask_cu = call["attention_mask"] if cumulative_lengths_mask(call) else None
    for name, cu in (("attention_mask", mask_cu), ("cu_seq_lens_q", call.get("cu_seq_lens_q"))):
        if cu is None:
            continue
        from_cu = _starts_of_cumulative(cu, seq, name)
        if starts is not None and not torch.equal(from_cu, starts.to(cu.device)):
            _reject(f"{name} {cu.tolist()} does not agree with position_ids (sample starts where positions restart "
                    "at 0); pass matching ones or drop one of them")
        starts = from_cu
    _check_cu_seq_lens_k(call, seq)
    positions = call.get("position_ids")
    if positions is not None and positions.ndim == 3 and bool((positions[..., starts[0]] != 0).any()):
        _reject("the mRoPE position_ids of a packed row must start at 0 at every sample start (each sample's positions "
                "computed alone, as the official fine-tuning script and get_rope_index do)")
    return starts


def _starts_of_cumulative(cu: torch.Tensor, seq: int, name: str) -> torch.Tensor:
    cumulative = cu.ndim == 1 and cu.numel() >= 2 and int(cu[0]) == 0 and int(cu[-1]) == seq
    if not (cumulative and bool((cu.diff() > 0).all())):
        _reject(f"{name} {cu.tolist()} must be the cumulative sample lengths [0, l1, l1 + l2, ..., {seq}] of the row "
                f"({seq} tokens)")
    starts = torch.zeros(1, seq, dtype=torch.bool, device=cu.device)
    starts[0, cu[:-1].long()] = True
    return starts


def _check_cu_seq_lens_k(call: dict, seq: int) -> None:
    cu_q, cu_k = call.get("cu_seq_lens_q"), call.get("cu_seq_lens_k")
    if cu_k is not None and (cu_q is None or not torch.equal(cu_k.to(cu_q.device), cu_q)):
        _reject("cu_seq_lens_k must equal cu_seq_lens_q (self-attention of a packed row)")
    if cu_q is None:
        return
    longest = int(cu_q.diff().max())
    for key in ("max_length_q", "max_length_k"):
        given = call.get(key)
        if given is not None and int(given) != longest:
            _reject(f"{key}={int(given)} but the longest packed sample has {longest} tokens")


def _plan_packed_row(model, call: dict, shape: tuple[int, int]) -> BatchPlan:
    starts = _packed_row_starts(call, shape[1])
    segments = _segments(None, starts)
    positions = call.get("position_ids")
    if positions is None or positions.ndim == 2:
        positions = _as_stock_computes(per_sample_mrope, getattr(model, "model", None), call, segments, positions)
    return BatchPlan(real=None, segments=segments, positions=positions, packed=True)


def _plan_ordinary_batch(model, call: dict, shape: tuple[int, int]) -> BatchPlan:
    mask = call.get("attention_mask")
    deltanet = has_deltanet(model.config.get_text_config())
    if any(call.get(k) is not None for k in CU_SEQ_LENS):
        _reject("cu_seq_lens / max_length describe one packed row: pass them with a batch of one row only")
    device = batch_reference(call).device
    real = None if mask is None else _check_mask_values(mask, shape, deltanet)
    if real is not None:
        _check_padding(call, real, deltanet)
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    first = torch.ones(shape, dtype=torch.bool, device=device) if real is None else real
    starts[torch.arange(shape[0], device=device), first.int().argmax(-1)] = True  # each row's first real token
    text = text_positions(call)
    restarts = None if real is not None or text is None else _stock_restarts(model, call, text, shape[0])
    if restarts is not None:
        if deltanet:
            _reject("position_ids restart inside a row of this batch: stock splits attention there but runs the "
                    "DeltaNet layers across the restarts; pass the samples as one packed row (every layer then "
                    "restarts at each sample), or as padded rows with an attention_mask")
        starts |= restarts.to(device)
    positions = call.get("position_ids")
    positions = (_as_stock_computes(stock_positions, model, call) if positions is None
                 else positions.expand(*positions.shape[:-2], *shape))
    return BatchPlan(real=real, segments=_segments(real, starts), positions=positions, packed=False)


def plan_batch(model, call: dict, packed: bool) -> tuple[BatchPlan | None, Problem | None]:
    """The batch of one forward of `model` against every rule (module docstring), and its plan; `packed` tells
    whether it is a packed row in the convention (`is_packed_row`). Returns (plan, None), or (None, Problem)."""
    try:
        shape = _check_tokens(model, call)
        _check_labels(model, call, shape)
        _check_vision(model, call)
        _check_position_shape(call, shape)
        plan = (_plan_packed_row if packed else _plan_ordinary_batch)(model, call, shape)
    except _Rejected as rejected:
        return None, rejected.problem
    return plan, None
