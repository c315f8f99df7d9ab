"""The ring's transfers behind its compute: ring attention's step (forward + backward) with each pass waited where it
starts (the schedule before the overlap) against the double-buffered ring (the pass posted before the block is
computed, waited after it), on CPU with gloo.

    python -m benchmarks.ring_overlap [--layouts 1x4 2x3] [--lengths 2048 4096 8192] [--heads 8] [--repeats 3]
    python -m benchmarks.ring_overlap --dry-run        (tiny, seconds: the tests run it)

Each layout U x R runs on P = U x R spawned ranks (`layout.Split`: U rings of R members over the zigzag chunks, each
member holding its subgroup's share for H / U heads); a row of `length` tokens of `--samples` equal samples. Per rank
and step: the step time, the time spent in the passes (posting them and waiting for them, `CollectiveProbe`: with the
passes waited where they start, the whole transfer; overlapped, what the compute did not hide) and the compute's CPU
time. Printed per layout and length, medians over the repeats, the two schedules alternating:

* old / new step time (the slowest rank's, which the ring runs at) and their ratio;
* hidden: the share of the old schedule's transfer time that the new one no longer waits for, 1 - wait_new / wait_old
  (mean over the ranks);
* busiest / mean: the busiest rank's compute against the ranks' mean, in CPU time of the computing thread (CPU time,
  so that ranks sharing fewer cores than they are do not read as imbalance), and by the layout's causal work (the
  pairs each ring member's queries attend: the zigzag chunks give every member the same for one sample).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tests.helpers.harness import run_distributed


def measure(rank: int, world_size: int, ulysses: int, lengths: list[int], heads: int, dim: int,
            repeats: int, samples: int = 3) -> dict:
    """On this rank, per length: [(schedule, step s, wait s, compute CPU s)] for `repeats` alternations of the two
    schedules (CPU: this thread's, the compute's — gloo moves the data on threads of its own)."""
    import vlmcp_patch
    from vlmcp_patch.attention import ring
    from vlmcp_patch.context import CPContext
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    vlmcp_patch.enable(cp_size=world_size)
    local_heads = heads // ulysses
    out = {}
    for length in lengths:
        cuts = [length * i // samples for i in range(samples + 1)]
        ctx = CPContext(cp=get_cp_group(world_size), segments=list(zip(cuts[:-1], cuts[1:])), ulysses=ulysses)
        peers, shares = ctx.groups.ring, ring.ring_shares(ctx)
        tokens = shares.positions[peers.index].numel()
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, local_heads, tokens, dim, generator=g, requires_grad=True) for _ in range(3))
        runs = []
        for _ in range(repeats + 1):  # the first round warms up
            for overlap in (False, True):
                vlmcp_patch.enable(ring_overlap=overlap)
                torch.distributed.barrier(ctx.cp.group)
                with CollectiveProbe() as probe:
                    start, cpu = time.perf_counter(), time.thread_time()
                    ring.ring_attention(q, k, v, shares, peers, dim ** -0.5).sum().backward()
                    step, cpu = time.perf_counter() - start, time.thread_time() - cpu
                waited = probe.seconds["ring pass wait"] + probe.seconds["batch_isend_irecv"]  # posting included
                runs.append(("new" if overlap else "old", step, waited, cpu))
        vlmcp_patch.enable(ring_overlap=True)
        out[length] = runs[2:]
    vlmcp_patch.enable(cp_size=1)
    return out


def work_balance(length: int, ulysses: int, ring_size: int, samples: int) -> float:
    """Busiest / mean ring member by causal work — the (query, key) pairs its queries may attend, what a flash kernel
    computes — from the layout alone (`layout.Split`, the zigzag chunks; the padding tail a segment of its own)."""
    from vlmcp_patch.layout import Split

    split = Split(length, ulysses * ring_size, ulysses)
    starts = torch.zeros(split.padded_len, dtype=torch.long)
    for i in range(samples + 1):  # each token's segment start: the samples', then the padding's
        first = length * i // samples if i < samples else length
        starts[first:] = first
    work = [float((split.subgroup_positions(g) - starts[split.subgroup_positions(g)] + 1).sum())
            for g in range(ring_size)]
    return max(work) / statistics.mean(work)


def summarize(per_rank: list[dict], length: int) -> dict:
    """The medians over repeats of the slowest rank's step, each rank's wait and compute, for both schedules."""
    result = {}
    for schedule in ("old", "new"):
        runs = [[(s, w, c) for name, s, w, c in r[length] if name == schedule] for r in per_rank]
        steps = [max(rank_runs[i][0] for rank_runs in runs) for i in range(len(runs[0]))]
        waits = [statistics.median(w for _, w, _ in rank_runs) for rank_runs in runs]
        computes = [statistics.median(c for _, _, c in rank_runs) for rank_runs in runs]
        result[schedule] = {"step": statistics.median(steps), "wait": statistics.mean(waits),
                            "busiest": max(computes) / statistics.mean(computes)}
    result["hidden"] = 1 - result["new"]["wait"] / result["old"]["wait"] if result["old"]["wait"] else 0.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x4", "2x3"], help="U x R")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8, help="query heads of the row (H / U per rank)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=3, help="equal samples packed in the row")
    parser.add_argument("--dry-run", action="store_true", help="tiny lengths, one repeat: that it runs")
    args = parser.parse_args()
    if args.dry_run:
        args.lengths, args.repeats, args.heads, args.dim = [96, 192], 1, 2, 8
    print(f"{'U x R':>6} {'tokens':>7} {'old s':>8} {'new s':>8} {'new/old':>8} {'wait old':>9} {'wait new':>9} "
          f"{'hidden':>7} {'busiest/mean':>13} {'work b/m':>9}")
    for layout in args.layouts:
        ulysses, ring_size = map(int, layout.split("x"))
        per_rank = run_distributed(measure, ulysses * ring_size, ulysses, args.lengths, args.heads, args.dim,
                                   args.repeats, args.samples, timeout=3600)
        for length in args.lengths:
            r = summarize(per_rank, length)
            old, new = r["old"], r["new"]
            print(f"{layout:>6} {length:>7} {old['step']:>8.4f} {new['step']:>8.4f} {new['step'] / old['step']:>8.2f} "
                  f"{old['wait']:>9.6f} {new['wait']:>9.6f} {r['hidden']:>7.0%} {new['busiest']:>13.2f} "
                  f"{work_balance(length, ulysses, ring_size, args.samples):>9.3f}")
    print("ring_overlap: done")


if __name__ == "__main__":
    main()
