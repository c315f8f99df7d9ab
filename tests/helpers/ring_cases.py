"""CP sizes beyond (or not dividing) the heads: the P = U x R layout, run inside the spawned ranks.

The whole-model cases compare with stock at P=1 as the parity cases do (`parity.compare`); each also reports the
layout the package chose and the ring's point-to-point traffic. The ring-attention case runs the ring's attention
alone on random tensors against attention over the whole sequence, with the log-sum-exp merge as given.
"""

from __future__ import annotations

import torch

from tests.helpers.cases import MULTI_IMAGE, PADDED_PAIR, build_batch
from vlmcp_patch.fixtures.data import Segment, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment
# Packed rows (their samples and images straddle the ring's chunks), compared with their samples run one by one.
PACKED = {
    "packed_multimodal": [[S(text=6), S(image=(24, 16)), S(text=9)], [S(text=11)],
                          [S(text=3), S(image=(16, 16)), S(text=4)]],
    "packed_text": [[S(text=9)], [S(text=14)], [S(text=6)]],
}

EIGHT_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 2}
TWO_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}
TWO_VALUE_HEADS = {"linear_num_key_heads": 1, "linear_num_value_heads": 2}
CONFIGS = {
    "qwen3_vl-8": lambda: tiny_qwen3_vl_config(**EIGHT_HEADS),
    "qwen3_vl_moe-8": lambda: tiny_qwen3_vl_config(moe=True, **EIGHT_HEADS),
    "qwen3_5-8": lambda: tiny_qwen3_5_config(**EIGHT_HEADS),  # 8 DeltaNet value heads, 2 key heads
    "qwen3_5_moe-8": lambda: tiny_qwen3_5_config(moe=True, **EIGHT_HEADS),
    "qwen3_vl-2": lambda: tiny_qwen3_vl_config(**TWO_HEADS),
    "qwen3_vl_moe-2": lambda: tiny_qwen3_vl_config(moe=True, **TWO_HEADS),
    "qwen3_5-2": lambda: tiny_qwen3_5_config(**TWO_HEADS, **TWO_VALUE_HEADS),
    "qwen3_5_moe-2": lambda: tiny_qwen3_5_config(moe=True, **TWO_HEADS, **TWO_VALUE_HEADS),
    "qwen3_5_causal_lm-2": lambda: tiny_qwen3_5_config(text_only=True, **TWO_HEADS, **TWO_VALUE_HEADS),
}
LAYOUTS = {"multi_image": MULTI_IMAGE, "padded_pair": PADDED_PAIR}

# (config, batch) per CP size: 8 query heads split 3 (U=1, R=3) and 6 (U=2, R=3) ways; 2 query heads and 2 DeltaNet
# value heads split 4 (U=2, R=2) and 8 (U=2, R=4) ways.
CASES = {
    3: [("qwen3_vl-8", "multi_image"), ("qwen3_vl_moe-8", "padded_pair"), ("qwen3_5-8", "packed_multimodal"),
        ("qwen3_5_moe-8", "multi_image")],
    6: [("qwen3_vl-8", "packed_multimodal"), ("qwen3_5-8", "padded_pair")],
    4: [("qwen3_vl-2", "packed_multimodal"), ("qwen3_vl_moe-2", "multi_image"), ("qwen3_5-2", "padded_pair"),
        ("qwen3_5_moe-2", "packed_multimodal"), ("qwen3_5_causal_lm-2", "packed_text")],
    8: [("qwen3_vl-2", "multi_image"), ("qwen3_5-2", "packed_multimodal")],
}


