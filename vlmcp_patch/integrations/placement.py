"""What a rank of a CP group puts on its device: under CP the pixel values of a batch stay on the host.

Every rank of a group receives the same batch, but each encodes only its share of the images and video frames:
the CP forward copies those pixel rows to the tower's device itself, cast once to its dtype
(`forward/vision.py`). Moving the whole batch's pixel values to every rank's device first would hold P copies of
the largest tensor of a multimodal batch. So under CP the integrations leave `pixel_values` and
`pixel_values_videos` where the data loader produced them (host memory) and move everything else — ids, labels,
masks, positions, grids: small integer tensors — as before:

* Accelerate's prepared data loaders (`send_to_device`, which the HF Trainer and TRL use too);
* the HF Trainer's `_prepare_inputs` (its evaluation loop and TRL's trainers go through it);
* a raw training loop (DeepSpeed's engine, plain torch) uses `batch_to_device` instead of its own `.to(device)`.

The agreement check of the forward fingerprints the whole batch where it is. At P=1 nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..distributed import cp_running
from ..forward.arguments import PIXEL_KEYS
from ..patching import Patch


def _kept_on_host(batch) -> dict:
    return {key: batch[key] for key in PIXEL_KEYS if torch.is_tensor(batch.get(key))}


def batch_to_device(batch: Mapping, device, non_blocking: bool = False) -> Mapping:
    """`batch` (a mapping of tensors) with its tensors on `device`, as a CP rank needs it: under CP the pixel values
    stay where they are (each rank copies its own share to its device in the forward); with CP off, everything
    moves. For raw training loops; the HF Trainer, TRL and Accelerate's data loaders do this by themselves."""
    kept = _kept_on_host(batch) if cp_running() else {}
    moved = {key: value.to(device, non_blocking=non_blocking) if torch.is_tensor(value) and key not in kept else value
             for key, value in batch.items()}
    return type(batch)(moved) if not isinstance(batch, dict) else moved


def _without(batch: Mapping, kept: dict) -> Mapping:
    return type(batch)({k: v for k, v in batch.items() if k not in kept})


def cp_send_to_device(wrapped, instance, args, kwargs):
    batch = args[0] if args else kwargs.pop("tensor")
    kept = _kept_on_host(batch) if cp_running() and isinstance(batch, Mapping) else {}
    if not kept:
        return wrapped(batch, *args[1:], **kwargs)
    # A BatchFeature moves itself whole (its own `.to`), whatever `skip_keys` says: move the rest only.
    moved = wrapped(_without(batch, kept), *args[1:], **kwargs)
    moved.update(kept)
    return moved


def cp_prepare_inputs(wrapped, instance, args, kwargs):
    inputs = args[0] if args else kwargs["inputs"]
    if not (cp_running() and isinstance(inputs, Mapping)):
        return wrapped(*args, **kwargs)
    kept = _kept_on_host(inputs)
    prepared = wrapped(_without(inputs, kept))
    prepared.update(kept)
    return prepared


def patches() -> list[Patch]:
    return [
        Patch(
            target="accelerate.data_loader.send_to_device",
            wrapper=cp_send_to_device,
            reason="under CP: a prepared data loader leaves the pixel values on the host; each rank copies only its "
            "share of them to its device, in the forward",
            expects=("tensor", "device", "non_blocking"),
            requires="accelerate",
        ),
        Patch(
            target="transformers.trainer.Trainer._prepare_inputs",
            wrapper=cp_prepare_inputs,
            reason="under CP: the Trainer (and TRL's trainers) leave the pixel values on the host; each rank copies "
            "only its share of them to its device, in the forward",
            expects=("inputs",),
            requires="transformers.trainer",
        ),
    ]
