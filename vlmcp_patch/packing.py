"""Packed rows: several samples in one sequence, in the `DataCollatorWithFlattening` convention.

One row; text `position_ids` restarting at 0 at each sample start; optionally `cu_seq_lens_q/k` and
`max_length_q/k` (which must agree with the positions); images and videos in sample order with
`mm_token_type_ids` for the whole row; no `attention_mask`.

Stock transformers computes 3D mRoPE for such a row as if it were one sample. Here each sample's
mRoPE positions are computed alone, starting where they would if the sample were run by itself.
"""

from __future__ import annotations

import itertools

import torch

from .context import sample_starts
from .errors import CPInputError


def text_positions_of(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The text row of `position_ids`: 2D as given, row 0 of a 4-row (text + 3D mRoPE) tensor."""
    if position_ids is None:
        return None
    if position_ids.ndim == 2:
        return position_ids
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def packed_starts(call: dict) -> torch.Tensor | None:
    """Sample starts (bool, shape (S,)) of a packed row, None for an ordinary batch; checks the convention.

    Only the collator's signals count: 2D `position_ids` or `cu_seq_lens_q`. The 4-row position ids that
    generation builds (text + 3D mRoPE, zeros over left padding) never mark a packed row.
    """
    positions = call.get("position_ids")
    text = positions if positions is not None and positions.ndim == 2 else None
    cu = call.get("cu_seq_lens_q")
    starts = None
    if text is not None:
        restarts = sample_starts(text)
        if bool(restarts[:, 1:].any()):
            if text.shape[0] != 1:
                raise CPInputError(
                    "packed samples (position_ids restarting at 0) must come as one row (batch size 1), as "
                    "DataCollatorWithFlattening builds them"
                )
            starts = restarts[0]
    if cu is not None:
        seq = (call.get("input_ids") if call.get("input_ids") is not None else call["inputs_embeds"]).shape[1]
        from_cu = torch.zeros(seq, dtype=torch.bool, device=cu.device)
        from_cu[cu[:-1].long()] = True
        agree = int(cu[-1]) == seq and (starts is None or torch.equal(from_cu, starts.to(cu.device)))
        cu_k = call.get("cu_seq_lens_k")
        agree = agree and (cu_k is None or torch.equal(cu_k.to(cu.device), cu))
        if text is not None and starts is None:
            agree = agree and int(from_cu.sum()) == 1
        if not agree:
            raise CPInputError(
                f"cu_seq_lens_q {cu.tolist()} does not agree with position_ids (sample starts where positions "
                "restart at 0) or with the sequence length; pass matching ones or drop cu_seq_lens_q/k"
            )
        lengths = cu.diff()
        for key in ("max_length_q", "max_length_k"):
            given = call.get(key)
            if given is not None and int(given) != int(lengths.max()):
                raise CPInputError(f"{key}={int(given)} but the longest packed sample has {int(lengths.max())} tokens")
        if starts is None and bool(from_cu[1:].any()):
            starts = from_cu
    return starts


def packed_text_positions(starts: torch.Tensor) -> torch.Tensor:
    """Text positions restarting at 0 at every sample start (for rows described by cu_seq_lens only)."""
    index = torch.arange(starts.shape[0], device=starts.device)
    last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=0).values
    return index - last_start


def _groups(types: torch.Tensor) -> list[int]:
    """Modality of each contiguous run in `mm_token_type_ids` (0 text, 1 image, 2 video)."""
    return [key for key, _ in itertools.groupby(types.tolist())]


def per_sample_mrope(model, call: dict, starts: torch.Tensor) -> torch.Tensor:
    """(4, 1, S) position ids: the text positions, then each sample's 3D mRoPE computed alone."""
    input_ids, types = call["input_ids"], call["mm_token_type_ids"]
    text = text_positions_of(call.get("position_ids"))
    bounds = starts.nonzero().flatten().tolist() + [input_ids.shape[1]]
    images = iter(call["image_grid_thw"]) if call.get("image_grid_thw") is not None else iter(())
    frames = call.get("video_grid_thw")
    if frames is not None:  # one entry per frame, like get_rope_index (timestamps separate frames)
        frames = torch.repeat_interleave(frames, frames[:, 0], dim=0)
        frames[:, 0] = 1
    frames = iter(frames) if frames is not None else iter(())
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        runs = _groups(types[0, a:b])
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
    if text is None:
        text = packed_text_positions(starts)[None]
    return torch.cat([text.to(mrope)[None], mrope], dim=0)