def _compared(model, layout: str, world_size: int) -> dict:
    """Against stock on the same batch — or, for a packed row, against its samples run one by one through stock (stock
    computes no per-sample positions for pictures and runs the DeltaNet layers across samples)."""
    from tests.helpers.packing_cases import compare_packed
    from tests.helpers.parity import compare
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    if layout in PACKED:
        return compare_packed(model, *make_packed_batch(PACKED[layout], seed=5), world_size)
    with CollectiveProbe() as probe:
        metrics = compare(model, build_batch(LAYOUTS[layout], seed=7), world_size)
    return {**metrics, "ring_sends": probe.calls["batch_isend_irecv"]}


# The flash_attention_2 path across a ring (flash-attn's kernel per block, the CPU stand-in): P=4, U=2, R=2.
FLASH_CASES = [("qwen3_vl-2", "packed_multimodal"), ("qwen3_5-2", "padded_pair")]


def run_ring_cases(rank: int, world_size: int, attn: str = "sdpa") -> dict:
    """Each case of `CASES[world_size]` (`FLASH_CASES` with attn='flash_attention_2') against stock; the stand-in's
    kernel calls of each case are reported."""
    from tests.helpers import flash_standin
    from vlmcp_patch.attention.heads import ulysses_of

    if attn == "flash_attention_2":
        flash_standin.install()
    results = {}
    for config_name, layout in FLASH_CASES if attn == "flash_attention_2" else CASES[world_size]:
        config = CONFIGS[config_name]()
        model = build_model(config, seed=1)
        if attn == "flash_attention_2":
            flash_standin.use_flash(model)
        flash_standin.CALLS.clear()
        metrics = _compared(model, layout, world_size)
        metrics["ulysses"] = ulysses_of(config.get_text_config(), world_size)
        metrics["flash_calls"] = list(flash_standin.CALLS)
        results[f"{config_name} {layout}"] = metrics
    return results


def ring_attention_alone(rank: int, world_size: int, kernel: str = "torch", wrong_merge: bool = False,
                         tile: int = 5, trains: str = "qkv") -> dict:
    """The ring's attention of random q, k, v over a row of three segments, at R = world size and U = 1, against
    softmax attention over the whole row per segment: on the torch kernel with small key tiles (several tiles and ring
    steps to merge), or on flash-attn's (the CPU stand-in), whose calls are reported. Only the inputs named in
    `trains` need a gradient (a frozen projection's output does not); the ring passes of the backward are counted."""
    from tests.helpers import flash_standin
    from vlmcp_patch.attention import ring, ring_flash
    from vlmcp_patch.collectives.order import CollectiveOrder
    from vlmcp_patch.context import CPContext
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.compare import rel_err
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    import vlmcp_patch

    vlmcp_patch.enable(cp_size=world_size)
    ctx = CPContext(cp=get_cp_group(world_size), segments=[(0, 9), (9, 26), (26, 31)], ulysses=1)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, heads, ctx.padded_len, 8, generator=g, requires_grad=True) for heads in (2, 1, 1)]
    mine = ctx.split.subgroup_positions(ctx.groups.ring.index)
    local = [t.detach()[:, :, mine].clone().requires_grad_(name in trains) for t, name in zip(full, "qkv")]

    def averaged(out, lse, block_out, block_lse):  # the control: blocks averaged, not weighted by their lse
        return (block_out.float(), block_lse) if out is None else ((out + block_out.float()) / 2, lse)

    if kernel == "flash":
        flash_standin.install()
    previous, ring.TILE = ring.TILE, tile
    try:
        # ordered as inside a model, after a collective of a layer that trains (its token needs a gradient) and tied
        # into the output: the backward runs for the order's sake even where no input needs a gradient (a frozen layer)
        order = CollectiveOrder()
        order.token = torch.zeros((), requires_grad=True)
        with order.running():
            out = ring.ring_attention(*local, ring.ring_shares(ctx), ctx.groups.ring, 8 ** -0.5,
                                      merge_fn=averaged if wrong_merge else ring.merge,
                                      kernel=ring_flash.FLASH_KERNEL if kernel == "flash" else ring.TORCH_KERNEL)
        out = order.tie(out)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        with CollectiveProbe() as probe:
            (out * weights).sum().backward()
    finally:
        ring.TILE = previous
    q_full, k_full, v_full = full[0], *(t.repeat_interleave(2, dim=1) for t in full[1:])  # 2 query heads per KV head
    reference = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[:, :, a:b] for t in (q_full, k_full, v_full)), is_causal=True) for a, b in ctx.attention_segments], dim=2)
    all_weights = torch.zeros_like(reference)
    for r in range(world_size):
        positions = ctx.split.subgroup_positions(r)
        all_weights[:, :, positions] = torch.randn(out.shape, generator=torch.Generator().manual_seed(r))
    (reference * all_weights).sum().backward()
    vlmcp_patch.enable(cp_size=1)
    return {  # k's and v's gradients came back around the ring to their owner: each rank holds its own, whole
        "out_err": rel_err(out, reference[:, :, mine]),
        "dq_err": rel_err(local[0].grad, full[0].grad[:, :, mine]) if "q" in trains else None,
        "dkv_err": max(rel_err(local[i + 1].grad, full[i + 1].grad[:, :, mine]) for i in range(2))
        if "k" in trains else None,
        "untrained_grads": [name for t, name in zip(local, "qkv") if t.grad is not None and name not in trains],
        "backward_passes": probe.calls["batch_isend_irecv"],
        "flash_calls": list(flash_standin.CALLS),
    }


