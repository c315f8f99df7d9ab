"""The switches chosen by need (`vlmcp_patch/by_need.py`) against CP with every switch off, at a budget where the row
fits untiled: the step's time of each (the choice's pricing and its one-number all-reduce are all it adds), and at a
tight budget the switches it took and the time they cost.

    python -m benchmarks.by_need [--tokens 8192] [--layers 2] [--repeats 5] [--size 2] [--dry-run]

The memory benchmark's model (Qwen3-VL's proportions, widths / 16, gradient checkpointing) and image-heavy row, at
P=`--size` (gloo, CPU). Each repeat runs the three setups one after the other (interleaved, so that the machine's
load falls on all alike): "untiled" (`VLMCP_MLP_TILE_TOKENS=0`, `VLMCP_RECOMPUTE_NORMS=0`,
`VLMCP_VISION_TILE_PATCHES=0`, explicit), "by need, roomy" (the default settings, `VLMCP_DEVICE_MEMORY_GIB` 1.25 x the
untiled price), "by need, tight" (1.02 x the price of the smallest set). Printed: the median step time of each (the
busiest rank's) and their fastest (the least disturbed on a shared machine), the ratios by need (roomy) / untiled —
the goal is <= 1.02 — and the switches each chose; and the choice's own time per forward (pricing and all-reduce,
timed around `by_need.choose_switches`), the only work by need adds to an untiled step.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tests.helpers.by_need_cases import budget_for, model_and_row, prices, rooms
from tests.helpers.harness import run_distributed

SETUPS = ("untiled", "by need, roomy", "by need, tight")


def _settings(setup: str, priced: dict) -> dict:
    if setup == "untiled":
        return {"mlp_tile_tokens": 0, "recompute_norms": False, "vision_tile_patches": 0, "device_memory_gib": 0}
    room = rooms(priced)["roomy" if setup.endswith("roomy") else "tight"]
    return {"mlp_tile_tokens": "auto", "recompute_norms": "auto", "vision_tile_patches": "auto",
            "device_memory_gib": budget_for(room, priced["pending"])}


def timed_steps(rank: int, world_size: int, tokens: int, layers: int, repeats: int) -> dict:
    """Per setup: the step times of the repeats and the switches the last step ran with."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.forward import top_level

    choosing = []

    def timed_choice(*args):
        start = time.perf_counter()
        try:
            return by_need.choose_switches(*args)
        finally:
            choosing.append(time.perf_counter() - start)

    top_level.choose_switches = timed_choice  # the benchmark's timer around the package's own function
    model, batch = model_and_row(tokens, layers)
    priced = prices(model, batch, world_size)
    times = {setup: [] for setup in SETUPS}
    switches = {}
    try:
        for repeat in range(repeats + 1):  # the first round warms up, not counted
            for setup in SETUPS:
                vlmcp_patch.enable(cp_size=world_size, **_settings(setup, priced))
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                model(**batch).loss.backward()
                seconds = time.perf_counter() - start
                if repeat:
                    times[setup].append(seconds)
                switches[setup] = by_need.STATE.choice.switches.on()
    finally:
        vlmcp_patch.enable(cp_size=1, mlp_tile_tokens="auto", recompute_norms="auto", vision_tile_patches="auto",
                           device_memory_gib=0)
        top_level.choose_switches = by_need.choose_switches
    return {"times": times, "switches": switches, "choice_seconds": statistics.median(choosing)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="a short row, one repeat (seconds)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.tokens, args.layers, args.repeats = 1024, 1, 1
    per_rank = run_distributed(timed_steps, args.size, args.tokens, args.layers, args.repeats, timeout=3600)
    median = {s: max(statistics.median(r["times"][s]) for r in per_rank) for s in SETUPS}
    fastest = {s: max(min(r["times"][s]) for r in per_rank) for s in SETUPS}
    print(f"qwen3-vl widths / 16, {args.layers} layers, image-heavy row of {args.tokens} tokens, P={args.size}, "
          f"gradient checkpointing; median of {args.repeats} steps (busiest rank)")
    for setup in SETUPS:
        on = ", ".join(per_rank[0]["switches"][setup]) or "none"
        print(f"{setup:>16}: median {median[setup]:8.3f} s, fastest {fastest[setup]:8.3f} s  switches: {on}")
    for name, of in (("median", median), ("fastest", fastest)):
        print(f"ratio by need (roomy) / untiled, {name}: {of['by need, roomy'] / of['untiled']:.3f} (goal <= 1.02); "
              f"tight / untiled {of['by need, tight'] / of['untiled']:.3f}")
    choice = max(r["choice_seconds"] for r in per_rank)
    print(f"the choice per forward: {choice * 1e3:.2f} ms ({choice / median['untiled']:.2e} of the untiled step)")


if __name__ == "__main__":
    main()
