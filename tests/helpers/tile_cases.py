"""The MLPs in sequence tiles under CP (`vlmcp_patch/tiles.py`), run inside the spawned ranks: the parity cases with a
tile small enough that every MLP of the tiny models runs several tiles, against stock at P=1."""

from __future__ import annotations

import torch

from tests.helpers.cases import FAMILIES, build_batch
from tests.helpers.ring_cases import CONFIGS, LAYOUTS
from vlmcp_patch.fixtures.models import build_model

TILE = 3  # tokens: the tiny slices (7-28 tokens, 6-70 vision patches per rank) cut into several tiles

# Per CP size, (family, parity case) from `cases.FAMILIES`: dense and MoE decoders, vision towers, gradient
# checkpointing both ways (the tiles recomputed inside a recomputed layer). P=3: 8 heads over a ring of 3 (U=1, R=3).
CASES = {
    2: [("qwen3_vl", "moe_grad_checkpointing"), ("qwen3_5", "moe_multi_image"),
        ("qwen3_5", "grad_checkpointing_reentrant")],
    4: [("qwen3_vl", "multi_image"), ("qwen3_5", "moe_padded_pair")],
    3: [("qwen3_vl_moe-8", "padded_pair"), ("qwen3_5-8", "multi_image")],
}


def _model_and_batch(family: str, case: str):
    if family in CONFIGS:  # the ring's configs
        return build_model(CONFIGS[family](), seed=1), build_batch(LAYOUTS[case], seed=7)
    make_config, cases = FAMILIES[family]
    config_kwargs, layout = cases[case]
    config_kwargs = dict(config_kwargs)
    checkpointing = config_kwargs.pop("gradient_checkpointing", False)
    model = build_model(make_config(**config_kwargs), seed=1)
    if checkpointing:
        reentrant = checkpointing == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
    return model, build_batch(layout, seed=7)


def _count_accumulations(model) -> dict:
    """Times each parameter's gradient was accumulated (the event DDP, ZeRO and FSDP2 hook)."""
    counts = {name: 0 for name, p in model.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def run_tile_cases(rank: int, world_size: int) -> dict:
    """Parity metrics (`parity.compare`) of each case of `CASES[world_size]` with `mlp_tile_tokens=TILE`, with the
    tiles the CP step ran, the RMSNorm calls it recomputed (`tiles.recomputed_norm_forward`, set on here) and how
    often each parameter's gradient was accumulated (stock's backward and CP's)."""
    import vlmcp_patch
    from tests.helpers.parity import compare
    from vlmcp_patch.tiles import NORMS, TILES

    results = {}
    vlmcp_patch.enable(mlp_tile_tokens=TILE, recompute_norms=True)  # set: by need they would stay off here
    try:
        for family, case in CASES[world_size]:
            model, batch = _model_and_batch(family, case)
            counts = _count_accumulations(model)
            TILES.drain()
            NORMS.drain()
            metrics = compare(model, batch, world_size)
            metrics["tiles"] = TILES.drain()
            metrics["norms"] = NORMS.drain()
            metrics["accumulations"] = sorted(set(counts.values()))
            results[f"{family} {case}"] = metrics
    finally:
        vlmcp_patch.enable(mlp_tile_tokens="auto", recompute_norms="auto")
    return results


def stock_step(model, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
