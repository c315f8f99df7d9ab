"""Host pixel values at 1/P (`vlmcp_patch/forward/host_pixels.py`), measured inside the ranks: the bytes of every
pixel-value storage alive in the process while the vision tower runs (`PixelBytesProbe`), against the batch's whole
pixel values.

A pixel storage is the storage of any live CPU tensor, not a parameter, of the pixel rows' width — the batch's,
a compact share, a view of either — each storage counted once: what the process holds of the pixel values at that
moment, wherever the reference comes from (the caller's batch, a data loader's prefetched batch, the forward's
arguments). The tiny towers' pixel rows are 96 wide (3 channels x 2 frames x 4 x 4); nothing else in them is.
"""

from __future__ import annotations

import gc
import warnings

import torch

from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config
from vlmcp_patch.layout import VisionShare

# A video of eight temporal groups between two images beside text: at P=4 each rank encodes two groups (the video
# split into them) and the images two and two (each modality's share by items balances).
VIDEO_AND_IMAGES = [[S(text=4), S(image=(16, 16)), S(text=3), S(video=(8, 16, 16)), S(text=2), S(image=(16, 16)),
                     S(text=3), S(image=(16, 16)), S(text=2), S(image=(16, 16)), S(text=2)]]
# Four equal images in one row beside text: at P=2 each rank encodes two, at P=4 one (the share by items balances).
FOUR_IMAGES = [[S(text=5), S(image=(16, 16)), S(text=3), S(image=(16, 16)), S(text=2), S(image=(16, 16)), S(text=4),
                S(image=(16, 16)), S(text=3)]]
TOL = 1e-5


def pixel_width(model) -> int:
    vision = model.config.vision_config
    return vision.in_channels * vision.temporal_patch_size * vision.patch_size**2


def pixel_bytes_alive(width: int) -> int:
    """Bytes of the distinct storages of every live CPU floating tensor of `width` columns that is no parameter."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # some objects warn when asked for their class (deprecated module attributes)
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if (isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter) and obj.device.type == "cpu"
                and obj.is_floating_point() and obj.ndim == 2 and obj.shape[-1] == width and not obj.requires_grad):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class PixelBytesProbe:
    """The most pixel-storage bytes (`pixel_bytes_alive`) alive at any call of `model`'s vision tower."""

    def __init__(self, model):
        self.width, self.most = pixel_width(model), 0
        self.handle = model.model.visual.register_forward_pre_hook(self._measure)

    def _measure(self, module, args):
        self.most = max(self.most, pixel_bytes_alive(self.width))

    def remove(self) -> None:
        self.handle.remove()


def pixel_bound(batch: dict, cp_size: int) -> dict:
    """The batch's whole pixel bytes, and the bound a rank's host may hold: per modality, its whole / P plus its largest
    unit of the share by items (an image, a video, or one temporal patch group of a video split into them:
    `layout.VisionShare.of`), summed."""
    whole = bound = 0
    for pixels_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        pixels = batch.get(pixels_key)
        if pixels is None:
            continue
        row_bytes = pixels.shape[-1] * pixels.element_size()
        units = VisionShare.of(batch[grid_key].tolist(), 1, cp_size).units
        whole += pixels.shape[0] * row_bytes
        bound += pixels.shape[0] * row_bytes / cp_size + max(patches for _, patches, *_ in units) * row_bytes
    return {"whole": whole, "bound": bound}


def _model(checkpointing: bool = False, family: str = "qwen3_vl"):
    config = tiny_qwen3_vl_config() if family == "qwen3_vl" else tiny_qwen3_5_config()
    model = build_model(config, seed=3)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _row(layout, checkpointing: bool) -> dict:
    from tests.helpers.cases import masked_where_stock_cuts

    return masked_where_stock_cuts(make_batch(layout, seed=7), checkpointing)


def _step(model, batch: dict) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_raw_loop(rank: int, world_size: int, layout=FOUR_IMAGES, cut: bool = True, tiles: int | str = "auto",
                 family: str = "qwen3_vl") -> dict:
    """A raw loop under CP: `batch = vlmcp_patch.batch_to_device(batch, device)` on a freshly collated batch, then one
    forward and backward, the pixel bytes alive measured at the tower; against stock at P=1 on the same batch (the
    patches reverted). `cut`: the setting `host_pixel_shares` (off: the control, every rank keeps the whole batch's
    pixel values); `tiles`: `vision_tile_patches` (a number: the tower in tiles of that many patches, with gradient
    checkpointing, each tile's rows read from the cut share); `family`: the tiny model's. Returns the bytes, the
    bound, the pixel rows of the batch and those this rank held (images and videos), the tiles run, and the loss and
    gradient errors (the gradients summed over the group)."""
    import vlmcp_patch
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
    from vlmcp_patch.vision_tiles import VISION_TILES

    vlmcp_patch.enable(cp_size=world_size, host_pixel_shares=cut, vision_tile_patches=tiles)
    try:
        checkpointing = tiles != "auto"
        model = _model(checkpointing, family)
        facts = pixel_bound(_row(layout, checkpointing), world_size)
        vlmcp_patch.revert()
        try:
            ref_loss, ref_grads = _step(model, _row(layout, checkpointing))
        finally:
            vlmcp_patch.apply()
        probe = PixelBytesProbe(model)
        VISION_TILES.drain()
        batch = vlmcp_patch.batch_to_device(_row(layout, checkpointing), torch.device("cpu"))
        loss, grads = _step(model, batch)
        tiles_run = VISION_TILES.drain()
        probe.remove()
    finally:
        vlmcp_patch.enable(host_pixel_shares=True, vision_tile_patches="auto")
    worst, _ = gradient_errors(summed_over_group(grads, get_cp_group().group), ref_grads)
    return {**facts, "alive": probe.most, "loss_error": rel_err(torch.tensor(loss), torch.tensor(ref_loss)),
            "grad_error": max(worst.values()), "same_params": sorted(grads) == sorted(ref_grads),
            "tiles": tiles_run, "held_rows": _pixel_rows(batch), "rows": _pixel_rows(_row(layout, checkpointing))}


