"""The HF Trainer with DDP, DeepSpeed and FSDP2 (gloo, CPU): a stock script plus `import vlmcp_patch` trains
as at P=1 — examples/hf_trainer_sft.py launched as a user would.

The reference is one process at P=1 on the same global batches (SGD with gradient accumulation 2 and
clipping at `CLIP`: Adam would turn rounding noise in near-zero gradient elements into full +-lr steps).
DeepSpeed and FSDP on CPU are set up as accelerate sets them up on GPUs, and every run reports what really
wraps the model: a silent fallback to plain DDP cannot pass. Stock two-process controls show the data
really is sharded there (their weights differ), so the CP parity is not trivial.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import ROOT, launch
from vlmcp_patch.fixtures.compare import state_dict_error

SCRIPT = ROOT / "examples" / "hf_trainer_sft.py"
# Below the gradient norm of every step of the tiny models' references on every supported release (Qwen3-VL: 1.34-1.46
# on 5.25, 0.68-0.75 on 5.2), so every comparison runs through clipping. Stock transformers 5.2's Trainer hands its
# accumulation steps to Accelerate as well, whose backward divides the loss by them a second time: its gradients are
# 1/2 of later releases' at accumulation 2 (stock's own, fixed by 5.6; CP equals them).
CLIP = 0.5
COMMON = ["--steps", "3", "--grad-accum", "2", "--batch-size", "2", "--optim", "sgd", "--lr", "0.05",
          "--max-grad-norm", str(CLIP)]
VL, Q35 = "tiny-qwen3-vl", "tiny-qwen3.5"
EXTENDED, INTEGRATION = pytest.mark.extended, pytest.mark.integration


def _deepspeed(stage: int) -> list:
    return ["--deepspeed", ROOT / "examples" / f"ds_trainer_zero{stage}.json"]


def _launch(name: str, procs: int, cp_size: int, model: str, extra=(), launcher=None, common=COMMON, env=None,
            script=SCRIPT):
    """(trained weights, per-step logs, what wrapped the model); the run's files live in a fresh folder."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    launcher = launcher or ("python" if procs == 1 and "--deepspeed" not in map(str, extra) else "torchrun")
    files = ["--save-weights", tmp / "w.pt", "--save-logs", tmp / "log.json"]
    args = ["--model", model, "--output-dir", tmp / "out", *common, *files, *extra]
    env = {"VLMCP_CP_SIZE": str(cp_size), **(env or {})}
    out = launch(script, args, procs=procs, launcher=launcher, env=env, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    entries = json.loads((tmp / "log.json").read_text())
    about = next(e for e in entries if "wrapper" in e)
    steps = [e for e in entries if "loss" in e or "eval_loss" in e]
    return Run(torch.load(tmp / "w.pt"), steps, about["wrapper"], tmp / "out",
               next(e for e in entries if "train_samples_per_second" in e), about["patched"],
               about["checkpoint_wrapped"], about["fsdp_vision_units"])


class Run:
    def __init__(self, weights, steps, wrapper, output, summary, patched, checkpoint_wrapped=0, fsdp_vision_units=0):
        self.weights, self.steps, self.wrapper, self.output, self.summary = weights, steps, wrapper, output, summary
        self.patched = patched  # whether the package's patches were installed in that run
        self.checkpoint_wrapped = checkpoint_wrapped  # modules under torch's checkpoint_wrapper (FSDP2's AC)
        self.fsdp_vision_units = fsdp_vision_units  # FSDP2 units inside the vision tower (Accelerate's policy)

    @property
    def train(self):
        return [e for e in self.steps if "loss" in e]

    @property
    def evaluation(self):
        return [e for e in self.steps if "eval_loss" in e]


@functools.cache
def stock_divides_by_the_accumulation_twice() -> bool:
    """Whether the installed Trainer hands its accumulation steps to Accelerate as well, whose `backward` divides the
    loss by them again (transformers 5.2; 5.6 hands it 1), asked of a Trainer built in a fresh process. Stock's
    gradients are then 1/accumulation^2 of the global batch's, except under DeepSpeed (whose backward the Trainer
    tells not to divide): one process with accumulation 4 no longer trains as two replicas with 2, nor DeepSpeed as
    one process without it (measured on 5.2: norms 0.348 vs 0.696, and 1.442 vs 0.721), stock and CP alike."""
    code = ("import torch; from transformers import Trainer, TrainingArguments; "
            "args = TrainingArguments('out', gradient_accumulation_steps=2, use_cpu=True, report_to=[]); "
            "print(Trainer(model=torch.nn.Linear(1, 1), args=args).accelerator.gradient_accumulation_steps)")
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()[-1] != "1"


def skip_where_stock_divides_by_the_accumulation_twice() -> None:
    """For a comparison whose reference splits the global batch otherwise (accumulation, DeepSpeed or not)."""
    if stock_divides_by_the_accumulation_twice():
        pytest.skip("stock's Trainer divides the loss by the accumulation steps twice on this transformers (its own "
                    "and Accelerate's), so the reference, split otherwise, trains otherwise in stock as well")


def p1(model: str) -> Run:
    """The P=1 reference of every two-process comparison (with a checkpoint after step 2)."""
    return _launch(f"p1-{model}", 1, 1, model, ["--save-steps", "2"])


def assert_trains_like(run: Run, reference: Run, cp_size: int = 2, dp_size: int = 1, clipped: bool = True) -> None:
    assert state_dict_error(run.weights, reference.weights) <= 1e-4
    assert len(run.train) == len(reference.train) == 3
    for a, b in zip(reference.train, run.train):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
        # VLMCPCallback's facts ride along with the Trainer's logs under CP only.
        assert b["cp_size"] == cp_size and b["cp_data_parallel_size"] == dp_size and "cp_size" not in a
        assert b["cp_tokens_per_rank"] > 0 and 0 <= b["cp_padding"] < 1
        # Vision data parallelism ran: each rank encoded its share of the patches, and the imbalance is logged.
        assert b["cp_vision_patches_per_rank"] > 0 and b["cp_vision_imbalance"] >= 1
    if clipped:
        assert any(e["grad_norm"] > CLIP for e in reference.train), f"gradient clipping (at {CLIP}) was never exercised"


# --------------------------------------------------------------------------------------------------------
# DDP


@pytest.mark.parametrize("model,launcher", [(VL, "torchrun"), pytest.param(Q35, "accelerate", marks=INTEGRATION)])
def test_ddp_cp2_equals_p1(model, launcher, once):
    run = _launch(f"ddp-cp2-{model}", 2, 2, model, launcher=launcher)
    assert run.wrapper == "DDP"
    assert_trains_like(run, once(p1, model))
    # The Trainer's own counts: 3 steps x accumulation 2 x batch 2 samples, and the same tokens, as at P=1.
    samples = [r.summary["train_samples_per_second"] * r.summary["train_runtime"] for r in (run, once(p1, model))]
    assert [round(s) for s in samples] == [12, 12]
    seen = [[e["num_input_tokens_seen"] for e in r.train] for r in (run, once(p1, model))]
    assert seen[0] == [tokens_counted_per_cp_rank() * n for n in seen[1]]


def tokens_counted_per_cp_rank() -> int:
    """How many times the Trainer counts a CP group's batch in `num_input_tokens_seen` under CP=2: once, where the
    package corrects the count (`Trainer._track_num_input_tokens`, 5.3 on); twice on transformers 5.2, which counts
    inside its training loop (`integrations/trainer.py`, docs/versions.md)."""
    from transformers import Trainer

    return 1 if hasattr(Trainer, "_track_num_input_tokens") else 2


@INTEGRATION
def test_batches_without_a_labelled_token_leave_the_weights_as_stock_does():
    """Every sample's answer cut away: the Trainer's num_items_in_batch is 0 at every step, the loss NaN and the
    gradients zero, as stock gives them — the weights stay what they were, finite, under CP=2 as in one process (before
    the fix, CP's NaN gradients turned every weight into NaN at the first step)."""
    cut = ["--answers-cut"]
    reference, run = _launch("p1-cut", 1, 1, VL, cut), _launch("ddp-cut", 2, 2, VL, cut)
    assert run.wrapper == "DDP"
    assert all(bool(torch.isfinite(w).all()) for w in run.weights.values() if w.is_floating_point())
    assert state_dict_error(run.weights, reference.weights) == 0.0
    assert len(run.train) == len(reference.train) == 3


@INTEGRATION
def test_stock_ddp_on_two_processes_shards_the_data(once):
    run = _launch("ddp-stock", 2, 1, VL)
    assert run.wrapper == "DDP" and state_dict_error(run.weights, once(p1, VL).weights) > 1e-2


# --------------------------------------------------------------------------------------------------------
# DeepSpeed: CP from VLMCP_CP_SIZE, or from Accelerate's ParallelismConfig(sp_backend="deepspeed", sp_size=2),
# which stock accelerate refuses for Qwen3.5 (DeltaNet layers) and runs wrongly for Qwen3-VL.


# The default tier's ZeRO-3 run is the vision tower's (tests/test_vision_tiles.py); this launch is the slowest of the
# suite (two ZeRO-3 engines), so it runs with `-m integration`.
@pytest.mark.parametrize("model,stage,switch", [
    pytest.param(VL, 3, "env", marks=INTEGRATION), pytest.param(Q35, 3, "sp", marks=INTEGRATION),
    pytest.param(VL, 2, "sp", marks=EXTENDED), pytest.param(Q35, 2, "env", marks=EXTENDED)])
def test_deepspeed_cp2_equals_p1(model, stage, switch, once):
    pytest.importorskip("deepspeed")
    if switch == "sp":
        _skip_without_accelerates_switches()
    skip_where_stock_divides_by_the_accumulation_twice()
    cp_size, extra = (2, []) if switch == "env" else (1, ["--sp-size", "2"])
    run = _launch(f"ds{stage}-{switch}-{model}", 2, cp_size, model, [*_deepspeed(stage), *extra])
    assert run.wrapper == f"DeepSpeed ZeRO-{stage}"
    assert_trains_like(run, once(p1, model))


def _skip_without_accelerates_switches() -> None:
    """Accelerate < 1.12 has no ParallelismConfig(sp_backend=...), and transformers' Trainer takes a ParallelismConfig
    from 1.12 on only (it raises ImportError before): nothing to route."""
    import accelerate
    from packaging.version import Version

    if Version(accelerate.__version__) < Version("1.12"):
        pytest.skip(f"Accelerate {accelerate.__version__}: the Trainer takes no ParallelismConfig before 1.12")


@INTEGRATION
@pytest.mark.parametrize("model,wrapper,checkpointing", [("tiny-qwen3-vl-2heads", "DeepSpeed ZeRO-3", False),
                                                         ("tiny-qwen3.5-2heads", "FSDP2", False),
                                                         ("tiny-qwen3-vl-2heads", "FSDP2", True)])
def test_four_ranks_beyond_two_heads_train_as_one_process(model, wrapper, checkpointing, once):
    """Two query heads (and two DeltaNet value heads) over four ranks: Ulysses pairs and a ring of two; with FSDP2's
    activation checkpointing through Accelerate (torch's non-reentrant `checkpoint_wrapper` around every decoder
    layer and vision block: their collectives recomputed inside the main backward)."""
    if wrapper.startswith("DeepSpeed"):
        pytest.importorskip("deepspeed")
        skip_where_stock_divides_by_the_accumulation_twice()
    extra = _deepspeed(3) if wrapper.startswith("DeepSpeed") else ["--fsdp"]
    extra += ["--activation-checkpointing"] if checkpointing else []
    run = _launch(f"ring-{model}-{'ac' if checkpointing else 'plain'}", 4, 4, model, extra)
    assert run.wrapper == wrapper
    assert (run.checkpoint_wrapped > 0) == checkpointing, run.checkpoint_wrapped
    assert_trains_like(run, once(p1, model), cp_size=4)


# --------------------------------------------------------------------------------------------------------
# FSDP2: CP from VLMCP_CP_SIZE (fsdp_config route and accelerate launch with an FSDP2 config file), or from
# Accelerate's ParallelismConfig(cp_size=2), which stock accelerate runs wrongly for Qwen3-VL ("Image features
# and image tokens do not match") and refuses for Qwen3.5.


@pytest.mark.parametrize("model,route", [(VL, "fsdp_config"),
                                         pytest.param(Q35, "parallelism_config", marks=INTEGRATION),
                                         pytest.param(VL, "accelerate_launch", marks=EXTENDED)])
def test_fsdp2_cp2_equals_p1(model, route, once):
    if route == "parallelism_config":
        _skip_without_accelerates_switches()
    extra, cp_size, launcher = {
        "fsdp_config": (["--fsdp"], 2, None),
        "parallelism_config": (["--fsdp", "--cp-size", "2", "--activation-checkpointing"], 1, None),
        "accelerate_launch": ([], 2, "accelerate_fsdp2"),
    }[route]
    run = _launch(f"fsdp-{route}-{model}", 2, cp_size, model, extra, launcher=launcher)
    assert run.wrapper == "FSDP2"
    assert_trains_like(run, once(p1, model))


@INTEGRATION
def test_fsdp2_lora_with_a_frozen_vision_tower_cp2_equals_p1(once):
    """PEFT LoRA on the text attention, vision tower frozen, FSDP2 and CP=2: only the adapters train, as at P=1."""
    reference = _launch("p1-lora", 1, 1, VL, ["--lora"])
    run = _launch("fsdp-lora", 2, 2, VL, ["--fsdp", "--lora"])
    assert run.wrapper == "FSDP2"
    assert_trains_like(run, reference, clipped=False)
    changed = [k for k in reference.weights if "lora" not in k and not torch.equal(reference.weights[k],
                                                                                     run.weights[k])]
    assert not changed, changed  # the frozen weights stayed as they were


@INTEGRATION
def test_stock_fsdp2_on_two_processes_shards_the_data(once):
    run = _launch("fsdp-stock", 2, 1, VL, ["--fsdp"])
    assert run.wrapper == "FSDP2" and state_dict_error(run.weights, once(p1, VL).weights) > 1e-2


@INTEGRATION
def test_fsdp2_checkpoints_under_cp_load_as_p1_and_resume_exactly(once):
    """FSDP2 + CP=2: a FULL_STATE_DICT checkpoint loads with stock `from_pretrained` and holds the P=1 weights
    after the same steps; a SHARDED_STATE_DICT (DCP) checkpoint resumes under CP exactly as the P=1 run goes on."""
    from transformers import Qwen3VLForConditionalGeneration

    import vlmcp_patch

    full = _launch("fsdp-full", 2, 2, VL, ["--fsdp", "--save-steps", "2", "--steps", "2"], common=COMMON[2:])
    sharded = ["--fsdp", "--fsdp-state-dict", "SHARDED_STATE_DICT", "--save-steps", "2"]
    first = _launch("fsdp-sharded", 2, 2, VL, [*sharded, "--steps", "2"], common=COMMON[2:])
    resumed = _launch("fsdp-resumed", 2, 2, VL, [*sharded, "--output-dir", first.output, "--resume"])
    vlmcp_patch.revert()
    try:
        load = Qwen3VLForConditionalGeneration.from_pretrained
        saved, reference = (load(run.output / "checkpoint-2").state_dict() for run in (full, once(p1, VL)))
    finally:
        vlmcp_patch.apply()
    assert state_dict_error(saved, reference) <= 1e-4
    assert [e["step"] for e in resumed.train] == [1, 2, 3]  # steps 1-2 from the checkpoint's trainer state
    assert abs(resumed.train[2]["loss"] - once(p1, VL).train[2]["loss"]) <= 1e-5 * abs(once(p1, VL).train[2]["loss"])
    assert state_dict_error(resumed.weights, once(p1, VL).weights) <= 1e-4


# --------------------------------------------------------------------------------------------------------
# The official Qwen3-VL fine-tuning script's batches (QwenLM/Qwen3-VL, qwen-vl-finetune): its own 3D positions and
# no mm_token_type_ids, right-padded, or flattened into one row whose attention_mask holds the cumulative sample
# lengths (vlmcp_patch/fixtures/official.py builds both from the synthetic samples).

OFFICIAL = ["official-padded", "official-flattened"]


def p1_official(data_format: str) -> Run:
    return _launch(f"p1-{data_format}", 1, 1, VL, ["--data-format", data_format])


@INTEGRATION
@pytest.mark.parametrize("wrapper", ["DDP", "DeepSpeed ZeRO-3"])
@pytest.mark.parametrize("data_format", OFFICIAL)
def test_the_official_scripts_batches_train_at_cp2_as_one_process(data_format, wrapper, once):
    if wrapper.startswith("DeepSpeed"):
        skip_where_stock_divides_by_the_accumulation_twice()
    extra = ["--data-format", data_format, *(_deepspeed(3) if wrapper.startswith("DeepSpeed") else [])]
    run = _launch(f"official-{data_format}-{wrapper[-1]}", 2, 2, VL, extra)
    assert run.wrapper == wrapper
    assert_trains_like(run, once(p1_official, data_format), clipped=False)


OFFICIAL_PACKING = ROOT / "tests" / "helpers" / "official_packing_script.py"


@INTEGRATION
def test_the_official_scripts_own_flash_attention_packing_trains_at_cp2_as_one_process():
    """The script's packed mode replaces the text attention by its own `flash_attn_varlen_func` call (CPU stand-in
    for flash-attn): under ZeRO-2 at CP=2 it trains to the one-process weights — its call on each rank's slice ran
    the exchange (a call on the slice alone raises, `tests/test_errors.py`)."""
    pytest.importorskip("deepspeed")
    skip_where_stock_divides_by_the_accumulation_twice()
    extra = ["--data-format", "official-flattened"]
    reference = _launch("p1-official-packing", 1, 1, VL, extra, script=OFFICIAL_PACKING)
    run = _launch("official-packing-zero2", 2, 2, VL, [*extra, *_deepspeed(2)], script=OFFICIAL_PACKING)
    assert run.wrapper == "DeepSpeed ZeRO-2"
    assert_trains_like(run, reference, clipped=False)


@INTEGRATION
def test_bf16_mixed_precision_keeps_the_cp_forward(once):
    """Accelerate's mixed precision rebinds the model's forward through `forward.__func__` and unwraps it through
    `__wrapped__`: the patched forward must survive both (before this release the stock forward ran, and the CP
    decoder refused it). bf16 rounds differently at CP=2 than at P=1, hence the loose bound."""
    reference = _launch("p1-bf16", 1, 1, VL, ["--bf16"])
    run = _launch("ddp-cp2-bf16", 2, 2, VL, ["--bf16"])
    assert [e["cp_size"] for e in run.train] == [2, 2, 2]
    for a, b in zip(reference.train, run.train):
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * abs(a["loss"])


@INTEGRATION
def test_the_official_scripts_padded_batches_at_p1_are_stock_bit_for_bit(once):
    stock = _launch("stock-official-padded", 1, 1, VL, ["--data-format", "official-padded"],
                    env={"VLMCP_DISABLE": "1"})
    ours = once(p1_official, "official-padded")
    assert all(torch.equal(ours.weights[k], stock.weights[k]) for k in stock.weights)
    assert [e["loss"] for e in ours.train] == [e["loss"] for e in stock.train]
    assert ours.patched and not stock.patched  # the package really ran in one and not in the other


# --------------------------------------------------------------------------------------------------------
# CP=2 x DP=2 on four processes: two replicas whose micro-batches mix text-only and image samples, against one
# process accumulating both replicas' micro-batches (the same global batches). Stock DDP without
# find_unused_parameters, ZeRO-2 and FSDP2 fail there (gradient buckets / reduce-scatters differ) and ZeRO-3
# hangs (weight gathers differ): placeholder vision passes keep them matched.

# Replicas with different data: a large image (shared by patches), two small ones (by items), a video, text alone
REPLICA = ["--batch-size", "1", "--eval-samples", "12", "--layouts", "mixed"]


def one_process_of_two_replicas() -> Run:
    return _launch("replicas-p1", 1, 1, VL, [*REPLICA, "--grad-accum", "4"])


WRAPPERS = {
    # DDP without find_unused_parameters (the Trainer's choice under gradient checkpointing) and with it
    "ddp": (["--ddp-find-unused-parameters", "false", "--gradient-checkpointing"], "DDP"),
    "ddp_find_unused": (["--ddp-find-unused-parameters", "true"], "DDP"),
    "zero1": (_deepspeed(1), "DeepSpeed ZeRO-1"),
    "zero2": (_deepspeed(2), "DeepSpeed ZeRO-2"),
    "zero3": (_deepspeed(3), "DeepSpeed ZeRO-3"),
    "fsdp2": (["--fsdp"], "FSDP2"),
}


@pytest.mark.parametrize("wrapper", [
    *(pytest.param(w, marks=INTEGRATION) for w in ("ddp", "zero2", "zero3", "fsdp2")),
    *(pytest.param(w, marks=EXTENDED) for w in ("ddp_find_unused", "zero1"))])
def test_cp2_dp2_mixed_modality_trains_and_evaluates_like_one_process(wrapper, once):
    if wrapper.startswith("zero"):
        pytest.importorskip("deepspeed")
    skip_where_stock_divides_by_the_accumulation_twice()
    extra, wrapped_by = WRAPPERS[wrapper]
    run = _launch(f"replicas-{wrapper}", 4, 2, VL, [*REPLICA, "--grad-accum", "2", *extra])
    assert run.wrapper == wrapped_by
    reference = once(one_process_of_two_replicas)
    assert sum(e.get("cp_vision_placeholder_passes", 0) for e in run.train) > 0, "no mixed-modality step ran"
    assert_trains_like(run, reference, dp_size=2, clipped=False)
    (ev1,), (ev4,) = reference.evaluation, run.evaluation
    assert abs(ev1["eval_loss"] - ev4["eval_loss"]) <= 1e-5 * abs(ev1["eval_loss"])
    # compute_metrics sees whole rows (full logits) and every sample once (not once per CP rank).
    assert ev1["eval_scored_tokens"] == ev4["eval_scored_tokens"]
    one_token = 1 / ev1["eval_scored_tokens"]  # an argmax near a tie may flip with rounding; garbage would not
    assert abs(ev1["eval_accuracy"] - ev4["eval_accuracy"]) <= one_token


@INTEGRATION
def test_matched_vision_passes_at_p1_on_request(once):
    """At P=1 the package leaves DDP alone unless asked: with VLMCP_MATCH_VISION_PASSES=1 two stock DDP replicas
    (no find_unused_parameters) with mixed micro-batches train like one process, where stock DDP fails."""
    skip_where_stock_divides_by_the_accumulation_twice()
    extra = [*REPLICA, "--grad-accum", "2", *WRAPPERS["ddp"][0]]
    run = _launch("p1-dp2-matched", 2, 1, VL, extra, env={"VLMCP_MATCH_VISION_PASSES": "1"})
    assert run.wrapper == "DDP"
    assert state_dict_error(run.weights, once(one_process_of_two_replicas).weights) <= 1e-4


# --------------------------------------------------------------------------------------------------------
# Setup checks


@INTEGRATION
def test_an_unsupported_model_under_cp_is_refused_before_the_first_step():
    """A model the package does not run under CP would train on P copies of each batch with P times the
    gradient: the Trainer integration refuses it when the Trainer is built."""
    out = launch(ROOT / "tests" / "helpers" / "unsupported_trainer_script.py", procs=2, env={"VLMCP_CP_SIZE": "2"})
    assert out.returncode != 0
    assert "UnsupportedSetupError" in out.stderr and "Qwen3ForCausalLM is not supported under CP" in out.stderr
    assert "'loss'" not in out.stdout  # no training step was logged


def test_callback_rejects_bad_setups_before_training():
    import vlmcp_patch
    from tests.helpers.error_cases import SCENARIOS
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    vlmcp_patch.enable(cp_size=2)
    try:
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="eager"):
            vlmcp_patch.check_cp_setup(build_model(tiny_qwen3_vl_config(attn_implementation="eager")))
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="Qwen3VLForConditionalGeneration"):
            vlmcp_patch.check_cp_setup(SCENARIOS["unsupported_model"](0)[0])
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="needs torch.distributed"):
            vlmcp_patch.check_cp_setup(build_model(tiny_qwen3_vl_config()))
    finally:
        vlmcp_patch.enable(cp_size=1)


