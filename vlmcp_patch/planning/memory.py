"""Memory: per-rank peak bytes by part — weights, gradients and optimizer under the sharding, the saved activations
(element counts per token or patch, by layer kind, times fitted constants), the recomputed layer's working set, the
head's chunk, the exchange buffers and the row's integers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..settings import AUTO
from ..tiles import NORM_BACKWARD_WIDTH, tile_tokens
from ..tiles import mlp_tile_tokens as package_mlp_tile_tokens
from ..vision_tiles import tile_patches
from .dims import ModelDims
from .host import checkpoint_pool_bytes, loader_host, offloaded_optimizer_host
from .layouts import replicated
from .rows import Row
from .training import Constants, Training


def attention_elements(d: ModelDims, ulysses: int) -> float:
    """Saved for backward per local token by one softmax-attention decoder layer, without checkpointing: the two
    norms' inputs and outputs (4h), q and k before and after their norms and rope (2 x (H + H_kv) D), v, the
    kernel's head-sharded q, k, v and output (with KV replication for U), the output projection's input, and the
    SwiGLU MLP's gate, up, activation and product (4 I); with an output gate (Qwen3.5) the gate and the gated
    output (2 H D)."""
    hd, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    kv_rep = replicated(d.kv_heads, d.heads, ulysses) * d.head_dim
    gate = 2 * hd if d.attention_gate else 0
    return 4 * d.hidden + 2 * (hd + kv) + kv + (2 * hd + 2 * kv_rep) + hd + gate + 4 * d.intermediate


def norm_elements(d: ModelDims, bytes_per_value: int) -> dict[str, float]:
    """Per token, by layer kind, what the decoder's RMSNorms keep for backward beyond their input and output:
    transformers' norms compute in fp32, so each keeps its normalized input (1 value per normalized number) and below
    fp32 also the fp32 copy of its input (2 values of the activations' dtype more: 3 in bf16). "attention": the two
    layer norms and the q and k norms; "deltanet": the two layer norms; "gated": DeltaNet's gated norm of the core
    output; "final": the final norm. Under CP the package recomputes all but the gated norm in backward, keeping their
    inputs only (`tiles.recomputed_norm_forward`). Measured in bf16 and fp32: `tests/test_plan.py`."""
    per = 1 if bytes_per_value >= 4 else 3
    q, k = d.heads * d.head_dim, d.kv_heads * d.head_dim
    v = d.linear_v_heads * d.linear_v_dim
    return {"attention": per * (2 * d.hidden + q + k), "deltanet": per * 2 * d.hidden, "gated": per * v,
            "final": per * d.hidden}


def mlp_tile_tokens(tokens: int, hidden: int, width: int, configured: int | None = None) -> int:
    """Tokens per tile of an MLP over `tokens` tokens whose intermediates hold `width` numbers per token: the
    package's own rule (`tiles.mlp_tile_tokens`), automatic or `configured` (`VLMCP_MLP_TILE_TOKENS`)."""
    if tokens <= 0:
        return 0
    return package_mlp_tile_tokens(tokens, hidden, width, AUTO if configured is None else configured)


def mlp_share(tokens: int, hidden: int, width: int, tiled: bool, configured: int | None = None) -> float:
    """The share of a slice's MLP intermediates alive at once while its layer is recomputed: one tile's when the
    MLP runs in tiles, else all of them."""
    return min(1.0, mlp_tile_tokens(tokens, hidden, width, configured) / tokens) if tiled and tokens else 1.0


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
    projection's input (w), the MLP's input, hidden, activation (w + 2 I_v); the mergers' in `merger_elements`."""
    w = d.vision_width
    return 13 * w + 2 * d.vision_intermediate


def merger_elements(d: ModelDims) -> float:
    """Saved per patch by the tower's mergers (the merger and each deepstack merger; none is checkpointed): each one's
    norm output, first linear's output and activation (4w per merged token each: 3w per patch), and the last block's
    output, which the merger reads (the other block outputs they read are the next blocks' inputs, counted there)."""
    if not d.vision_depth:
        return 0.0
    return (1 + d.deepstack) * 3 * d.vision_width + d.vision_width


def mlp_tiles_act(t: Training, size: int) -> bool:
    """Whether the decoder's and tower's MLPs run in tiles (`tiles.run_in_tiles`): the switch on, under CP, or at
    P = 1 where a size is set (`VLMCP_MLP_TILE_TOKENS=N`) — not under ZeRO-3 at P = 1, which gathers an MLP one
    linear at a time there (the package makes it a leaf module under CP only: it then runs whole)."""
    return t.tiled_mlp and (size > 1 or (t.mlp_tile_tokens is not None and t.sharding != "zero3"))


def vision_tile(d: ModelDims, t: Training, patches: int, size: int) -> int:
    """Patches of one tile of the vision tower over a rank's `patches` (the package's rule,
    `vision_tiles.tile_patches`: automatic, or `t.vision_tile_patches`; a share of one tile is that tile: the package
    takes the tiled function whenever the switch is on, `vision_tiles.tiling_applies`); 0 when the tower runs untiled:
    tiling off, CP off without a size set (`VLMCP_VISION_TILE_PATCHES=N` acts at P = 1 too), FSDP (which gathers
    the tower module by module: the package runs it whole), ZeRO-3 at P = 1 (a leaf module under CP only). ZeRO-3
    under CP tiles: the package makes the tower a ZeRO-3 leaf, gathered whole once per call
    (`vision_tower_gathered`)."""
    acts = size > 1 or (t.vision_tile_patches is not None and t.sharding != "zero3")
    if not (t.tiled_vision and acts and d.vision_depth and patches) or t.sharding == "fsdp":
        return 0
    work = d.vision_depth * vision_elements(d)
    kept = d.hidden * (1 + d.deepstack) / d.merge**2
    return min(patches, tile_patches(patches, work, kept,
                                     AUTO if t.vision_tile_patches is None else t.vision_tile_patches))


def vision_tower_gathered(d: ModelDims, t: Training, tiled: bool) -> float:
    """Elements of the whole vision tower's weights that ZeRO-3 holds gathered while a tiled tower runs (a leaf
    module: `vision_tiles.gather_whole_towers_under_zero3`), beside a tile's recompute; 0 otherwise."""
    return d.vision_params() if tiled and t.sharding == "zero3" else 0.0


@dataclass
class Memory:
    """Per-rank peak memory, bytes, by part."""

    weights: float = 0.0  # parameters held (sharded, plus ZeRO-3's gathered working layers)
    gradients: float = 0.0
    optimizer: float = 0.0  # master weights and moments
    activations: float = 0.0  # saved for backward (with checkpointing: the checkpoints)
    forward_only: float = 0.0  # with checkpointing, alive to the end of the forward only: the vision features
    # routed to this rank and the final norm's tensors (without checkpointing they are in `activations`)
    working: float = 0.0  # the recomputed layer's working set with the feature gradients alive then (checkpointing)
    head: float = 0.0  # one chunk of fp32 logits and its companions
    head_weight: float = 0.0  # beside the head's chunk: the head weight's fp32 gradient, ZeRO-3's gathered lm_head
    # with checkpointing, the decoder's forward at its peak layer beside what `activations` holds: the vision
    # features, the embeddings and the previous layer's output, one layer's forward working set
    forward_decoder: float = 0.0
    host: float = 0.0  # the checkpoint offload's bytes held in host memory by this rank (not on the device)
    host_pool: float = 0.0  # the host bytes its pool allocates to hold them (`offload.pool_bytes_for`)
    host_optimizer: float = 0.0  # the optimizer offloaded to the host, as DeepSpeed holds it (`host.HostOptimizer`)
    host_batch: float = 0.0  # the step's batches on the host: the row's integers, this rank's share of the pixels
    # (pinned: each tensor a caching-host-allocator block; with accumulation, the optimizer step's k batches)
    # the vision features parked on the host with the offload under CP (`offload.park_features`): the slice's merged
    # and deepstack features in forward, their gradients in backward (the forward's are gone by then: the model's
    # output does not hold them)
    host_features: float = 0.0
    # the data loader's (`host.loader_host`, `host.LoaderHost`): the optimizer step's batches are `host_batch`; the
    # finished batches waiting, each cut to this rank's share; the previous step's batches the Trainer holds while it
    # fetches (pinned: cached throughout, `host_previous_cached`; else between steps only); the rows being collated, at
    # their peak; the pageable batch while it is pinned
    host_queued: float = 0.0
    host_previous: float = 0.0
    host_previous_cached: bool = False
    host_collation: float = 0.0
    host_pinning: float = 0.0
    # whether the collations (and the pinning) run while the step does (loader workers) or only between steps, when
    # the parked features are gone (`host.collation_beside_step`)
    host_collation_beside_step: bool = True
    exchange: float = 0.0  # all-to-all send/receive buffers, ring K/V in flight, DeltaNet state gathers
    batch: float = 0.0  # the row's integer tensors (whole row on every rank) and this rank's pixel values
    # kernels' transients beside the recomputed layer in backward: flash-attn 2's backward scratch (fp32 dq
    # accumulator, GQA-expanded dk / dv) or a recomputed RMSNorm tile's fp32 values and gradients; never alive with
    # the exchange buffers (a kernel runs between the exchanges, each freeing its buffers when it returns)
    scratch: float = 0.0
    forward_exchange: float = 0.0  # the exchange buffers of the layer computing in the decoder's forward
    rotary: float = 0.0  # the rotary tables (cos, sin) of the slice, alive through the decoder's forward and backward

    @property
    def total(self) -> float:
        """The peak: what lives through the step, plus the largest of three phases' transients, never alive
        together — the decoder's forward (`forward_decoder` with its exchange buffers), the end of the forward (the
        features and the final norm, the head's chunk and the head weight's fp32 gradient, which the fused head makes
        there) and one layer's recompute in backward (its working set with the feature gradients arrived by then, and
        the larger of its exchange buffers and its kernels' scratch, which are never alive at once)."""
        return (self.weights + self.gradients + self.optimizer + self.activations + self.batch + self.rotary
                + max(self.working + max(self.exchange, self.scratch), self.forward_only + self.head + self.head_weight,
                      self.forward_decoder + self.forward_exchange))

    @property
    def host_between_steps(self) -> float:
        """What the data loader adds between steps (beside the step with loader workers): the previous step's
        batches (unpinned), and the collation, then the pageable batch while it is pinned — one after the other in
        the training process (the larger), at once with workers (their sum)."""
        previous = 0.0 if self.host_previous_cached else self.host_previous
        if self.host_collation_beside_step:
            return previous + self.host_collation + self.host_pinning
        return previous + max(self.host_collation, self.host_pinning)

    @property
    def host_total(self) -> float:
        """Host bytes this rank needs at its peak: the terms of its phase (`host_terms`), summed — what lives through
        both phases plus, where the collations run beside the step (loader workers), the parked vision features and
        the between-steps terms (`host_between_steps`); where they run only between steps (no workers), the larger of
        the two phases' own terms (`host.collation_beside_step` says what lives in each phase)."""
        return sum(self.host_terms().values())

    @property
    def host_phase(self) -> str:
        """The phase `host_total` counts: "beside the step" (loader workers: both phases' terms at once), "during the
        step" (the parked features the larger) or "between steps"."""
        if self.host_collation_beside_step:
            return "beside the step"
        return "during the step" if self.host_features > self.host_between_steps else "between steps"

    def host_terms(self) -> dict[str, float]:
        """The terms `host_total` counts, by name, in its phase (`host_phase`): what lives through both phases (the
        checkpoint pool as allocated, the offloaded optimizer, the step's batches, the queued ones and, pinned, the
        previous step's cached blocks), then the phase's own. With no workers the collation and the pinning are one
        after the other: the larger is counted. Those of 0 bytes among the previous batches, the parked features, the
        collation and the pinning are left out."""
        terms = {"checkpoint pool": self.host_pool, "optimizer": self.host_optimizer,
                 "step's batches": self.host_batch, "queued batches": self.host_queued}
        phase = self.host_phase
        during, between = phase in ("beside the step", "during the step"), phase != "during the step"
        if self.host_previous_cached or between:
            terms["previous batches"] = self.host_previous
        if during:
            terms["parked features"] = self.host_features
        if between:
            if self.host_collation_beside_step or self.host_collation >= self.host_pinning:
                terms["collation"] = self.host_collation
            if self.host_collation_beside_step or self.host_pinning > self.host_collation:
                terms["pinning"] = self.host_pinning
        optional = ("previous batches", "parked features", "collation", "pinning")
        return {k: v for k, v in terms.items() if v or k not in optional}  # a term of 0 adds nothing


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


def offloaded_optimizer(d: ModelDims, t: Training, world: int) -> float:
    """Host bytes per rank of an offloaded optimizer as DeepSpeed holds it: its states, its fp32 gradients and its
    pinned buffers as allocated (`host.offloaded_optimizer_host`)."""
    return offloaded_optimizer_host(d, t, world).total


def activation_memory(d: ModelDims, row: Row, t: Training, c: Constants, size: int, ulysses: int) -> Memory:
    """Activation-side bytes of the busiest rank: the slice's tokens (row / P, padded), the rank's share of the
    vision patches (balanced: an even split), the fused head's chunk, the exchange buffers, the row's integers;
    with the checkpoint offload, the host pool (`Memory.host`). The MLPs run in tiles where the package tiles them
    (`t.tiled_mlp` and P > 1): without checkpointing their intermediates are not kept; with it one tile's are in
    the recomputed layer's working set."""
    b = t.bytes_per_value
    ring = size // ulysses
    local = math.ceil(row.tokens / (size if ring == 1 else 2 * size)) * (1 if ring == 1 else 2)
    patches = math.ceil(row.patches(d) / size)
    vision_local = math.ceil(row.vision_tokens / size)
    att, dn = attention_elements(d, ulysses), deltanet_elements(d, ulysses) if d.linear_layers else 0.0
    norms, recomputed = norm_elements(d, b), t.recompute_norms and size > 1
    att += 0.0 if recomputed else norms["attention"]
    dn += norms["gated"] + (0.0 if recomputed else norms["deltanet"]) if dn else 0.0
    vis, mergers = (vision_elements(d), merger_elements(d)) if d.vision_depth else (0.0, 0.0)
    tiled = mlp_tiles_act(t, size)
    mlp = 4 * d.intermediate  # the decoder MLP's intermediates per token: alive in its recompute (or one tile's)
    if tiled:  # the MLPs' intermediates (4 I per token, 2 I_v per patch) are kept per tile, or not at all
        keep = (mlp_share(local, d.hidden, 4 * d.intermediate, tiled, t.mlp_tile_tokens)
                if t.gradient_checkpointing else 0.0)
        att -= (1 - keep) * 4 * d.intermediate
        dn = dn - (1 - keep) * 4 * d.intermediate if dn else 0.0
        mlp *= keep
        if vis:
            keep_v = (mlp_share(patches, d.vision_width, 2 * d.vision_intermediate, tiled, t.mlp_tile_tokens)
                      if t.gradient_checkpointing else 0.0)
            vis -= (1 - keep_v) * 2 * d.vision_intermediate
    features = vision_local * d.hidden * (1 + d.deepstack)  # merged + deepstack features routed to this rank
    # with the offload under CP they wait on the host (`offload.park_features`): on the device only stock's copy of
    # the merged features for its forward, a level only while its layer adds it, their gradients only at the tower
    parked = parks_features(t, size)
    on_device = 0.0 if parked else features
    # the tower over tiles of items (`vision_tiles.py`): nothing of it kept between forward and backward but the
    # features; in backward one tile is recomputed at a time, every block's activations alive (its blocks' own
    # checkpointing is off inside a tile), its MLPs in their own tiles keeping no intermediates
    tile = vision_tile(d, t, patches, size)
    vis_tile = (vision_elements(d) - (2 * d.vision_intermediate if tiled else 0)) if tile else 0.0
    # a tile's own pixel values come to the device with it (`vision_tiles.encode_in_tiles`): the share's never do
    tile_work = tile * (c.vision * (d.vision_depth * vis_tile + mergers) + 2 * d.vision_width + d.patch_values)
    tile_work += vision_tower_gathered(d, t, bool(tile))  # under ZeRO-3 the whole tower, gathered meanwhile
    # DeltaNet across a ring (models/deltanet_ring.py): a chunk continuing a sample runs the delta rule twice more
    # for its transfer (B from a zero state, M from the identity), and autograd keeps both runs' intermediates
    ring_rule = 2 * deltanet_rule_elements(d, ulysses) if (ring > 1 and d.linear_layers) else 0.0
    dn += ring_rule
    attention_x, deltanet_x = exchange_elements(d, t, local, ulysses, ring)
    # the kernels' transients in a layer's backward, bytes: flash-attn's scratch (softmax layers), a recomputed norm
    # tile's fp32 values and gradients
    flash_scratch = flash_backward_scratch_bytes(d, t, local, ulysses)
    norm_scratch = norm_tile_scratch_bytes(d, local) if recomputed else 0.0
    # the final norm's input and output (its backward's and the head's) and what it keeps besides, unless recomputed
    final = local * (2 * d.hidden + (0.0 if recomputed else norms["final"]))
    m = Memory()
    if not t.gradient_checkpointing:
        m.activations = b * local * (d.full_layers * c.attention * att + d.linear_layers * c.deltanet * dn)
        m.activations += b * ((0 if tile else patches * c.vision * (d.vision_depth * vis + mergers)) + on_device
                              + final)
        m.exchange = b * max(attention_x, deltanet_x)  # transient, one layer's at a time
        m.scratch = max(flash_scratch, norm_scratch)  # everything saved is alive at the last layer's backward
        m.working = b * tile_work  # a vision tile recomputed in backward (the exchanges are not running then)
    else:
        decoder = b * local * d.hidden * d.layers
        vision = 0.0 if tile else b * patches * d.vision_width * d.vision_depth  # tiled: no block checkpoints
        if t.offload_checkpoints:  # all but the last layer's input go to the host (in backward, beside the input of
            # the layer recomputed, the next one's comes back: `beside_a_recomputed_layer`)
            m.host = decoder - b * local * d.hidden + vision  # the pool: every input but the last layer's
            decoder, vision = b * local * d.hidden, 0.0
        # the untiled tower's mergers keep their activations to the end of the step (they are not checkpointed),
        # and with them the block outputs they read, on the device even when the blocks' inputs are offloaded
        if not tile:
            taps = (d.merger_inputs - 1) * d.vision_width if t.offload_checkpoints else 0.0
            vision += b * patches * (c.vision * mergers + taps)
        m.activations = decoder + vision
        # nothing autograd keeps for backward holds the features or the final norm's tensors once the head's backward
        # has run: gone before the first layer is recomputed (measured: `tests/test_plan.py`, the backward's peak)
        m.forward_only = b * (on_device + final)
        # one layer is recomputed at a time: its activations, the gradient flowing through it (2 hidden states)
        # and its own exchange buffers — the largest of the layer kinds and the vision block — beside the
        # checkpoints and feature gradients alive at the worst layer. The tower's backward comes after every
        # decoder layer's (no decoder checkpoint left), with the gradients of the merged and deepstack features
        gradient = 2 * d.hidden
        mlp_work = c.mlp_work * mlp
        around = beside_a_recomputed_layer(d, local, vision_local, t.offload_checkpoints, parked)
        # flash-attn's backward scratch beside a softmax layer's working set (its kernel runs in the middle of it)
        kinds = ([(local * (c.attention_work * (att - mlp) + mlp_work + gradient) + around, attention_x,
                   flash_scratch / b)]
                 if d.full_layers else [])
        if d.linear_layers:
            kinds.append((local * (c.deltanet_work * (dn - mlp) + mlp_work + gradient) + around, deltanet_x, 0.0))
        if norm_scratch:  # a recomputed norm's tiles run when the rest of its layer's backward is done (measured:
            # priced on top of the working set it overpredicts the recomputed rows by 12-15 %): beside the gradient,
            # the layer's input and the q / k norms' inputs
            qk = (d.heads + d.kv_heads) * d.head_dim if d.full_layers else 0
            kinds.append((local * (gradient + d.hidden + qk) + around, 0.0, norm_scratch / b))
        if d.vision_depth:
            tower = tile_work if tile else patches * (c.vision_work * vis + 2 * d.vision_width)
            kinds.append((tower + features - decoder / b, 0.0, 0.0))
        working, exchange, scratch = max(kinds, key=lambda k: k[0] + max(k[1], k[2]))
        m.working, m.exchange, m.scratch = b * working, b * exchange, b * scratch
        # the decoder's forward at its layers: the vision features routed to the rank (the joined features, the
        # base of the views stock's forward holds until the decoder returns; parked: on the host) and stock's own
        # copy of the merged
        # features (its deepstack copies the decoder no longer reads: `vision.use_the_routed_deepstack_levels`), the
        # embeddings and the previous layer's output, and one layer's forward working set, which is what its
        # recompute keeps (measured: a probe at the forward's peak, layer 1 of the image-heavy rows in
        # production-like MLP tiles)
        # with its exchange buffers (q, k, v going to the heads and the output coming back): the kind whose sum is
        # larger
        forward_kinds = ([(c.attention_work * (att - mlp), attention_x / local)] if d.full_layers else [])
        if d.linear_layers:
            forward_kinds.append((c.deltanet_work * (dn - mlp), deltanet_x / local))
        layer_forward, forward_exchange = max(forward_kinds, key=sum)
        m.forward_decoder = b * (on_device + vision_local * d.hidden + local * (2 * d.hidden + layer_forward))
        m.forward_exchange = b * local * forward_exchange
    # the fused head: one chunk of fp32 logits (turned into their gradient in place), its copy in the head's dtype
    # for the gradient matmuls (the matmul's own output before the upcast, as large) and, for the weight's fp32
    # gradient, that copy's fp32 cast (`.T.float()`; not when the head is frozen), and the slice's hidden-state
    # gradient in the head's dtype; a stock head keeps the slice's fp32 logits, their softmax and gradient (3 x)
    from ..loss import chunk_tokens  # torch at call time only

    if t.stock_head:
        m.head = 3 * 4.0 * local * d.vocab + b * local * d.hidden
    else:
        chunk = chunk_tokens(local, d.hidden, d.vocab, t.loss_chunk)  # the package's own rule, or the one set
        copy = 0 if b >= 4 else b + (0 if t.frozen_head else 4)  # no copies in fp32
        m.head = (4 + copy) * chunk * d.vocab + b * local * d.hidden
    # the head weight's gradient, fp32 (`loss._accumulate_head_grads`), made in the forward and handed to autograd
    # at the start of backward; under ZeRO-3 the whole lm_head gathered while the head runs
    m.head_weight = 0.0 if t.frozen_head else 4.0 * d.vocab * d.hidden
    if t.sharding in ("zero3", "fsdp") and size * t.dp > 1:
        m.head_weight += b * d.vocab * d.hidden
    # ids, labels, positions, token types: int64, whole row; untiled, the pixel values of the rank's patches, which
    # the patch embedding keeps for backward: under CP the integrations copy a rank's share to its device inside the
    # step, at P = 1 the whole batch is there (in tiles, a tile's pixels only, in its working set)
    m.batch = 32.0 * row.tokens + (0 if tile else b * patches * d.patch_values)
    m.rotary = rotary_bytes(d, t, local)
    m.host_pool = checkpoint_pool_bytes(m.host)
    loader = loader_host(d, row, size, t)
    m.host_batch, m.host_queued, m.host_previous = loader.batches, loader.queued, loader.previous
    m.host_previous_cached, m.host_collation, m.host_pinning = loader.cached, loader.collating, loader.pinning
    m.host_collation_beside_step = loader.beside_step
    # parked: the features on the host, and while stock's forward prepares the decoder's inputs its own host copy of
    # each deepstack level (transformers 5.18+ joins each level's one-item tuple: `torch.cat`), gone when the decoder
    # reads the parked levels (`vision.use_the_routed_deepstack_levels`); in backward their gradients, as many bytes
    m.host_features = b * (features + d.deepstack * vision_local * d.hidden) if parked else 0.0
    return m


def parks_features(t: Training, size: int) -> bool:
    """Whether the step prices the slice's vision features parked on the host (`offload.park_features`): set so
    (`t.park_features`: as `VLMCP_OFFLOAD_FEATURES=1`, or `table.plan` / by need where the row needs it), under CP
    (the CP vision path parks them)."""
    return bool(t.park_features) and size > 1


def may_park_features(t: Training, size: int) -> bool:
    """Whether parking the features is left to the row's need (`Training.park_features` None) and could act."""
    return t.park_features is None and t.offload_checkpoints and size > 1


def flash_backward_scratch_bytes(d: ModelDims, t: Training, local: int, ulysses: int) -> float:
    """Bytes flash-attn 2's varlen backward allocates beside its inputs and outputs, for one softmax layer of a rank
    that attends `local x U` tokens (its Ulysses subgroup's; a ring's block calls are as long) for H / U query heads
    (`mha_varlen_bwd` in `csrc/flash_attn/flash_api.cpp`): the fp32 dq accumulator (tokens x heads x the head size
    rounded up to 32, or 64 above 128), the fp32 softmax_d (tokens x heads) and, under GQA (fewer KV heads than
    query heads on the rank, after the package's replication for U), dk and dv expanded to every query head in the
    activations' dtype. 0 without flash-attn (`t.attention`), or without softmax layers."""
    if t.attention != "flash_attention_2" or not d.full_layers:
        return 0.0
    tokens, heads = local * ulysses, d.heads // ulysses
    kv_heads = replicated(d.kv_heads, d.heads, ulysses) // ulysses
    rounded = -(-d.head_dim // (32 if d.head_dim <= 128 else 64)) * (32 if d.head_dim <= 128 else 64)
    scratch = 4.0 * tokens * heads * (rounded + 1)
    if kv_heads != heads:
        scratch += 2.0 * t.bytes_per_value * tokens * heads * d.head_dim
    return scratch


def norm_tile_scratch_bytes(d: ModelDims, local: int) -> float:
    """Bytes of a recomputed RMSNorm's fp32 transient in backward (`tiles.recomputed_norm_forward`): one tile of rows,
    `NORM_BACKWARD_WIDTH` fp32 values per normalized number (its input's fp32 copy, the normalized input, their
    gradients), tiles by the package's rule (`tiles.tile_tokens`) — the largest of the decoder's norms: the layer
    norms (the slice's tokens x hidden) and the q and k norms (a row per token and head, head_dim wide)."""
    norms = [(local, d.hidden)]
    if d.full_layers:
        norms += [(local * d.heads, d.head_dim), (local * d.kv_heads, d.head_dim)]
    return max(4.0 * NORM_BACKWARD_WIDTH * width * tile_tokens(rows, width, NORM_BACKWARD_WIDTH * width)
               for rows, width in norms if rows)


def rotary_bytes(d: ModelDims, t: Training, local: int) -> float:
    """The rotary tables of the slice (cos and sin, head_dim wide, in the activations' dtype; Qwen3-VL's 3D mRoPE
    interleaves its three sections into the same two tables): computed once per forward and handed to every layer,
    alive through forward and backward. Head_dim wide even where the rotary is partial (Qwen3.5): an upper bound."""
    return 2.0 * t.bytes_per_value * local * d.head_dim if d.full_layers else 0.0


def beside_a_recomputed_layer(d: ModelDims, local: int, vision_local: int, offloaded: bool,
                              parked: bool = False) -> float:
    """Elements alive beside the decoder layer recomputed in backward, counted from the decoder checkpoints
    `Memory.activations` holds at the forward's end, at the layer where they are most. Backward runs the layers from
    the last to the first: layer i's recompute sees the deepstack features' gradients of layers i..D-1 (each arrives
    as backward passes the layer that adds it) and the checkpoints not yet used. Offloaded: the device holds the
    recomputed layer's input (the one `activations` counts) and, above layer 0, the next one's, prefetched. On the
    device: the inputs of layers 0..i, those above gone with their backward. (Measured: `benchmarks.plan_measure
    --work`; a probe of the live tensors at the peak shows layer 1's recompute beside layer 0's prefetched input and
    the deepstack gradients of layers 1 and 2.) `parked`: the feature gradients wait on the host
    (`offload.park_features`), none on the device."""
    def at(layer: int) -> float:
        arrived = 0.0 if parked else max(0, d.deepstack - layer) * vision_local * d.hidden
        if offloaded:
            return arrived + (local * d.hidden if layer > 0 else 0.0)
        return arrived - (d.layers - 1 - layer) * local * d.hidden
    return max(at(layer) for layer in range(d.layers))


def exchange_elements(d: ModelDims, t: Training, local: int, ulysses: int, ring: int) -> tuple[float, float]:
    """(softmax layer, DeltaNet layer) exchange buffers of a rank, in elements of the activations' dtype: the
    all-to-all's send and receive buffers of the largest tensor a layer exchanges (it exchanges q, k, v and the
    output one after the other — DeltaNet's q, k, v, gates and output — and each exchange holds two buffers of the
    tensor it moves, `collectives.differentiable._all_to_all`), across a ring the K/V in flight
    and the next, under sdpa the ring's fp32 tiles (scores, masked scores and probabilities alive at once), and the
    DeltaNet (M, B) of every chunk (2R chunks x H_v / U heads x d_k x (d_k + d_v), fp32)."""
    b = t.bytes_per_value
    hd, kv = d.heads * d.head_dim, replicated(d.kv_heads, d.heads, ulysses) * d.head_dim
    attention = 2 * local * max(hd, kv) if ulysses > 1 else 0.0
    deltanet = 0.0
    if d.linear_layers and ulysses > 1:
        k_rep = replicated(d.linear_k_heads, d.linear_v_heads, ulysses) * d.linear_k_dim
        deltanet = 2 * local * max(k_rep, d.linear_v_heads * d.linear_v_dim)
    if ring > 1:
        attention += 4 * local * kv
        if t.attention == "sdpa":
            tile = min(512, local * ulysses)
            attention += (4 / b) * 3 * tile * tile * (d.heads // ulysses)
        if d.linear_layers:
            deltanet += (4 / b) * 2 * ring * (d.linear_v_heads / ulysses) * d.linear_k_dim * (
                d.linear_k_dim + d.linear_v_dim)
    return attention, deltanet
