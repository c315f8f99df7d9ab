"""The HF Trainer with DDP and DeepSpeed (gloo, CPU): a stock script plus `import vlmcp_patch` trains as at P=1.

Three launches of examples/hf_trainer_sft.py on the same global batches: one process at P=1; two
processes at CP=2 (one data-parallel replica); and, as a control, two processes of stock DDP at P=1,
which must shard the data (its weights differ) — otherwise the CP parity would prove nothing.
SGD keeps the comparison about gradients: Adam turns rounding noise in near-zero gradient elements
into full +-lr steps.
"""

from __future__ import annotations

import contextlib
import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.harness import ROOT, launch, weight_error

SCRIPT = ROOT / "examples" / "hf_trainer_sft.py"
COMMON = ["--steps", "3", "--grad-accum", "2", "--batch-size", "2", "--optim", "sgd", "--lr", "0.05"]


def _launch(tmp: Path, name: str, procs: int, cp_size: int, model: str, extra=(), launcher=None):
    launcher = launcher or ("python" if procs == 1 and "--deepspeed" not in extra else "torchrun")
    files = ["--save-weights", tmp / f"{name}.pt", "--save-logs", tmp / f"{name}.json"]
    args = ["--model", model, "--output-dir", tmp / name, *COMMON, *files, *extra]
    out = launch(SCRIPT, args, procs=procs, launcher=launcher, env={"VLMCP_CP_SIZE": str(cp_size)})
    assert out.returncode == 0, out.stderr[-4000:]
    entries = json.loads((tmp / f"{name}.json").read_text())
    steps = [entry for entry in entries if "train_samples_per_second" not in entry]
    return torch.load(tmp / f"{name}.pt"), steps


def samples_trained(tmp: Path, name: str) -> float:
    """Samples in the run summary (samples per second x runtime): the Trainer's count of replicas at work."""
    summary = next(e for e in json.loads((tmp / f"{name}.json").read_text()) if "train_samples_per_second" in e)
    return summary["train_samples_per_second"] * summary["train_runtime"]


@functools.cache
def runs(model: str, tmp: str):
    tmp = Path(tmp)
    out = {
        "p1": _launch(tmp, "p1", 1, 1, model),
        "cp2": _launch(tmp, "cp2", 2, 2, model),
        "ddp2": _launch(tmp, "ddp2", 2, 1, model),
    }
    if model == "tiny-qwen3-vl":
        out["accelerate-launch"] = _launch(tmp, "acc", 2, 2, model, launcher="accelerate")
    return out



@pytest.mark.parametrize("model", ["tiny-qwen3-vl", "tiny-qwen3.5"])
def test_trainer_ddp_cp2_equals_p1(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(model)
    r = runs(model, str(tmp))
    (w1, log1), (wd, _) = r["p1"], r["ddp2"]
    assert weight_error(wd, w1) > 1e-2, "stock DDP on two processes did not shard the data"
    for w2, log2 in [r[name] for name in ("cp2", "accelerate-launch") if name in r]:
        _check_same_training(w1, log1, w2, log2)
    # The Trainer's own counts: 3 steps x accumulation 2 x batch 2 samples, and the same tokens, as at P=1.
    assert round(samples_trained(tmp, "p1")) == round(samples_trained(tmp, "cp2")) == 12
    assert [e["num_input_tokens_seen"] for e in log1] == [e["num_input_tokens_seen"] for e in r["cp2"][1]]


def _check_same_training(w1, log1, w2, log2):
    assert weight_error(w2, w1) <= 1e-4
    assert len(log1) == len(log2) == 3  # no evaluation in these runs
    for a, b in zip(log1, log2):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
        # VLMCPCallback's facts ride along with the Trainer's logs at CP=2 only.
        assert b["cp_size"] == 2 and b["cp_data_parallel_size"] == 1 and "cp_size" not in a
        assert b["cp_tokens_per_rank"] > 0 and 0 <= b["cp_padding"] < 1


def test_trainer_cp2_dp2_trains_and_evaluates_like_p1(tmp_path):
    """Four processes = 2 data-parallel replicas of CP=2, against one process accumulating both replicas'
    micro-batches: the same global batches, the same steps, the same evaluation loss and metrics."""
    replica = ["--batch-size", "1", "--eval-samples", "12"]
    w1, log1 = _launch(tmp_path, "one", 1, 1, "tiny-qwen3-vl", [*replica, "--grad-accum", "4"])
    w4, log4 = _launch(tmp_path, "four", 4, 2, "tiny-qwen3-vl", [*replica, "--grad-accum", "2"])
    assert weight_error(w4, w1) <= 1e-4
    train1, train4 = ([e for e in log if "loss" in e] for log in (log1, log4))
    assert len(train1) == len(train4) == 3
    for a, b in zip(train1, train4):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
    eval1, eval4 = ([e for e in log if "eval_loss" in e] for log in (log1, log4))
    assert len(eval1) == len(eval4) == 1
    assert abs(eval1[0]["eval_loss"] - eval4[0]["eval_loss"]) <= 1e-5 * abs(eval1[0]["eval_loss"])
    # compute_metrics sees whole rows (full logits) and every sample once (not once per CP rank).
    assert eval1[0]["eval_scored_tokens"] == eval4[0]["eval_scored_tokens"]
    one_token = 1 / eval1[0]["eval_scored_tokens"]  # an argmax near a tie may flip with rounding; garbage would not
    assert abs(eval1[0]["eval_accuracy"] - eval4[0]["eval_accuracy"]) <= one_token


def _deepspeed(stage: int) -> list[str]:
    return ["--deepspeed", str(ROOT / "examples" / f"ds_trainer_zero{stage}.json")]


@functools.cache
def deepspeed_runs(model: str, stage: int) -> dict:
    """P=1 on one process, CP=2 by VLMCP_CP_SIZE and CP=2 by Accelerate's own switch (sp_size=2)."""
    tmp, ds = Path(tempfile.mkdtemp()), _deepspeed(stage)
    return {
        "p1": _launch(tmp, "p1", 1, 1, model, ds),
        "cp2": _launch(tmp, "cp2", 2, 2, model, ds),
        "sp2": _launch(tmp, "sp2", 2, 1, model, [*ds, "--sp-size", "2"]),
    }


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model", ["tiny-qwen3-vl", "tiny-qwen3.5"])
def test_trainer_deepspeed_cp2_equals_p1(model, stage):
    """HF Trainer on DeepSpeed, set up on CPU the way accelerate sets it up on GPUs (see the example's
    `configure_cpu_deepspeed_state`): CP=2 from VLMCP_CP_SIZE and from
    `ParallelismConfig(sp_backend="deepspeed", sp_size=2)` both train like one process. For Qwen3.5
    stock accelerate refuses that switch (DeltaNet layers); for Qwen3-VL ALST fails on the batch."""
    pytest.importorskip("deepspeed")
    r = deepspeed_runs(model, stage)
    w1, log1 = r["p1"]
    assert any(entry["grad_norm"] > 1.0 for entry in log1), "gradient clipping (at 1.0) was never exercised"
    for name in ("cp2", "sp2"):
        w2, log2 = r[name]
        assert weight_error(w2, w1) <= 1e-4, name
        assert len(log1) == len(log2) == 3
        for a, b in zip(log1, log2):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), name
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), name
            assert b["cp_size"] == 2 and b["cp_data_parallel_size"] == 1, name


