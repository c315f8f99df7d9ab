"""Measure the per-rank peak of the memory benchmark's models for `benchmarks.plan_check` (a cache of one run).

    python -m benchmarks.plan_measure [--out benchmarks/data/plan_memory.json] [--tokens 2048] [--layers 2]

Each (model, sample, checkpointing, P) is one `benchmarks.memory.measure` run: the busiest rank's peak of live
bytes (parameter gradients left out, the batch's device bytes in), as that benchmark counts it. Results are
appended to the JSON file as they come, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks import memory
from tests.helpers.harness import run_distributed

SIZES = (1, 2, 4, 6, 8)


def memory_args(model: str, sample: str, gc: bool, tokens: int, layers: int) -> argparse.Namespace:
    """The options of `benchmarks.memory` for one run (widths / 16, three vision blocks, the integrations' loop)."""
    argv = ["--model", model, "--sample", sample, "--tokens", str(tokens), "--layers", str(layers), "--scale", "16",
            "--loops", "host", *(["--gradient-checkpointing"] if gc else [])]
    return memory.parser().parse_args(argv)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/data/plan_memory.json")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["qwen3-vl", "qwen3.5"])
    parser.add_argument("--samples", nargs="+", default=["text-heavy", "image-heavy"])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    done = json.load(open(args.out)) if os.path.exists(args.out) else []
    seen = {(r["model"], r["sample"], r["gc"], r["P"]) for r in done}
    for model in args.models:
        for sample in args.samples:
            for gc in (False, True):
                for size in args.sizes:
                    if (model, sample, gc, size) in seen:
                        continue
                    start = time.perf_counter()
                    ns = memory_args(model, sample, gc, args.tokens, args.layers)
                    ranks = [r["host"] for r in run_distributed(memory.measure, size, ns, args.tokens, False, timeout=3600)]
                    busiest = max(ranks, key=lambda r: r["peak"])
                    done.append({"model": model, "sample": sample, "gc": gc, "P": size, "tokens": args.tokens,
                                 "layers": args.layers, "peak": busiest["peak"], "saved": busiest["saved"],
                                 "patches": busiest["all_patches"],
                                 "tokens_per_rank": busiest["tokens_per_rank"]})
                    with open(args.out, "w") as f:
                        json.dump(done, f, indent=1)
                    print(f"{model} {sample} gc={gc} P={size}: {busiest['peak'] / 2**20:.1f} MiB "
                          f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
