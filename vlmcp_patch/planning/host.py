"""Host memory: what one node's host holds for its ranks — the checkpoint pools as allocated, an offloaded optimizer
as DeepSpeed holds it, every rank's copy of the batch — and the allowance for the rest (the OS, the data loader, NCCL,
each process's own memory). Pure arithmetic; the pool's allocation rule is the package's own
(`offload.pool_bytes_for`, imported when priced)."""

from __future__ import annotations

from dataclasses import dataclass

# the per-rank decode's temporal groups per processor call: each call's fp32 rows go into the share's one tensor
from ..share_decode import GROUPS_PER_CALL as SHARE_DECODE_GROUPS_PER_CALL
from .dims import ModelDims
from .hardware import GIB
from .rows import Row
from .training import PIXEL_DTYPES, Training

# The allowance for what the plan does not price part by part (docs/plan.md, "the host"):
# per rank, 16 GiB: the training process's own memory (the CUDA, cuBLAS, cuDNN and NCCL libraries and their host
# buffers, about 4 GiB once a CUDA context and NCCL are up; the Python heap, a checkpoint shard while the model loads,
# DeepSpeed's and NCCL's small pinned staging buffers: 4 GiB) and its data loader (two worker processes of about 2 GiB
# each and the batches they prefetch, beyond the pixel values priced on their own: 4 GiB);
HOST_GIB_PER_RANK = 16.0
# per node, 5 % of its memory: the kernel and its page tables, the page cache the dataset's files and the model's
# safetensors go through, the node's daemons (about 95 GiB of 1,907).
HOST_NODE_SHARE = 0.05

# The dtype of the pixel values as the processors make them: Hugging Face's Qwen-VL image and video processors return
# fp32 (`pixel_values`, `pixel_values_videos`), and a data loader that collates the whole row hands them over as they
# are (the package's cut keeps their dtype); the cast to the model's dtype then happens on the device, inside the
# patch embedding. The per-rank decode may hand them over in the model's dtype (`Training.pixel_bytes`).
PROCESSOR_PIXEL_BYTES = PIXEL_DTYPES["fp32"]
# Batches each DataLoader worker prepares ahead (torch's `prefetch_factor` default)
LOADER_PREFETCH = 2
# The row's integer tensors as the data loader produces them: input_ids, labels, attention_mask and mm_token_type_ids,
# int64 (8 bytes a token each), the whole row on every rank of the group; 32 bytes a token in all.
BATCH_INT_TENSORS = 4
BATCH_INT_BYTES = 8 * BATCH_INT_TENSORS

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