def test_trainer_deepspeed_stock_two_processes_shard_the_data(tmp_path):
    pytest.importorskip("deepspeed")
    w1, _ = deepspeed_runs("tiny-qwen3-vl", 2)["p1"]
    wd, _ = _launch(tmp_path, "ds2", 2, 1, "tiny-qwen3-vl", _deepspeed(2))
    assert weight_error(wd, w1) > 1e-2


def test_trainer_zero3_cp2_dp2_mixed_modality_equals_one_process(tmp_path):
    """Four processes = 2 replicas of CP=2 under ZeRO-3, where one replica's micro-batch is text-only
    while the other's has images (stock ZeRO-3 hangs there: the text-only ranks skip the vision tower's
    weight all-gathers). Placeholder vision passes keep them matched; the weights equal one process
    accumulating both replicas' micro-batches (ZeRO-2, which has no such collectives)."""
    pytest.importorskip("deepspeed")
    replica = ["--batch-size", "1"]
    w1, log1 = _launch(tmp_path, "one", 1, 1, "tiny-qwen3-vl", [*replica, "--grad-accum", "4", *_deepspeed(2)])
    w4, log4 = _launch(tmp_path, "four", 4, 2, "tiny-qwen3-vl", [*replica, "--grad-accum", "2", *_deepspeed(3)])
    assert sum(entry.get("cp_vision_placeholder_passes", 0) for entry in log4) > 0, "no mixed-modality step ran"
    assert weight_error(w4, w1) <= 1e-4
    for a, b in zip(log1, log4):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])


def test_trainer_checkpoints_under_cp_are_stock_and_resume_exactly(tmp_path):
    """CP=2 saves Trainer checkpoints in the unchanged format (stock `from_pretrained` loads them, and they
    hold the P=1 weights), and resuming one under CP continues as the uninterrupted P=1 run."""
    from transformers import Qwen3VLForConditionalGeneration

    common = ["--output-dir", str(tmp_path / "cp2"), "--save-steps", "2"]
    _launch(tmp_path, "cp2-first-two", 2, 2, "tiny-qwen3-vl", [*common, "--steps", "2"])
    w_resumed, log = _launch(tmp_path, "cp2-resumed", 2, 2, "tiny-qwen3-vl", [*common, "--steps", "3", "--resume"])
    w1_two, _ = _launch(tmp_path, "p1-two", 1, 1, "tiny-qwen3-vl", ["--steps", "2"])
    w1_three, log1 = _launch(tmp_path, "p1-three", 1, 1, "tiny-qwen3-vl", ["--steps", "3"])
    assert [entry["step"] for entry in log] == [1, 2, 3]  # steps 1-2 from the checkpoint's trainer state
    assert abs(log[2]["loss"] - log1[2]["loss"]) <= 1e-5 * abs(log1[2]["loss"])
    with vlmcp_disabled_patches():
        saved = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "cp2" / "checkpoint-2").state_dict()
    assert weight_error(saved, w1_two) <= 1e-4
    assert weight_error(w_resumed, w1_three) <= 1e-4


@contextlib.contextmanager
def vlmcp_disabled_patches():
    import vlmcp_patch

    vlmcp_patch.revert()
    try:
        yield
    finally:
        vlmcp_patch.apply()


def test_callback_rejects_bad_setups_before_training():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import vlmcp_patch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    vlmcp_patch.enable(cp_size=2)
    try:
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="eager"):
            vlmcp_patch.check_cp_setup(build_model(tiny_qwen3_vl_config(attn_implementation="eager")))
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="Qwen3VLForConditionalGeneration"):
            vlmcp_patch.check_cp_setup(Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                                   num_attention_heads=2, num_key_value_heads=1,
                                                                   intermediate_size=32, head_dim=8)))
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="3 query heads"):
            vlmcp_patch.check_cp_setup(build_model(tiny_qwen3_vl_config(num_attention_heads=3, num_key_value_heads=1)))
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="needs torch.distributed"):
            vlmcp_patch.check_cp_setup(build_model(tiny_qwen3_vl_config()))
    finally:
        vlmcp_patch.enable(cp_size=1)
