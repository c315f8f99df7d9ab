"""Attention by head chunks (`VLMCP_HEAD_CHUNKS`) on CPU with gloo: one attention layer's memory and step time per
rank, chunked against unchunked, from one run.

    python -m benchmarks.head_chunks [--cp 2] [--ulysses 0] [--length 4096] [--heads 16] [--kv-heads 4] [--dim 64]
                                     [--chunks 2 4] [--repeats 3]
    python -m benchmarks.head_chunks --dry-run        (tiny, seconds)

Each rank holds its slice of a row of `--length` tokens (three samples) as q, k, v for all heads, as a decoder layer
hands them to the attention, and runs the package's attention over CP (`ulysses.attention_over_cp` around
transformers' sdpa function) forward and backward. Measured with torch's profiler's memory events (each operator's
own allocations less its own frees, in the order the operators started), relative to what was allocated before the step:

* forward peak: the most bytes held at once during the forward;
* held: what the forward leaves allocated for backward (the output and the tensors saved for backward);
* backward peak: the most bytes held at once during the backward (the held bytes included);

and the step time (forward + backward, median over `--repeats`, without the profiler). Printed per chunk count with
its ratio to unchunked (N=1), rank 0's figures.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from tests.helpers.harness import run_distributed

MIB = 2**20


class _Stub(torch.nn.Module):
    """What transformers' sdpa function reads of an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.is_causal, self.num_key_value_groups = True, groups


def _profiled(fn):
    """`fn()` under torch's profiler with memory events: (its result, the bytes it left allocated, its peak), both
    relative to what was allocated before it (a free of an older tensor counts negative). Each operator's own
    allocations less its own frees, in the order the operators started (a temporary an operator allocates and frees
    inside itself, a kernel's scratch, is not seen)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, live, peak


def measure(rank: int, world_size: int, ulysses: int, length: int, heads: int, kv_heads: int, dim: int,
            chunk_counts: list[int], repeats: int) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import vlmcp_patch
    from vlmcp_patch.attention.ulysses import attention_over_cp
    from vlmcp_patch.context import CPContext
    from vlmcp_patch.distributed import get_cp_group

    vlmcp_patch.enable(cp_size=world_size, ulysses_size=ulysses)
    cuts = [0, length // 3, length // 2, length]
    ctx = CPContext(cp=get_cp_group(world_size), segments=list(itertools.pairwise(cuts)),
                    ulysses=ulysses or world_size)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, ctx.padded_len, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
    local = [ctx.shard(t, 2).contiguous().requires_grad_(True) for t in full]
    del full
    module = _Stub(heads // kv_heads)
    weights = torch.randn(1, local[0].shape[2], heads, dim, generator=g)

    def forward():
        out = attention_over_cp(sdpa_attention_forward, "sdpa", module, *local, ctx, {"scaling": dim ** -0.5})
        return (out * weights).sum()

    def step():
        for t in local:
            t.grad = None
        forward().backward()

    results = {}
    for chunks in [1, *chunk_counts]:
        vlmcp_patch.enable(head_chunks=chunks)
        step()  # warm up
        times = []
        for _ in range(repeats):
            torch.distributed.barrier(ctx.cp.group)
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        torch.distributed.barrier(ctx.cp.group)
        for t in local:
            t.grad = None
        loss, held, fwd_peak = _profiled(forward)
        _, _, bwd_extra = _profiled(loss.backward)
        results[chunks] = {"fwd_peak": fwd_peak, "held": held, "bwd_peak": held + bwd_extra,
                           "step_s": statistics.median(times)}
    vlmcp_patch.enable(cp_size=1, head_chunks=1, ulysses_size=0)
    return {"layout": (ctx.groups.ulysses.size, ctx.ring_size), "results": results}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=0, help="U (0: P, no ring)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.length, args.heads, args.kv_heads, args.dim, args.chunks, args.repeats = 96, 8, 2, 8, [2], 1
    per_rank = run_distributed(measure, args.cp, args.ulysses, args.length, args.heads, args.kv_heads, args.dim,
                               args.chunks, args.repeats, timeout=1800)
    first = per_rank[0]
    u, r = first["layout"]
    print(f"head_chunks: P={args.cp} (U x R = {u} x {r}), {args.length} tokens, {args.heads} query / {args.kv_heads} "
          f"KV heads of {args.dim}, fp32; rank 0, relative to what was allocated before the step")
    base = first["results"][1]
    print(f"{'N':>3} {'fwd peak MiB':>13} {'held MiB':>9} {'bwd peak MiB':>13} {'step s':>8} | "
          f"{'fwd peak':>8} {'held':>6} {'bwd peak':>8} {'step':>6} (x unchunked)")
    for chunks, m in first["results"].items():
        print(f"{chunks:>3} {m['fwd_peak'] / MIB:>13.1f} {m['held'] / MIB:>9.1f} {m['bwd_peak'] / MIB:>13.1f} "
              f"{m['step_s']:>8.3f} | {m['fwd_peak'] / base['fwd_peak']:>8.3f} {m['held'] / base['held']:>6.3f} "
              f"{m['bwd_peak'] / base['bwd_peak']:>8.3f} {m['step_s'] / base['step_s']:>6.3f}")
    print("head_chunks: done")


if __name__ == "__main__":
    main()
