"""Plan before you book: a cost model of one CP training step — per-rank peak memory and step time — for each CP
size P and each U x R layout a model's heads allow. Pure arithmetic: this module imports nothing heavy itself (the
package's own rules it prices — `layout.ulysses_choices` and `ulysses_degree`, `layout.kv_replication_factor`,
`loss.chunk_tokens` — are imported when a plan is made).

    python -m vlmcp_patch plan --model qwen3-vl-8b --video-tokens 1048576 --gpus-per-node 8 --gpu h100
    vlmcp_patch.plan(model="qwen3.5-27b", row=Row.video(524288), gpu="h100")   # -> list[PlanRow]

Units: bytes, seconds, FLOP/s; link bandwidths in GB/s (1e9 bytes/s) per GPU and direction, as NCCL's "bus
bandwidth" reports it; attained rates in TFLOP/s (1e12 FLOP/s). How each number is made and how it was checked
against measurements: docs/plan.md.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

GIB = 2**30

# ------------------------------------------------------------------------------------------------------------
# Models: the dimensions a cost needs, written down from the public configs (no download).


@dataclass(frozen=True)
class ModelDims:
    """What the cost model needs of a model. Counts are per model; `layer_types` lists "full" (softmax attention)
    and "linear" (gated DeltaNet) layers in order. Vision fields are zero for a text-only model."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    linear_layers: int = 0  # gated DeltaNet layers among `layers`
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 4
    vision_depth: int = 0
    vision_width: int = 0
    vision_intermediate: int = 0
    vision_heads: int = 0
    patch: int = 16
    temporal_patch: int = 2
    merge: int = 2
    deepstack: int = 0  # Qwen3-VL's deepstack mergers

    @property
    def full_layers(self) -> int:
        return self.layers - self.linear_layers

    def head_counts(self) -> list[int]:
        """The head counts U must divide (the package's rule: query heads, and DeltaNet value heads)."""
        return [self.heads] + ([self.linear_v_heads] if self.linear_layers else [])

    # parameters ------------------------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * d * (self.heads + 2 * self.kv_heads) + self.heads * d * h

    def deltanet_params(self) -> int:
        h, k, v = self.hidden, self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        conv = (2 * k + v) * self.conv_kernel
        return h * (2 * k + 2 * v) + h * 2 * self.linear_v_heads + conv + v * h

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def vision_params(self) -> int:
        w, i = self.vision_width, self.vision_intermediate
        if not self.vision_depth:
            return 0
        block = 4 * w * w + 2 * w * i
        merger = (4 * w) * (4 * w) + (4 * w) * self.hidden
        return self.vision_depth * block + (1 + self.deepstack) * merger + 3 * self.temporal_patch * self.patch**2 * w

    def params(self) -> int:
        """All parameters (the vision tower's included)."""
        decoder = self.full_layers * self.attention_params() + self.linear_layers * self.deltanet_params()
        decoder += self.layers * self.mlp_params()
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return decoder + embed + self.vision_params()


