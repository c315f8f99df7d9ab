"""DeltaNet's state across the ring: what one layer's exchange moves and what it costs in the layer's step.

    python -m benchmarks.deltanet_state [--sizes 3 6 8] [--lengths 1536 3072] [--scale 4] [--repeats 2]
    python -m benchmarks.deltanet_state --dry-run        (tiny, seconds: the tests run it)

One Qwen3.5 gated DeltaNet layer (32 value / 16 key heads of 128, widths divided by `--scale`) under CP at P ranks
as a ring of P (U = 1: every rank holds every head, the state's exchange at its largest), forward + backward on a row
of three samples, each rank on one thread. The state crosses the ring as in LASP-2 (`models/deltanet_ring.py`): every
rank computes the affine transfer [M | B] (value heads x d_k x (d_k + d_v), fp32) of its two chunks, one all-gather
hands every rank all of them, each folds those before its chunks locally — no chain of waits; backward sums their
gradients with one reduce-scatter. The conv's halos (d_conv - 1 tokens of the conv channels per chunk) take one more
all-gather and reduce-scatter. Printed per P and length, medians over the repeats: bytes each rank sends per layer,
forward (the two all-gathers) and backward (the two reduce-scatters' input, R times the forward's: a ring
reduce-scatter moves (R - 1) / R of it, half an all-reduce's traffic), against the formula; the layer's step (slowest
rank); and the share of it spent inside those collectives (waiting for the slower ranks included). The bytes do not
depend on the length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tests.helpers.harness import run_distributed
from vlmcp_patch.fixtures.probes import GATHERS, SCATTERS


def _layer(scale: int):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=2048 // scale, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128 // scale, linear_value_head_dim=128 // scale,
                               linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(config, layer_idx=0)


def formula_bytes(layer, size: int) -> dict[str, int]:
    """Bytes one rank sends per layer at a ring of `size` (U = 1), fp32: forward, its two chunks' transfers
    (H_v x d_k x (d_k + d_v) each) and conv halos (channels x (d_conv - 1) each); backward, the reduce-scatter of
    the gradient of what the ring gathered (its input: `size` times that)."""
    transfers = 2 * layer.num_v_heads * layer.head_k_dim * (layer.head_k_dim + layer.head_v_dim) * 4
    halos = 2 * layer.conv_dim * (layer.conv_kernel_size - 1) * 4
    return {"forward": transfers + halos, "backward": size * (transfers + halos)}


def measure(rank: int, world_size: int, lengths: list[int], scale: int, repeats: int) -> dict:
    import vlmcp_patch
    from vlmcp_patch.context import CPContext
    from vlmcp_patch.fixtures.probes import CollectiveProbe
    from vlmcp_patch.layout import segments_from_lengths

    vlmcp_patch.enable(cp_size=world_size)
    cp = vlmcp_patch.get_cp_group(world_size)
    layer = _layer(scale)
    out = {}
    for length in lengths:
        ctx = CPContext(cp=cp, segments=segments_from_lengths([length // 3, length // 3, length - 2 * (length // 3)]),
                        ulysses=1)
        g = torch.Generator().manual_seed(1)
        row = torch.randn(1, length, layer.hidden_size, generator=g)
        runs = []
        for _ in range(repeats + 1):  # the first warms up
            layer.zero_grad()
            torch.distributed.barrier(cp.group)
            with CollectiveProbe() as forward:
                start = time.perf_counter()
                local = layer(ctx.shard(row, dim=1), attention_mask=None, vlmcp_ctx=ctx)
            with CollectiveProbe() as backward:
                local.sum().backward()
                step = time.perf_counter() - start
            runs.append({"step": step, "forward": sum(forward.bytes[n] for n in GATHERS),
                         "backward": sum(backward.bytes[n] for n in SCATTERS),
                         "inside": sum(forward.seconds[n] for n in GATHERS)
                         + sum(backward.seconds[n] for n in SCATTERS)})
        out[length] = runs[1:]
    vlmcp_patch.enable(cp_size=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 6, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1536, 3072])
    parser.add_argument("--scale", type=int, default=4, help="widths divided by this (the head counts kept)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="tiny lengths and widths, one repeat: that it runs")
    args = parser.parse_args()
    if args.dry_run:
        args.sizes, args.lengths, args.scale, args.repeats = [3], [96], 16, 1
    layer = _layer(args.scale)
    print(f"{'P':>2} {'tokens':>7} {'fwd KiB':>9} {'formula':>9} {'bwd KiB':>9} {'formula':>9} {'step s':>8} "
          f"{'in state collectives':>21}")
    for size in args.sizes:
        per_rank = run_distributed(measure, size, args.lengths, args.scale, args.repeats, timeout=3600)
        formula = formula_bytes(layer, size)
        for length in args.lengths:
            runs = [r[length] for r in per_rank]
            forward = statistics.median(run["forward"] for run in runs[0])
            backward = statistics.median(run["backward"] for run in runs[0])
            steps = [max(rank_runs[i]["step"] for rank_runs in runs) for i in range(len(runs[0]))]
            inside = statistics.mean(statistics.median(run["inside"] / run["step"] for run in r) for r in runs)
            print(f"{size:>2} {length:>7} {forward / 1024:>9.1f} {formula['forward'] / 1024:>9.1f} "
                  f"{backward / 1024:>9.1f} {formula['backward'] / 1024:>9.1f} {statistics.median(steps):>8.4f} "
                  f"{inside:>21.1%}")
    print("deltanet_state: done")


if __name__ == "__main__":
    main()
