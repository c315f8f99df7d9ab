"""The per-rank decode (`vlmcp_patch/share_decode.py`) inside a CP group: each rank builds its batch with
`ShareDecoding`, decoding only its images and video groups, and trains on it; stock at P=1 trains on the processor's
whole batch.

The row: text, a video of eight temporal groups and four equal images (each modality's share by items balances at
P = 2 and 4). The video is a `VideoItem` whose groups are drawn with PIL and processed by the real image processor
(one picture per temporal group, the tiny tower's convention, as `fixtures.data` builds videos); the tokens are the
stock Qwen3-VL processor's expansion (timestamps included), over the tiny tokenizer. Every decode is counted.
"""

from __future__ import annotations

import torch

from vlmcp_patch.fixtures.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, image_processor, make_image
from vlmcp_patch.fixtures.processor import tiny_processor

TOL = 1e-5
TEXT = ["Look: <|vision_start|><|video_pad|><|vision_end|> then <|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|image_pad|><|vision_end|>, <|vision_start|><|image_pad|><|vision_end|>, "
        "<|vision_start|><|image_pad|><|vision_end|>. Done."]
GROUPS = 8
PIXEL_WIDTH = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE**2  # values per pixel row of the tiny towers


def processor_with_videos():
    """The stock Qwen3-VL processor logic with the real Qwen3-VL video processor as its video processor. Built the
    processor way it needs torchvision, which this machine lacks; the video processor is constructed without it and
    set on the tiny processor (only its settings and the stock text expansion are used: `ShareDecoding` never asks
    it for pixels)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    processor = tiny_processor()
    # Bounds under which the row's video (16 frames of 16 x 16) keeps its size: `ShareDecoding` checks a `VideoItem`'s
    # grid against the processor's rule where torchvision runs it.
    factor = PATCH_SIZE * MERGE_SIZE
    processor.video_processor = Qwen3VLVideoProcessor(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE,
                                                      temporal_patch_size=TEMPORAL_PATCH_SIZE,
                                                      size={"shortest_edge": 16 * factor * factor,
                                                            "longest_edge": 1024 * factor * factor})
    return processor


class Decodes:
    """What was decoded: video groups, and images by seed; with `measuring`, the most pixel-storage bytes alive in
    the process at any video decode (`host_pixel_cases.pixel_bytes_alive`), the call's new rows among them."""

    def __init__(self, measuring: bool = False):
        self.groups: list[int] = []
        self.images: list[int] = []
        self.measuring, self.most = measuring, 0
        # what the process held of such storages before this decode began (a test run's other objects)
        self.before = self._alive() if measuring else 0

    @staticmethod
    def _alive() -> int:
        from tests.helpers.host_pixel_cases import pixel_bytes_alive

        return pixel_bytes_alive(PIXEL_WIDTH)

    def measure(self) -> None:
        if self.measuring:
            self.most = max(self.most, self._alive())


