"""Every batch on the CP path becomes one packed row of its real tokens.

Two kinds of batch arrive:

* a **packed row**, in the convention of transformers' `DataCollatorWithFlattening` extended to images:
  one row, no `attention_mask`, text `position_ids` restarting at 0 at each sample start (and/or
  `cu_seq_lens_q/k`, which must agree), images and videos in sample order, `mm_token_type_ids` for the
  row. It is the only batch that takes the package's path at P=1 (`is_packed_row`): stock transformers
  computes 3D mRoPE over such a row as if it were one sample.
* an **ordinary batch** (under CP only): rows, right-padded with an `attention_mask` or not padded. Its
  real tokens are laid back to back, one sample per row, so that no rank holds a slice of padding and no
  (S x S) mask is ever built; outputs go back to the caller's layout (`CPContext.rows`).

Positions are fixed before anything is cut: given `position_ids` travel with their tokens; otherwise
each sample gets what stock computes for it alone (3D mRoPE from `get_rope_index` when it has images or
videos, text positions 0, 1, ... otherwise).
"""

from __future__ import annotations

import itertools

import torch

from ..context import RowLayout
from ..errors import CPInputError
from ..layout import Segment, positions_restarting_at, segments_from_lengths, segments_of, starts_of
from ..loss import IGNORE_INDEX, shifted_labels
from .arguments import batch_reference

PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Per-token inputs that follow their tokens into the row: (name, index of the batch dimension).
PER_TOKEN = (("input_ids", 0), ("inputs_embeds", 0), ("mm_token_type_ids", 0), ("shift_labels", 0))


def _text_positions(call: dict) -> torch.Tensor | None:
    positions = call.get("position_ids")
    return positions if positions is not None and positions.ndim == 2 else None


def _restarts(text_positions: torch.Tensor) -> torch.Tensor:
    """True after the first token of each row where the position does not continue by +1."""
    return starts_of(text_positions)[..., 1:]


def is_packed_row(call: dict) -> bool:
    """The packed-row convention: one row, no attention_mask, and 2D text positions that restart or
    `cu_seq_lens_q` with more than one sample. The only batch that takes the package's path at P=1."""
    reference = batch_reference(call)
    if reference is None or reference.shape[0] != 1 or call.get("attention_mask") is not None:
        return False
    text = _text_positions(call)
    if text is not None and bool(_restarts(text).any()):
        return True
    cu = call.get("cu_seq_lens_q")
    return cu is not None and cu.numel() > 2


def has_vision(call: dict) -> bool:
    keys = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
    return any(call.get(k) is not None for k in keys)


def packed_row_starts(call: dict) -> list[int]:
    """Sample starts of a packed row; raises `CPInputError` when its signals disagree."""
    seq = batch_reference(call).shape[1]
    text = _text_positions(call)
    starts = None if text is None else starts_of(text)[0]
    cu = call.get("cu_seq_lens_q")
    if cu is not None:
        from_cu = torch.zeros(seq, dtype=torch.bool, device=cu.device)
        from_cu[cu[:-1].long().clamp(max=seq - 1)] = True
        cu_k = call.get("cu_seq_lens_k")
        agree = (
            int(cu[0]) == 0
            and int(cu[-1]) == seq
            and bool((cu.diff() > 0).all())
            and (starts is None or torch.equal(from_cu, starts.to(cu.device)))
            and (cu_k is None or torch.equal(cu_k.to(cu.device), cu))
        )
        if not agree:
            raise CPInputError(
                f"cu_seq_lens_q {cu.tolist()} does not agree with position_ids (sample starts where positions "
                "restart at 0) or with the sequence length; pass matching ones or drop cu_seq_lens_q/k"
            )
        longest = int(cu.diff().max())
        for key in ("max_length_q", "max_length_k"):
            given = call.get(key)
            if given is not None and int(given) != longest:
                raise CPInputError(f"{key}={int(given)} but the longest packed sample has {longest} tokens")
        starts = from_cu
    if has_vision(call) and (call.get("mm_token_type_ids") is None or call.get("input_ids") is None):
        raise CPInputError("a packed multimodal row needs input_ids and mm_token_type_ids for per-sample mRoPE")
    return starts.nonzero().flatten().tolist()


