"""TRL's RL and preference trainers (GRPO, RLOO, DPO, KTO) at CP=2 train exactly as one process — a stock TRL
script plus `import vlmcp_patch` (examples/trl_grpo.py, examples/trl_dpo.py), launched as a user would.

Compared with one process on the same global batches (SGD): the trained weights, every logged metric of every
step, and — for the RL trainers, which draw their own completions — the completions every rank scored. The
controls: a stock two-process GRPO run, which shards the prompts (its weights differ); for DPO and KTO, whose
per-pair mean makes data-parallel replicas equal one process, the tokens each rank's decoder saw (half the row).
CP=2 x DP=2 with one replica's prompts text-only runs under ZeRO-3 and FSDP2 against two stock data-parallel
processes (with matched vision passes, without which they hang).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import ROOT, launch
from vlmcp_patch.fixtures.compare import state_dict_error

GRPO, DPO = ROOT / "examples" / "trl_grpo.py", ROOT / "examples" / "trl_dpo.py"
COMMON = ["--optim", "sgd", "--lr", "0.05"]
IGNORED = {"step_time", "epoch", "learning_rate", "step"}  # timings, and what is equal by construction


class Run:
    def __init__(self, folder: Path, procs: int):
        entries = json.loads((folder / "log.json").read_text())
        self.steps = [e for e in entries if "loss" in e]
        self.wrapper = next(e["wrapper"] for e in entries if "wrapper" in e)
        self.weights = torch.load(folder / "w.pt")
        files = sorted(folder.glob("completions.json.*"))
        self.completions = [json.loads(f.read_text()) for f in files]


def _launch(script: Path, name: str, procs: int, cp_size: int, extra=(), env=None) -> Run:
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    files = ["--save-weights", folder / "w.pt", "--save-logs", folder / "log.json", "--output-dir", folder / "out"]
    if script == GRPO:
        files += ["--save-completions", folder / "completions.json"]
    sharded = any(flag in map(str, extra) for flag in ("--deepspeed", "--fsdp"))
    launcher = "python" if procs == 1 and not sharded else "torchrun"
    # the host cut of the pixel values on (its default), whatever the calling environment says
    out = launch(script, [*COMMON, *files, *extra], procs=procs, launcher=launcher,
                 env={"VLMCP_CP_SIZE": str(cp_size), "VLMCP_HOST_PIXEL_SHARES": "1", **(env or {})}, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return Run(folder, procs)


def run(script: str, name: str, procs: int, cp_size: int, extra: tuple = (), env: tuple = ()) -> Run:
    return _launch(ROOT / "examples" / script, name, procs, cp_size, extra, dict(env))


def close(a: float, b: float) -> bool:
    """Equal up to fp32 rounding: relative 1e-5, or absolute 1e-6 for values near zero (KL, rewards near 0)."""
    return abs(a - b) <= 1e-5 * abs(a) + 1e-6


def assert_trains_like(candidate: Run, reference: Run) -> None:
    assert state_dict_error(candidate.weights, reference.weights) <= 1e-5
    assert len(candidate.steps) == len(reference.steps) > 0
    for a, b in zip(reference.steps, candidate.steps):
        metrics = {k for k, v in a.items() if isinstance(v, (int, float)) and k not in IGNORED}
        differing = {k: (a[k], b[k]) for k in metrics if not close(a[k], b[k])}
        assert not differing, differing
        # VLMCPCallback's facts ride along at CP=2 only; tokens per rank > 0: the CP forward ran.
        assert b["cp_size"] == 2 and b["cp_tokens_per_rank"] > 0 and "cp_size" not in a


RL = {
    # GRPO with a reference model (beta > 0), two optimisation passes per rollout (old-policy log-probs),
    # two steps per generation (the buffered batch, shuffled) and gradient accumulation
    "grpo-qwen3-vl": ("trl_grpo.py", ("--beta", "0.1", "--num-iterations", "2", "--steps-per-generation", "2",
                                      "--grad-accum", "2", "--steps", "4")),
    "grpo-qwen3.5": ("trl_grpo.py", ("--model", "tiny-qwen3.5", "--loss-type", "bnpo")),
    "rloo-qwen3-vl": ("trl_grpo.py", ("--trainer", "rloo", "--beta", "0.05")),
}
PREFERENCE = {
    "dpo-qwen3-vl": ("trl_dpo.py", ()),  # a separate reference model
    "dpo-qwen3.5-peft": ("trl_dpo.py", ("--model", "tiny-qwen3.5", "--reference", "peft")),
    "dpo-precomputed": ("trl_dpo.py", ("--reference", "precomputed", "--text")),
    "kto-qwen3-vl": ("trl_dpo.py", ("--trainer", "kto",)),
}


# DPO on image pairs: each rank holds only its share of the pixel values on the host (the cut, which TRL < 1.16's
# DPOTrainer would leave behind: integrations/trl.py), every forward of every step
CUT = {"dpo-qwen3-vl", "dpo-qwen3.5-peft"}

# The default run trains GRPO; the others run with `-m integration`, these two with `-m extended` (docs/testing.md).
DEFAULT = {"grpo-qwen3-vl"}
EXTENDED = {"dpo-qwen3-vl", "dpo-precomputed"}
INTEGRATION = pytest.mark.integration


def cases(table: dict) -> list:
    return [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.extended if c in EXTENDED else INTEGRATION)
            for c in table]


@pytest.mark.parametrize("case", cases({**RL, **PREFERENCE}))
def test_cp2_trains_like_one_process(case, once):
    pytest.importorskip("trl")
    script, extra = {**RL, **PREFERENCE}[case]
    reference = once(run, script, f"{case}-p1", 1, 1, extra)
    candidate = once(run, script, f"{case}-cp2", 2, 2, extra)
    assert candidate.wrapper == "DDP"
    assert_trains_like(candidate, reference)
    if case in CUT:  # the policy's and the reference's forward of each step held the cut share
        assert all(step.get("cp_host_pixel_shares") == 2 for step in candidate.steps), candidate.steps


@pytest.mark.parametrize("case", cases(RL))
def test_every_rank_of_the_group_scored_the_one_process_completions(case, once):
    pytest.importorskip("trl")
    script, extra = RL[case]
    reference = once(run, script, f"{case}-p1", 1, 1, extra)
    candidate = once(run, script, f"{case}-cp2", 2, 2, extra)
    assert len(candidate.completions) == 2 and candidate.completions[0] == candidate.completions[1]
    assert candidate.completions[0] == reference.completions[0] and reference.completions[0]


@INTEGRATION
def test_stock_grpo_on_two_processes_shards_the_prompts(once):
    pytest.importorskip("trl")
    script, extra = RL["grpo-qwen3-vl"]
    control = once(run, script, "grpo-ddp2", 2, 1, extra)
    reference = once(run, script, "grpo-qwen3-vl-p1", 1, 1, extra)
    assert state_dict_error(control.weights, reference.weights) > 1e-2
    assert control.completions[0] != control.completions[1]  # each process drew for its own prompts


@INTEGRATION
def test_preference_trainers_split_each_row_over_the_group(once):
    """DPO's and KTO's per-pair mean makes replicas equal one process: here each rank's decoder saw half the row."""
    pytest.importorskip("trl")
    for case in set(PREFERENCE) - EXTENDED:
        script, extra = PREFERENCE[case]
        for step in once(run, script, f"{case}-cp2", 2, 2, extra).steps:
            assert 0 < step["cp_tokens_per_rank"] and step["cp_padding"] < 0.5