# Public configs, written down (no download). Where a number is from memory of the config and not checked against
# the file, docs/plan.md says so.
MODELS: dict[str, ModelDims] = {
    # Qwen/Qwen3-VL-8B-Instruct config.json: text 4096 wide, 36 layers, 32 / 8 heads of 128, MLP 12288, vocab
    # 151936, untied; vision 27 blocks 1152 wide (MLP 4304, 16 heads, patch 16, temporal 2, merge 2), deepstack 3.
    "qwen3-vl-8b": ModelDims("qwen3-vl-8b", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                             intermediate=12288, vocab=151936, tied=False, vision_depth=27, vision_width=1152,
                             vision_intermediate=4304, vision_heads=16, deepstack=3),
    # Qwen/Qwen3.5-27B config.json (from memory, see docs/plan.md): 5120 wide, 64 layers, 3 gated DeltaNet per
    # softmax layer; softmax 24 / 4 heads of 256; DeltaNet 16 key / 48 value heads of 128, conv 4; MLP 17408;
    # vocab 248320; vision as Qwen3-VL's (27 x 1152, patch 16), no deepstack.
    "qwen3.5-27b": ModelDims("qwen3.5-27b", hidden=5120, layers=64, heads=24, kv_heads=4, head_dim=256,
                             intermediate=17408, vocab=248320, tied=False, linear_layers=48, linear_k_heads=16,
                             linear_v_heads=48, linear_k_dim=128, linear_v_dim=128, vision_depth=27,
                             vision_width=1152, vision_intermediate=4304, vision_heads=16),
    # meta-llama/Llama-3.1-8B config.json: 4096 wide, 32 layers, 32 / 8 heads of 128, MLP 14336, vocab 128256.
    "llama-3.1-8b": ModelDims("llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                              intermediate=14336, vocab=128256, tied=False),
    # Qwen/Qwen3-4B config.json: 2560 wide, 36 layers, 32 / 8 heads of 128, MLP 9728, vocab 151936, tied.
    "qwen3-4b": ModelDims("qwen3-4b", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                          intermediate=9728, vocab=151936, tied=True),
}


def dims_from_config(config, name: str = "config") -> ModelDims:
    """ModelDims of a Hugging Face config: a config object, or its dict (config.json), multimodal or text-only."""
    as_dict = config if isinstance(config, dict) else config.to_dict()
    text = as_dict.get("text_config") or as_dict
    vision = as_dict.get("vision_config") or {}
    kinds = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    return ModelDims(
        name=name, hidden=text["hidden_size"], layers=text["num_hidden_layers"], heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate=text["intermediate_size"], vocab=text["vocab_size"],
        tied=bool(as_dict.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        linear_layers=sum(k == "linear_attention" for k in kinds),
        linear_k_heads=text.get("linear_num_key_heads", 0) or 0,
        linear_v_heads=text.get("linear_num_value_heads", 0) or 0,
        linear_k_dim=text.get("linear_key_head_dim", 0) or 0, linear_v_dim=text.get("linear_value_head_dim", 0) or 0,
        conv_kernel=text.get("linear_conv_kernel_dim", 4) or 4,
        vision_depth=vision.get("depth", 0), vision_width=vision.get("hidden_size", 0),
        vision_intermediate=vision.get("intermediate_size", 0), vision_heads=vision.get("num_heads", 0),
        patch=vision.get("patch_size", 16), temporal_patch=vision.get("temporal_patch_size", 2),
        merge=vision.get("spatial_merge_size", 2), deepstack=len(vision.get("deepstack_visual_indexes") or []))


def model_dims(model) -> ModelDims:
    """A known name (MODELS), tiny-qwen3-vl / tiny-qwen3.5 (the test fixtures), a config.json path or folder, a
    config object or dict, or ModelDims itself."""
    if isinstance(model, ModelDims):
        return model
    if isinstance(model, str):
        if model.lower() in MODELS:
            return MODELS[model.lower()]
        if model in ("tiny-qwen3-vl", "tiny-qwen3.5"):
            from .fixtures.models import tiny_qwen3_5_config, tiny_qwen3_vl_config

            config = (tiny_qwen3_vl_config if model == "tiny-qwen3-vl" else tiny_qwen3_5_config)()
            return dims_from_config(config, model)
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if os.path.isfile(path):
            with open(path) as f:
                return dims_from_config(json.load(f), os.path.basename(os.path.dirname(path)) or path)
        raise ValueError(f"unknown model {model!r}: a name of {sorted(MODELS)}, tiny-qwen3-vl, tiny-qwen3.5, "
                         "or a config.json path")
    return dims_from_config(model, getattr(model, "name_or_path", "") or "config")


# ------------------------------------------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class Row:
    """One packed row: `tokens` decoder tokens, of which `vision_tokens` are merged vision tokens (each of merge^2
    patches); `sample_tokens` is the longest packed sample (causal attention runs within samples; default: the
    whole row is one sample); `patches_per_item` the patches a vision attention spans (one image, or one temporal
    patch group of a video)."""

    tokens: int
    vision_tokens: int = 0
    sample_tokens: int = 0
    patches_per_item: int = 0
    samples: int = 1

    @property
    def longest_sample(self) -> int:
        return self.sample_tokens or self.tokens

    def patches(self, dims: ModelDims) -> int:
        return self.vision_tokens * dims.merge**2

    @staticmethod
    def text(tokens: int) -> Row:
        return Row(tokens=tokens)

    @staticmethod
    def video(tokens: int, side: int = 448, patch: int = 16, merge: int = 2, question: int = 256) -> Row:
        """A row of one long video (frames of side x side pixels) and a short question, `tokens` in all: the frames
        are cut in temporal patch groups of (side / patch)^2 patches, one vision attention each."""
        per_group = (side // patch) ** 2
        return Row(tokens=tokens, vision_tokens=max(0, tokens - question), patches_per_item=per_group)

    @staticmethod
    def from_items(text: int = 0, images: tuple = (), videos: tuple = (), patch: int = 16, merge: int = 2,
                   temporal: int = 2) -> Row:
        """A row of `text` text tokens, images (height, width) and videos (frames, height, width) in pixels, one
        sample; sides are rounded to whole merged patches as Qwen's processor does."""
        unit = patch * merge
        side = lambda px: max(unit, round(px / unit) * unit) // patch  # noqa: E731 - patches along a side
        vision, largest = 0, 0
        for h, w in images:
            n = side(h) * side(w)
            vision, largest = vision + n // merge**2, max(largest, n)
        for frames, h, w in videos:
            n = side(h) * side(w)
            groups = max(1, -(-frames // temporal))
            vision, largest = vision + groups * n // merge**2, max(largest, n)
        return Row(tokens=text + vision, vision_tokens=vision, patches_per_item=largest)


# ------------------------------------------------------------------------------------------------------------
# Hardware


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


# ------------------------------------------------------------------------------------------------------------
# Training setup and the calibrated constants


@dataclass(frozen=True)
class Training:
    """How the step trains. `sharding`: none (DDP), zero1, zero2, zero3, fsdp (= zero3); optimizer Adam with fp32
    master weights (16 bytes per trained parameter: bf16 weight and gradient, fp32 master, two moments);
    `dp` data-parallel replicas of the CP group (ZeRO / FSDP shard over P x dp ranks); `offload_optimizer`: the
    optimizer states and master weights live in host memory (DeepSpeed offload); `offload_checkpoints` and
    `tiled_mlp`: DeepSpeed ALST's checkpoint offload and tiled MLP — not features of vlmcp-patch, only to
    reproduce ALST's published numbers; `stock_head`: full-vocabulary fp32 logits (a head without chunking)."""

    sharding: str = "zero3"
    gradient_checkpointing: bool = True
    dp: int = 1
    bytes_per_value: int = 2
    offload_optimizer: bool = False
    offload_checkpoints: bool = False
    tiled_mlp: bool = False
    stock_head: bool = False
    freeze_vision: bool = False
    attention: str = "flash_attention_2"  # or "sdpa": the ring's blocks then run tiled fp32 torch math
    # the ring posts each pass before computing its block and waits after it (`collectives.start_pass`): only
    # `Time.ring_overlapped` stays exposed; False prices the serial schedule (`collectives.OVERLAP = False`)
    ring_overlap: bool = True


@dataclass(frozen=True)
class Constants:
    """Multipliers on the element counts below, fitted on this CPU at P=1 (`benchmarks.plan_check`) and checked at
    P > 1: `attention`, `deltanet`, `vision` on the saved activations of a layer / block without checkpointing;
    `*_work` on the working set of the one layer (block) recomputed at a time with checkpointing."""

    attention: float = 1.0
    deltanet: float = 1.0
    vision: float = 1.0
    attention_work: float = 1.0
    deltanet_work: float = 1.0
    vision_work: float = 1.0


# Fitted by `python -m benchmarks.plan_check --fit` on this repository's CPU runs (fp32, torch's sdpa and its
# pure-torch delta rule; docs/plan.md "checked against measurements"). The DeltaNet ones carry the torch fallback's
# intermediates: with flash-linear-attention's kernels on a GPU they overestimate.
CALIBRATED = Constants(attention=1.154, deltanet=2.381, vision=1.122, attention_work=1.790, deltanet_work=2.491,
                       vision_work=1.830)

# ------------------------------------------------------------------------------------------------------------
# Layouts


def layouts(dims: ModelDims, size: int) -> list[tuple[int, int]]:
    """Every (U, R) with U x R = `size` and U dividing the heads (the package picks the largest U:
    `layout.ulysses_degree`)."""
    from .layout import ulysses_choices  # torch at call time only

    return [(u, size // u) for u in reversed(ulysses_choices(size, dims.head_counts()))]


def package_ulysses(dims: ModelDims, size: int, gpus_per_node: int | None = None) -> int:
    """The U the package chooses at P = `size` on nodes of `gpus_per_node` (its own rule,
    `vlmcp_patch.layout.ulysses_degree`: the subgroups kept inside a node where the heads allow)."""
    from .layout import ulysses_degree  # torch at call time only

    return ulysses_degree(size, dims.head_counts(), node_size=gpus_per_node)


def replicated(heads: int, query_heads: int, ulysses: int) -> int:
    """KV heads (or DeltaNet key heads) after the package's replication for U (its own rule,
    `layout.kv_replication_factor`: the smallest factor of the group size that makes them divisible by U)."""
    from .layout import kv_replication_factor  # torch at call time only

    return heads * kv_replication_factor(query_heads, heads, ulysses)


# ------------------------------------------------------------------------------------------------------------
# Memory: element counts per token (or per patch) that a rank keeps, by layer kind


def attention_elements(d: ModelDims, ulysses: int) -> float:
    """Saved for backward per local token by one softmax-attention decoder layer, without checkpointing: the two
    norms' inputs and outputs (4h), q and k before and after their norms and rope (2 x (H + H_kv) D), v, the
    kernel's head-sharded q, k, v and output (with KV replication for U), the output projection's input, and the
    SwiGLU MLP's gate, up, activation and product (4 I)."""
    hd, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    kv_rep = replicated(d.kv_heads, d.heads, ulysses) * d.head_dim
    return 4 * d.hidden + 2 * (hd + kv) + kv + (2 * hd + 2 * kv_rep) + hd + 4 * d.intermediate


def deltanet_elements(d: ModelDims, ulysses: int) -> float:
    """The same for one gated DeltaNet layer: norms (4h); the projections' outputs (q, k, v, z, b, a); after the
    exchange the conv's input, output and activation for this rank's channels (key heads replicated for U), the
    L2-normed q and k, the gates; the chunked delta rule's per-token intermediates (its 64-token chunk matrices
    and the per-chunk states, H_v d_k d_v / 64 per token); the core output, its gated norm (3 x) and the output
    projection's input; the MLP (4 I)."""
    k = d.linear_k_heads * d.linear_k_dim
    k_rep = replicated(d.linear_k_heads, d.linear_v_heads, ulysses) * d.linear_k_dim
    v, hv = d.linear_v_heads * d.linear_v_dim, d.linear_v_heads
    projections = 2 * k + 2 * v + 2 * hv
    conv = 3 * (2 * k_rep + v)
    rule = deltanet_rule_elements(d, ulysses)
    out = v + 3 * v + v
    return 4 * d.hidden + projections + conv + rule + out + 4 * d.intermediate


def deltanet_rule_elements(d: ModelDims, ulysses: int) -> float:
    """Per local token, the chunked delta rule's own saved elements: L2-normed q and k (key heads replicated for
    U), the two gates, its 64-token chunk matrices (64 per head) and the per-chunk states (H_v d_k d_v / 64)."""
    k_rep = replicated(d.linear_k_heads, d.linear_v_heads, ulysses) * d.linear_k_dim
    hv = d.linear_v_heads
    return 2 * k_rep + 2 * hv + 64 * hv + hv * d.linear_k_dim * d.linear_v_dim / 64


def vision_elements(d: ModelDims) -> float:
    """Saved per patch by one vision block: norms (4w), qkv (3w), the attention kernel's q, k, v, output (4w), the
    projection's input (w), the MLP's input, hidden, activation (w + 2 I_v); the merger's share is per merged
    token and counted with the deepstack features."""
    w = d.vision_width
    return 13 * w + 2 * d.vision_intermediate


# ------------------------------------------------------------------------------------------------------------
# The plan's row


@dataclass
class Memory:
    """Per-rank peak memory, bytes, by part."""

    weights: float = 0.0  # parameters held (sharded, plus ZeRO-3's gathered working layers)
    gradients: float = 0.0
    optimizer: float = 0.0  # master weights and moments
    activations: float = 0.0  # saved for backward (with checkpointing: the checkpoints)
    working: float = 0.0  # the recomputed layer's working set (checkpointing), else 0
    head: float = 0.0  # one chunk of fp32 logits and its companions
    exchange: float = 0.0  # all-to-all send/receive buffers, ring K/V in flight, DeltaNet state gathers
    batch: float = 0.0  # the row's integer tensors (whole row on every rank)

    @property
    def total(self) -> float:
        """The peak: what lives through the step, plus the larger of two transients that are never alive together —
        one layer's working set with its exchange buffers (during that layer) and the head's chunk (at the end of
        the forward, where the fused head also makes its gradient)."""
        return (self.weights + self.gradients + self.optimizer + self.activations + self.batch
                + max(self.working + self.exchange, self.head))


@dataclass
class Time:
    """Seconds of one step (forward + backward) on the busiest rank, by part."""

    compute: float = 0.0
    all_to_all: float = 0.0
    ring: float = 0.0  # each pass completed before its block is computed (the serial schedule)
    ring_overlapped: float = 0.0  # what remains exposed with the passes overlapping the blocks' compute
    deltanet_state: float = 0.0
    sharding: float = 0.0  # ZeRO-3 / FSDP gathers and reduce-scatters left exposed after overlap with compute

    overlap: bool = True  # the ring's passes overlap its blocks' compute (Training.ring_overlap)

    @property
    def total(self) -> float:
        ring = self.ring_overlapped if self.overlap else self.ring
        return self.compute + self.all_to_all + ring + self.deltanet_state + self.sharding


@dataclass
class PlanRow:
    """One (P, U x R) of the plan. `fits`: the predicted peak within the GPU's usable memory; `chosen`: the layout
    the package picks at this P; `smallest` / `fastest`: the marks of the table; `why`: why it loses (or wins)."""

    size: int
    ulysses: int
    ring: int
    nodes: int
    tokens_per_rank: int
    memory: Memory
    time: Time
    fits: bool = False
    chosen: bool = False
    smallest: bool = False
    fastest: bool = False
    why: str = ""
    other_checkpointing_gib: float = 0.0  # the peak with gradient checkpointing switched the other way

    @property
    def peak_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_rank / self.time.total if self.time.total else 0.0


def static_memory(d: ModelDims, t: Training, world: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per rank under the named sharding over `world` ranks, bf16 weights
    and gradients, fp32 Adam (12 bytes per trained parameter). ZeRO-3 / FSDP also hold the layers being gathered:
    two decoder layers' weights (the one computing and the one prefetched)."""
    n = d.params()
    trained = n - (d.vision_params() if t.freeze_vision else 0)
    b = t.bytes_per_value
    optimizer = 0.0 if t.offload_optimizer else 12.0 * trained
    layer = d.attention_params() + d.mlp_params()
    sharding = "zero3" if t.sharding == "fsdp" else t.sharding
    if sharding == "none":
        return b * n, b * trained, optimizer
    if sharding == "zero1":
        return b * n, b * trained, optimizer / world
    if sharding == "zero2":
        return b * n, b * trained / world, optimizer / world
    if sharding == "zero3":
        return b * n / world + 2 * b * layer, b * trained / world, optimizer / world
    raise ValueError(f"sharding {t.sharding!r}: one of none, zero1, zero2, zero3, fsdp")


def activation_memory(d: ModelDims, row: Row, t: Training, c: Constants, size: int, ulysses: int) -> Memory:
    """Activation-side bytes of the busiest rank: the slice's tokens (row / P, padded), the rank's share of the
    vision patches (balanced: an even split), the fused head's chunk, the exchange buffers, the row's integers."""
    b = t.bytes_per_value
    ring = size // ulysses
    local = math.ceil(row.tokens / (size if ring == 1 else 2 * size)) * (1 if ring == 1 else 2)
    patches = math.ceil(row.patches(d) / size)
    vision_local = math.ceil(row.vision_tokens / size)
    att, dn = attention_elements(d, ulysses), deltanet_elements(d, ulysses) if d.linear_layers else 0.0
    vis = vision_elements(d) if d.vision_depth else 0.0
    if t.tiled_mlp:  # ALST's tiled MLP: the MLP's 4 I per token are recomputed in tiles, not kept
        att, dn = att - 4 * d.intermediate, (dn - 4 * d.intermediate if dn else 0.0)
    features = vision_local * d.hidden * (1 + d.deepstack)  # merged + deepstack features routed to this rank
    # DeltaNet across a ring (models/deltanet_ring.py): a chunk continuing a sample runs the delta rule twice more
    # for its transfer (B from a zero state, M from the identity), and autograd keeps both runs' intermediates
    ring_rule = 2 * deltanet_rule_elements(d, ulysses) if (ring > 1 and d.linear_layers) else 0.0
    dn += ring_rule
    attention_x, deltanet_x = exchange_elements(d, t, local, ulysses, ring)
    m = Memory()
    if not t.gradient_checkpointing:
        m.activations = b * local * (d.full_layers * c.attention * att + d.linear_layers * c.deltanet * dn)
        m.activations += b * (patches * d.vision_depth * c.vision * vis + features)
        m.exchange = b * max(attention_x, deltanet_x)  # transient, one layer's at a time
    else:
        kept = 0 if t.offload_checkpoints else b * local * d.hidden * d.layers
        m.activations = kept + b * (patches * d.vision_width * d.vision_depth + features)
        # one layer is recomputed at a time: its activations, the gradient flowing through it (2 hidden states)
        # and its own exchange buffers — the largest of the layer kinds and the vision block
        gradient = 2 * d.hidden
        kinds = [(local * (c.attention_work * att + gradient), attention_x)] if d.full_layers else []
        if d.linear_layers:
            kinds.append((local * (c.deltanet_work * dn + gradient), deltanet_x))
        if d.vision_depth:
            kinds.append((patches * (c.vision_work * vis + 2 * d.vision_width), 0.0))
        working, exchange = max(kinds, key=sum)
        m.working, m.exchange = b * working, b * exchange
    # the fused head: one chunk of fp32 logits (turned into their gradient in place), its bf16 copy for the
    # gradient matmuls, the slice's hidden-state gradient in fp32; a stock head keeps the slice's fp32 logits,
    # their softmax and gradient (3 x)
    from .loss import chunk_tokens  # torch at call time only

    if t.stock_head:
        m.head = 3 * 4.0 * local * d.vocab + 4.0 * local * d.hidden
    else:
        chunk = chunk_tokens(local, d.hidden, d.vocab)  # the package's own rule
        copy = b if b < 4 else 0  # the cast back to the head's dtype is a no-op in fp32
        m.head = (4 + copy) * chunk * d.vocab + 4.0 * local * d.hidden
    m.batch = 32.0 * row.tokens  # ids, labels, positions, token types: int64, whole row
    return m


def exchange_elements(d: ModelDims, t: Training, local: int, ulysses: int, ring: int) -> tuple[float, float]:
    """(softmax layer, DeltaNet layer) exchange buffers of a rank, in elements of the activations' dtype: the
    all-to-all's send and receive buffers (q, k, v; DeltaNet's q, k, v and gates), across a ring the K/V in flight
    and the next, under sdpa the ring's fp32 tiles (scores, masked scores and probabilities alive at once), and the
    DeltaNet (M, B) of every chunk (2R chunks x H_v / U heads x d_k x (d_k + d_v), fp32)."""
    b = t.bytes_per_value
    hd, kv = d.heads * d.head_dim, replicated(d.kv_heads, d.heads, ulysses) * d.head_dim
    attention = 2 * local * (hd + 2 * kv) if ulysses > 1 else 0.0
    deltanet = 0.0
    if d.linear_layers and ulysses > 1:
        k_rep = replicated(d.linear_k_heads, d.linear_v_heads, ulysses) * d.linear_k_dim
        deltanet = 2 * local * (2 * k_rep + d.linear_v_heads * d.linear_v_dim + 2 * d.linear_v_heads)
    if ring > 1:
        attention += 4 * local * kv
        if t.attention == "sdpa":
            tile = min(512, local * ulysses)
            attention += (4 / b) * 3 * tile * tile * (d.heads // ulysses)
        if d.linear_layers:
            deltanet += (4 / b) * 2 * ring * (d.linear_v_heads / ulysses) * d.linear_k_dim * (
                d.linear_k_dim + d.linear_v_dim)
    return attention, deltanet


# ------------------------------------------------------------------------------------------------------------
# Time


def step_flops(d: ModelDims, row: Row, t: Training) -> dict[str, float]:
    """FLOPs of one step over the whole row, by kind: matmul (projections, MLPs, head, vision tower), attention
    (causal, within samples; vision within items), deltanet (chunked delta rule). Backward = 2 x forward for
    matmuls, 2.5 x for attention; checkpointing adds one more forward of the decoder and the tower."""
    n, patches = row.tokens, row.patches(d)
    linear = d.full_layers * d.attention_params() + d.linear_layers * d.deltanet_params() + d.layers * d.mlp_params()
    vision_block = 4 * d.vision_width**2 + 2 * d.vision_width * d.vision_intermediate
    matmul_fwd = 2 * n * linear + 2 * patches * d.vision_depth * vision_block
    head_fwd = 2 * n * d.hidden * d.vocab
    samples = max(1, math.ceil(n / row.longest_sample))
    length = n / samples  # samples of equal length, the longest's
    attention_fwd = 2 * samples * length**2 * d.heads * d.head_dim * d.full_layers  # causal: half of 4 s^2 H D
    if patches and row.patches_per_item:  # vision attention: bidirectional within each item
        items = patches / row.patches_per_item
        attention_fwd += 4 * items * row.patches_per_item**2 * d.vision_width * d.vision_depth
    chunk = 64  # the delta rule's chunk: per token and head, the state update and read (4 d_k d_v) and intra-chunk
    deltanet_fwd = d.linear_layers * n * d.linear_v_heads * (
        4 * d.linear_k_dim * d.linear_v_dim + 2 * chunk * (d.linear_k_dim + d.linear_v_dim))
    passes = 4 if t.gradient_checkpointing else 3  # forward, backward (2 x), recompute
    return {"matmul": passes * matmul_fwd + 3 * head_fwd,
            "attention": (2.5 + (2 if t.gradient_checkpointing else 1)) * attention_fwd,
            "deltanet": passes * deltanet_fwd}


TILE_PASSES_FORWARD, TILE_PASSES_BACKWARD = 8, 7  # elementwise passes per tile element in ring.py's torch kernel


def ring_tile_seconds(d: ModelDims, hw: Hardware, local: float, ulysses: int, ring: int, forward_passes: int) -> float:
    """Seconds of the ring's tiled fp32 math under sdpa (`attention/ring.py`): per layer, a rank meets its subgroup's
    U x local queries with each of the R subgroups' keys for H/U heads. A tile (512 x 512) where no query may attend
    is skipped: under the zigzag that is about half of the later chunks' tiles when a chunk is at least a tile long,
    (R + 1) / 2R of them computed; shorter chunks share tiles and nearly every tile is computed. Each element takes
    ~8 elementwise passes forward (scale, mask, log-sum-exp, subtract, exp, merge) and ~7 backward (the same
    recomputed, the two gradient products)."""
    queries = local * ulysses
    chunk = local / 2  # a rank holds two zigzag chunks' share
    computed = (ring + 1) / (2 * ring) if chunk * ulysses >= 512 else 1.0
    elements = d.full_layers * queries * queries * (d.heads / ulysses) * ring * computed
    passes = TILE_PASSES_FORWARD * forward_passes + TILE_PASSES_BACKWARD
    return elements * passes / (hw.tile_gelems * 1e9)


def all_to_all_seconds(hw: Hardware, volume: float, ulysses: int, gpus_per_node: int) -> float:
    """Seconds for a rank to exchange `volume` bytes with the U - 1 others of its Ulysses subgroup (consecutive
    ranks): the (n - 1) / U that stays in its node over NVLink and the (U - n) / U that leaves it over InfiniBand,
    at the same time (n: the subgroup's ranks per node)."""
    inside = min(ulysses, gpus_per_node)
    nvlink = volume * (inside - 1) / ulysses / (hw.nvlink_gbs * 1e9)
    infiniband = volume * (ulysses - inside) / ulysses / (hw.ib_gbs * 1e9)
    return max(nvlink, infiniband)


def link_gbs(hw: Hardware, span: int, gpus_per_node: int) -> float:
    """Bandwidth of a collective among `span` consecutive ranks: NVLink within a node, InfiniBand across."""
    return hw.nvlink_gbs if span <= gpus_per_node else hw.ib_gbs


def step_time(d: ModelDims, row: Row, t: Training, hw: Hardware, size: int, ulysses: int, gpus_per_node: int,
              compute_s: float | None = None) -> Time:
    """Seconds of one step on the busiest rank. Compute: the row's FLOPs / P at the attained rates. All-to-all:
    the package's volumes (docs/exchanges.md), the share leaving the rank, over NVLink inside the node and InfiniBand
    across (`all_to_all_seconds`). Ring:
    (6 (R-1) + 2) H_kv' D per token of the rank, in R-1 sequential steps, over the ring's link (ring members sit U
    ranks apart: inside a node when P <= node). DeltaNet across a ring: two all-gathers per layer and pass of a
    fixed size. With checkpointing the forward exchanges run twice."""
    b, ring = t.bytes_per_value, size // ulysses
    flops = step_flops(d, row, t)
    attention_s = flops["attention"] / hw.attention_tflops / 1e12 / size
    if compute_s is None:
        compute_s = (flops["matmul"] / hw.matmul_tflops + flops["deltanet"] / hw.deltanet_tflops) / 1e12 / size
        compute_s += attention_s
    out = Time(compute=compute_s, overlap=t.ring_overlap)
    local = row.tokens / size
    forward_passes = 2 if t.gradient_checkpointing else 1
    if ring > 1 and t.attention == "sdpa" and hw.tile_gelems:
        out.compute += ring_tile_seconds(d, hw, local, ulysses, ring, forward_passes=forward_passes)
    kv = replicated(d.kv_heads, d.heads, ulysses) * d.head_dim  # KV width per token after the replication for U
    if ulysses > 1:
        hd = d.heads * d.head_dim
        per_token = d.full_layers * 2 * (2 * hd + 2 * kv) / 2  # each way: (2 H + 2 H_kv') D, forward or backward
        if d.linear_layers:
            k_rep = replicated(d.linear_k_heads, d.linear_v_heads, ulysses) * d.linear_k_dim
            v = d.linear_v_heads * d.linear_v_dim
            per_token += d.linear_layers * (2 * k_rep + 2 * v + 2 * d.linear_v_heads)
        volume = b * local * per_token * (forward_passes + 1)  # bytes of a rank's slice through the exchanges
        calls = 4 * d.layers * (forward_passes + 1)
        out.all_to_all = all_to_all_seconds(hw, volume, ulysses, gpus_per_node) + calls * hw.latency_s
    if ring > 1:
        forward = 2 * (ring - 1) * local * kv * forward_passes
        backward = (4 * (ring - 1) + 2) * local * kv
        bw = link_gbs(hw, size, gpus_per_node) * 1e9
        out.ring = d.full_layers * (b * (forward + backward) / bw + (2 * (ring - 1) + 1) * hw.latency_s)
        # overlapped: each of the (R - 1) passes hides behind one block's attention compute
        out.ring_overlapped = max(0.0, out.ring - attention_s * (ring - 1) / ring)
        if d.linear_layers:
            state = 4.0 * 2 * ring * (d.linear_v_heads / ulysses) * d.linear_k_dim * (d.linear_k_dim + d.linear_v_dim)
            out.deltanet_state = d.linear_layers * (forward_passes + 1) * 2 * (
                state / bw + hw.latency_s * math.ceil(math.log2(ring)))
    if t.sharding in ("zero3", "fsdp"):  # gather forward (and recompute) and backward, reduce-scatter backward
        world = size * t.dp
        if world > 1:
            bw = link_gbs(hw, world, gpus_per_node) * 1e9
            comm = (forward_passes + 2) * b * d.params() * (world - 1) / world / bw
            out.sharding = max(0.0, comm - out.compute)
    return out


# ------------------------------------------------------------------------------------------------------------
# The plan


def candidate_sizes(gpus_per_node: int, max_gpus: int) -> list[int]:
    """P = 1, 2, 4, ... up to a node, then whole nodes (multiples of the node), up to `max_gpus`."""
    sizes = [p for p in (1, 2, 4, 8, 16, 32) if p < gpus_per_node]
    sizes += [gpus_per_node * k for k in range(1, max_gpus // gpus_per_node + 1)
              if k in (1, 2, 3, 4, 6) or k % 4 == 0]
    return sorted({p for p in sizes if p <= max_gpus})


def hardware(gpu: str | Hardware = "h100", memory_gib: float | None = None, **rates) -> Hardware:
    """`gpu` ("h100", "h200" or a Hardware) with `memory_gib` and the `rates` given (not None) in place of its own."""
    hw = GPUS[gpu.lower()] if isinstance(gpu, str) else gpu
    hw = replace(hw, **{k: v for k, v in rates.items() if v is not None})
    return replace(hw, memory_gib=memory_gib) if memory_gib else hw


def plan(model="qwen3-vl-8b", row: Row | int = 131072, gpu: str | Hardware = "h100", gpus_per_node: int = 8,
         memory_gib: float | None = None, training: Training | None = None, sizes=None, max_gpus: int = 128,
         all_layouts: bool = True, constants: Constants | None = None, **rates) -> list[PlanRow]:
    """The table: a PlanRow per P and per U x R the heads allow (only the package's choice if not `all_layouts`).

    `row`: a Row, or a token count (one text sample). `gpu`: "h100", "h200" or a Hardware; `memory_gib` and
    `rates` (matmul_tflops, attention_tflops, deltanet_tflops, nvlink_gbs, ib_gbs, latency_s) override its fields.
    Marks: `smallest` on the package's layout at the smallest P that fits; `fastest` on the row of highest tokens/s
    per GPU among all rows that fit (any P, any layout); every row's `why` says why it wins or loses."""
    dims = model_dims(model)
    row = Row.text(row) if isinstance(row, int) else row
    hw = hardware(gpu, memory_gib, **rates)
    t = training or Training()
    c = constants or CALIBRATED
    rows: list[PlanRow] = []
    flipped = replace(t, gradient_checkpointing=not t.gradient_checkpointing)
    for size in sizes or candidate_sizes(gpus_per_node, max_gpus):
        chosen = package_ulysses(dims, size, gpus_per_node)
        weights, grads, optimizer = static_memory(dims, t, size * t.dp)
        for ulysses, ring in layouts(dims, size):
            if not all_layouts and ulysses != chosen:
                continue
            memory = activation_memory(dims, row, t, c, size, ulysses)
            memory.weights, memory.gradients, memory.optimizer = weights, grads, optimizer
            other = activation_memory(dims, row, flipped, c, size, ulysses)
            other.weights, other.gradients, other.optimizer = weights, grads, optimizer
            time = step_time(dims, row, t, hw, size, ulysses, gpus_per_node)
            rows.append(PlanRow(size=size, ulysses=ulysses, ring=ring, nodes=-(-size // gpus_per_node),
                                tokens_per_rank=row.tokens // size, memory=memory, time=time,
                                fits=memory.total <= hw.usable * hw.memory_gib * GIB, chosen=ulysses == chosen,
                                other_checkpointing_gib=other.total / GIB))
    mark(rows)
    return rows


def mark(rows: list[PlanRow]) -> None:
    """The smallest P that fits (the package's layout), the fastest layout that fits, and why each other loses."""
    fitting = [r for r in rows if r.fits and r.chosen]
    smallest = min(fitting, key=lambda r: r.size) if fitting else None
    fastest = max((r for r in rows if r.fits), key=lambda r: r.tokens_per_s_per_gpu, default=None)
    if smallest:
        smallest.smallest = True
    if fastest:
        fastest.fastest = True
    picked = {r.size: r.ulysses for r in rows if r.chosen}
    for r in rows:
        r.why = _why(r, smallest, fastest, picked.get(r.size))


def _why(r: PlanRow, smallest: PlanRow | None, fastest: PlanRow | None, picked: int | None = None) -> str:
    """Why a row wins or loses: what overflows memory, or how much slower per GPU than the fastest and which
    exchange costs it that, and whether the package would pick this layout at this P."""
    if not r.fits:
        m = r.memory
        parts = {"weights+grads+optimizer": m.weights + m.gradients + m.optimizer,
                 "activations": m.activations + m.working, "head": m.head, "exchange buffers": m.exchange}
        return f"does not fit: {max(parts, key=parts.get)} dominate"
    notes = []
    if r is smallest:
        notes.append("smallest P that fits")
    if r is fastest:
        notes.append("fastest per GPU")
    elif fastest is not None:
        loss = 1 - r.tokens_per_s_per_gpu / fastest.tokens_per_s_per_gpu
        tm = r.time
        parts = {"all-to-all": tm.all_to_all, "ring": tm.ring_overlapped if tm.overlap else tm.ring,
                 "DeltaNet state": tm.deltanet_state,
                 "ZeRO-3 gathers": tm.sharding}
        worst = max(parts, key=parts.get)
        if loss < 0.005:
            notes.append("as fast per GPU as the fastest")
        elif parts[worst] > 0.01 * tm.total:
            notes.append(f"{loss:.0%} slower per GPU: {worst} {parts[worst] / tm.total:.0%} of its step")
        else:
            notes.append(f"{loss:.0%} slower per GPU")
    if not r.chosen:
        notes.append(f"not the package's layout at this P (it takes U={picked})" if picked else
                     "not the package's layout at this P")
    return "; ".join(notes)


# ------------------------------------------------------------------------------------------------------------
# Printing


def format_table(rows: list[PlanRow], dims: ModelDims, row: Row, hw: Hardware, t: Training,
                 gpus_per_node: int) -> str:
    """The table and, under it, its assumptions."""
    lines = [f"{dims.name}: {row.tokens:,} tokens ({row.vision_tokens:,} vision tokens, "
             f"{row.patches(dims):,} patches), longest sample {row.longest_sample:,}; {hw.name}, "
             f"{hw.memory_gib:g} GiB, nodes of {gpus_per_node}",
             f"{'P':>4} {'UxR':>6} {'nodes':>5} {'peak GiB':>8} {'fits':>4} "
             f"{'GC off' if t.gradient_checkpointing else 'GC on':>7} {'w+g+opt':>7} {'act':>6} {'work':>6} "
             f"{'head':>5} {'exch':>5} {'step s':>8} {'compute':>8} {'a2a':>6} {'ring':>6} {'ring ov':>7} "
             f"{'dn st':>6} {'zero3':>6} {'tok/s/GPU':>9}  mark"]
    for r in rows:
        m, tm = r.memory, r.time
        g = lambda x: f"{x / GIB:.1f}"  # noqa: E731
        mark_text = ("* " if r.smallest else "") + ("> " if r.fastest else "") + r.why
        lines.append(f"{r.size:>4} {f'{r.ulysses}x{r.ring}':>6} {r.nodes:>5} {r.peak_gib:>8.1f} "
                     f"{'yes' if r.fits else 'no':>4} {r.other_checkpointing_gib:>7.1f} "
                     f"{g(m.weights + m.gradients + m.optimizer):>7} "
                     f"{g(m.activations):>6} {g(m.working):>6} {g(m.head):>5} {g(m.exchange):>5} "
                     f"{tm.total:>8.2f} {tm.compute:>8.2f} {tm.all_to_all:>6.2f} {tm.ring:>6.2f} "
                     f"{tm.ring_overlapped:>7.2f} {tm.deltanet_state:>6.3f} {tm.sharding:>6.2f} "
                     f"{r.tokens_per_s_per_gpu:>9.0f}  {mark_text}")
    lines += assumptions(dims, hw, t)
    return "\n".join(lines)


def assumptions(dims: ModelDims, hw: Hardware, t: Training) -> list[str]:
    return [
        "marks: * smallest P that fits (the package's layout); > fastest per GPU among those that fit; "
        f"'{'GC off' if t.gradient_checkpointing else 'GC on'}': the peak with checkpointing switched "
        f"{'off' if t.gradient_checkpointing else 'on'}; memory parts in GiB, times in s",
        f"assumptions: {dims.params() / 1e9:.2f}B parameters; bf16 weights and gradients, fp32 Adam "
        f"({'offloaded' if t.offload_optimizer else 'on the GPU'}), sharding {t.sharding} over P x {t.dp} ranks; "
        f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}; usable memory "
        f"{hw.usable:.0%} of {hw.memory_gib:g} GiB",
        f"  attained rates: matmul {hw.matmul_tflops:g}, attention {hw.attention_tflops:g}, DeltaNet "
        f"{hw.deltanet_tflops:g} TFLOP/s; links NVLink {hw.nvlink_gbs:g} GB/s, IB {hw.ib_gbs:g} GB/s per GPU, "
        f"{hw.latency_s * 1e6:g} us per collective step",
        "  activation constants fitted on CPU at P=1 and checked at P=2..8 (docs/plan.md); vision work split evenly; "
        + ("ring passes overlapped with compute (the step counts 'ring ov')" if t.ring_overlap else
           "ring passes priced without overlap (--no-ring-overlap; 'ring ov': what overlap leaves)"),
    ]


# ------------------------------------------------------------------------------------------------------------
# The sizing table of docs/plan.md


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


# ------------------------------------------------------------------------------------------------------------
# The command


def _pixels(text: str, parts: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.lower().split("x"))
    if len(values) != parts:
        raise ValueError(f"{text!r}: expected {parts} numbers joined by x")
    return values


def main(argv=None) -> int:
    """`python -m vlmcp_patch plan ...`: print the table for one model and row."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m vlmcp_patch plan", description=__doc__.splitlines()[0])
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
                    "schedule, collectives.OVERLAP = False)")
    tr.add_argument("--chosen-only", action="store_true", help="only the package's layout at each P")
    tr.add_argument("--sizing-table", action="store_true", help="print docs/plan.md's table and stop")
    a = p.parse_args(argv)
    if a.sizing_table:
        print(sizing_table(a.gpu, a.gpus_per_node))
        return 0
    dims = model_dims(a.model)
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
    training = Training(sharding=a.sharding, gradient_checkpointing=not a.no_gradient_checkpointing, dp=a.dp,
                        offload_optimizer=a.offload_optimizer, freeze_vision=a.freeze_vision,
                        ring_overlap=a.ring_overlap)
    rates = {k: getattr(a, k) for k in ("matmul_tflops", "attention_tflops", "deltanet_tflops", "nvlink_gbs",
                                         "ib_gbs")}
    rates["latency_s"] = a.latency_us * 1e-6 if a.latency_us else None
    rows = plan(dims, row, gpu=a.gpu, gpus_per_node=a.gpus_per_node, memory_gib=a.memory_gib, training=training,
                sizes=a.sizes, max_gpus=a.max_gpus, all_layouts=not a.chosen_only, **rates)
    print(format_table(rows, dims, row, hardware(a.gpu, a.memory_gib, **rates), training, a.gpus_per_node))
    return 0
