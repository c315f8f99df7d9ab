"""A long video row's pixel values on the host, before and after each rank keeps only its share
(`vlmcp_patch/forward/host_pixels.py`; docs/memory.md, "Pixel values on the host"): arithmetic, no run.

    python -m benchmarks.host_pixels [--patches 16800000] [--side 448] [--cp-size 8] [--ranks-per-node 8]
    python -m benchmarks.host_pixels --measure


A row of `--patches` video patches of Qwen3-VL's 1,536 values (3 channels x 2 frames x 16 x 16), fp32 as the
processor returns them, frames of `--side` pixels square (`(side / 16)^2` patches per temporal group of 2 frames).
The share by items of a video split into its temporal groups holds 1/P of them plus at most one group
(`layout.contiguous_ranks`). Decode time: lmms-engine's Qwen3-VL Ulysses PR #59, one worker 93 s for 29,981 frames.
Decoding its share only (`vlmcp_patch.ShareDecoding`) a rank holds at most the share and one call's groups
(`share_decode.GROUPS_PER_CALL`), fp32 as the processor returns them.

`--measure` runs the tiny row of `tests/helpers/share_decode_cases.py` (a video of eight temporal groups and four
images) in one process, for each rank of P = 2 and 4: the most pixel-storage bytes alive while it is decoded whole and
cut (today's loaders) and while `ShareDecoding` decodes the rank's share, one group a call.
"""

from __future__ import annotations

import argparse

from vlmcp_patch.share_decode import GROUPS_PER_CALL

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
        "decoding_share": (share + GROUPS_PER_CALL * unit, ranks_per_node * (share + GROUPS_PER_CALL * unit)),
        "decode_s": (frames * DECODE_S_PER_FRAME, frames * DECODE_S_PER_FRAME / cp_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=16_800_000)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--measure", action="store_true", help="measure the tiny row's decode (one process)")
    args = parser.parse_args()
    if args.measure:
        measure()
        return
    n = host_pixel_bytes(args.patches, args.side, args.cp_size, args.ranks_per_node)
    print(f"{args.patches / 1e6:.1f}M patches, {n['frames']:,} frames, row {n['row'] / GB:.1f} GB fp32, "
          f"one temporal group {n['unit'] / 1e6:.1f} MB; P={args.cp_size}, {args.ranks_per_node} ranks per node")
    for name, what in (("before", "held, every rank the whole row"), ("now", "held, 1/P + one group, per batch"),
                       ("collating", "while collating, every rank (before the cut)"),
                       ("decoding_share", f"while decoding its share (+ {GROUPS_PER_CALL} groups)")):
        rank, node = n[name]
        print(f"{what:48s} {rank / GB:8.1f} GB per rank {node / GB:9.1f} GB per node")
    whole, share = n["decode_s"]
    print(f"{'decode, the whole video on every rank':48s} {whole:8.0f} s;  its share only: {share:.1f} s")


def measure() -> None:
    """The tiny row's pixel bytes alive per rank: decoded whole then cut, against decoded as the rank's share."""
    from tests.helpers import share_decode_cases as cases
    from tests.helpers.host_pixel_cases import pixel_bytes_alive
    from vlmcp_patch.forward.host_pixels import keep_pixel_share

    whole, _ = cases.build(1, 0)
    whole_bytes = sum(whole[key].nbytes for key in ("pixel_values", "pixel_values_videos"))
    del whole
    print(f"tiny row: {whole_bytes:,} B of pixel values (fp32); the most alive per rank while its batch is built")
    for size in (2, 4):
        for rank in range(size):
            collated, _ = cases.build(1, 0)
            cut = keep_pixel_share(collated, size, rank)
            at_cut = pixel_bytes_alive(cases.PIXEL_WIDTH)
            del collated, cut
            batch, decodes = cases.build(size, rank, measuring=True, groups_per_call=1)
            share = sum(batch[key].nbytes for key in ("pixel_values", "pixel_values_videos"))
            del batch
            print(f"P={size} rank {rank}: decoded whole then cut {at_cut:8,} B; decoding its share {decodes.most:8,} B "
                  f"(its share {share:,} B)")


if __name__ == "__main__":
    main()
