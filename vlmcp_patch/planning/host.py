"""Host memory: what one node's host holds for its ranks — the checkpoint pools as allocated, an offloaded optimizer
as DeepSpeed holds it, every rank's copy of the batch — and the allowance for the rest (the OS, the data loader, NCCL,
each process's own memory). Pure arithmetic; the pool's allocation rule is the package's own
(`offload.pool_bytes_for`, imported when priced)."""

from __future__ import annotations

from dataclasses import dataclass

from .dims import ModelDims
from .hardware import GIB
from .rows import Row
from .training import Training

# The allowance for what the plan does not price part by part (docs/plan.md, "the host"):
# per rank, 16 GiB: the training process's own memory (the CUDA, cuBLAS, cuDNN and NCCL libraries and their host
# buffers, about 4 GiB once a CUDA context and NCCL are up; the Python heap, a checkpoint shard while the model loads,
# DeepSpeed's and NCCL's small pinned staging buffers: 4 GiB) and its data loader (two worker processes of about 2 GiB
# each and the batches they prefetch, beyond the pixel values priced on their own: 4 GiB);
HOST_GIB_PER_RANK = 16.0
# per node, 5 % of its memory: the kernel and its page tables, the page cache the dataset's files and the model's
# safetensors go through, the node's daemons (about 95 GiB of 1,907).
HOST_NODE_SHARE = 0.05

# The dtype of the pixel values as the ranks hold them: Hugging Face's Qwen-VL image and video processors return fp32
# (`pixel_values`, `pixel_values_videos`), and a data loader hands them over as they are; the cast to the model's dtype
# happens on the device, inside the patch embedding.
PIXEL_BYTES = 4
# Batches each DataLoader worker prepares ahead (torch's `prefetch_factor` default)
LOADER_PREFETCH = 2
# The row's integer tensors as the data loader produces them, per token: input_ids, labels, attention_mask and
# mm_token_type_ids (int64), the whole row on every rank of the group.
BATCH_INT_BYTES = 32

# DeepSpeed ZeRO-3 splits each rank's optimizer partition into sub-groups of at most this many parameters (its
# `sub_group_size` default), each with its own fp32 gradient buffer.
DEEPSPEED_SUB_GROUP = 10**9


def pinned_block_bytes(nbytes: float) -> float:
    """Bytes torch's caching host allocator takes for one pinned request of `nbytes` (`tensor.pin_memory()`, which
    DeepSpeed's default pinning uses): the next power of two (`ATen/core/CachingHostAllocator.h`: `PowerOf2Ceil`,
    its round threshold unlimited by default)."""
    n = int(nbytes)
    return float(1 << max(0, (n - 1).bit_length())) if n > 0 else 0.0


@dataclass(frozen=True)
class HostOptimizer:
    """Host bytes of one rank's offloaded optimizer, as DeepSpeed 0.19 holds it: `states` pageable (fp32 master
    weights and Adam's two moments), `gradients` the fp32 gradient buffers (pinned with `pin_memory: true`, each a
    caching-host-allocator block), `other_pinned` the pinned bf16 and staging buffers of ZeRO-1/2."""

    states: float = 0.0
    gradients: float = 0.0
    other_pinned: float = 0.0

    @property
    def total(self) -> float:
        return self.states + self.gradients + self.other_pinned


def trained_parameters(d: ModelDims, t: Training) -> int:
    return d.params() - (d.vision_params() if t.freeze_vision else 0)


def offloaded_optimizer_host(d: ModelDims, t: Training, world: int, pinned: bool = True) -> HostOptimizer:
    """One rank's offloaded optimizer on the host (DeepSpeed's `offload_optimizer: {device: cpu, pin_memory: true}`;
    nothing without `t.offload_optimizer`). Its share: the trained parameters / `world` (all of them without ZeRO).
    - ZeRO-3 (`stage3.py`): the fp32 master partition and the CPU Adam's two fp32 moments, pageable (12 bytes per
      parameter); two fp32 gradient buffers (8): the flat partition every gradient is reduced into
      (`grad_partitions_flat_buffer`), and each sub-group's fp32 gradient the optimizer steps on
      (`fp32_partitioned_groups_flat[i].grad`, which is kept between steps when offloaded).
    - ZeRO-1/2 (`stage_1_and_2.py`): the fp32 master partition (4, pinned), its bf16 copy-back buffer (2, pinned),
      the fp32 gradient partition (4, pinned), the moments (8, pageable), and a bf16 staging buffer of the largest
      parameter (pinned).
    Pinned buffers cost a caching-host-allocator block each (`pinned_block_bytes`)."""
    if not t.offload_optimizer:
        return HostOptimizer()
    share = trained_parameters(d, t) / (1 if t.sharding == "none" else world)
    block = pinned_block_bytes if pinned else float
    sharding = "zero3" if t.sharding == "fsdp" else t.sharding
    if sharding == "zero3":
        full, rest = divmod(int(share), DEEPSPEED_SUB_GROUP)
        sub_groups = [DEEPSPEED_SUB_GROUP] * full + ([rest] if rest else [])
        gradients = block(4 * share) + sum(block(4 * n) for n in sub_groups)
        return HostOptimizer(states=12.0 * share, gradients=gradients)
    largest = max(d.vocab * d.hidden, d.intermediate * d.hidden)  # the embedding, or one MLP projection
    return HostOptimizer(states=8.0 * share, gradients=block(4 * share),
                         other_pinned=block(4 * share) + block(2 * share) + block(t.bytes_per_value * largest))