def video_item(decodes: Decodes, key: str = "video-0", seed: int = 100):
    from transformers.video_utils import VideoMetadata

    from vlmcp_patch.share_decode import VideoItem

    pil = image_processor()

    def rows(first: int, count: int) -> torch.Tensor:
        decodes.groups.extend(range(first, first + count))
        part = torch.cat([pil(images=[make_image(16, 16, seed=seed + g)], return_tensors="pt")["pixel_values"]
                          for g in range(first, first + count)])
        decodes.measure()
        return part

    frames = TEMPORAL_PATCH_SIZE * GROUPS
    metadata = VideoMetadata(total_num_frames=frames, fps=2.0, width=16, height=16, frames_indices=list(range(frames)))
    return VideoItem(grid=(GROUPS, 16 // PATCH_SIZE, 16 // PATCH_SIZE), rows=rows, key=key, metadata=metadata)


def images(decodes: Decodes) -> list:
    """Four 16 x 16 pictures, written once as PNG files and opened lazily (`PIL.Image.open` reads the header). Their
    decodes are counted (`_count_decodes`: `ShareDecoding` decodes a lazily opened file from its name, never the
    caller's object)."""
    import os
    import tempfile
    from pathlib import Path

    from PIL import Image

    # One path per picture on every rank: the path is the image's key in the ranks' agreement.
    folder = Path(tempfile.gettempdir()) / f"vlmcp-share-decode-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    out = []
    for seed in range(4):
        path = folder / f"image-{seed}.png"
        if not path.exists():
            part = folder / f"image-{seed}.{os.getpid()}.png"
            make_image(16, 16, seed=seed).save(part)
            os.replace(part, path)
        out.append(Image.open(path))
        _COUNTERS[str(path)] = decodes
    _count_decodes()
    return out


# Which `Decodes` counts the decodes of each picture file: the last `images` call's (one row at a time per process).
_COUNTERS: dict[str, Decodes] = {}


def _count_decodes() -> None:
    """Counts, once installed in a process, each picture of `images` that `ShareDecoding` decodes (by its seed), in
    the `Decodes` of the last `images` call that opened it."""
    from vlmcp_patch import share_decode

    real = share_decode._decodable
    if getattr(real, "counted", False):
        return

    def decodable(image):
        name = str(getattr(image, "filename", "") or "")
        if name in _COUNTERS:
            _COUNTERS[name].images.append(int(name.rsplit("image-", 1)[1].split(".")[0]))
        return real(image)

    decodable.counted = True
    share_decode._decodable = decodable


def build(size: int | None = None, rank: int | None = None, key: str = "video-0", dtype=None,
          measuring: bool = False, groups_per_call: int = 16):
    """(batch with labels, decodes) of the row, decoded for (size, rank) (None: the running group's, or whole)."""
    from vlmcp_patch.share_decode import ShareDecoding

    decodes = Decodes(measuring)
    batch = dict(ShareDecoding(processor_with_videos(), size=size, rank=rank, dtype=dtype,
                               groups_per_call=groups_per_call)(
        text=TEXT, images=images(decodes), videos=[video_item(decodes, key)], return_mm_token_type_ids=True))
    batch["labels"] = batch["input_ids"].masked_fill(batch["mm_token_type_ids"] != 0, -100)
    return batch, decodes


def _step(model, batch: dict) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_decoded_share(rank: int, world_size: int) -> dict:
    """Under CP: this rank's batch from `ShareDecoding` (the running group's cut), one forward and backward; against
    stock at P=1 on the whole batch (the patches reverted). Returns the rows and decodes this rank made, the whole's,
    and the loss and gradient errors (the gradients summed over the group)."""
    import vlmcp_patch
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    vlmcp_patch.enable(cp_size=world_size)
    model = build_model(tiny_qwen3_vl_config(), seed=3)
    model.train()
    whole, _ = build(1, 0)
    vlmcp_patch.revert()
    try:
        ref_loss, ref_grads = _step(model, whole)
    finally:
        vlmcp_patch.apply()
    batch, decodes = build()
    loss, grads = _step(model, batch)
    worst, _ = gradient_errors(summed_over_group(grads, get_cp_group().group), ref_grads)
    return {"loss_error": rel_err(torch.tensor(loss), torch.tensor(ref_loss)), "grad_error": max(worst.values()),
            "same_params": sorted(grads) == sorted(ref_grads), "groups": decodes.groups, "images": decodes.images,
            "rows": {k: batch[k].shape[0] for k in ("pixel_values", "pixel_values_videos")},
            "whole_rows": {k: whole[k].shape[0] for k in ("pixel_values", "pixel_values_videos")}}


def run_other_recipes(rank: int, world_size: int) -> dict:
    """What each rank raises when rank 1 decoded its share of another video (same grid, another key), and what the
    same call with the same key then gives: the group still runs."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    vlmcp_patch.enable(cp_size=world_size)
    model = build_model(tiny_qwen3_vl_config(), seed=3)
    other, _ = build(key="video-1" if rank == 1 else "video-0")
    try:
        model(**other)
        error = None
    except Exception as raised:  # noqa: BLE001 - reported to the test
        error = f"{type(raised).__name__}: {raised}"
    same, _ = build()
    return {"error": error, "then": float(model(**same).loss)}


def run_pixel_dtype(rank: int, world_size: int) -> dict:
    """A bf16 model under CP: the loss and gradients with the share decoded in fp32 (the processor's) and in bf16 (the
    patch embedding's dtype): bit-identical, since the patch embedding casts its input to its weight's dtype first."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    vlmcp_patch.enable(cp_size=world_size)
    model = build_model(tiny_qwen3_vl_config(), seed=3, dtype=torch.bfloat16)
    model.train()
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        batch, _ = build(dtype=dtype)
        out[name] = (batch["pixel_values_videos"].dtype, *_step(model, batch))
    (_, loss32, grads32), (dtype16, loss16, grads16) = out["fp32"], out["bf16"]
    return {"dtype": str(dtype16), "same_loss": loss32 == loss16,
            "same_grads": grads32.keys() == grads16.keys() and all(torch.equal(grads32[n], grads16[n]) for n in grads32)}


def run_pickled(rank: int, world_size: int) -> dict:
    """The cut a `ShareDecoding` carries when pickled (as a DataLoader hands its collator to spawned workers) under a
    running CP group, and without one (`disabled()` is not a group's absence: CP off by setting)."""
    import pickle

    import vlmcp_patch
    from vlmcp_patch.share_decode import ShareDecoding

    vlmcp_patch.enable(cp_size=world_size)
    under_cp = pickle.loads(pickle.dumps(ShareDecoding(processor_with_videos()))).cut()
    vlmcp_patch.enable(host_pixel_shares=False)
    try:
        cut_off = pickle.loads(pickle.dumps(ShareDecoding(processor_with_videos()))).cut()
    finally:
        vlmcp_patch.enable(host_pixel_shares=True)
    return {"under_cp": under_cp, "cut_off": cut_off}


class RowCollator:
    """A data collator that builds the row with one `ShareDecoding` made in the training process (the running group's
    cut, resolved where it is called: in a DataLoader worker, or with the pickled collator)."""

    def __init__(self):
        from vlmcp_patch.share_decode import ShareDecoding

        self.decode = ShareDecoding(processor_with_videos())

    def __call__(self, features) -> dict:
        decodes = Decodes()
        return dict(self.decode(text=TEXT, images=images(decodes), videos=[video_item(decodes)]))