MIXED = ["--text-only-replica", "1", "--batch-size", "2"]


@INTEGRATION
@pytest.mark.parametrize("wrapper,flags", [("DeepSpeed ZeRO-3", ("--deepspeed", str(ROOT / "examples" /
                                                                                  "ds_trainer_zero3.json"))),
                                           ("FSDP2", ("--fsdp",))])
def test_cp2_dp2_grpo_with_a_text_only_replica(wrapper, flags, once):
    pytest.importorskip("trl")
    extra = (*MIXED, *flags)
    matched = (("VLMCP_MATCH_VISION_PASSES", "1"),)
    reference = once(run, "trl_grpo.py", f"mixed-dp2-{wrapper[-1]}", 2, 1, extra, matched)
    candidate = once(run, "trl_grpo.py", f"mixed-cp2dp2-{wrapper[-1]}", 4, 2, extra)
    assert reference.wrapper == candidate.wrapper == wrapper
    assert state_dict_error(candidate.weights, reference.weights) <= 1e-5
    for a, b in zip(reference.steps, candidate.steps):
        assert close(a["loss"], b["loss"]) and close(a["grad_norm"], b["grad_norm"])
        assert a["num_tokens"] == b["num_tokens"] and b["cp_data_parallel_size"] == 2
    # the two replicas' ranks: each group scored its own replica's completions, identically on its two ranks
    assert candidate.completions[0] == candidate.completions[1] != candidate.completions[2] == candidate.completions[3]


