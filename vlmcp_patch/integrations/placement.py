"""What a rank of a CP group keeps of a batch, and puts on its device: under CP the pixel values stay on the host,
cut down to this rank's share.

Every rank of a group receives the same batch, but each encodes only its share of the images and video frames:
the CP forward copies those pixel rows to the tower's device itself, cast once to its dtype
(`forward/vision.py`). Moving the whole batch's pixel values to every rank's device first would hold P copies of
the largest tensor of a multimodal batch, and keeping them whole on the host P copies per node. So under CP the
integrations cut `pixel_values` and `pixel_values_videos` down to this rank's share by items, a new tensor beside a
small record of the cut (`forward/host_pixels.py`: where the items balance; the whole batch's otherwise), leave them
where the data loader produced them (host memory), and move everything else — ids, labels, masks, positions,
grids: small integer tensors — as before:

* Accelerate's prepared data loaders: the cut right after the collator (`cp_prepare_data_loader`,
  integrations/accelerate.py: prefetched batches and workers' batches hold the share only), then `send_to_device`
  (which the HF Trainer and TRL use too);
* the HF Trainer's `_prepare_inputs` (its evaluation loop and TRL's trainers go through it);
* a raw training loop (DeepSpeed's engine, plain torch) uses `batch = batch_to_device(batch, device)` instead of its
  own `.to(device)` (and `PixelShareCollator` around its collator for workers and prefetching).

The agreement check of the forward compares the whole pixel tensors' fingerprints, taken before the cut. At P=1
nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..distributed import cp_running
from ..flags import REPLICA_VIEW
from ..forward.arguments import PIXEL_KEYS, SHARE_RECORDS
from ..forward.host_pixels import keep_pixel_share, keep_this_ranks_share, this_ranks_cut
from ..patching import Patch


def _kept_on_host(batch) -> dict:
    """The pixel values and the records of their cut (`SHARE_RECORDS`): they stay where they are."""
    return {key: batch[key] for key in (*PIXEL_KEYS, *SHARE_RECORDS.values()) if torch.is_tensor(batch.get(key))}


class PixelShareCollator:
    """A collator whose batches hold only this rank's share of the pixel values under CP (`forward/host_pixels.py`):
    `collate`'s batch cut right after it is made, in the data loader's worker where there is one, so that prefetched
    batches and those in flight from workers hold the share only. Accelerate's prepared data loaders (the HF
    Trainer's, TRL's) get it by themselves (integrations/accelerate.py); a raw loop wraps its collator:
    `DataLoader(..., collate_fn=vlmcp_patch.PixelShareCollator(collate))`. `cut`: (CP size, rank in the group) to cut for; by
    default this process's, read where the collator is built (`host_pixels.this_ranks_cut`; None: nothing is cut)."""

    def __init__(self, collate: Callable, cut: tuple[int, int] | None | str = "this process's"):
        self.collate = collate
        self.cut = this_ranks_cut() if cut == "this process's" else cut

    def __call__(self, features):
        batch = self.collate(features)
        return batch if self.cut is None or not isinstance(batch, Mapping) else keep_pixel_share(batch, *self.cut)


def batch_to_device(batch: Mapping, device, non_blocking: bool = False) -> Mapping:
    """`batch` (a mapping of tensors) with its tensors on `device`, as a CP rank needs it: under CP the pixel values
    stay where they are, cut to this rank's share (`forward/host_pixels.py`; each rank copies its share to its
    device in the forward); with CP off, everything moves. For raw training loops — `batch = batch_to_device(batch,
    device)`: the whole batch's pixel values go once nothing else holds them —; the HF Trainer, TRL and Accelerate's
    data loaders do this by themselves."""
    batch = keep_this_ranks_share(batch)
    kept = _kept_on_host(batch) if cp_running() else {}
    moved = {key: value.to(device, non_blocking=non_blocking) if torch.is_tensor(value) and key not in kept else value
             for key, value in batch.items()}
    return type(batch)(moved) if not isinstance(batch, dict) else moved


def _without(batch: Mapping, kept: dict) -> Mapping:
    return type(batch)({k: v for k, v in batch.items() if k not in kept})


def cp_send_to_device(wrapped, instance, args, kwargs):
    batch = keep_this_ranks_share(args[0] if args else kwargs.pop("tensor"))
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
    if not REPLICA_VIEW.get():
        # inside TRL's RL trainers' replica view the Trainer prepares prompts for generate(), a pass without CP that
        # needs the pixel values whole (their training batches are built after it, and keep them whole)
        inputs = keep_this_ranks_share(inputs)
    kept = _kept_on_host(inputs)
    prepared = wrapped(_without(inputs, kept))
    prepared.update(kept)
    return prepared


def patches() -> list[Patch]:
    return [
        Patch(
            target="accelerate.data_loader.send_to_device",
            wrapper=cp_send_to_device,
            reason="under CP: a prepared data loader leaves the pixel values on the host, cut to this rank's share; "
            "each rank copies them to its device, in the forward",
            expects=("tensor", "device", "non_blocking"),
            requires="accelerate",
        ),
        Patch(
            target="transformers.trainer.Trainer._prepare_inputs",
            wrapper=cp_prepare_inputs,
            reason="under CP: the Trainer (and TRL's trainers) leave the pixel values on the host, cut to this rank's "
            "share; each rank copies them to its device, in the forward",
            expects=("inputs",),
            requires="transformers.trainer",
        ),
    ]