def ordinary_batch_problem(call: dict) -> str | None:
    """Why an ordinary batch cannot become a packed row exactly (None when it can)."""
    reference = batch_reference(call)
    mask = call.get("attention_mask")
    text = _text_positions(call)
    if mask is not None:
        if mask.ndim != 2 or tuple(mask.shape) != tuple(reference.shape[:2]):
            return "under CP attention_mask must be the 2D (batch, seq) padding mask"
        if bool((mask[:, 1:].long() > mask[:, :-1].long()).any()):
            return (
                "attention_mask has left padding (or holes); under CP pad on the right "
                "(tokenizer.padding_side = 'right') or pack samples without padding."
            )
        if not bool(mask.any()):
            return "the batch holds no token: attention_mask is all zeros"
        targets = _targets(call)
        if targets is not None and bool(((targets != IGNORE_INDEX) & ~mask.bool()).any()):
            return (
                "labels at padding positions (attention_mask 0) must be -100 under CP: padding is not computed. "
                "Mask them as most collators do (labels[attention_mask == 0] = -100)."
            )
        if text is not None and bool((_restarts(text) & mask[:, 1:].bool()).any()):
            return (
                "a batch with both attention_mask and position_ids restarting inside a row (packed samples with "
                "padding) is ambiguous; pass packed rows without attention_mask, or padded rows whose positions "
                "count up within each row."
            )
    elif text is not None and reference.shape[0] > 1 and bool(_restarts(text).any()):
        return (
            "packed samples (position_ids restarting at 0) must come as one row (batch size 1), as "
            "DataCollatorWithFlattening builds them"
        )
    if has_vision(call) and (call.get("input_ids") is None or call.get("mm_token_type_ids") is None):
        return "under CP, images and videos need input_ids and mm_token_type_ids (as the processor returns them)"
    return None


def _frames(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """One grid entry per temporal patch group, as get_rope_index walks videos (timestamps separate them)."""
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def per_sample_mrope(model, call: dict, segments: list[Segment], text: torch.Tensor) -> torch.Tensor:
    """(4, 1, S) position ids of a row: the text positions `text` (1, S), then each sample's 3D mRoPE
    computed alone by the model's own `get_rope_index`."""
    input_ids, types = call["input_ids"], call["mm_token_type_ids"]
    images = iter(call["image_grid_thw"]) if call.get("image_grid_thw") is not None else iter(())
    frames = iter(_frames(call["video_grid_thw"])) if call.get("video_grid_thw") is not None else iter(())
    pieces = []
    for a, b in segments:
        runs = [kind for kind, _ in itertools.groupby(types[0, a:b].tolist())]
        sample_images = [next(images) for kind in runs if kind == 1]
        sample_frames = [next(frames) for kind in runs if kind == 2]
        positions, _ = model.get_rope_index(
            input_ids[:, a:b],
            mm_token_type_ids=types[:, a:b],
            image_grid_thw=torch.stack(sample_images) if sample_images else None,
            video_grid_thw=torch.stack(sample_frames) if sample_frames else None,
        )
        pieces.append(positions)
    mrope = torch.cat(pieces, dim=-1)
    return torch.cat([text.to(mrope)[None], mrope], dim=0)


def _default_positions(model, call: dict, segments: list[Segment]) -> torch.Tensor:
    """What stock computes for each sample alone: 3D mRoPE with images or videos, else text positions."""
    device = batch_reference(call).device
    text = positions_restarting_at(segments).to(device)[None]
    if has_vision(call) and hasattr(model, "get_rope_index"):
        return per_sample_mrope(model, call, segments, text)
    return text


def _targets(call: dict) -> torch.Tensor | None:
    """The target of every position on the caller's layout: `shift_labels`, or `labels` shifted by one."""
    if call.get("shift_labels") is not None:
        return call["shift_labels"]
    return None if call.get("labels") is None else shifted_labels(call["labels"])


def _with_targets(call: dict) -> None:
    """Labels become `shift_labels` on the caller's layout, before any padding is dropped: the last real
    token of a row keeps the target stock gives it."""
    targets = _targets(call)
    call.pop("labels", None)
    if targets is not None:
        call["shift_labels"] = targets


def packed_row_of_batch(model, call: dict) -> tuple[list[Segment], RowLayout | None]:
    """Rewrite `call` (in place) as one packed row; return its samples and where they came from.

    `model` is the module with `get_rope_index` (the multimodal model), or None for text-only models.
    Called after the checks agreed across the group (`packed_row_starts`, `ordinary_batch_problem`).
    """
    _with_targets(call)
    reference = batch_reference(call)
    if is_packed_row(call):
        starts = packed_row_starts(call)
        segments = segments_of(starts, reference.shape[1])
        rows = None
        given = call.get("position_ids")
        if given is None or given.ndim == 2:  # 3D (mRoPE) position ids given with the row are kept as they are
            text = given if given is not None else positions_restarting_at(segments).to(reference.device)[None]
            if has_vision(call) and model is not None:
                text = per_sample_mrope(model, call, segments, text)
            call["position_ids"] = text
    else:
        mask = call.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones(reference.shape[:2], dtype=torch.bool, device=reference.device)
        rows = RowLayout.of_mask(mask.bool())
        segments = segments_from_lengths([n for n in rows.lengths() if n])
        for name, batch_dim in PER_TOKEN:
            if call.get(name) is not None:
                call[name] = rows.to_row(call[name], batch_dim)
        positions = call.get("position_ids")
        if positions is not None:
            call["position_ids"] = rows.to_row(positions, batch_dim=positions.ndim - 2)
        else:
            call["position_ids"] = _default_positions(model, call, segments)
        if rows.batch == 1 and rows.index.numel() == rows.width:
            rows = None  # already one unpadded row
    for key in PACKING_KWARGS:
        call.pop(key, None)  # the context carries the boundaries
    return segments, rows
