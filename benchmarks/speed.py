"""Speed of one training step (forward + backward) for stock P=1, the package's P=1 path and CP=2 / CP=4, on packed
rows of growing length at the released models' proportions (the memory benchmark's models).

    python -m benchmarks.speed [--models qwen3-vl qwen3.5] [--samples text-heavy image-heavy] \\
        [--lengths 512 1024 2048] [--sizes 2 4] [--plot speed.png]

Every rank runs one thread (P ranks use P cores). Each configuration runs one warm-up step, which also records
the rank's peak of live tensor bytes, then `--repeats` timed steps (2), of which each rank keeps the one of least
CPU time (on a shared machine the same step's CPU time varies by tens of percent from one run to the next).
Per rank it records the step's wall-clock, the CPU time of its thread (the work it did: a machine with fewer
cores than ranks stretches the wall-clock, not this), the time inside collectives and inside the batch
agreement. It prints, from that one run:

* package P=1 / stock P=1 — the package's own cost;
* work-split efficiency, P x (busiest rank's CPU time) / package P=1 CPU time — 1.0 is a perfect split;
* the machine's own split (`mach`): P stock processes at once, each on a row of 1/P the length, CPU time per token
  of the busiest / stock P=1's — what the same per-rank sizes and shared cores cost without the package (shorter
  matmuls run at lower FLOP/s; ranks sharing cores and caches slow each other), to read the efficiency against;
* the share of the busiest rank's step inside collectives (wall-clock) and inside the batch agreement;
* tokens per second per rank (CPU time);
* how each ratio moves as the length doubles, and the exponent of step time against length (log-log slope).

`--plot FILE` (needs matplotlib: `pip install -e ".[plot]"`) draws step time and per-rank peak memory against
length for stock and each P. `--dry-run` runs the tiny test models for a few seconds.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.common import MIB, SAMPLES, LiveBytes, build_benchmark_model, real_image_processor
from tests.helpers.harness import run_distributed
from vlmcp_patch.fixtures.data import Segment, make_packed_batch
from vlmcp_patch.fixtures.probes import CollectiveProbe

BASE_TOKENS = {"text-heavy": 1878, "image-heavy": 884}  # the memory benchmark's rows


def scaled_layout(sample: str, factor: float) -> list[list[Segment]]:
    """The memory benchmark's two-sample row with its text and its pictures' areas scaled by `factor`."""
    side = math.sqrt(factor)
    scale = lambda w: max(32, int(round(w * side / 32)) * 32)  # noqa: E731 - whole merged patches of 16
    return [[Segment(text=max(1, round(s.text * factor))) if s.image is None else
             Segment(image=(scale(s.image[0]), scale(s.image[1]))) for s in sample_segments]
            for sample_segments in SAMPLES[sample]]


def packed_row(sample: str, tokens: int, tiny: bool) -> dict:
    if tiny:
        half = max(8, tokens // 2) // 2
        return make_packed_batch([[Segment(text=half), Segment(image=(16, 16)), Segment(text=half)]] * 2, seed=0)[0]
    processor = real_image_processor()
    factor = tokens / BASE_TOKENS[sample]
    return make_packed_batch(scaled_layout(sample, factor), seed=0, processor=processor)[0]


def _model(name: str, tiny: bool):
    if not tiny:
        return build_benchmark_model(name)
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

    return build_model((tiny_qwen3_vl_config if name == "qwen3-vl" else tiny_qwen3_5_config)(), seed=0)


def measure(rank: int, world_size: int, name: str, sample: str, tokens: int, stock: bool, tiny: bool,
            repeats: int = 1) -> dict:
    """One warm-up step (peak live bytes), then `repeats` timed steps of this rank: the one of least CPU time."""
    import vlmcp_patch
    from vlmcp_patch.forward import top_level

    torch.manual_seed(0)
    model, batch = _model(name, tiny), packed_row(sample, tokens, tiny)
    if stock:
        vlmcp_patch.revert()
    vlmcp_patch.enable(cp_size=world_size)
    agreement = _timed_agreement(top_level)
    live = LiveBytes([*model.parameters(), *model.buffers(), *(v for v in batch.values() if torch.is_tensor(v))])
    with live:
        model(**batch).loss.backward()
    peak = live.peak(excluded=live.ids_of(p.grad for p in model.parameters()))
    steps = [_timed_step(model, batch, agreement) for _ in range(repeats)]
    return {**min(steps, key=lambda step: step["cpu"]), "peak": peak, "tokens": batch["input_ids"].shape[1]}


def _timed_step(model, batch: dict, agreement: dict) -> dict:
    from vlmcp_patch.stats import STATS

    model.zero_grad(set_to_none=True)
    STATS.drain()
    agreement["seconds"] = 0.0
    with CollectiveProbe() as probe:
        wall, cpu = time.perf_counter(), time.thread_time()
        model(**batch).loss.backward()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return {"wall": wall, "cpu": cpu, "collectives": probe.total_seconds, "agreement": agreement["seconds"],
            "tokens_per_rank": STATS.drain().get("cp_tokens_per_rank")}


def _timed_agreement(top_level) -> dict:
    """Time spent in the batch agreement (checks, fingerprints, its collective) of the CP forwards."""
    record, agree = {"seconds": 0.0}, top_level.agree

    def timed_agree(*args, **kwargs):
        start = time.perf_counter()
        try:
            return agree(*args, **kwargs)
        finally:
            record["seconds"] += time.perf_counter() - start

    top_level.agree = timed_agree
    return record


def run_all(args) -> dict:
    """(model, sample, tokens) -> {"stock": [rank results], 1: [...], 2: [...], ...}"""
    results = {}
    for name in args.models:
        for sample in args.samples:
            for tokens in args.lengths:
                key = (name, sample, tokens)
                runs = {}
                for size in ("stock", 1, *args.sizes):
                    runs[size] = run_distributed(measure, 1 if size == "stock" else size, name, sample, tokens,
                                                 size == "stock", args.dry_run, args.repeats, timeout=7200)
                for size in args.sizes:  # the machine's own split: P stock processes at once on 1/P of the row
                    runs[f"stock/{size}"] = run_distributed(measure, size, name, sample, round(tokens / size), True,
                                                            args.dry_run, args.repeats, timeout=7200)
                results[key] = runs
                print(f"measured {key}", flush=True)
    return results


def _busiest(per_rank: list[dict], field: str) -> float:
    return max(r[field] for r in per_rank)


def _per_token(per_rank: list[dict]) -> float:
    """CPU seconds per token of the busiest of independent processes (each on its own row)."""
    return max(r["cpu"] / r["tokens"] for r in per_rank)


def summary_rows(results: dict, sizes: list[int]) -> list[dict]:
    rows = []
    for (name, sample, tokens), runs in results.items():
        stock, own = runs["stock"][0], runs[1][0]
        row = {"model": name, "sample": sample, "tokens": runs[1][0]["tokens"], "stock_s": stock["cpu"],
               "p1_s": own["cpu"], "p1_over_stock": own["cpu"] / stock["cpu"], "stock_peak": stock["peak"],
               "p1_peak": own["peak"], "p1_tokens_per_s": own["tokens"] / own["cpu"]}
        for size in sizes:
            ranks = runs[size]
            busiest = _busiest(ranks, "cpu")
            row[f"cp{size}_s"] = busiest
            row[f"cp{size}_efficiency"] = size * busiest / own["cpu"]
            row[f"cp{size}_machine"] = _per_token(runs[f"stock/{size}"]) / (stock["cpu"] / stock["tokens"])
            row[f"cp{size}_collectives"] = max(r["collectives"] / r["wall"] for r in ranks)
            row[f"cp{size}_agreement"] = max(r["agreement"] / r["wall"] for r in ranks)
            row[f"cp{size}_peak"] = _busiest(ranks, "peak")
            row[f"cp{size}_tokens_per_s"] = ranks[0]["tokens_per_rank"] / busiest
            row[f"cp{size}_split"] = ranks[0]["tokens_per_rank"]
        rows.append(row)
    return rows


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares exponent b of y ~ x^b."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))


def print_report(rows: list[dict], sizes: list[int]) -> None:
    head = f"{'model':9s} {'sample':12s} {'tokens':>6} {'stock s':>8} {'P=1 s':>7} {'P1/stock':>8}"
    for size in sizes:
        head += (f" {f'CP{size} s':>7} {f'eff{size}':>6} {f'mach{size}':>6} {f'coll{size}':>6} {f'agr{size}':>6}"
                 f" {f'tok/s{size}':>8}")
    print(head)
    for r in rows:
        line = (f"{r['model']:9s} {r['sample']:12s} {r['tokens']:>6d} {r['stock_s']:>8.4f} {r['p1_s']:>7.4f} "
                f"{r['p1_over_stock']:>8.3f}")
        for size in sizes:
            line += (f" {r[f'cp{size}_s']:>7.4f} {r[f'cp{size}_efficiency']:>6.3f} {r[f'cp{size}_machine']:>6.3f}"
                     f" {r[f'cp{size}_collectives']:>6.1%}"
                     f" {r[f'cp{size}_agreement']:>6.2%} {r[f'cp{size}_tokens_per_s']:>8.1f}")
        print(line)
    print("exponent of step time against length (log-log slope; 1 linear, 2 quadratic):")
    for key in sorted({(r["model"], r["sample"]) for r in rows}):
        mine = [r for r in rows if (r["model"], r["sample"]) == key]
        if len(mine) < 2:
            continue
        fits = {"stock": slope([(r["tokens"], r["stock_s"]) for r in mine]),
                "P=1": slope([(r["tokens"], r["p1_s"]) for r in mine])}
        fits.update({f"CP{s}": slope([(r["tokens"], r[f"cp{s}_s"]) for r in mine]) for s in sizes})
        print(f"  {key[0]:9s} {key[1]:12s} " + "  ".join(f"{k} {v:.2f}" for k, v in fits.items()))


def plot(rows: list[dict], sizes: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["sample"]) for r in rows})
    fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 7), squeeze=False)
    for col, key in enumerate(keys):
        mine = sorted((r for r in rows if (r["model"], r["sample"]) == key), key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in mine]
        series = [("stock P=1", "stock"), ("package P=1", "p1"), *((f"CP={s} (busiest rank)", f"cp{s}") for s in sizes)]
        for label, prefix in series:
            axes[0][col].plot(tokens, [r[f"{prefix}_s"] for r in mine], marker="o", label=label)
            axes[1][col].plot(tokens, [r[f"{prefix}_peak"] / MIB for r in mine], marker="o", label=label)
        axes[0][col].set(title=f"{key[0]}, {key[1]}", xscale="log", yscale="log", ylabel="step CPU time (s)")
        axes[1][col].set(xscale="log", yscale="log", xlabel="tokens of the packed row", ylabel="peak MiB per rank")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-vl", "qwen3.5"], choices=["qwen3-vl", "qwen3.5"])
    parser.add_argument("--samples", nargs="+", default=["text-heavy", "image-heavy"], choices=list(SAMPLES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed steps per configuration; each rank reports its least CPU time (shared machines)")
    parser.add_argument("--plot", help="draw step time and peak memory against length into this file")
    parser.add_argument("--dry-run", action="store_true", help="the tiny test models, a few seconds")
    args = parser.parse_args(argv)
    rows = summary_rows(run_all(args), args.sizes)
    print_report(rows, args.sizes)
    for r in rows:  # what the ratios were computed from: the CP runs really split the row
        print(f"split: {r['model']} {r['sample']} {r['tokens']} tokens -> "
              + ", ".join(f"CP{s} {r[f'cp{s}_split']} per rank" for s in args.sizes))
    if args.plot:
        plot(rows, args.sizes, args.plot)


if __name__ == "__main__":
    main()
