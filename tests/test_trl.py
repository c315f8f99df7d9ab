"""TRL's SFTTrainer (DDP, gloo, CPU): a stock TRL script plus `import vlmcp_patch` trains exactly as at P=1.

Three launches of examples/trl_sft.py on the same global batches (a conversational image-text data set,
SFTTrainer's own vision collator over a stock-logic Qwen3-VL processor): one process at P=1; two
processes at CP=2 (one data-parallel replica); and, as a control, two processes of stock DDP at P=1,
which must shard the data (its weights differ). SGD, as in test_trainer.py: Adam turns rounding noise in
near-zero gradient elements into full +-lr steps.

SFTTrainer scores tokens with TRL's fused LM head (`add_fused_lm_head`): `model(..., fused_lm_head=True)`
runs the backbone (`model.model`) directly, so the patched top-level forward never sees the call, and it
computes the loss, entropy and token accuracy itself. `_prototype_trl_patches` below shows what the package
needs for that; the launches go through it only while the package does not declare those patches itself.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "trl_sft.py"
COMMON = ["--steps", "3", "--grad-accum", "2", "--batch-size", "2", "--optim", "sgd", "--lr", "0.05"]
FUSED_TARGET = "trl.trainer.sft_trainer.add_fused_lm_head"
COMPUTE_LOSS_TARGET = "trl.trainer.sft_trainer.SFTTrainer.compute_loss"


# ---------------------------------------------------------------------------------------------
# Prototype of the package change (to move into vlmcp_patch/integrations/trl.py)


def cp_fused_lm_head_forward(model, fused, args, kwargs):
    """TRL's fused-LM-head forward of `model` (`fused`, the instance forward) under CP.

    The backbone runs like under the patched top-level forward (checks, context, vision and mRoPE on the
    full sequence, decoder on this rank's slice); the fused head scores this rank's slice against the
    labels shifted on the full sequence; the per-token outputs are gathered (the backward keeps this rank's
    slice), so every field and the loss are the P=1 ones on every rank of the group.
    """
    from vlmcp_patch.context import CPContext, bypassed
    from vlmcp_patch.distributed import SINGLE_RANK
    from vlmcp_patch.loss import IGNORE_INDEX, shifted_labels
    from vlmcp_patch.models.common import (
        _check_batch,
        _check_setup,
        _packed_layout,
        _pin_vision_to_sdpa,
        _prepare_packed_row,
        active_cp,
        agree_on_batch,
        call_arguments,
    )
    from vlmcp_patch.packing import text_positions_of
    from vlmcp_patch.stats import STATS

    if not kwargs.get("fused_lm_head") or bypassed():
        return fused(*args, **kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("fused_lm_head")
    call = call_arguments(fused, args, kwargs)
    starts, problem = _packed_layout(call)
    cp = active_cp()
    if cp is None:
        if starts is None and problem is None:  # P=1, not packed: exactly stock TRL
            return fused(*args, **kwargs, fused_lm_head=True, labels=labels, shift_labels=shift_labels,
                         num_items_in_batch=num_items_in_batch)
        cp = SINGLE_RANK  # P=1 packed row: per-sample mRoPE and boundaries, no exchanges
    problem = problem or _check_setup(model, cp, call) or _check_batch(model, call)
    agree_on_batch(cp, problem, call)
    _pin_vision_to_sdpa(model)
    if starts is not None:
        _prepare_packed_row(model, call, starts)
    reference = call["input_ids"] if call.get("input_ids") is not None else call["inputs_embeds"]
    ctx = CPContext.create(
        cp,
        batch_size=reference.shape[0],
        seq_len=reference.shape[1],
        device=reference.device,
        attention_mask=call.get("attention_mask"),
        text_position_ids=text_positions_of(call.get("position_ids")),
    )
    STATS.record(ctx)
    full = shift_labels if shift_labels is not None else shifted_labels(labels)
    local = ctx.shard(full.to(reference.device), dim=1, value=IGNORE_INDEX)
    with ctx.handed_to_decoder():  # TRL calls `model.model(...)`; its text decoder takes the context
        out = fused(**call, fused_lm_head=True, shift_labels=local)
    fields = {}
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask"):
        x = getattr(out, name)
        if x is not None:
            gathered = ctx.gather(x.to(torch.uint8) if x.dtype == torch.bool else x, dim=1)
            x = gathered.bool() if x.dtype == torch.bool else gathered
            # TRL scores positions 0..S-2 when it shifts itself; the last one has no label.
            x = x if shift_labels is not None else x[:, :-1]
        fields[name] = x
    count = fields["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return type(out)(loss=-fields["log_probs"].sum() / count, aux_loss=out.aux_loss, **fields)


def cp_add_fused_lm_head(wrapped, instance, args, kwargs):
    """After TRL installs its fused forward on the model instance, wrap that forward for CP.

    The wrapper is a plain method (not a wrapt proxy): Accelerate's mixed precision rebinds
    `model.forward.__func__`, which must be ours, not TRL's function behind a proxy.
    """
    import types

    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model"]
    fused = model.forward

    @functools.wraps(fused.__func__)  # keeps the signature TRL copies from the class forward
    def forward(self, *a, **kw):
        return cp_fused_lm_head_forward(self, fused, a, kw)

    model.forward = types.MethodType(forward, model)
    return result


def cp_sft_compute_loss(wrapped, instance, args, kwargs):
    """`num_tokens` sums the attention masks gathered from all W ranks: under CP the P ranks of a group hold
    the same micro-batch, so count it once per group."""
    from vlmcp_patch.integrations.accelerate import _cp_training
    from vlmcp_patch.settings import SETTINGS

    before = instance._total_train_tokens
    result = wrapped(*args, **kwargs)
    if _cp_training() and instance._total_train_tokens != before:
        instance._total_train_tokens = before + (instance._total_train_tokens - before) // SETTINGS.cp_size
        instance._metrics["train"]["num_tokens"] = [instance._total_train_tokens]
    return result


def package_has_trl_patches() -> bool:
    import vlmcp_patch

    targets = {entry["target"] for entry in vlmcp_patch.status()}
    return FUSED_TARGET in targets


def _prototype_trl_patches() -> None:
    """Install the prototype on the imported TRL (what the package's declared patches would do)."""
    import trl.trainer.sft_trainer as sft
    import wrapt

    sft.add_fused_lm_head = wrapt.FunctionWrapper(sft.add_fused_lm_head, cp_add_fused_lm_head)
    sft.SFTTrainer.compute_loss = wrapt.FunctionWrapper(sft.SFTTrainer.compute_loss, cp_sft_compute_loss)


# ---------------------------------------------------------------------------------------------
# The test


def _launch(tmp: Path, name: str, procs: int, cp_size: int, extra=()) -> tuple[dict, list]:
    from tests.harness import free_port

    env = {**os.environ, "VLMCP_CP_SIZE": str(cp_size), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port", str(free_port()),
    ]
    # Until the package declares the TRL patches, run the example through this file's prototype.
    script = SCRIPT if package_has_trl_patches() else Path(__file__)
    files = ["--save-weights", str(tmp / f"{name}.pt"), "--save-logs", str(tmp / f"{name}.json")]
    cmd = launcher + [str(script), "--output-dir", str(tmp / name), *COMMON, *files, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp / f"{name}.pt"), json.loads((tmp / f"{name}.json").read_text())


@functools.cache
def runs(tmp: str):
    tmp = Path(tmp)
    return {"p1": _launch(tmp, "p1", 1, 1), "cp2": _launch(tmp, "cp2", 2, 2), "ddp2": _launch(tmp, "ddp2", 2, 1)}


def weight_error(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b if b[k].is_floating_point())


def test_sft_trainer_cp2_equals_p1(tmp_path_factory):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    r = runs(str(tmp_path_factory.mktemp("trl")))
    (w1, log1), (w2, log2), (wd, logd) = r["p1"], r["cp2"], r["ddp2"]
    assert weight_error(wd, w1) > 1e-2, "stock DDP on two processes did not shard the data"
    assert weight_error(w2, w1) <= 1e-4
    assert len(log1) == len(log2) == 3
    for a, b in zip(log1, log2):
        for key in ("loss", "entropy", "mean_token_accuracy"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
        assert a["num_tokens"] == b["num_tokens"]
        # VLMCPCallback's facts ride along at CP=2 only; tokens per rank > 0: the CP forward ran.
        assert b["cp_size"] == 2 and b["cp_data_parallel_size"] == 1 and "cp_size" not in a
        assert b["cp_tokens_per_rank"] > 0
    # The control's token count covers both replicas' batches: twice P=1's micro-batches per step.
    assert logd[0]["num_tokens"] != log1[0]["num_tokens"]


def test_sft_trainer_cp2_bf16_mixed_precision(tmp_path):
    """bf16 is SFTConfig's default on GPUs: Accelerate's autocast then rebinds `model.forward.__func__`, and the
    CP forward must survive that (a proxy around TRL's method would be dropped and the backbone call fail)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    bf16 = ["--bf16", "--steps", "2"]
    _, log1 = _launch(tmp_path, "p1", 1, 1, bf16)
    _, log2 = _launch(tmp_path, "cp2", 2, 2, bf16)
    assert len(log1) == len(log2) == 2
    for a, b in zip(log1, log2):  # bf16 rounding differs between the layouts: loose
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(a["loss"])
        assert b["cp_size"] == 2 and b["cp_tokens_per_rank"] > 0


if __name__ == "__main__":
    # `python tests/test_trl.py ARGS`: examples/trl_sft.py ARGS, with the prototype TRL patches installed.
    import runpy

    if not package_has_trl_patches():
        _prototype_trl_patches()
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")
