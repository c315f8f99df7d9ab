"""The MLPs in sequence tiles under CP (`vlmcp_patch/tiles.py`), run inside the spawned ranks: the parity cases with a
tile small enough that every MLP of the tiny models runs several tiles, against stock at P=1."""

from __future__ import annotations

import copy

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


# The numbers of tiles the bf16 accuracy tests compare with the untiled module (`bf16_gradient_errors`).
BF16_TILE_COUNTS = (1, 16, 128)


def _parameter_gradients(module: torch.nn.Module, step, tiles: int) -> torch.Tensor:
    """Every parameter's gradient after `step(copy of module, tiles)`, flattened end to end in fp64."""
    module = copy.deepcopy(module)
    step(module, tiles)
    return torch.cat([p.grad.double().flatten() for p in module.parameters()])


def bf16_gradient_errors(module64: torch.nn.Module, step) -> dict[int, float]:
    """The relative error (2-norm over all parameters' gradients together) of a bf16 copy of `module64` against
    `module64` (fp64, the exact reference), untiled (key 0) and in each of `BF16_TILE_COUNTS` tiles. `step(module,
    tiles)` runs one forward and backward of `module` on inputs cast to its dtype: the stock call for 0 tiles, else
    the tiled function under test."""
    exact = _parameter_gradients(module64, step, 0)
    bf16 = copy.deepcopy(module64).to(torch.bfloat16)
    return {tiles: ((_parameter_gradients(bf16, step, tiles) - exact).norm() / exact.norm()).item()
            for tiles in (0, *BF16_TILE_COUNTS)}


def run_fsdp2_mlp_units(rank: int, world_size: int) -> dict:
    """Qwen3.5 (text) at CP=world_size under FSDP2 with `mlp_tile_tokens=TILE`, the loss scaled by P (the raw-loop
    contract under a wrapper of one's own): per wrapping, `"children"` (every decoder MLP's Linear layers units of
    their own, as a size-based policy wraps them, then the root) and `"root"` (the root alone: the MLPs gathered whole
    with it). For each, the MLP tiles that ran, the loss, and the worst error of a full gradient against stock at P=1
    (`fixtures.compare.gradient_errors`; computed on this rank from the same weights and batch), over how many of
    the parameters."""
    import vlmcp_patch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vlmcp_patch.fixtures.compare import gradient_errors
    from vlmcp_patch.tiles import TILES

    make_config, cases = FAMILIES["qwen3_5"]
    config_kwargs, layout = cases["causal_lm"]
    base, batch = build_model(make_config(**config_kwargs), seed=1), build_batch(layout, seed=7)
    vlmcp_patch.revert()
    try:
        ref_loss, ref_grads = stock_step(copy.deepcopy(base), batch)
    finally:
        vlmcp_patch.apply()
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for wrapping in ("children", "root"):
        model = copy.deepcopy(base)
        if wrapping == "children":
            for module in model.modules():
                if type(module).__name__.endswith("MLP"):
                    for linear in module.children():
                        fully_shard(linear, mesh=mesh)
        fully_shard(model, mesh=mesh)
        vlmcp_patch.enable(cp_size=world_size, mlp_tile_tokens=TILE)
        TILES.drain()
        try:
            out = model(**batch)
            (out.loss * world_size).backward()
        finally:
            vlmcp_patch.enable(cp_size=1, mlp_tile_tokens="auto")
        errors, _ = gradient_errors({name: p.grad.full_tensor() for name, p in model.named_parameters()}, ref_grads)
        results[wrapping] = {"tiles": TILES.drain(), "loss": out.loss.item(), "ref_loss": ref_loss.item(),
                             "grad_err": max(errors.values()), "compared": len(errors),
                             "params": len(list(model.parameters()))}
    return results