def script_flash_call_alone(rank: int, world_size: int) -> dict:
    """A script's own `flash_attn_varlen_func` call inside a CP forward (as the official script's packed attention
    makes it), at P=4 with U=2 and R=2: local q, k, v (tokens, 4 heads / 2 KV heads, dim) and the row's cumulative
    lengths, against flash-attn's kernel (the CPU stand-in) over the whole row; the stand-in's calls are reported."""
    from tests.helpers import flash_standin

    flash_standin.install()
    import flash_attn

    import vlmcp_patch
    from vlmcp_patch.attention import foreign
    from vlmcp_patch.context import CPContext
    from vlmcp_patch.distributed import get_cp_group
    from vlmcp_patch.fixtures.compare import rel_err

    vlmcp_patch.revert()
    vlmcp_patch.apply()  # as at an import that finds flash-attn: its entry points wrapped
    vlmcp_patch.enable(cp_size=world_size)
    ctx = CPContext(cp=get_cp_group(world_size), segments=[(0, 9), (9, 26), (26, 31)], ulysses=2)
    cu = torch.tensor([0, 9, 26, 31], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(31, heads, 8, generator=g, requires_grad=True) for heads in (4, 2, 2)]
    weights = torch.randn(31, 4, 8, generator=g)
    local = [ctx.shard(t.detach(), 0).requires_grad_(True) for t in full]
    flash_standin.CALLS.clear()
    token = foreign._RUNNING.set(foreign._Call(ctx))  # what the hook around a foreign attention forward sets
    try:
        out = flash_attn.flash_attn_varlen_func(*local, cu, cu, 17, 17, causal=True)
        exchanged = foreign._RUNNING.get().exchanged
    finally:
        foreign._RUNNING.reset(token)
    (out * ctx.shard(weights, 0)).sum().backward()
    reference = flash_standin.flash_attn_varlen_func(*full, cu, cu, 17, 17, causal=True)
    (reference * weights).sum().backward()
    vlmcp_patch.enable(cp_size=1)
    mine, real = ctx.local_positions, ctx.local_real_len
    mine = mine[:real]
    return {
        "ring_size": ctx.ring_size,
        "exchanged": exchanged,
        "out_err": rel_err(out[:real], reference[mine]),
        "dq_err": rel_err(local[0].grad[:real], full[0].grad[mine]),
        "dkv_err": max(rel_err(local[i].grad[:real], full[i].grad[mine]) for i in (1, 2)),
        "flash_calls": list(flash_standin.CALLS),
    }
