"""`ShareDecoding` given a video as the user has it (`vlmcp_patch/video_share.py`): a path to an encoded file (H.264
with and without B-frames, MPEG-4, odd sizes, frame rates the sampling rate does not divide, a last temporal group of
one frame, a video shorter than one group), an array, a tensor, a list of PIL frames. Against the processor's own
output: the whole batch with no cut, each rank's rows at P = 2 and 4 (only its groups' frames decoded), one training
step at P = 2 and 4 (loss and every gradient summed over the group) against stock at P=1; a hand-built `VideoItem`
whose grid the processor's rule contradicts raises.

These need torchvision and PyAV (the main environment's '+cpu' torch has no torchvision that imports): they skip
there, and run in `.venv-video` (tests/helpers/video_files.VIDEO_VENV)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.helpers import video_files as vf
from tests.helpers.harness import run_distributed
from vlmcp_patch.forward.arguments import SHARE_RECORDS
from vlmcp_patch.forward.host_pixels import RANK, SIZE, START, STOP, WHOLE


def _missing() -> str | None:
    """Why not here, checked without importing a torchvision that may break the process ('+cpu' torch)."""
    if importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("av") is None:
        return f"{vf.VIDEO_VENV} (torchvision or av not installed)"
    probe = subprocess.run([sys.executable, "-c", "from torchvision.transforms.v2 import functional; import av"],
                           check=False, capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{vf.VIDEO_VENV} (torchvision does not import: {probe.stderr[-200:]})"


MISSING = _missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"video tests {MISSING}")

TEXT = ["see <|vision_start|><|video_pad|><|vision_end|> then"]
TWO = ["a <|vision_start|><|video_pad|><|vision_end|> b <|vision_start|><|video_pad|><|vision_end|> c"]
PIXELS = "pixel_values_videos"


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return vf.videos(tmp_path_factory.mktemp("videos"))


class Reads:
    """The PyAV readers `ShareDecoding` opens, kept to count what each decoded."""

    def __init__(self, monkeypatch):
        from vlmcp_patch import video_share

        self.readers = []
        real = video_share.PyAVFrames

        class Counted(real):
            def __init__(inner, path):
                super().__init__(path)
                self.readers.append(inner)

        monkeypatch.setattr(video_share, "PyAVFrames", Counted)


def _equal(ours, stock):
    assert sorted(ours) == sorted(stock)
    for key in stock:
        assert torch.equal(ours[key], stock[key]), key


@pytest.mark.parametrize("name", ["odd", "mpeg4", "b_frames", "short"])
def test_a_video_path_gives_the_processors_own_batch(videos, name):
    from vlmcp_patch.share_decode import ShareDecoding

    processor = vf.processor()
    _equal(ShareDecoding(processor)(text=TEXT, videos=[videos[name]]), vf.stock(processor, TEXT, [videos[name]]))


@pytest.mark.parametrize("form", ["array", "tensor_channels_first", "pil_frames", "two_paths"])
def test_every_video_form_the_processor_takes_gives_its_own_batch(videos, form):
    import numpy as np
    from PIL import Image

    from vlmcp_patch.share_decode import ShareDecoding

    processor = vf.processor()
    frames = np.stack([vf.frame_pixels(i, 29, 17, 3) for i in range(37)])
    given, text = {
        "array": ([frames], TEXT),
        "tensor_channels_first": ([torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()], TEXT),
        "pil_frames": ([[Image.fromarray(f) for f in frames]], TEXT),
        "two_paths": ([videos["odd"], videos["mpeg4"]], TWO),
    }[form]
    stock = vf.stock(processor, text, given)
    _equal(ShareDecoding(processor)(text=text, videos=given), stock)


# (size, the row's two videos, their sampled frames, their frames): rows that split into `size` equal shares.
SHARES = [(2, ("odd", "b_frames"), (15, 11), 53 + 41), (4, ("odd", "mpeg4"), (15, 16), 53 + 40)]


@pytest.mark.parametrize("size, names, sampled_frames, frames", SHARES)
def test_each_rank_decodes_its_groups_frames_only_and_gets_the_processors_rows(videos, size, names, sampled_frames,
                                                                               frames, monkeypatch):
    from vlmcp_patch.share_decode import ShareDecoding

    processor = vf.processor()
    paths = [videos[name] for name in names]
    stock = vf.stock(processor, TWO, paths)
    grid = stock["video_grid_thw"].tolist()
    whole = stock[PIXELS].shape[0]
    covered = torch.zeros(whole, dtype=torch.bool)
    kept_total = 0
    for rank in range(size):
        reads = Reads(monkeypatch)
        batch = ShareDecoding(processor, size=size, rank=rank, groups_per_call=2)(text=TWO, videos=paths)
        for key in set(stock) - {PIXELS}:  # mm_token_type_ids where the release returns them
            assert torch.equal(batch[key], stock[key]), key
        record = batch[SHARE_RECORDS[PIXELS]]
        start, stop = int(record[START]), int(record[STOP])
        assert [int(record[SIZE]), int(record[RANK]), int(record[WHOLE])] == [size, rank, whole]
        assert torch.equal(batch[PIXELS], stock[PIXELS][start:stop])
        covered[start:stop] = True
        # this rank's sampled frames: those of its temporal groups (the last group of `odd` holds one frame)
        mine, offset = 0, 0
        for (t, h, w), sampled in zip(grid, sampled_frames):
            groups = range(max(start - offset, 0) // (h * w), min(stop - offset, t * h * w) // (h * w))
            mine += sum(min(2, sampled - 2 * g) for g in groups if 0 <= g < t)
            offset += t * h * w
        kept = sum(r.kept for r in reads.readers)
        assert kept == mine, (rank, kept, mine)
        assert sum(r.decoded for r in reads.readers) < frames, [r.decoded for r in reads.readers]
        kept_total += kept
    assert bool(covered.all()) and kept_total == sum(sampled_frames)


def test_a_video_shorter_than_one_temporal_group_does_as_the_processor(videos):
    """One frame: 5.25's size rule refuses it (the same error here); earlier releases pad it to one group (the same
    batch here)."""
    from vlmcp_patch.share_decode import ShareDecoding

    processor = vf.processor()
    try:
        stock = vf.stock(processor, TEXT, [videos["single"]])
    except ValueError as error:
        with pytest.raises(ValueError) as ours:
            ShareDecoding(processor, size=2, rank=1)(text=TEXT, videos=[videos["single"]])
        assert str(ours.value) == str(error)
    else:
        _equal(ShareDecoding(processor)(text=TEXT, videos=[videos["single"]]), stock)


def test_a_video_item_whose_grid_the_processor_contradicts_raises():
    from tests.helpers import share_decode_cases as cases
    from vlmcp_patch.share_decode import ShareDecoding, VideoItem

    given = cases.video_item(cases.Decodes())
    text = ["<|vision_start|><|video_pad|><|vision_end|>"]
    ShareDecoding(cases.processor_with_videos(), size=2, rank=0)(text=text, videos=[given])  # as the processor: runs
    short = VideoItem((given.grid[0] - 1, *given.grid[1:]), given.rows, given.key, given.metadata)
    with pytest.raises(ValueError, match=r"grid \(7, 4, 4\) is not the \(8, 4, 4\)"):
        ShareDecoding(cases.processor_with_videos(), size=2, rank=0)(text=text, videos=[short])


@pytest.mark.parametrize("video", [{"path": "video.mp4"}, 42, b"bytes"])
def test_a_video_it_cannot_take_is_refused_saying_what_to_pass(video):
    from vlmcp_patch.share_decode import ShareDecoding

    with pytest.raises(TypeError, match="pass a path to a video file, a 4D array"):
        ShareDecoding(vf.processor())(text=TEXT, videos=[video])


def run_video_paths(rank: int, world_size: int) -> dict:
    """One training step under CP on a row of two video files given as paths (each rank decodes its groups), against
    stock at P=1 on the processor's whole batch (the patches reverted)."""
    import tempfile
    from pathlib import Path

    import vlmcp_patch
    from tests.helpers.share_decode_cases import _step
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.share_decode import ShareDecoding

    files = vf.videos(Path(tempfile.gettempdir()) / "vlmcp-video-files", ["odd", "mpeg4"])
    paths = [files["odd"], files["mpeg4"]]
    processor = vf.processor()

    def labelled(batch):
        batch = dict(batch)
        batch["labels"] = batch["input_ids"].masked_fill(batch["mm_token_type_ids"] != 0, -100)
        return batch

    vlmcp_patch.enable(cp_size=world_size)
    model = build_model(tiny_qwen3_vl_config(), seed=3)
    model.train()
    whole = labelled(vf.stock(processor, TWO, paths, return_mm_token_type_ids=True))
    vlmcp_patch.revert()
    try:
        ref_loss, ref_grads = _step(model, whole)
    finally:
        vlmcp_patch.apply()
    batch = labelled(ShareDecoding(processor)(text=TWO, videos=paths, return_mm_token_type_ids=True))
    loss, grads = _step(model, batch)
    worst, _ = gradient_errors(summed_over_group(grads, get_cp_group().group), ref_grads)
    return {"loss_error": rel_err(torch.tensor(loss), torch.tensor(ref_loss)), "grad_error": max(worst.values()),
            "same_params": sorted(grads) == sorted(ref_grads), "rows": batch[PIXELS].shape[0],
            "whole_rows": whole[PIXELS].shape[0], "recorded": SHARE_RECORDS[PIXELS] in batch}


@pytest.mark.parametrize("size", [2, 4])
def test_video_files_as_paths_train_as_stock_p1(size):
    results = run_distributed(run_video_paths, size, timeout=300)
    for rank, r in enumerate(results):
        assert r["same_params"] and r["recorded"], (rank, r)
        assert r["loss_error"] <= 1e-5 and r["grad_error"] <= 1e-5, (rank, r)
        assert r["rows"] * size == r["whole_rows"], r
