"""The printed table and its assumptions, and the sizing table of docs/plan.md."""

from __future__ import annotations

from .dims import ModelDims
from .hardware import GIB, Hardware
from .host import HOST_GIB_PER_RANK, HOST_NODE_SHARE, loader_text
from .rows import Row
from .table import PlanRow, plan
from .training import Training


def format_table(rows: list[PlanRow], dims: ModelDims, row: Row, hw: Hardware, t: Training,
                 gpus_per_node: int) -> str:
    """The table and, under it, its assumptions."""
    lines = [f"{dims.name}: {row.tokens:,} tokens ({row.vision_tokens:,} vision tokens, "
             f"{row.patches(dims):,} patches), longest sample {row.longest_sample:,}; {hw.name}, "
             f"{hw.memory_gib:g} GiB, nodes of {gpus_per_node}",
             f"{'P':>4} {'UxR':>6} {'nodes':>5} {'peak GiB':>8} {'fits':>4} "
             f"{'GC off' if t.gradient_checkpointing else 'GC on':>7} {'w+g+opt':>7} {'act':>6} {'work':>6} "
             f"{'head':>5} {'exch':>5} {'host/node':>9} {'step s':>8} {'compute':>8} {'a2a':>6} {'ring':>6} "
             f"{'ring ov':>7} {'dn st':>6} {'zero3':>6} {'copies':>6} {'cp exp':>6} {'tok/s/GPU':>9}  mark"]
    for r in rows:
        m, tm = r.memory, r.time
        g = lambda x: f"{x / GIB:.1f}"  # noqa: E731
        mark_text = ("* " if r.smallest else "") + ("> " if r.fastest else "") + r.why
        lines.append(f"{r.size:>4} {f'{r.ulysses}x{r.ring}':>6} {r.nodes:>5} {r.peak_gib:>8.1f} "
                     f"{_fits(r):>4} {r.other_checkpointing_gib:>7.1f} "
                     f"{g(m.weights + m.gradients + m.optimizer):>7} "
                     f"{g(m.activations + m.forward_only):>6} {g(m.working):>6} {g(m.head + m.head_weight):>5} "
                     f"{g(max(m.exchange, m.scratch)):>5} "
                     f"{r.host_gib_per_node:>9.1f} {tm.total:>8.2f} {tm.compute:>8.2f} {tm.all_to_all:>6.2f} "
                     f"{tm.ring:>6.2f} {tm.ring_overlapped:>7.2f} {tm.deltanet_state:>6.3f} {tm.sharding:>6.2f} "
                     f"{tm.offload_copies:>6.2f} {tm.offload:>6.2f} {r.tokens_per_s_per_gpu:>9.0f}  {mark_text}")
    lines += assumptions(dims, hw, t)
    return "\n".join(lines)


def _fits(r: PlanRow) -> str:
    """'yes', or what the row overflows: 'dev' (the GPU), 'host' (the node's host memory), 'both'."""
    return "yes" if r.fits else {"device": "dev", "host": "host"}.get(r.binds, "both")


def assumptions(dims: ModelDims, hw: Hardware, t: Training) -> list[str]:
    return [
        "marks: * smallest P that fits (the package's layout); > fastest per GPU among those that fit; fits: 'yes', "
        "or what the row overflows ('dev': the GPU's usable memory less the margin, 'host': the node's host memory); "
        "'exch': the exchange buffers or the kernels' scratch (flash-attn's backward, a norm tile), the larger; "
        f"'{'GC off' if t.gradient_checkpointing else 'GC on'}': the peak with checkpointing switched "
        f"{'off' if t.gradient_checkpointing else 'on'}; memory parts in GiB, times in s",
        f"assumptions: {dims.params() / 1e9:.2f}B parameters; bf16 weights and gradients, fp32 Adam "
        f"({'offloaded' if t.offload_optimizer else 'on the GPU'}), sharding {t.sharding} over P x {t.dp} ranks; "
        f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}; usable memory "
        f"{hw.usable:.0%} of {hw.memory_gib:g} GiB, of which the row leaves {hw.margin:.0%} free (--margin)",
        f"  host/node: {hw.host_memory_gib:,.0f} GiB per node (--host-memory-gib) for the checkpoint pools as "
        "allocated, the offloaded optimizer as DeepSpeed holds it (states and fp32 gradients, pinned blocks), every "
        "rank's batch (the row's integers, 1/P of its pixel values plus one item), its data loader's "
        f"({loader_text(t)}: --loader-workers, --collation, --pixel-dtype, --no-pin-memory, --accumulation-steps; "
        "--host-breakdown prints each term) and an allowance of "
        f"{HOST_GIB_PER_RANK:g} GiB per rank and {HOST_NODE_SHARE:.0%} of the node (docs/plan.md)",
        f"  attained rates: matmul {hw.matmul_tflops:g}, attention {hw.attention_tflops:g}, DeltaNet "
        f"{hw.deltanet_tflops:g} TFLOP/s; links NVLink {hw.nvlink_gbs:g} GB/s, IB {hw.ib_gbs:g} GB/s per GPU, "
        f"{hw.latency_s * 1e6:g} us per collective step",
        "  activation constants fitted on CPU (the recomputed layer's at P=1 and 2) and checked at P=2..8 "
        "(docs/plan.md); vision work split evenly; "
        + (f"ring passes overlapped with compute, {hw.ring_hidden:.0%} of their time hidden as measured on CPU (the "
           "step counts 'ring ov')" if t.ring_overlap else
           "ring passes priced without overlap (--no-ring-overlap; 'ring ov': what overlap leaves)"),
        "  MLPs " + ("in sequence tiles under CP (P > 1; --no-mlp-tiles prices them whole)" if t.tiled_mlp else
                     "whole (--no-mlp-tiles)")
        + "; RMSNorms " + ("recomputed in backward under CP (P > 1; --no-recompute-norms keeps their fp32 copies)"
                           if t.recompute_norms else "as transformers keeps them (--no-recompute-norms)")
        + "; vision tower " + ("over tiles of items under CP (P > 1; ZeRO-3 gathers it whole; not under FSDP; "
                               "--no-vision-tiles prices it whole)" if t.tiled_vision else "over the rank's whole share "
                               "(--no-vision-tiles)")
        + "; checkpoints " + (f"offloaded to the host (host/node: the pools of the node's ranks"
                              f"{' and the optimizer' if t.offload_optimizer else ''}; copies at {hw.host_gbs:g} GB/s "
                              "per GPU each way, 'cp exp' what compute does not hide)" if t.offload_checkpoints
                              else "on the GPU (--offload-checkpoints moves them to the host)"),
    ]