# --------------------------------------------------------------------------------------------------------
# The MLPs in tiles (vlmcp_patch/tiles.py) and the vision tower in tiles of items (vlmcp_patch/vision_tiles.py)
# under each wrapper's gradient hooks: each parameter's gradient is summed over the tiles and accumulated once, so
# DDP's buckets, ZeRO's reduce-scatters and FSDP2's reduce see one gradient. Under ZeRO-3 the tower is a leaf module,
# gathered whole once per call with its tiles inside; a tower FSDP2 gathers module by module runs untiled (its gathers
# would follow each rank's number of tiles).


@INTEGRATION
@pytest.mark.parametrize("wrapper", ["ddp", "zero2", "zero3", "fsdp2"])
def test_tiled_mlps_train_like_p1_under_each_wrapper(wrapper, once):
    if wrapper.startswith("zero"):
        pytest.importorskip("deepspeed")
        skip_where_stock_divides_by_the_accumulation_twice()
    extra, wrapped_by = WRAPPERS[wrapper]
    run = _launch(f"tiles-{wrapper}", 2, 2, VL, extra,
                  env={"VLMCP_MLP_TILE_TOKENS": "3", "VLMCP_VISION_TILE_PATCHES": "1", "VLMCP_RECOMPUTE_NORMS": "1"})
    assert run.wrapper == wrapped_by
    assert all(e["cp_mlp_tiles_per_call"] >= 3 for e in run.train), [e.get("cp_mlp_tiles_per_call") for e in run.train]
    # the RMSNorms recomputed under each wrapper too (`VLMCP_RECOMPUTE_NORMS=1`): one row tile each here
    assert all(e["cp_norm_tiles_per_call"] >= 1 for e in run.train), [e.get("cp_norm_tiles_per_call") for e in run.train]
    vision_tiles = [e.get("cp_vision_tiles_per_call") for e in run.train]
    # FSDP2 units inside the tower (the newest Accelerate wraps its blocks) gather module by module: untiled. A tower
    # inside one unit (Accelerate 1.11's policy) is gathered whole with it, and tiles
    if wrapper == "fsdp2" and run.fsdp_vision_units:
        assert vision_tiles == [None] * len(run.train)
    else:  # some call of some step in several tiles (the ranks' shares by items); a share by patches (from 5.15, where
        # an item is larger than a rank's share) runs through the tiled function as one tile, and counts as a call
        assert any(t is not None and t > 1 for t in vision_tiles), vision_tiles
    assert_trains_like(run, once(p1, VL))


