"""Packing processed multimodal samples into rows, for the HF Trainer / TRL `data_collator`.

`MultimodalPackingCollator` concatenates the samples of a micro-batch into one packed row in the
`DataCollatorWithFlattening` convention (text `position_ids` restarting at 0, the first label of each
sample set to -100, no `attention_mask`), plus the vision inputs in sample order and
`mm_token_type_ids` for the whole row. `pack_into_bins` / `PackedDataset` group samples first-fit
decreasing up to a token budget, so that each micro-batch is one well-filled row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .loss import IGNORE_INDEX

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _row(value) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    return tensor[0] if tensor.ndim == 2 else tensor


def sample_length(sample: dict) -> int:
    return int(_row(sample["input_ids"]).shape[0])


def pack_into_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped so that each group's total length is at most `max_tokens`."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if length > max_tokens:
            raise ValueError(
                f"sample {index} has {length} tokens, more than the packing budget max_tokens={max_tokens}"
            )
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(max_tokens - length)
    return [sorted(b) for b in bins]


class PackedDataset(torch.utils.data.Dataset):
    """A dataset whose items are bins of samples (lists), packed first-fit decreasing up to `max_tokens`.

    Use it with `MultimodalPackingCollator` and a per-device batch size of 1: each step is one row.
    """

    def __init__(self, samples: Sequence[dict], max_tokens: int, length: Callable[[dict], int] = sample_length):
        self.samples = samples
        self.bins = pack_into_bins([length(s) for s in samples], max_tokens)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> list[dict]:
        return [self.samples[i] for i in self.bins[index]]


class MultimodalPackingCollator:
    """Concatenate samples (or bins of samples) into one packed row.

    Each sample is a dict with `input_ids` and `mm_token_type_ids` (1-D or shape (1, L)), optionally
    `labels` (default: `input_ids`, with image/video placeholder tokens ignored) and vision inputs.
    Set `return_cu_seq_lens=True` to add `cu_seq_lens_q/k` and `max_length_q/k`.
    """

    def __init__(self, return_cu_seq_lens: bool = False):
        self.return_cu_seq_lens = return_cu_seq_lens

    def __call__(self, features: Sequence) -> dict:
        samples = [s for f in features for s in (f if isinstance(f, (list, tuple)) else [f])]
        ids, types, labels, positions = [], [], [], []
        for sample in samples:
            row = _row(sample["input_ids"]).long()
            kinds = _row(sample["mm_token_type_ids"]).long() if "mm_token_type_ids" in sample else torch.zeros_like(row)
            if "labels" in sample:
                target = _row(sample["labels"]).long().clone()
            else:
                target = row.masked_fill(kinds != 0, IGNORE_INDEX)
            target[0] = IGNORE_INDEX  # the previous sample's last token must not predict this one
            ids.append(row)
            types.append(kinds)
            labels.append(target)
            positions.append(torch.arange(row.shape[0]))
        batch = {
            "input_ids": torch.cat(ids)[None],
            "mm_token_type_ids": torch.cat(types)[None],
            "labels": torch.cat(labels)[None],
            "position_ids": torch.cat(positions)[None],
        }
        for key in VISION_KEYS:
            parts = [torch.as_tensor(s[key]) for s in samples if s.get(key) is not None]
            if parts:
                batch[key] = torch.cat(parts)
        if self.return_cu_seq_lens:
            lengths = torch.tensor([0] + [len(r) for r in ids])
            cu = lengths.cumsum(0).to(torch.int32)
            longest = int(lengths.max())
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return batch
