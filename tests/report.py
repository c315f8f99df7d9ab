"""Print the measured parity errors (worst over cases and ranks) per model family and CP size.

    python -m tests.report

The numbers quoted in the README and the issue notes come from here.
"""

from __future__ import annotations

from collections import defaultdict

from tests.cases import FAMILIES, run_cases
from tests.deltanet_cases import run_layer_cases
from tests.harness import run_distributed
from tests.packing_cases import CONFIGS, run_packing_cases

KEYS = ("loss_err", "logits_err", "grad_err", "decay_path_grad_err")


def _worst(rows: list[dict]) -> dict:
    return {k: max(r.get(k, 0.0) for r in rows) for k in KEYS}


def main() -> None:
    for cp_size in (2, 4):
        for family, (_, cases) in FAMILIES.items():
            per_rank = run_distributed(run_cases, cp_size, cp_size, family, list(cases), "sdpa", timeout=600)
            groups = defaultdict(list)
            for res in per_rank:
                for name, m in res.items():
                    groups[f"{family}{'_moe' if name.startswith('moe') else ''}"].append(m)
            for model, rows in groups.items():
                print(f"P={cp_size} {model:14s}", "  ".join(f"{k}={v:.1e}" for k, v in _worst(rows).items()))
    for cp_size in (1, 2, 4):
        per_rank = run_distributed(run_packing_cases, cp_size, list(CONFIGS), timeout=600)
        for model in CONFIGS:
            rows = [res[model] for res in per_rank]
            print(f"packed P={cp_size} {model:14s}", "  ".join(f"{k}={v:.1e}" for k, v in _worst(rows).items()))
    for cp_size in (2, 4):
        res = run_distributed(run_layer_cases, cp_size, timeout=300)[0]
        for name, m in res.items():
            print(f"DeltaNet layer P={cp_size} {name}: out {m['out_err']:.1e} grads {m['param_grad_err']:.1e} "
                  f"a2a bytes/token/forward {m['a2a_bytes_per_token']:.0f}")


if __name__ == "__main__":
    main()