# Checkpoints in host memory (vlmcp_patch/offload.py) under each wrapper, with gradient checkpointing: the same
# weights, bit for bit, as the same run with the checkpoints on the device.


@INTEGRATION
@pytest.mark.parametrize("wrapper", ["ddp", "zero3", "fsdp2"])
def test_offloaded_checkpoints_train_bit_for_bit_like_checkpoints_on_the_device(wrapper):
    if wrapper.startswith("zero"):
        pytest.importorskip("deepspeed")
    extra, wrapped_by = WRAPPERS[wrapper]
    extra = [*extra, *([] if "--gradient-checkpointing" in extra else ["--gradient-checkpointing"])]
    on_device = _launch(f"checkpoints-{wrapper}", 2, 2, VL, extra)
    on_host = _launch(f"offload-{wrapper}", 2, 2, VL, extra, env={"VLMCP_OFFLOAD_CHECKPOINTS": "1"})
    assert on_host.wrapper == on_device.wrapper == wrapped_by
    assert all(e["cp_host_pool_mib"] > 0 for e in on_host.train) and "cp_host_pool_mib" not in on_device.train[0]
    assert on_host.weights.keys() == on_device.weights.keys()
    assert all(torch.equal(on_host.weights[k], on_device.weights[k]) for k in on_host.weights)
    assert [e["loss"] for e in on_host.train] == [e["loss"] for e in on_device.train]
