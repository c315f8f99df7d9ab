"""The hardware a plan prices: one GPU's memory, attained rates and links (defaults for H100 and H200)."""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30

@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Rates are *attained* (what a step's kernels reach), not the data sheet's peak:
    `matmul_tflops` for the projections, MLPs and head; `attention_tflops` for flash attention (forward; backward
    is counted as 2.5x the forward's FLOPs at the same rate); `deltanet_tflops` for the chunked delta rule.
    `nvlink_gbs` / `ib_gbs`: bus bandwidth per GPU (GB/s) inside a node / across nodes; `latency_s` per collective
    step."""

    name: str
    memory_gib: float
    matmul_tflops: float
    attention_tflops: float
    deltanet_tflops: float
    nvlink_gbs: float
    ib_gbs: float
    latency_s: float = 20e-6
    usable: float = 0.92  # of memory_gib: the allocator's fragmentation and the CUDA context
    # GB/s of the host link per GPU and direction, effective: the checkpoint offload's copies (PCIe Gen5 x16: 64 GB/s
    # raw, ~50 effective; an assumption, not measured here — `--host-link-gbs`)
    host_gbs: float = 50.0
    # the share of the ring's transfer time the double buffer hides (at most one block's attention): 0.44 is the
    # median of docs/speed.md's six CPU runs of `benchmarks.ring_overlap` (20-66 %); no GPU run yet (`--ring-hidden`)
    ring_hidden: float = 0.44
    # G elements/s of one elementwise pass over fp32 tiles: the ring's block kernel under sdpa is tiled torch math
    # (memory-bound passes over each 512 x 512 tile), not a fused kernel; 0: not priced (flash-attn's varlen kernel)
    tile_gelems: float = 0.0


# Defaults (docs/plan.md "defaults"): H100 SXM 80 GB, H200 141 GB, bf16 dense peak 989 TFLOP/s; attained rates as
# large-model training reaches them (~45% MFU on matmuls, flash-attention 2 forward+backward ~40% of peak, FLA's
# chunked delta rule ~15%); NVLink 4: ~360 GB/s all-to-all bus bandwidth per GPU; 400 Gb/s InfiniBand: one NIC per
# GPU, ~45 GB/s attained.
GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 80GB SXM, NVLink 4, 400 Gb/s IB", 80, 450, 400, 150, 360, 45),
    "h200": Hardware("H200 141GB SXM, NVLink 4, 400 Gb/s IB", 141, 450, 400, 150, 360, 45),
}



def hardware(gpu: str | Hardware = "h100", memory_gib: float | None = None, **rates) -> Hardware:
    """`gpu` ("h100", "h200" or a Hardware) with `memory_gib` and the `rates` given (not None) in place of its own."""
    hw = GPUS[gpu.lower()] if isinstance(gpu, str) else gpu
    hw = replace(hw, **{k: v for k, v in rates.items() if v is not None})
    return replace(hw, memory_gib=memory_gib) if memory_gib else hw
