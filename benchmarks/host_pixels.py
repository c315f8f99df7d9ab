"""A long video row's pixel values on the host, before and after each rank keeps only its share
(`vlmcp_patch/forward/host_pixels.py`; docs/memory.md, "Pixel values on the host"): arithmetic, no run.

    python -m benchmarks.host_pixels [--patches 16800000] [--side 448] [--cp-size 8] [--ranks-per-node 8]

A row of `--patches` video patches of Qwen3-VL's 1,536 values (3 channels x 2 frames x 16 x 16), fp32 as the
processor returns them, frames of `--side` pixels square (`(side / 16)^2` patches per temporal group of 2 frames).
The share by items of a video split into its temporal groups holds 1/P of them plus at most one group
(`layout.contiguous_ranks`). Decode time: lmms-engine's Qwen3-VL Ulysses PR #59, one worker 93 s for 29,981 frames.
"""

from __future__ import annotations

import argparse

WIDTH = 3 * 2 * 16 * 16
FP32 = 4
DECODE_S_PER_FRAME = 93 / 29_981
GB = 1e9


def host_pixel_bytes(patches: int, side: int, cp_size: int, ranks_per_node: int) -> dict:
    """Bytes and seconds per rank and per node of a row's pixel values: held whole (before), held as this rank's
    share by items (now), while the collator joins the decoded frames (every rank, before the cut), and the decode."""
    group = (side // 16) ** 2
    row, unit = patches * WIDTH * FP32, group * WIDTH * FP32
    frames = 2 * -(-patches // group)
    share = row / cp_size + unit
    return {
        "frames": frames, "row": row, "unit": unit,
        "before": (row, ranks_per_node * row), "now": (share, ranks_per_node * share),
        "collating": (2 * row, 2 * ranks_per_node * row),
        "decode_s": (frames * DECODE_S_PER_FRAME, frames * DECODE_S_PER_FRAME / cp_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=16_800_000)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    args = parser.parse_args()
    n = host_pixel_bytes(args.patches, args.side, args.cp_size, args.ranks_per_node)
    print(f"{args.patches / 1e6:.1f}M patches, {n['frames']:,} frames, row {n['row'] / GB:.1f} GB fp32, "
          f"one temporal group {n['unit'] / 1e6:.1f} MB; P={args.cp_size}, {args.ranks_per_node} ranks per node")
    for name, what in (("before", "held, every rank the whole row"), ("now", "held, 1/P + one group, per batch"),
                       ("collating", "while collating, every rank (before the cut)")):
        rank, node = n[name]
        print(f"{what:48s} {rank / GB:8.1f} GB per rank {node / GB:9.1f} GB per node")
    whole, share = n["decode_s"]
    print(f"{'decode, the whole video on every rank':48s} {whole:8.0f} s;  its share only: {share:.1f} s")


if __name__ == "__main__":
    main()
