"""Under CP a rank moves to its device only its share of a batch's pixel values, through each training stack: the HF
Trainer (DDP), TRL's SFTTrainer, a raw Accelerate loop and a raw loop with `vlmcp_patch.batch_to_device`. The same
stacks at P=1, the control, move every pixel tensor the collator produced."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers.harness import ROOT, launch

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)

SCRIPT = ROOT / "tests" / "helpers" / "device_moves_script.py"
STACKS = ["trainer", "trl_sft", "accelerate", "raw"]


def moves(cp_size: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="moves-")) / "moves.json"
    procs, launcher = (2, "torchrun") if cp_size > 1 else (1, "python")
    run = launch(SCRIPT, [out, *STACKS], procs=procs, launcher=launcher, env={"VLMCP_CP_SIZE": str(cp_size)},
                 timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _pixel_moves(stack: dict) -> tuple[set, list]:
    """(the collator's pixel tensors: storage and rows, the pixel-row tensors moved: storage and rows)."""
    produced = {tuple(p) for p in stack["produced"]}
    moved = [(ptr, shape[0]) for ptr, shape in stack["moved"] if len(shape) == 2 and shape[-1] == 96]
    return produced, moved


@pytest.mark.parametrize("stack", STACKS)
def test_each_rank_moves_only_its_share_of_the_pixels(stack, once):
    produced, moved = _pixel_moves(once(moves, 2)[stack])
    assert produced, "the collator produced pixel values"
    assert not set(moved) & produced, f"a whole batch's pixel values were moved to the device: {moved}"
    largest = max(rows for _, rows in produced)
    assert moved and all(rows < largest for _, rows in moved), "each rank copied its share itself"
    # The control: one process moves the collator's pixel tensors whole, as stock does.
    produced_p1, moved_p1 = _pixel_moves(once(moves, 1)[stack])
    assert set(moved_p1) & produced_p1