def checkpoint_pool_bytes(held: float, pinned: bool = True) -> float:
    """Host bytes the package's checkpoint pool allocates to hold `held` bytes (its own rule,
    `offload.pool_bytes_for`; pinned on an accelerator)."""
    from ..offload import pool_bytes_for  # torch at call time only

    return float(pool_bytes_for(int(held), pinned=pinned)) if held > 0 else 0.0


def item_patches(d: ModelDims, row: Row) -> int:
    """Patches of the row's largest vision item: one image, or one temporal patch group of a video (the unit the
    ranks split the pixel values by)."""
    return row.patches_per_item or (row.patches(d) if row.vision_tokens else 0)


def batch_host_bytes(d: ModelDims, row: Row, size: int) -> float:
    """Host bytes of the batch one rank of a CP group of `size` holds: the row's integer tensors whole, and its share of
    the pixel values — 1/P of the row's plus one item (the ranks split the items; the one an edge cuts is held whole
    by both), never more than the row's — in the data loader's dtype (`PIXEL_BYTES`: fp32)."""
    return BATCH_INT_BYTES * row.tokens + _pixel_bytes(d, row, size)


def _pixel_bytes(d: ModelDims, row: Row, size: int) -> float:
    """fp32 pixel bytes of the share a rank of a CP group of `size` holds (`batch_host_bytes`; the whole row at
    `size` 1)."""
    patches = row.patches(d)
    share = min(patches, patches / size + (item_patches(d, row) if size > 1 else 0))
    return PIXEL_BYTES * d.patch_values * share


def collation_host_bytes(d: ModelDims, row: Row, size: int, collation: str = "whole") -> float:
    """Host bytes one rank of a CP group of `size` holds while one collation of the next row runs, at its peak: every
    item it decodes and their joined pixel tensor (twice the pixel values it decodes), and with the whole row decoded
    the share the cut copies out of it before both go (`host_pixels.keep_pixel_share`), in the data loader's dtype
    (docs/memory.md, "what the data loader still materialises"; the decoded frames before the processor, uint8, are
    not priced). `collation` "whole": it decodes the whole row (today's loaders: the cut comes after the collator);
    "share": only its share (the per-rank decode of docs/memory.md, not built)."""
    if collation not in ("whole", "share"):
        raise ValueError(f"collation {collation!r}: whole or share")
    share = _pixel_bytes(d, row, size)
    return 2.0 * share if collation == "share" else 2.0 * _pixel_bytes(d, row, 1) + (share if size > 1 else 0.0)


def loader_host_bytes(d: ModelDims, row: Row, size: int, collation: str = "whole",
                      workers: int = 0) -> tuple[float, float]:
    """(collating, queued): what one rank's data loader holds on the host beside the batch the step trains, with
    `workers` worker processes (`DataLoader(num_workers=...)`; 0: collated in the training process). Every collation
    that may run at once — one per worker, each the moment its iterator starts, or the training process's own (which
    runs between steps; priced as if beside the step's peak, an upper bound) — and the finished batches waiting, each
    already cut to this rank's share: Accelerate's, which the HF Trainer and TRL use, takes the next batch before it
    yields the current one, and the workers' queues hold `LOADER_PREFETCH` batches per worker, one of them being
    collated."""
    collating = max(1, workers) * collation_host_bytes(d, row, size, collation)
    queued = (1 + max(0, workers * LOADER_PREFETCH - workers)) * batch_host_bytes(d, row, size)
    return collating, queued


def loader_text(t: Training) -> str:
    """The data loader `loader_host_bytes` prices for `t`, in words."""
    rows = max(1, t.loader_workers)
    decoding = "the whole row" if t.collation == "whole" else "its share"
    return (f"{rows} row{'s' if rows > 1 else ''} collating, each rank decoding {decoding}, and the next batches cut; "
            f"{t.loader_workers} workers")


def allowance_bytes(ranks: int, node_gib: float) -> float:
    """The node's host bytes not priced part by part: `HOST_GIB_PER_RANK` per rank and `HOST_NODE_SHARE` of the
    node."""
    return (HOST_GIB_PER_RANK * ranks + HOST_NODE_SHARE * node_gib) * GIB
