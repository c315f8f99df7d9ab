"""Time: seconds of one step on the busiest rank, by part — compute at the attained rates, the all-to-all, the ring
(serial and what overlap leaves exposed), the DeltaNet state exchange, the ZeRO-3 gathers left exposed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dims import ModelDims
from .hardware import Hardware
from .layouts import replicated
from .memory import mlp_tiles_act, parks_features, vision_tile
from .rows import Row
from .training import Training


@dataclass
class Time:
    """Seconds of one step (forward + backward) on the busiest rank, by part."""

    compute: float = 0.0
    all_to_all: float = 0.0
    ring: float = 0.0  # each pass completed before its block is computed (the serial schedule)
    ring_overlapped: float = 0.0  # what remains exposed with the passes overlapping the blocks' compute
    deltanet_state: float = 0.0
    sharding: float = 0.0  # ZeRO-3 / FSDP gathers and reduce-scatters left exposed after overlap with compute
    offload_copies: float = 0.0  # the checkpoint offload's copies over the host link, both ways, if run alone
    offload: float = 0.0  # what of them the compute does not hide

    overlap: bool = True  # the ring's passes overlap its blocks' compute (Training.ring_overlap)

    @property
    def total(self) -> float:
        ring = self.ring_overlapped if self.overlap else self.ring
        return self.compute + self.all_to_all + ring + self.deltanet_state + self.sharding + self.offload



def step_flops(d: ModelDims, row: Row, t: Training, tiled: bool = False,
               vision_tiled: bool = False) -> dict[str, float]:
    """FLOPs of one step over the whole row, by kind: matmul (projections, MLPs, head, vision tower), attention
    (causal, within samples; vision within items), deltanet (chunked delta rule). Backward = 2 x forward for
    matmuls, 2.5 x for attention; checkpointing adds one more forward of the decoder and the tower; MLPs in tiles
    (`tiled`) one more forward of every MLP (each tile recomputed in backward); the tower in tiles (`vision_tiled`)
    one more forward of the tower without checkpointing (with it the tiles' recompute replaces the blocks')."""
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
    if vision_tiled and not t.gradient_checkpointing:  # the tower: forward, recompute, backward
        matmul_fwd += 2 * patches * d.vision_depth * vision_block / passes
    if tiled:
        mlps = 2 * n * d.layers * d.mlp_params() + 2 * patches * d.vision_depth * 2 * d.vision_width * d.vision_intermediate
        matmul_fwd += mlps / passes  # one more forward of the MLPs, not of the rest
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
    patches = math.ceil(row.patches(d) / size)
    flops = step_flops(d, row, t, tiled=mlp_tiles_act(t, size), vision_tiled=vision_tile(d, t, patches, size) > 0)
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
        # overlapped: each of the (R - 1) passes hides behind one block's attention compute, as far as measured
        # (`Hardware.ring_hidden`: the share of the transfer the double buffer hid in benchmarks.ring_overlap)
        out.ring_overlapped = out.ring - min(hw.ring_hidden * out.ring, attention_s * (ring - 1) / ring)
        if d.linear_layers:
            state = 4.0 * 2 * ring * (d.linear_v_heads / ulysses) * d.linear_k_dim * (d.linear_k_dim + d.linear_v_dim)
            out.deltanet_state = d.linear_layers * (forward_passes + 1) * 2 * (
                state / bw + hw.latency_s * math.ceil(math.log2(ring)))
    if t.offload_checkpoints and t.gradient_checkpointing:
        out.offload_copies, out.offload = offload_seconds(d, row, t, hw, size, out.compute)
    if parks_features(t, size):
        parked = parked_feature_seconds(d, row, t, hw, size)
        out.offload_copies += parked
        out.offload += parked
    if t.sharding in ("zero3", "fsdp"):  # gather forward (and recompute) and backward, reduce-scatter backward
        world = size * t.dp
        if world > 1:
            bw = link_gbs(hw, world, gpus_per_node) * 1e9
            comm = (forward_passes + 2) * b * d.params() * (world - 1) / world / bw
            out.sharding = max(0.0, comm - out.compute)
    return out


def parked_feature_seconds(d: ModelDims, row: Row, t: Training, hw: Hardware, size: int) -> float:
    """Seconds of the parked vision features' copies on one rank (`offload.park_features`), all exposed (they run on
    the compute stream, from and to pageable memory): the slice's merged and deepstack features to the host and back
    to the device where the decoder reads them, their gradients the same way in backward — four moves of them."""
    vision_local = row.vision_tokens / size
    return 4 * t.bytes_per_value * vision_local * d.hidden * (1 + d.deepstack) / (hw.host_gbs * 1e9)


def offload_seconds(d: ModelDims, row: Row, t: Training, hw: Hardware, size: int, compute_s: float) -> tuple[float, float]:
    """(the copies' seconds, what stays exposed) of the checkpoint offload on one rank: every checkpointed input
    but the last layer's goes to the host in forward and comes back in backward, at `hw.host_gbs` each way. The
    copies run on a side stream: each layer's copy out hides behind the next layer's forward, each copy back behind
    the recompute and backward of the layer after it. With checkpointing the forward is about a quarter of the
    compute and the recompute with the backward three quarters; what a phase's copies exceed its compute by stays
    exposed (layers priced alike: copies and compute both proportional to a layer's tokens)."""
    b = t.bytes_per_value
    local, patches = row.tokens / size, row.patches(d) / size
    moved = b * (local * d.hidden * max(0, d.layers - 1) + patches * d.vision_width * d.vision_depth)
    one_way = moved / (hw.host_gbs * 1e9)
    exposed = max(0.0, one_way - compute_s / 4) + max(0.0, one_way - 3 * compute_s / 4)
    return 2 * one_way, exposed