STANDIN = ROOT / "tests" / "helpers" / "vllm_standin_script.py"


def vllm_run(mode: str, procs: int, cp_size: int) -> tuple[Run, list[list[int]]]:
    """A GRPO run whose rollouts go through TRL's vLLM path (server or colocate) with stand-ins for vLLM; and, per
    rank, how many prompts each engine call received."""
    folder = Path(tempfile.mkdtemp(prefix=f"vllm-{mode}-{procs}-"))
    files = ["--save-weights", folder / "w.pt", "--save-logs", folder / "log.json", "--output-dir", folder / "out",
             "--save-completions", folder / "completions.json"]
    env = {"VLMCP_CP_SIZE": str(cp_size), "VLLM_STANDIN_RECORD": str(folder / "engine")}
    out = launch(STANDIN, [*COMMON, *files, "--vllm-mode", mode], procs=procs,
                 launcher="python" if procs == 1 else "torchrun", env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    calls = [[len(json.loads(line)) for line in f.read_text().splitlines()] for f in sorted(folder.glob("engine.*"))]
    return Run(folder, procs), calls


@INTEGRATION
@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_vllm_rollouts_reach_the_engine_once_per_group(mode, once):
    """TRL's vLLM rollouts under CP=2 (the engine and its client replaced by in-process stand-ins): the engine gets
    one copy of each prompt per CP group — as many as from one process — and every rank of the group trains on
    the same completions, the one-process ones."""
    pytest.importorskip("trl")
    (reference, reference_calls), (candidate, calls) = once(vllm_run, mode, 1, 1), once(vllm_run, mode, 2, 2)
    assert calls == reference_calls and len(calls) == 1  # one rank's engine (server: the main process'; colocate:
    # the group's first rank's), the same prompts per call as one process
    assert candidate.completions[0] == candidate.completions[1] == reference.completions[0]
    assert_trains_like(candidate, reference)
    assert any(step["grad_norm"] > 0.1 for step in reference.steps)  # the rollouts really train


@INTEGRATION
def test_split_rollouts_generate_each_rank_its_share(once):
    """With VLMCP_SPLIT_ROLLOUTS=1 the ranks of a group generate different rows of the group's rollout (other draws
    than one process: documented) and then all train on the same completions."""
    pytest.importorskip("trl")
    script, extra = RL["grpo-qwen3-vl"]
    reference = once(run, script, "grpo-qwen3-vl-p1", 1, 1, extra)
    split = once(run, script, "grpo-split-cp2", 2, 2, extra, (("VLMCP_SPLIT_ROLLOUTS", "1"),))
    assert split.completions[0] == split.completions[1] != reference.completions[0]
    first_prompt = split.completions[0][0]
    assert first_prompt[0] != first_prompt[1]  # the two generations of a prompt came from two ranks' streams
    assert all(step["grad_norm"] > 0 for step in split.steps)
