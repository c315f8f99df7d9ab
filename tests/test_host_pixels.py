"""Pixel values at 1/P on the host (`vlmcp_patch/forward/host_pixels.py`): under CP each rank keeps only the pixel
rows it encodes once the batch reaches the forward — through a raw loop (`batch_to_device`), Accelerate's prepared
data loaders and the HF Trainer — measured as the bytes of every pixel storage alive in the rank's process while the
vision tower runs, against the batch's: at most whole / P plus one unit of the share by items per modality. Loss
and gradients equal stock P=1; different pixels on the ranks, a share cut for another rank and a cut batch in a
pass without CP raise on every rank before compute. The control keeps the whole batch's pixel values (the cut
switched off, as the package did before), and is over the bound."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import ROOT, launch, run_distributed
from tests.helpers.host_pixel_cases import FOUR_IMAGES, TOL, VIDEO_AND_IMAGES, run_default_cases, run_raw_loop
from vlmcp_patch.fixtures.compare import gradient_errors
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch

SCRIPT = ROOT / "tests" / "helpers" / "host_pixels_script.py"
STACKS = ["raw", "accelerate", "trainer"]


# ---------------------------------------------------------------------------------------------------------
# The cut, in one process


def test_the_cut_keeps_this_ranks_rows_in_a_new_tensor_and_the_whole_fingerprint():
    from vlmcp_patch.forward.agreement import tensor_fingerprint
    from vlmcp_patch.forward.arguments import SHARE_RECORDS
    from vlmcp_patch.forward.host_pixels import FINGERPRINT, START, STOP, WHOLE, keep_pixel_share

    batch = make_batch(FOUR_IMAGES, seed=7)
    pixels = batch["pixel_values"]
    rows = pixels.shape[0]
    for rank in range(2):
        cut = keep_pixel_share(batch, 2, rank)
        share, record = cut["pixel_values"], cut[SHARE_RECORDS["pixel_values"]]
        start, stop = rank * rows // 2, (rank + 1) * rows // 2  # four equal images: two per rank
        assert torch.equal(share, pixels[start:stop])
        assert share.untyped_storage().nbytes() == share.numel() * share.element_size()  # no view of the whole
        assert [int(record[i]) for i in (START, STOP, WHOLE)] == [start, stop, rows]
        assert record[FINGERPRINT:].tolist() == tensor_fingerprint(pixels)
        assert cut["image_grid_thw"] is batch["image_grid_thw"] and cut["input_ids"] is batch["input_ids"]
    assert keep_pixel_share(cut, 2, 0) is cut  # cut once


def test_items_that_do_not_balance_keep_the_whole_pixel_values():
    """One large image beside a small one: the forward shares them by patches, whose rows depend on the tower."""
    from vlmcp_patch.forward.host_pixels import keep_pixel_share

    batch = make_batch([[S(text=4), S(image=(64, 64)), S(text=3), S(image=(16, 16)), S(text=2)]], seed=3)
    assert keep_pixel_share(batch, 2, 1) is batch


def test_with_cp_off_batch_to_device_moves_the_pixel_values_untouched():
    import vlmcp_patch

    batch = make_batch(FOUR_IMAGES, seed=7)
    moved = vlmcp_patch.batch_to_device(batch, torch.device("cpu"))
    assert moved["pixel_values"] is batch["pixel_values"] and set(moved) == set(batch)


# ---------------------------------------------------------------------------------------------------------
# Under CP, gloo: a raw loop in spawned ranks


def _check_raw_loop(ranks: list[dict], cp_size: int) -> None:
    for rank in ranks:
        assert rank["same_params"] and rank["loss_error"] <= TOL and rank["grad_error"] <= TOL, rank
        assert rank["alive"] <= rank["bound"] < rank["whole"], rank
        assert rank["held_rows"] * cp_size == rank["rows"], rank


def test_a_raw_loop_holds_its_share_of_the_pixel_values_and_the_control_the_whole(once):
    ranks = once(run_distributed, run_default_cases, 2)
    _check_raw_loop([r["cut"] for r in ranks], 2)
    for rank in (r["whole"] for r in ranks):  # the control: the package before the cut
        assert rank["alive"] == rank["whole"] > rank["bound"] and rank["held_rows"] == rank["rows"], rank
        assert rank["loss_error"] <= TOL and rank["grad_error"] <= TOL, rank


def test_pixels_a_rank_cannot_use_raise_on_every_rank_before_compute(once):
    first, second = (r["refusals"] for r in once(run_distributed, run_default_cases, 2))
    # rank 1 changed a row only rank 0 keeps: the whole tensors' fingerprints still differ
    assert first["differing"] == second["differing"] and "pixel_values differ between the ranks" in first["differing"]
    assert "cut for CP rank 0 of 2, and this is rank 1 of 2" in second["cut_for_rank_0"]
    assert first["cut_for_rank_0"].startswith("CPInputError: CP rank(s) [1] of this group rejected the batch")
    for rank in (first, second):
        assert "a pass without CP (generate(), disabled()) needs them whole" in rank["without_cp"]
        assert rank["then"] is None  # the group runs on


def test_a_call_that_left_the_record_behind_takes_its_batchs_or_raises_on_every_rank(once):
    """A call built from chosen keys of a cut batch (TRL < 1.16's DPOTrainer): alone, refused by name on every rank;
    inside `CARRIED_BATCH` it runs as with its record, whether it holds the share, a copy of it or the whole pixel
    values, and another rank's rows of the same shape are refused."""
    ranks = [r["carried"] for r in once(run_distributed, run_default_cases, 2)]
    for rank in ranks:
        assert "hold 32 of the 64 rows image_grid_thw asks for, as many as this rank's share" in rank["alone"], rank
        assert "'vlmcp_pixel_values_share'" in rank["alone"] and "left it behind" in rank["other_rows"], rank
        for name in ("itself", "copy", "whole"):
            assert abs(rank[name] - rank["with_record"]) <= TOL * abs(rank["with_record"]), (name, rank)
    assert len({rank["with_record"] for rank in ranks}) == 1


@pytest.mark.integration
@pytest.mark.parametrize("cp_size, layout, tiles, family", [
    (4, FOUR_IMAGES, "auto", "qwen3_vl"),
    (4, VIDEO_AND_IMAGES, "auto", "qwen3_5"),
    (2, FOUR_IMAGES, 16, "qwen3_vl"),
], ids=["p4-images", "p4-video-qwen3.5", "p2-tower-in-tiles"])
def test_a_raw_loop_holds_its_share(cp_size, layout, tiles, family):
    """At P=4 each rank keeps one image, or two images and two of a video's temporal groups (Qwen3.5). At P=2 with
    the tower in tiles (one per image: two per rank) and gradient checkpointing, each tile's rows come from the cut
    share, forward and recompute."""
    ranks = run_distributed(run_raw_loop, cp_size, layout, True, tiles, family, timeout=400)
    _check_raw_loop(ranks, cp_size)
    tiled = [rank["tiles"]["forward_tiles"] > 0 and rank["tiles"]["backward_tiles"] > 0 for rank in ranks]
    assert tiled == [tiles != "auto"] * cp_size, [rank["tiles"] for rank in ranks]


# ---------------------------------------------------------------------------------------------------------
# Through the training stacks, launched


def _launched(cp_size: int) -> Path:
    out = Path(tempfile.mkdtemp(prefix="host-pixels-"))
    procs, launcher = (cp_size, "torchrun") if cp_size > 1 else (1, "python")
    run = launch(SCRIPT, [out, *STACKS, "accelerate_prefetch"], procs=procs, launcher=launcher, env={"VLMCP_CP_SIZE": str(cp_size)},
                 timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.integration
def test_a_prefetched_batch_is_cut_as_it_is_collated(once):
    """Accelerate's loader holds the next micro-batch while one runs: both hold this rank's share only (cut by the
    collator's wrapper, not only when `send_to_device` hands the batch over), so two batches' bound."""
    cut, stock = once(_launched, 2), once(_launched, 1)
    for rank in range(2):
        held = json.loads((cut / f"accelerate_prefetch.rank{rank}.json").read_text())
        assert held["alive"] <= 2 * held["bound"] < held["whole"] * (1 + 1 / 2), held  # prefetched whole: 1.5 x
    whole = json.loads((stock / "accelerate_prefetch.rank0.json").read_text())
    assert whole["alive"] >= 2 * whole["whole"], whole


@pytest.mark.integration
@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_holds_its_share_of_the_pixel_values_and_steps_as_p1(stack, once):
    cut, stock = once(_launched, 2), once(_launched, 1)
    for rank in range(2):
        held = json.loads((cut / f"{stack}.rank{rank}.json").read_text())
        assert held["alive"] <= held["bound"] < held["whole"], held
    whole = json.loads((stock / f"{stack}.rank0.json").read_text())
    assert whole["alive"] >= whole["whole"], whole  # the control: one process holds the batch's pixel values
    grads, reference = torch.load(cut / f"{stack}.pt"), torch.load(stock / f"{stack}.pt")
    assert sorted(grads) == sorted(reference)
    assert max(gradient_errors(grads, reference)[0].values()) <= TOL
