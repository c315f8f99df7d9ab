"""Measure the per-rank peak of the memory benchmark's models for `benchmarks.plan_check` (a cache of one run).

    python -m benchmarks.plan_measure [--out benchmarks/data/plan_memory.json] [--tokens 2048] [--layers 2]
    python -m benchmarks.plan_measure --work      # the recomputed layer's rows (benchmarks/data/plan_work.json)
    python -m benchmarks.plan_measure --work --dtype bf16 --models qwen3-vl --out benchmarks/data/plan_work_bf16.json
    python -m benchmarks.plan_measure --work --models qwen3-vl --samples image-heavy --sizes 2 4 --norms recomputed \
        --vision-tile-patches 256 [--mlp-tile-tokens 256] [--park-features] --out benchmarks/data/plan_decoder.json

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


# The rows whose peak is the recomputed layer (`--work`): checkpointing with the checkpoints offloaded and the head's
# chunk at 64 tokens, so neither the checkpoints nor the head's chunk sets the peak; 8,192 tokens, so that the MLPs
# run in tiles at P = 2 and 4 (at least `tiles.MIN_TILE` tokens each) while P = 1 runs them whole; under CP each row
# with the RMSNorms recomputed (the package's default) and kept whole (`--no-recompute-norms`)
WORK = {"out": "benchmarks/data/plan_work.json", "tokens": 8192, "layers": 4, "sizes": [1, 2, 4], "offload": True,
        "loss_chunk": 64}


def memory_args(model: str, sample: str, gc: bool, tokens: int, layers: int, offload: bool = False,
                loss_chunk: int = 0, recompute_norms: bool = True, dtype: str = "fp32",
                mlp_tile_tokens: int | None = None, vision_tile_patches: int | None = None,
                park_features: bool = False) -> argparse.Namespace:
    """The options of `benchmarks.memory` for one run (widths / 16, three vision blocks, the integrations' loop)."""
    argv = ["--model", model, "--sample", sample, "--tokens", str(tokens), "--layers", str(layers), "--scale", "16",
            "--loops", "host", "--loss-chunk-tokens", str(loss_chunk), "--dtype", dtype,
            *(["--gradient-checkpointing"] if gc else []),
            *(["--offload-checkpoints"] if offload else []), *([] if recompute_norms else ["--no-recompute-norms"]),
            "--offload-features", "on" if park_features else "off",
            *(["--mlp-tile-tokens", str(mlp_tile_tokens)] if mlp_tile_tokens else []),
            *(["--vision-tile-patches", str(vision_tile_patches)] if vision_tile_patches else [])]
    return memory.parser().parse_args(argv)


def runs(args) -> list[dict]:
    """The (model, sample, checkpointing, P and options) of each run asked for; the tiles' sizes where set."""
    tiles = {name: getattr(args, name) for name in ("mlp_tile_tokens", "vision_tile_patches") if getattr(args, name)}
    if args.park_features:
        tiles["park_features"] = True
    out = []
    for model in args.models:
        for sample in args.samples:
            for gc in (True,) if args.work else (False, True):
                for size in args.sizes:
                    if not args.work:
                        out.append({"model": model, "sample": sample, "gc": gc, "P": size, **tiles})
                        continue
                    # P = 1 never recomputes them
                    for recompute in (True,) if size == 1 or args.norms == "recomputed" else (True, False):
                        out.append({"model": model, "sample": sample, "gc": gc, "P": size, "offload": WORK["offload"],
                                    "loss_chunk": WORK["loss_chunk"], "tiled_mlp": True, "recompute_norms": recompute,
                                    **tiles})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON file (default benchmarks/data/plan_memory.json, with --work "
                        "benchmarks/data/plan_work.json)")
    parser.add_argument("--tokens", type=int, help="the row's length (default 2,048; with --work 8,192)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 2; with --work 4)")
    parser.add_argument("--models", nargs="+", default=["qwen3-vl", "qwen3.5"])
    parser.add_argument("--samples", nargs="+", default=["text-heavy", "image-heavy"])
    parser.add_argument("--sizes", type=int, nargs="+", help="CP sizes (default 1 2 4 6 8; with --work 1 2 4)")
    parser.add_argument("--work", action="store_true", help="the recomputed layer's rows (`WORK`), checkpointing on")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights' and pixels' dtype")
    parser.add_argument("--mlp-tile-tokens", type=int, help="tokens per MLP tile (default: the automatic rule)")
    parser.add_argument("--vision-tile-patches", type=int,
                        help="patches per vision tile (default: the automatic rule); with a small one a decoder layer, "
                        "not the tower, sets the peak of an image-heavy row")
    parser.add_argument("--park-features", action="store_true",
                        help="under CP, the vision features parked on the host (VLMCP_OFFLOAD_FEATURES=1)")
    parser.add_argument("--norms", choices=["both", "recomputed"], default="both",
                        help="with --work, under CP: the norms recomputed and kept (both), or recomputed only")
    args = parser.parse_args(argv)
    defaults = WORK if args.work else {"tokens": 2048, "layers": 2, "sizes": list(SIZES)}
    for name in ("tokens", "layers", "sizes"):
        setattr(args, name, getattr(args, name) or defaults[name])
    args.out = args.out or (WORK["out"] if args.work else "benchmarks/data/plan_memory.json")
    done = json.load(open(args.out)) if os.path.exists(args.out) else []
    keys = ("model", "sample", "gc", "P", "recompute_norms", "mlp_tile_tokens", "vision_tile_patches", "park_features")
    seen = {tuple(r.get(k) for k in keys) for r in done}
    for run in runs(args):
        if tuple(run.get(k) for k in keys) in seen:
            continue
        start = time.perf_counter()
        options = {k: run[k] for k in ("offload", "loss_chunk", "recompute_norms", "mlp_tile_tokens",
                                       "vision_tile_patches", "park_features") if k in run}
        options["dtype"] = run["dtype"] = args.dtype
        ns = memory_args(run["model"], run["sample"], run["gc"], args.tokens, args.layers, **options)
        ranks = [r["host"] for r in run_distributed(memory.measure, run["P"], ns, args.tokens, False, timeout=3600)]
        busiest = max(ranks, key=lambda r: r["peak"])
        done.append({**run, "tokens": args.tokens, "layers": args.layers, "peak": busiest["peak"],
                     "saved": busiest["saved"], "patches": busiest["all_patches"],
                     "tokens_per_rank": busiest["tokens_per_rank"], **({"host": busiest["host"]} if args.work else {})})
        with open(args.out, "w") as f:
            json.dump(done, f, indent=1)
        print(f"{run}: {busiest['peak'] / 2**20:.1f} MiB ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
