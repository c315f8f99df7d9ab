"""TRL's SFTTrainer (DDP, gloo, CPU): a stock TRL script plus `import vlmcp_patch` trains exactly as at P=1.

Three launches of examples/trl_sft.py on the same global batches (a conversational image-text data set,
SFTTrainer's own vision collator over a stock-logic Qwen3-VL processor): one process at P=1; two
processes at CP=2 (one data-parallel replica); and, as a control, two processes of stock DDP at P=1,
which must shard the data (its weights differ). SGD, as in test_trainer.py: Adam turns rounding noise in
near-zero gradient elements into full +-lr steps.

SFTTrainer scores tokens with TRL's fused LM head (`add_fused_lm_head`): `model(..., fused_lm_head=True)`
runs the backbone (`model.model`) directly, past the patched top-level forward, and computes the loss,
entropy and token accuracy itself — see vlmcp_patch/integrations/trl.py.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import ROOT, launch
from vlmcp_patch.fixtures.compare import state_dict_error

SCRIPT = ROOT / "examples" / "trl_sft.py"
COMMON = ["--steps", "3", "--grad-accum", "2", "--batch-size", "2", "--optim", "sgd", "--lr", "0.05"]


def _launch(tmp: Path, name: str, procs: int, cp_size: int, extra=()) -> tuple[dict, list, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    files = ["--save-weights", tmp / f"{name}.pt", "--save-logs", tmp / f"{name}.json"]
    args = ["--output-dir", tmp / name, *COMMON, *files, *extra]
    out = launch(SCRIPT, args, procs=procs, launcher="python" if procs == 1 else "torchrun",
                 env={"VLMCP_CP_SIZE": str(cp_size)})
    assert out.returncode == 0, out.stderr[-4000:]
    entries = json.loads((tmp / f"{name}.json").read_text())
    wrapper = next(e["wrapper"] for e in entries if "wrapper" in e)
    return torch.load(tmp / f"{name}.pt"), [e for e in entries if "loss" in e], wrapper


RUNS = {"p1": (1, 1, ()), "cp2": (2, 2, ()), "ddp2": (2, 1, ()), "fsdp-cp2": (2, 2, ("--fsdp",)),
        "p1-nll": (1, 1, ("--loss-type", "nll")), "cp2-nll": (2, 2, ("--loss-type", "nll"))}


def sft_run(name: str):
    """(trained weights, per-step logs, what wrapped the model) of one launch of RUNS."""
    procs, cp_size, extra = RUNS[name]
    return _launch(Path(tempfile.mkdtemp(prefix=f"trl-{name}-")), name, procs, cp_size, extra)


def _assert_same_training(run, reference):
    (w1, log1, _), (w2, log2, _) = reference, run
    assert state_dict_error(w2, w1) <= 1e-4
    assert len(log1) == len(log2) == 3
    for a, b in zip(log1, log2):
        for key in ("loss", "entropy", "mean_token_accuracy"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
        assert a["num_tokens"] == b["num_tokens"]
        # VLMCPCallback's facts ride along at CP=2 only; tokens per rank > 0: the CP forward ran.
        assert b["cp_size"] == 2 and b["cp_data_parallel_size"] == 1 and "cp_size" not in a
        assert b["cp_tokens_per_rank"] > 0


@pytest.mark.parametrize("wrapper", ["DDP", pytest.param("FSDP2", marks=pytest.mark.integration)])
def test_sft_trainer_cp2_equals_p1(wrapper, once):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    run = once(sft_run, "cp2" if wrapper == "DDP" else "fsdp-cp2")
    assert run[2] == wrapper
    _assert_same_training(run, once(sft_run, "p1"))


@pytest.mark.extended
def test_sft_trainer_with_the_nll_loss_cp2_equals_p1(once):
    """SFTConfig(loss_type="nll"): on TRL 1.4 to 1.14 the loss through the model's forward, the one CP runs there (their
    chunked loss, the default, is refused under CP: test_integration_releases.py); on 1.15+ the fused head as ever."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    _assert_same_training(once(sft_run, "cp2-nll"), once(sft_run, "p1-nll"))


@pytest.mark.integration
def test_stock_sft_trainer_on_two_processes_shards_the_data(once):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    (w1, log1, _), (wd, logd, _) = once(sft_run, "p1"), once(sft_run, "ddp2")
    assert state_dict_error(wd, w1) > 1e-2, "stock DDP on two processes did not shard the data"
    # The control's token count covers both replicas' batches: twice P=1's micro-batches per step.
    assert logd[0]["num_tokens"] != log1[0]["num_tokens"]


@pytest.mark.extended
def test_sft_trainer_cp2_bf16_mixed_precision(tmp_path):
    """bf16 is SFTConfig's default on GPUs: Accelerate's autocast then rebinds `model.forward.__func__`, and the
    CP forward must survive that (a proxy around TRL's method would be dropped and the backbone call fail)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    bf16 = ["--bf16", "--steps", "2"]
    _, log1, _ = _launch(tmp_path, "p1", 1, 1, bf16)
    _, log2, _ = _launch(tmp_path, "cp2", 2, 2, bf16)
    assert len(log1) == len(log2) == 2
    for a, b in zip(log1, log2):  # bf16 rounding differs between the layouts: loose
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(a["loss"])
        assert b["cp_size"] == 2 and b["cp_tokens_per_rank"] > 0
