"""`python -m vlmcp_patch plan ...`: the command line of the cost model."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .dims import MODELS, model_dims
from .hardware import DEVICE_MARGIN, DGX_HOST_GIB, GPUS, hardware
from .longest import host_breakdown, longest_lines
from .printing import format_table, longest_table, sizing_table
from .rows import Row
from .table import plan
from .training import PIXEL_DTYPES, Training

DESCRIPTION = ("Plan before you book: a cost model of one CP training step — per-rank peak memory and step time — "
               "for each CP")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a tile holds at least 1 (--no-mlp-tiles / --no-vision-tiles price "
                                         "tiling off)")
    return value


def _steps(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: an optimizer step takes at least 1 batch")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a share of the usable memory, 0 <= margin < 1 (0.05 is 5 %)")
    return value


def _pixels(text: str, parts: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.lower().split("x"))
    if len(values) != parts:
        raise ValueError(f"{text!r}: expected {parts} numbers joined by x")
    return values


def main(argv=None) -> int:
    """`python -m vlmcp_patch plan ...`: print the table for one model and row."""
    p = argparse.ArgumentParser(prog="python -m vlmcp_patch plan", description=DESCRIPTION)
    p.add_argument("--model", default="qwen3-vl-8b",
                   help=f"{', '.join(MODELS)}, tiny-qwen3-vl, tiny-qwen3.5, or a config.json (file or folder)")
    what = p.add_argument_group("the row (one of: --tokens, --video-tokens, or --text / --image / --video)")
    what.add_argument("--tokens", type=int, help="a text row of this many tokens (one sample)")
    what.add_argument("--video-tokens", type=int, help="a row of one video (448 x 448 frames) of this many tokens")
    what.add_argument("--text", type=int, default=0, help="text tokens beside --image / --video")
    what.add_argument("--image", action="append", default=[], help="HxW pixels; repeat for more")
    what.add_argument("--video", action="append", default=[], help="FRAMESxHxW pixels; repeat for more")
    what.add_argument("--sample-tokens", type=int, default=0, help="the longest packed sample (default: the row)")
    hw = p.add_argument_group("the cluster")
    hw.add_argument("--gpu", default="h100", choices=list(GPUS))
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--memory-gib", type=float, help="GPU memory (default: the GPU's)")
    hw.add_argument("--host-memory-gib", type=float,
                    help=f"the node's host memory, GiB (default {DGX_HOST_GIB:,.0f}: a DGX H100 / H200's 2 TB)")
    hw.add_argument("--margin", type=_share,
                    help=f"share of the usable GPU memory the row leaves free (default {DEVICE_MARGIN:g})")
    hw.add_argument("--max-gpus", type=int, default=128)
    hw.add_argument("--sizes", type=int, nargs="+", help="CP sizes to price (default: 1, 2, 4, then whole nodes)")
    for name in ("matmul_tflops", "attention_tflops", "deltanet_tflops", "nvlink_gbs", "ib_gbs"):
        hw.add_argument("--" + name.replace("_", "-"), type=float,
                        help="attained rate (benchmarks.gpu_check prints it)")
    hw.add_argument("--latency-us", type=float, help="per collective step, microseconds")
    tr = p.add_argument_group("training")
    tr.add_argument("--sharding", default="zero3", choices=["none", "zero1", "zero2", "zero3", "fsdp"])
    tr.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the CP group (ZeRO shards over all)")
    tr.add_argument("--no-gradient-checkpointing", action="store_true")
    tr.add_argument("--offload-optimizer", action="store_true")
    tr.add_argument("--freeze-vision", action="store_true")
    tr.add_argument("--no-ring-overlap", dest="ring_overlap", action="store_false",
                    help="price the ring's passes as if each completed before its block is computed (the serial "
                    "schedule, VLMCP_RING_OVERLAP=0)")
    tr.add_argument("--offload-checkpoints", action="store_true",
                    help="price VLMCP_OFFLOAD_CHECKPOINTS=1: the checkpointed inputs in host memory")
    tr.add_argument("--no-mlp-tiles", dest="tiled_mlp", action="store_false",
                    help="price VLMCP_MLP_TILE_TOKENS=0 (the MLPs whole; by default they run in tiles under CP)")
    tr.add_argument("--mlp-tile-tokens", type=_positive,
                    help="price VLMCP_MLP_TILE_TOKENS=N (tokens per MLP tile; by default the package's automatic rule)")
    tr.add_argument("--vision-tile-patches", type=_positive,
                    help="price VLMCP_VISION_TILE_PATCHES=N (patches per vision tile; by default the automatic rule)")
    tr.add_argument("--no-recompute-norms", dest="recompute_norms", action="store_false",
                    help="price VLMCP_RECOMPUTE_NORMS=0 (the RMSNorms keep their fp32 intermediates; by default they "
                    "keep their input only under CP, recomputed in backward)")
    tr.add_argument("--no-vision-tiles", dest="tiled_vision", action="store_false",
                    help="price VLMCP_VISION_TILE_PATCHES=0 (the vision tower over the rank's whole share; by "
                    "default it runs over tiles of items under CP, except under FSDP)")
    hw.add_argument("--host-link-gbs", type=float,
                    help=f"host link per GPU and direction, GB/s (default {GPUS['h100'].host_gbs:g}: PCIe Gen5 x16, "
                    "effective)")
    hw.add_argument("--ring-hidden", type=float,
                    help=f"share of the ring's transfer that overlap hides (default {GPUS['h100'].ring_hidden:g}, "
                    "measured on CPU: docs/speed.md)")
    tr.add_argument("--collation", choices=["whole", "share"], default="whole",
                    help="how the data loader brings the pixel values to the host: every rank decodes the whole row, "
                    "then keeps its share (whole, the package's cut after the collator), or only its share (share: "
                    "the per-rank decode, vlmcp_patch.share_decode)")
    tr.add_argument("--pixel-dtype", choices=list(PIXEL_DTYPES), default="fp32",
                    help="the pixel values' dtype as the data loader hands them to the ranks: fp32 (the Qwen-VL "
                    "processors' own) or bf16 (the model's, bit-identical once the patch embedding casts; only with "
                    "--collation share, whose per-rank decode takes a dtype)")
    tr.add_argument("--loader-workers", type=int, default=0,
                    help="the data loader's worker processes (dataloader_num_workers; default 0, the HF Trainer's): "
                    "each collates a row at once and queues finished ones on the host")
    tr.add_argument("--no-pin-memory", dest="pin_memory", action="store_false",
                    help="price dataloader_pin_memory=False (by default the data loader pins each batch, as the HF "
                    "Trainer does on a GPU machine: each tensor a power-of-two block of torch's caching host "
                    "allocator)")
    tr.add_argument("--accumulation-steps", type=_steps, default=1,
                    help="gradient_accumulation_steps: the Trainer fetches an optimizer step's batches at once and "
                    "holds the previous step's while it does (priced on the host; default 1)")
    tr.add_argument("--host-breakdown", action="store_true",
                    help="the host terms per node each total counts, in its phase: under each --longest line, and "
                    "under the table one line per row")
    tr.add_argument("--chosen-only", action="store_true", help="only the package's layout at each P")
    tr.add_argument("--longest", action="store_true",
                    help="print only the longest row (video for a model with vision, else text) on one node of "
                    "--gpus-per-node H100 and H200 that fits both the GPUs (with --margin) and the host "
                    "(--host-memory-gib), and which of the two binds")
    tr.add_argument("--sizing-table", action="store_true", help="print docs/plan.md's two tables and stop")
    a = p.parse_args(argv)
    if a.pixel_dtype != "fp32" and a.collation == "whole":
        p.error(f"--pixel-dtype {a.pixel_dtype} needs --collation share: with the whole row collated every rank "
                "holds the processor's fp32 pixel values, and the cut keeps their dtype (only the per-rank decode, "
                "vlmcp_patch.share_decode, hands them over in another)")
    if a.sizing_table:
        print(sizing_table(a.gpu, a.gpus_per_node))
        print()
        print(longest_table(a.gpus_per_node))
        return 0
    dims = model_dims(a.model)
    training = Training(sharding=a.sharding, gradient_checkpointing=not a.no_gradient_checkpointing, dp=a.dp,
                        offload_optimizer=a.offload_optimizer, freeze_vision=a.freeze_vision,
                        ring_overlap=a.ring_overlap, offload_checkpoints=a.offload_checkpoints,
                        tiled_mlp=a.tiled_mlp, tiled_vision=a.tiled_vision, recompute_norms=a.recompute_norms,
                        mlp_tile_tokens=a.mlp_tile_tokens, vision_tile_patches=a.vision_tile_patches,
                        collation=a.collation, loader_workers=a.loader_workers,
                        pixel_bytes=PIXEL_DTYPES[a.pixel_dtype], pin_memory=a.pin_memory,
                        accumulation_steps=a.accumulation_steps)
    rates = {k: getattr(a, k) for k in ("matmul_tflops", "attention_tflops", "deltanet_tflops", "nvlink_gbs",
                                         "ib_gbs", "ring_hidden")}
    rates["latency_s"] = a.latency_us * 1e-6 if a.latency_us else None
    rates["host_gbs"] = a.host_link_gbs
    rates["host_memory_gib"], rates["margin"] = a.host_memory_gib, a.margin
    kind = "video" if dims.vision_depth else "text"
    if a.longest:
        print("\n".join(longest_lines(dims, kind, training, a.gpus_per_node, breakdown=a.host_breakdown, **rates)))
        return 0
    if a.tokens:
        row = Row(tokens=a.tokens, sample_tokens=a.sample_tokens)
    elif a.video_tokens:
        row = replace(Row.video(a.video_tokens, patch=dims.patch, merge=dims.merge), sample_tokens=a.sample_tokens)
    elif a.text or a.image or a.video:
        row = Row.from_items(a.text, [_pixels(i, 2) for i in a.image], [_pixels(v, 3) for v in a.video],
                             dims.patch, dims.merge, dims.temporal_patch)
        row = replace(row, sample_tokens=a.sample_tokens)
    else:
        p.error("give the row: --tokens, --video-tokens, or --text / --image / --video")
    rows = plan(dims, row, gpu=a.gpu, gpus_per_node=a.gpus_per_node, memory_gib=a.memory_gib, training=training,
                sizes=a.sizes, max_gpus=a.max_gpus, all_layouts=not a.chosen_only, **rates)
    print(format_table(rows, dims, row, hardware(a.gpu, a.memory_gib, **rates), training, a.gpus_per_node))
    if a.host_breakdown:  # each row's host terms per node, in the phase its total counts
        print("\n".join(f"P={r.size} {r.ulysses}x{r.ring}:{host_breakdown(r)[1:]}" for r in rows))
    if not a.memory_gib:  # the node's longest row, for the GPUs' own memory
        print("\n".join(longest_lines(dims, "video" if row.vision_tokens else "text", training, a.gpus_per_node,
                                      breakdown=a.host_breakdown, **rates)))
    return 0