SIZING_MODELS = ("qwen3-vl-8b", "qwen3.5-27b")
SIZING_TOKENS = (131072, 524288, 1048576)


def sizing_table(gpu: str = "h100", gpus_per_node: int = 8, max_gpus: int = 256) -> str:
    """Markdown: for each model and video row of 128K / 512K / 1M tokens, the smallest P that fits (the package's
    layout), its peak and tokens/s per GPU, and the fastest layout that fits (ZeRO-3, checkpointing, defaults)."""
    lines = ["| model | row (video) | GPUs (nodes) | layout U x R | peak GiB / GPU | step s | tokens/s per GPU | "
             "fastest that fits: P, U x R, tokens/s per GPU |", "|---|---|---|---|---|---|---|---|"]
    for name in SIZING_MODELS:
        for tokens in SIZING_TOKENS:
            rows = plan(name, Row.video(tokens), gpu=gpu, gpus_per_node=gpus_per_node, max_gpus=max_gpus)
            small = next((r for r in rows if r.smallest), None)
            fast = next((r for r in rows if r.fastest), None)
            if small is None:
                lines.append(f"| {name} | {tokens // 1024}K | more than {max_gpus} | | | | | |")
                continue
            lines.append(f"| {name} | {tokens // 1024}K | {small.size} ({small.nodes}) | "
                         f"{small.ulysses} x {small.ring} | {small.peak_gib:.1f} | {small.time.total:.1f} | "
                         f"{small.tokens_per_s_per_gpu:,.0f} | "
                         f"{fast.size}, {fast.ulysses} x {fast.ring}, {fast.tokens_per_s_per_gpu:,.0f} |")
    return "\n".join(lines)


# The setups of the longest-row table: (what is offloaded, the step's training). The last is ALST's (DeepSpeed's
# optimizer offload beside the checkpoints'), for a like-for-like comparison with its published lengths.
LONGEST_SETUPS = (("nothing", Training()), ("checkpoints", Training(offload_checkpoints=True)),
                  ("checkpoints, optimizer", Training(offload_checkpoints=True, offload_optimizer=True)))


def longest_table(gpus_per_node: int = 8, gpus=("h100", "h200")) -> str:
    """Markdown: for each model of the sizing table, the longest video row on one node of `gpus_per_node` GPUs in
    each of `LONGEST_SETUPS` (ZeRO-3, checkpointing, MLPs in tiles, the default rates, margin and host memory):
    its device peak and host per node against their budgets, and which one binds."""
    from .longest import longest_row

    lines = ["| model | GPUs | offloaded | longest video row | U x R | device GiB / GPU (budget) | "
             "host GiB / node (budget) | binds | step s | copies s (exposed) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SIZING_MODELS:
        for gpu in gpus:
            for where, training in LONGEST_SETUPS:
                best = longest_row(name, "video", gpu, gpus_per_node, training)
                if best.row is None:
                    lines.append(f"| {name} | {gpus_per_node} {gpu.upper()} | {where} | none | | | | "
                                 f"{best.binds} | | |")
                    continue
                r, tm = best.row, best.row.time
                copies = f"{tm.offload_copies:.1f} ({tm.offload:.1f})" if training.offload_checkpoints else "—"
                parked = ", vision features (by need)" if r.memory.host_features else ""
                lines.append(f"| {name} | {gpus_per_node} {gpu.upper()} | {where}{parked} | {best.tokens:,} "
                             f"({best.tokens / 1e6:.2f}M) | {r.ulysses} x {r.ring} | {r.peak_gib:.1f} "
                             f"({r.device_budget_gib:.1f}) | {r.host_gib_per_node:,.0f} ({r.host_budget_gib:,.0f}) | "
                             f"{best.binds} | {tm.total:.0f} | {copies} |")
    return "\n".join(lines)
