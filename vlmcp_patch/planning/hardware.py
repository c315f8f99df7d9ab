"""The hardware a plan prices: one GPU's memory, attained rates and links (defaults for H100 and H200)."""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30

# The share of a GPU's usable memory the plan leaves free at the longest row, and that the run-time choice of switches
# leaves too: what the plan does not price (the allocator's fragmentation past `Hardware.usable`, kernels' workspaces,
# a row's imbalance) has room there. `--margin` sets another.
DEVICE_MARGIN = 0.05

# A DGX H100 or H200 node: 2 TB of host memory (32 DIMMs of 64 GB). Priced as 2,048 GB = 1,907 GiB: the lower
# reading of "2 TB", which leaves what the firmware and the kernel reserve of the physical 2 TiB inside the difference.
DGX_HOST_GIB = 2048e9 / GIB

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
    # the node's host memory, GiB (`--host-memory-gib`): the checkpoint pools, an offloaded optimizer, the batches and
    # the allowance of `planning.host` must fit in it
    host_memory_gib: float = DGX_HOST_GIB
    margin: float = DEVICE_MARGIN  # of the usable memory, left free (`--margin`)

    @property
    def device_budget(self) -> float:
        """Bytes a rank's predicted peak may reach: the usable memory less the margin."""
        return self.usable * self.memory_gib * GIB * (1 - self.margin)


# Defaults (docs/plan.md "defaults"): H100 SXM 80 GB, H200 141 GB, bf16 dense peak 989 TFLOP/s; attained rates as
# large-model training reaches them (~45% MFU on matmuls, flash-attention 2 forward+backward ~40% of peak, FLA's
# chunked delta rule ~15%); NVLink 4: ~360 GB/s all-to-all bus bandwidth per GPU; 400 Gb/s InfiniBand: one NIC per
# GPU, ~45 GB/s attained.
GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 80GB SXM, NVLink 4, 400 Gb/s IB", 80, 450, 400, 150, 360, 45,
                     host_memory_gib=DGX_HOST_GIB),  # a DGX H100: 2 TB
    "h200": Hardware("H200 141GB SXM, NVLink 4, 400 Gb/s IB", 141, 450, 400, 150, 360, 45,
                     host_memory_gib=DGX_HOST_GIB),  # a DGX H200: 2 TB
}



def hardware(gpu: str | Hardware = "h100", memory_gib: float | None = None, **rates) -> Hardware:
    """`gpu` ("h100", "h200" or a Hardware) with `memory_gib` and the `rates` given (not None) in place of its own
    (any field: `host_memory_gib`, `margin`, `usable` as well as the rates)."""
    hw = GPUS[gpu.lower()] if isinstance(gpu, str) else gpu
    hw = replace(hw, **{k: v for k, v in rates.items() if v is not None})
    return replace(hw, memory_gib=memory_gib) if memory_gib else hw
