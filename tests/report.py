"""Print the measured numbers the README and the issue notes quote.

    python -m tests.report              # parity: CP vs stock P=1 (worst over cases and ranks), packed rows,
                                        # one DeltaNet layer
    python -m tests.report --training   # trained weights of every training integration vs one process (TRL's RL
                                        # and preference trainers included)
    python -m tests.report --rl         # only TRL's RL and preference trainers
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from tests.helpers.cases import FAMILIES, run_cases
from tests.helpers.deltanet_cases import run_layer_cases
from tests.helpers.harness import run_distributed
from tests.helpers.packing_cases import CONFIGS, run_packing_cases
from vlmcp_patch.fixtures.compare import state_dict_error

KEYS = ("loss_err", "logits_err", "grad_err", "decay_path_grad_err")


def _worst(rows: list[dict]) -> dict:
    return {k: max(r.get(k, 0.0) for r in rows) for k in KEYS}


def parity() -> None:
    for cp_size in (2, 4):
        for family, (_, cases) in FAMILIES.items():
            per_rank = run_distributed(run_cases, cp_size, cp_size, family, list(cases), "sdpa", timeout=900)
            groups = defaultdict(list)
            for res in per_rank:
                for name, m in res.items():
                    groups[f"{family}{'_moe' if name.startswith('moe') else ''}"].append(m)
            for model, rows in groups.items():
                print(f"P={cp_size} {model:14s}", "  ".join(f"{k}={v:.1e}" for k, v in _worst(rows).items()))
    for cp_size in (1, 2, 4):
        per_rank = run_distributed(run_packing_cases, cp_size, list(CONFIGS), timeout=900)
        for model in CONFIGS:
            rows = [res[model] for res in per_rank]
            print(f"packed P={cp_size} {model:14s}", "  ".join(f"{k}={v:.1e}" for k, v in _worst(rows).items()))
    for cp_size in (2, 4):
        res = run_distributed(run_layer_cases, cp_size, timeout=600)[0]
        for name, m in res.items():
            print(f"DeltaNet layer P={cp_size} {name}: out {m['out_err']:.1e} grads {m['param_grad_err']:.1e} "
                  f"a2a bytes/token/forward {m['a2a_bytes_per_token']:.0f}")


def _differences(run, reference) -> str:
    """Trained weights, per-step loss and grad_norm: worst relative difference against one process."""
    steps = list(zip(run.train, reference.train))
    loss = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in steps)
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in steps)
    error = state_dict_error(run.weights, reference.weights)
    return f"{error:.1e} (loss {loss:.1e}, grad_norm {norm:.1e}) [{run.wrapper}]"


def training() -> None:
    """Every training integration at CP=2 (and CP=2 x DP=2) against one process on the same global batches."""
    from tests import test_trainer as t

    rows = [
        ("HF Trainer + DDP, torchrun", lambda m: t._launch(f"r-ddp-{m}", 2, 2, m)),
        ("HF Trainer + DDP, accelerate launch", lambda m: t._launch(f"r-acc-{m}", 2, 2, m, launcher="accelerate")),
        *[(f"HF Trainer + DeepSpeed ZeRO-{z}, {how}", lambda m, z=z, extra=extra, cp=cp: t._launch(
            f"r-ds{z}-{cp}-{m}", 2, cp, m, [*t._deepspeed(z), *extra]))
          for z in (2, 3) for how, extra, cp in (("VLMCP_CP_SIZE", [], 2), ("sp_size", ["--sp-size", "2"], 1))],
        ("HF Trainer + FSDP2, fsdp_config", lambda m: t._launch(f"r-fsdp-{m}", 2, 2, m, ["--fsdp"])),
        ("HF Trainer + FSDP2, ParallelismConfig(cp_size=2)",
         lambda m: t._launch(f"r-pc-{m}", 2, 1, m, ["--fsdp", "--cp-size", "2"])),
        ("HF Trainer + FSDP2, accelerate launch config file",
         lambda m: t._launch(f"r-accfsdp-{m}", 2, 2, m, launcher="accelerate_fsdp2")),
    ]
    p1 = {model: t.p1(model) for model in (t.VL, t.Q35)}
    print(f"{'setup (CP=2 vs one process: max rel. weight diff)':52s} {'Qwen3-VL':>50} {'Qwen3.5':>50}")
    for name, run in rows:
        cells = [_differences(run(model), p1[model]) for model in (t.VL, t.Q35)]
        print(f"{name:52s} {cells[0]:>50} {cells[1]:>50}")
    from tests import test_deepspeed as d
    from tests import test_trl as trl

    for stage, launcher in ((2, "torchrun"), (3, "torchrun"), (3, "deepspeed")):
        cells = [f"{state_dict_error(d.train(m, stage, 2, 2, launcher)[0], d.train(m, stage, 1, 1)[0]):.1e}"
                 for m in (t.VL, t.Q35)]
        print(f"{f'raw DeepSpeed ZeRO-{stage}, {launcher}':52s} {cells[0]:>50} {cells[1]:>50}")
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    trl_p1 = trl._launch(tmp, "p1", 1, 1)
    for wrapper, extra in (("DDP", []), ("FSDP2", ["--fsdp"])):
        run = trl._launch(tmp, f"cp2-{wrapper}", 2, 2, extra)
        print(f"{'TRL SFTTrainer, ' + wrapper:52s} {f'{state_dict_error(run[0], trl_p1[0]):.1e} [{run[2]}]':>50}")
    reference = t.one_process_of_two_replicas()  # launched once here
    for wrapper, extra in (("DDP", ["--ddp-find-unused-parameters", "false", "--gradient-checkpointing"]),
                           ("DeepSpeed ZeRO-2", t._deepspeed(2)), ("DeepSpeed ZeRO-3", t._deepspeed(3)),
                           ("FSDP2", ["--fsdp"])):
        run = t._launch(f"r-mixed-{wrapper}", 4, 2, t.VL, [*t.REPLICA, "--grad-accum", "2", *extra])
        print(f"{'CP=2 x DP=2, mixed modality, ' + wrapper:52s} {_differences(run, reference):>50}")
    control = t._launch("r-stock", 2, 1, t.VL)
    print(f"{'stock DDP, two processes (control)':52s} {state_dict_error(control.weights, p1[t.VL].weights):>50.1e}")
    reinforcement()


def _metric_difference(run, reference) -> float:
    """The worst difference of any logged metric, relative to its magnitude (0.01 at least: values near zero)."""
    from tests.test_trl_rl import IGNORED

    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-2) for a, b in zip(reference.steps, run.steps)
               for k, v in a.items() if isinstance(v, (int, float)) and k not in IGNORED)


def reinforcement() -> None:
    """TRL's RL and preference trainers at CP=2 against one process (tests/test_trl_rl.py's runs)."""
    from tests import test_trl_rl as rl

    for case, (script, extra) in {**rl.RL, **rl.PREFERENCE}.items():
        reference, run = rl.run(script, f"r-{case}-p1", 1, 1, extra), rl.run(script, f"r-{case}-cp2", 2, 2, extra)
        same = "same completions" if run.completions and run.completions[0] == reference.completions[0] else ""
        error, metrics = state_dict_error(run.weights, reference.weights), _metric_difference(run, reference)
        cell = f"{error:.1e} (metrics {metrics:.1e}) [{run.wrapper}] {same}"
        print(f"{'TRL ' + case + ' ' + ' '.join(extra):52s} {cell}")
    control = rl.run("trl_grpo.py", "r-grpo-ddp2", 2, 1, rl.RL["grpo-qwen3-vl"][1])
    reference = rl.run("trl_grpo.py", "r-grpo-qwen3-vl-p1", 1, 1, rl.RL["grpo-qwen3-vl"][1])
    print(f"{'stock GRPO, two processes (control)':52s} {state_dict_error(control.weights, reference.weights):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training", action="store_true", help="the training integrations instead of parity")
    parser.add_argument("--rl", action="store_true", help="only TRL's RL and preference trainers")
    args = parser.parse_args()
    reinforcement() if args.rl else training() if args.training else parity()


if __name__ == "__main__":
    main()
