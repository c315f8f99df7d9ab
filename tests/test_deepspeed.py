"""Raw DeepSpeed (ZeRO-2 and ZeRO-3, gloo on CPU): a stock training loop plus `import vlmcp_patch`.

Launches of examples/deepspeed_train.py on the same global batches — one process at P=1 and two
processes at CP=2 — must give the same per-step loss and (clipped) gradient norm, and trained weights
equal within 1e-4 after three optimizer steps with gradient accumulation (ZeRO-2 under torchrun, ZeRO-3
under the deepspeed launcher; the HF Trainer tests cover the other stages). A control run of stock
DeepSpeed on two processes shows the data really is sharded there (its weights differ).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import ROOT, launch
from vlmcp_patch.fixtures.compare import state_dict_error

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)

pytest.importorskip("deepspeed")

SCRIPT = ROOT / "examples" / "deepspeed_train.py"


def train(model: str, stage: int, procs: int, cp_size: int, launcher="torchrun") -> tuple[dict, list]:
    tmp = Path(tempfile.mkdtemp())
    args = ["--deepspeed", ROOT / "examples" / f"ds_zero{stage}.json", "--model", model,
            "--save-weights", tmp / "w.pt", "--save-logs", tmp / "log.json"]
    out = launch(SCRIPT, args, procs=procs, launcher=launcher, env={"VLMCP_CP_SIZE": str(cp_size)}, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp / "w.pt"), json.loads((tmp / "log.json").read_text())



@pytest.mark.parametrize("model,stage,launcher", [("tiny-qwen3-vl", 2, "torchrun"), ("tiny-qwen3.5", 3, "deepspeed")])
def test_deepspeed_cp2_equals_p1(model, stage, launcher, once):
    """CP=2 under torchrun, and under the deepspeed launcher (it adds --local_rank; VLMCP_CP_SIZE rides in the
    environment), against one process."""
    (w1, log1), (w2, log2) = once(train, model, stage, 1, 1), once(train, model, stage, 2, 2, launcher)
    assert state_dict_error(w2, w1) <= 1e-4
    assert len(log1) == len(log2) == 3
    for a, b in zip(log1, log2):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
    assert any(entry["grad_norm"] > 1.0 for entry in log1), "gradient clipping (at 1.0) was never exercised"


def test_stock_deepspeed_on_two_processes_shards_the_data(once):
    (w1, _), (wd, _) = once(train, "tiny-qwen3-vl", 2, 1, 1), once(train, "tiny-qwen3-vl", 2, 2, 1)
    assert state_dict_error(wd, w1) > 1e-2
