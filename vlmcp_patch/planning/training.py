"""How the step trains (sharding, checkpointing, offload, tiling) and the activation constants fitted on
measurements."""

from __future__ import annotations

from dataclasses import dataclass

# The pixel values' dtypes a data loader may hand the ranks (`Training.pixel_bytes`, `--pixel-dtype`), bytes per value
PIXEL_DTYPES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Training:
    """How the step trains. `sharding`: none (DDP), zero1, zero2, zero3, fsdp (= zero3); optimizer Adam with fp32
    master weights (16 bytes per trained parameter: bf16 weight and gradient, fp32 master, two moments);
    `dp` data-parallel replicas of the CP group (ZeRO / FSDP shard over P x dp ranks); `offload_optimizer`: the
    optimizer states and master weights live in host memory (DeepSpeed offload); `offload_checkpoints`: the
    package's checkpoint offload (`VLMCP_OFFLOAD_CHECKPOINTS`): each checkpointed decoder layer's and vision block's
    input waits in a host pool between forward and backward, the last layer's input and the one prefetched stay on
    the device; `tiled_mlp`: the MLPs in sequence tiles (`VLMCP_MLP_TILE_TOKENS`, automatic tiles), under CP
    (P > 1), at P = 1 where a size is set — False prices `VLMCP_MLP_TILE_TOKENS=0`; `tiled_vision`: the vision tower
    over tiles of items (`VLMCP_VISION_TILE_PATCHES`, automatic tiles), under CP, at P = 1 where a size is set, not
    under FSDP (which gathers the tower module by module: the package runs it whole; under CP ZeRO-3 gathers it
    whole as a leaf module and it tiles) — False prices `VLMCP_VISION_TILE_PATCHES=0`;
    `mlp_tile_tokens` / `vision_tile_patches`: the tiles' size where set (`VLMCP_MLP_TILE_TOKENS=N`,
    `VLMCP_VISION_TILE_PATCHES=N`: at P = 1 too), else (None) the package's automatic rules;
    `stock_head`: full-vocabulary fp32 logits (a head without chunking); `frozen_head`: the LM head's weight does not
    train (LoRA, frozen tied embeddings): no fp32 gradient of it, nor the fp32 copy of a chunk that makes it."""

    sharding: str = "zero3"
    gradient_checkpointing: bool = True
    dp: int = 1
    bytes_per_value: int = 2
    offload_optimizer: bool = False
    offload_checkpoints: bool = False
    tiled_mlp: bool = True
    tiled_vision: bool = True
    mlp_tile_tokens: int | None = None
    vision_tile_patches: int | None = None
    recompute_norms: bool = True  # under CP the decoder's RMSNorms keep their input only (`VLMCP_RECOMPUTE_NORMS`)
    stock_head: bool = False
    frozen_head: bool = False
    loss_chunk: int = 0  # tokens per chunk of the head (`VLMCP_LOSS_CHUNK`); 0: the package's automatic rule
    freeze_vision: bool = False
    attention: str = "flash_attention_2"  # or "sdpa": the ring's blocks then run tiled fp32 torch math
    # the ring posts each pass before computing its block and waits after it (`collectives.start_pass`): only
    # `Time.ring_overlapped` stays exposed; False prices the serial schedule (`VLMCP_RING_OVERLAP=0`)
    ring_overlap: bool = True
    # with the checkpoint offload under CP, the slice's vision features wait on the host between the tower and the
    # decoder and their gradients between the decoder and the tower (`VLMCP_OFFLOAD_FEATURES`, `offload.park_features`):
    # None: where the row needs it to fit the device, as the package decides by need (`table.plan`); True / False:
    # as set
    park_features: bool | None = None
    # how the data loader brings the row's pixel values to the host (`host.collation_host_bytes`): "whole", every
    # rank of the group decodes and collates the whole row, then keeps its share (what data loaders do with the
    # package's cut, `forward/host_pixels.keep_pixel_share`); "share", each rank decodes and collates only its share
    # (the per-rank decode, `vlmcp_patch.share_decode`, docs/memory.md)
    collation: str = "whole"
    # bytes per pixel value as the data loader hands them to the ranks (`PIXEL_DTYPES`): 4, the fp32 Hugging Face's
    # Qwen-VL processors return; 2, bf16, only with collation "share" (the per-rank decode's `dtype=`: values in the
    # dtype the patch embedding computes in are bit-identical to stock's, which casts its input to its weight's
    # dtype first, `Qwen3VLVisionPatchEmbed.forward`). With "whole" every rank collates the processor's fp32 and the
    # cut keeps that dtype: `host.collation_host_bytes` refuses 2 there
    pixel_bytes: int = 4
    # the data loader's worker processes (`DataLoader(num_workers=...)`, the HF Trainer's `dataloader_num_workers`):
    # each collates a row at once and queues finished ones (`host.loader_host`); 0, the Trainer's default:
    # collated in the training process
    loader_workers: int = 0
    # whether the data loader copies each collated batch into pinned memory (`DataLoader(pin_memory=...)`, the HF
    # Trainer's `dataloader_pin_memory`, True by default where an accelerator is): each tensor of the batch then a
    # power-of-two block of torch's caching host allocator, which keeps freed blocks for reuse (`host.loader_host`)
    pin_memory: bool = True
    # the optimizer step's micro-batches (the HF Trainer's `gradient_accumulation_steps`): the Trainer fetches them at
    # once (`get_batch_samples`) and holds them through the step, and the previous step's while it fetches
    # (`host.loader_host`); priced on the host only
    accumulation_steps: int = 1


@dataclass(frozen=True)
class Constants:
    """Multipliers on the element counts below, fitted on this CPU (`benchmarks.plan_check`): `attention`,
    `deltanet`, `vision` on the saved activations of a layer / block without checkpointing (fitted at P = 1);
    `*_work` on the working set of the one layer (block) recomputed at a time with checkpointing — `mlp_work` on
    its MLP's intermediates (whole, or one tile's), `attention_work` / `deltanet_work` on the rest of the layer
    (fitted on rows whose peak is that layer, at P = 1 with the MLP whole and P = 2 in tiles, which tell the two
    apart)."""

    attention: float = 1.0
    deltanet: float = 1.0
    vision: float = 1.0
    attention_work: float = 1.0
    deltanet_work: float = 1.0
    vision_work: float = 1.0
    mlp_work: float = 1.0


# Fitted by `python -m benchmarks.plan_check --fit` on this repository's CPU runs (fp32, torch's sdpa and its
# pure-torch delta rule; docs/plan.md "checked against measurements"; refitted when the rotary tables and the forward's
# exchange buffers were priced on their own, which they had absorbed). The DeltaNet ones carry the torch fallback's
# intermediates: with flash-linear-attention's kernels on a GPU they overestimate.
CALIBRATED = Constants(attention=0.932, deltanet=2.226, vision=0.956, attention_work=0.701, deltanet_work=2.445,
                       vision_work=0.928, mlp_work=1.615)