def _pixel_rows(batch: dict) -> int:
    return sum(batch[key].shape[0] for key in ("pixel_values", "pixel_values_videos") if key in batch)


def _error_of(call) -> str | None:
    """`type: message` of what `call()` raises (None: it returned)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"
    return None


def run_refusals(rank: int, world_size: int) -> dict:
    """What each rank raises, before compute, for cut pixel values it cannot use: pixels that differ between the ranks
    in rows only rank 0 keeps (rank 1 changes them before its cut), a batch every rank cut for rank 0, and a cut
    batch given to a pass without CP (`disabled()`). Then a good step, to show the group still runs."""
    import vlmcp_patch
    from vlmcp_patch.forward.host_pixels import keep_pixel_share

    vlmcp_patch.enable(cp_size=world_size)
    model = _model()

    def differing():
        batch = make_batch(FOUR_IMAGES, seed=7)
        if rank == 1:
            batch["pixel_values"][0] += 1  # row 0: rank 0's share
        model(**vlmcp_patch.batch_to_device(batch, torch.device("cpu")))

    def cut_for_rank_0():
        model(**keep_pixel_share(make_batch(FOUR_IMAGES, seed=7), world_size, 0))

    def without_cp():
        batch = vlmcp_patch.batch_to_device(make_batch(FOUR_IMAGES, seed=7), torch.device("cpu"))
        with vlmcp_patch.disabled():
            model(**batch)

    results = {name: _error_of(case) for name, case in
               (("differing", differing), ("cut_for_rank_0", cut_for_rank_0), ("without_cp", without_cp))}
    results["then"] = _error_of(lambda: model(**vlmcp_patch.batch_to_device(make_batch(FOUR_IMAGES, seed=7), "cpu")))
    return results


def run_carried(rank: int, world_size: int) -> dict:
    """A call built from chosen keys of a cut batch, its records left behind (as TRL < 1.16's DPOTrainer builds its
    calls): the error it meets alone, and inside `CARRIED_BATCH` (the batch it came from) the loss with the cut
    share itself, with a copy of it (a device move), with the whole pixel values, and the error with another rank's
    rows of the same shape; the loss of the batch with its records, for comparison."""
    import vlmcp_patch
    from vlmcp_patch.flags import CARRIED_BATCH, scoped
    from vlmcp_patch.forward.arguments import SHARE_RECORDS
    from vlmcp_patch.forward.host_pixels import keep_pixel_share

    vlmcp_patch.enable(cp_size=world_size)
    model = _model()
    batch = vlmcp_patch.batch_to_device(make_batch(FOUR_IMAGES, seed=7), torch.device("cpu"))
    picked = {k: v for k, v in batch.items() if k not in SHARE_RECORDS.values()}
    other = keep_pixel_share(make_batch(FOUR_IMAGES, seed=7), world_size, (rank + 1) % world_size)["pixel_values"]
    results = {"alone": _error_of(lambda: model(**picked)), "with_record": float(model(**batch).loss)}
    with scoped(CARRIED_BATCH, batch):
        for name, pixels in (("itself", picked["pixel_values"]), ("copy", picked["pixel_values"].clone()),
                             ("whole", make_batch(FOUR_IMAGES, seed=7)["pixel_values"])):
            results[name] = float(model(**{**picked, "pixel_values": pixels}).loss)
        results["other_rows"] = _error_of(lambda: model(**{**picked, "pixel_values": other}))
    return results


def run_default_cases(rank: int, world_size: int) -> dict:
    """The default tier's one launch: the raw loop with the cut and without it (the control), the refusals, and a
    call that left the records of the cut behind."""
    return {"cut": run_raw_loop(rank, world_size), "whole": run_raw_loop(rank, world_size, cut=False),
            "refusals": run_refusals(rank, world_size), "carried": run_carried(rank, world_size)}