def batch_host_bytes(d: ModelDims, row: Row, size: int, pixel_bytes: int = PROCESSOR_PIXEL_BYTES,
                     pinned: bool = False) -> float:
    """Host bytes of the batch one rank of a CP group of `size` holds: the row's integer tensors whole, and its share of
    the pixel values — 1/P of the row's plus one item (the ranks split the items; the one an edge cuts is held whole
    by both), never more than the row's — `pixel_bytes` a value (the data loader's dtype: fp32 by default).
    `pinned`: as the data loader's pinned copy holds it (`Training.pin_memory`): torch pins each tensor of a batch on
    its own (`torch/utils/data/_utils/pin_memory.py`: a mapping's values one by one, `tensor.pin_memory()` each), so
    each is a block of torch's caching host allocator (`pinned_block_bytes`): the `BATCH_INT_TENSORS` integer tensors
    and the pixel share (the grid and the cut's record, a few bytes each, are not priced)."""
    pixels = _pixel_bytes(d, row, size, pixel_bytes)
    if not pinned:
        return BATCH_INT_BYTES * row.tokens + pixels
    ints = BATCH_INT_TENSORS * pinned_block_bytes(BATCH_INT_BYTES // BATCH_INT_TENSORS * row.tokens)
    return ints + pinned_block_bytes(pixels)


def _pixel_bytes(d: ModelDims, row: Row, size: int, pixel_bytes: int = PROCESSOR_PIXEL_BYTES) -> float:
    """Pixel bytes of the share a rank of a CP group of `size` holds (`batch_host_bytes`; the whole row at `size`
    1), `pixel_bytes` a value."""
    patches = row.patches(d)
    share = min(patches, patches / size + (item_patches(d, row) if size > 1 else 0))
    return pixel_bytes * d.patch_values * share


def collation_host_bytes(d: ModelDims, row: Row, size: int, collation: str = "whole",
                         pixel_bytes: int = PROCESSOR_PIXEL_BYTES) -> float:
    """Host bytes one rank of a CP group of `size` holds while one collation of the next row runs, at its peak
    (docs/memory.md, "what the data loader still materialises"; the decoded frames before the processor, uint8 at the
    source's resolution, the processor's transients and the integer tensors the collation makes are not priced here:
    the collated batch, integers included, is `LoaderHost.pinning`'s). `collation`:
    - "whole": every item of the row decoded, in the processor's fp32, and their joined pixel tensor: at the
      concatenation the items and the joined tensor coexist (twice the row's pixel values); after it the cut copies
      the share out of the joined tensor (`forward/host_pixels.keep_pixel_share`) while the items are gone (the whole
      and the share), so the peak is twice the row's pixel values. The cut keeps the dtype, so `pixel_bytes` must be
      fp32's;
    - "share": the per-rank decode (`vlmcp_patch.share_decode`): the share's one tensor, in its `dtype=`
      (`pixel_bytes` a value), and the one processor call whose fp32 rows are being written into it — at most
      `SHARE_DECODE_GROUPS_PER_CALL` of the row's largest items (a video's temporal groups; an image is a call of
      its own, so for images an upper bound), never more than the share."""
    if collation not in ("whole", "share"):
        raise ValueError(f"collation {collation!r}: whole or share")
    if pixel_bytes not in PIXEL_DTYPES.values():
        raise ValueError(f"pixel_bytes {pixel_bytes}: one of {sorted(PIXEL_DTYPES.values())}")
    if collation == "whole" and pixel_bytes != PROCESSOR_PIXEL_BYTES:
        raise ValueError(f"pixel_bytes {pixel_bytes} with collation 'whole': every rank collates the processor's fp32 "
                         "and the cut keeps it; the model's dtype needs the per-rank decode (collation 'share')")
    share = _pixel_bytes(d, row, size, pixel_bytes)
    if collation == "share":
        call = SHARE_DECODE_GROUPS_PER_CALL * PROCESSOR_PIXEL_BYTES * d.patch_values * item_patches(d, row)
        return share + min(call, _pixel_bytes(d, row, size))
    return 2.0 * _pixel_bytes(d, row, 1)


@dataclass(frozen=True)
class LoaderHost:
    """What one rank's data loader holds on the host, by term (`loader_host`), bytes:
    - `batches`: the optimizer step's batches the Trainer holds during the step (`accumulation_steps` of them);
    - `queued`: the finished batches waiting (Accelerate's next, and per worker one more of the `LOADER_PREFETCH` it
      queues);
    - `previous`: the previous optimizer step's batches, which the Trainer still holds while it fetches the next ones
      (between steps). Pinned, their blocks stay in torch's caching host allocator during the step too, reused by the
      next batches (`cached`: counted throughout); unpinned, one fewer is counted (the next batch's share is the
      collation's own output) and only between steps;
    - `collating`: the collations that may run at once, each at its peak (`collation_host_bytes`);
    - `pinning`: with pinned memory, the collated batch's pageable copy while torch copies it into its pinned one
      (0 unpinned);
    - `beside_step`: whether `collating` and `pinning` run while the step does (`collation_beside_step`)."""

    batches: float = 0.0
    queued: float = 0.0
    previous: float = 0.0
    cached: bool = False
    collating: float = 0.0
    pinning: float = 0.0
    beside_step: bool = False


def loader_host(d: ModelDims, row: Row, size: int, t: Training) -> LoaderHost:
    """What one rank's data loader holds on the host (`LoaderHost`), for `t`'s `loader_workers`, `collation`,
    `pixel_bytes`, `pin_memory` and `accumulation_steps`, as torch's DataLoader, Accelerate's `DataLoaderShard` and
    the HF Trainer's loop hold it (`collation_beside_step` for the phases):
    - every collation that may run at once — one per worker, or the training process's own — each at its peak;
    - each batch cut to this rank's share as it is collated (`integrations/placement.PixelShareCollator`, inside the
      collate function), so the cut batch is what torch pins; the batches the Trainer holds (k = the accumulation
      steps: `get_batch_samples` takes an optimizer step's k at once, and its `batch_samples` and `inputs` still
      hold the previous k while it does), Accelerate's next (`DataLoaderShard.__iter__` takes the next batch before
      it yields the current one) and the workers' queues (`LOADER_PREFETCH` per worker, one of them being
      collated). (Accelerate's `send_to_device` moves a yielded batch's integer tensors to the device: priced on the
      host here all the same, 32 bytes a token per batch, an overcount.)
    - pinning (`pin_memory`, the Trainer's `dataloader_pin_memory`, True by default on a GPU machine): torch's
      DataLoader copies each collated batch into pinned memory — with no workers in the training process itself,
      right after the collate function returns (`_SingleProcessDataLoaderIter._next_data`), with workers in the
      training process's pin thread (`_pin_memory_loop`) as the workers' batches arrive — tensor by tensor, each a
      block of the caching host allocator, rounded up to a power of two (`batch_host_bytes(pinned=True)`); the
      pageable batch lives until its pinned copy is made (`pinning`: between steps with no workers, when the
      collation's transients are gone: the larger of the two counts; beside the step with workers). The allocator
      keeps a freed block for the next request of its size (`CachingHostAllocator.h`: `maybe_cache_block`, no
      limit by default), so the pinned blocks stay at their most in use at once: the step's k, the queued ones and
      the previous k — 2k + 1 batches with no workers — in both phases."""
    k, workers = t.accumulation_steps, t.loader_workers
    if k < 1:
        raise ValueError(f"accumulation_steps {k}: an optimizer step takes at least 1 batch")
    batch = batch_host_bytes(d, row, size, t.pixel_bytes, pinned=t.pin_memory)
    pageable = batch_host_bytes(d, row, size, t.pixel_bytes)
    queued = 1 + max(0, workers * LOADER_PREFETCH - workers)
    return LoaderHost(batches=k * batch, queued=queued * batch,
                      # unpinned with no workers the collation's own output becomes the next batch; with workers
                      # the Trainer's previous k are held beside the queues and the collations in flight
                      previous=(k if t.pin_memory or workers > 0 else k - 1) * batch, cached=t.pin_memory,
                      collating=max(1, workers) * collation_host_bytes(d, row, size, t.collation, t.pixel_bytes),
                      pinning=pageable if t.pin_memory else 0.0, beside_step=collation_beside_step(workers))


def collation_beside_step(workers: int) -> bool:
    """Whether the data loader's collations run while the step does (`Memory.host_total` adds them to the step's
    host terms) or only between steps (it takes the larger of the two phases).

    With `workers` > 0 the worker processes collate while the step runs: beside it. With none, the training process
    collates, and only between steps: Accelerate's `DataLoaderShard.__iter__` (accelerate/data_loader.py) collates
    batch n+2 (`next(dataloader_iter)`) when the Trainer asks for batch n+1 — after step n's forward, backward and
    optimizer step have returned — and the HF Trainer's loop (`_inner_training_loop`) asks for it through
    `get_batch_samples` while its `batch_samples` and `inputs` still hold batch n. So a rank's host holds, beside
    what lives throughout (the checkpoint pool, the offloaded optimizer):
    - between steps: the previous batch (held by the Trainer), the current one (held by Accelerate, `current_batch`)
      and the collation of the next at its peak, then (pinned) its pageable copy while it is pinned;
    - during the step: the current batch, the next one Accelerate queued (`next_batch`) and the vision features
      parked on the host (`offload.park_features`: the forward's, then their gradients in backward; none outside the
      step).
    The collation and the parked features never at once (`loader_host` for the batches, pinned or not, with gradient
    accumulation)."""
    return workers > 0


def loader_text(t: Training) -> str:
    """The data loader `loader_host` prices for `t`, in words."""
    rows = max(1, t.loader_workers)
    decoding = "the whole row" if t.collation == "whole" else "its share"
    dtype = next(name for name, nbytes in PIXEL_DTYPES.items() if nbytes == t.pixel_bytes)
    when = "beside the step" if collation_beside_step(t.loader_workers) else "between steps"
    pinned = "pinned" if t.pin_memory else "not pinned"
    return (f"{rows} row{'s' if rows > 1 else ''} collating {when}, each rank decoding {decoding} in {dtype}, the "
            f"batches cut and {pinned}; {t.loader_workers} workers, {t.accumulation_steps} accumulation step"
            f"{'s' if t.accumulation_steps > 1 else ''}")


def allowance_bytes(ranks: int, node_gib: float) -> float:
    """The node's host bytes not priced part by part: `HOST_GIB_PER_RANK` per rank and `HOST_NODE_SHARE` of the
    node."""
    return (HOST_GIB_PER_RANK * ranks + HOST_NODE_SHARE * node_gib) * GIB
