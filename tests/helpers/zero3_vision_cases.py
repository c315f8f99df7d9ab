"""The vision tower under DeepSpeed ZeRO-3 at CP (`vlmcp_patch/vision_tiles.py`), run inside the spawned ranks: the
tower a ZeRO-3 leaf, its tiles inside one call, ranks with different numbers of tiles; and the same leaf tower called
untiled. Each case: one backward through the engine against stock at P=1, every parameter's full gradient."""

from __future__ import annotations

import copy
import os

import torch

from tests.helpers.vision_tile_cases import UNEVEN_VIDEOS, VIDEO_GROUPS, _model_and_batch

# (name, layout, patches per tile), at P=2: the uneven videos make four tiles on rank 0 and one on rank 1 (one tower
# call); the video of four groups beside two images, in tiles of a group, makes two tiled calls (the video's, and the
# two images', which do not balance over two ranks: shared by patches, their slice one tile); by need with no memory
# limit known ("auto") two untiled calls: the leaf tower called twice per forward; with vision tiling off (0) the
# leaf tower called twice untiled; with vision data parallelism off every rank runs every item, in tiles, in each of
# its two calls.
ZERO3_CASES = [("uneven tiles", UNEVEN_VIDEOS, 16), ("tiled and untiled calls", VIDEO_GROUPS, 1),
               ("untiled calls", VIDEO_GROUPS, "auto"), ("vision tiling off", VIDEO_GROUPS, 0),
               ("every item in tiles", VIDEO_GROUPS, 16, False)]


def _reference_grads(model, batch) -> tuple[float, dict]:
    """Loss and gradients of stock at P=1 (the package reverted) on a copy of `model`."""
    import vlmcp_patch

    ref = copy.deepcopy(model)
    vlmcp_patch.revert()
    try:
        loss = ref(**batch).loss
        loss.backward()
    finally:
        vlmcp_patch.apply()
    return float(loss), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def run_zero3_vision_cases(rank: int, world_size: int) -> dict:
    """Per case: the tower's tiles on this rank, whether the tower was a ZeRO-3 leaf, the loss and the largest
    relative error of any parameter's full gradient against stock at P=1 (with the parameter's name)."""
    import deepspeed

    import vlmcp_patch
    from vlmcp_patch.vision_tiles import VISION_TILES

    os.environ.setdefault("LOCAL_RANK", str(rank))
    results = {}
    for name, layout, tile, *vision_dp in ZERO3_CASES:
        vlmcp_patch.enable(cp_size=1, vision_tile_patches=tile, vision_dp=vision_dp[0] if vision_dp else True)
        model, batch = _model_and_batch("qwen3_vl", False, layout)
        ref_loss, ref_grads = _reference_grads(model, batch)
        vlmcp_patch.enable(cp_size=world_size)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=config)
        VISION_TILES.drain()
        loss = engine(**batch).loss
        engine.backward(loss)
        tiles = VISION_TILES.drain()
        worst, where = 0.0, None
        for n, p in engine.module.named_parameters():  # the same order on every rank: one gather each
            grad = deepspeed.utils.safe_get_full_grad(p)
            want = ref_grads.get(n)
            if want is None:
                continue
            err = float((grad - want).norm() / want.norm().clamp_min(1e-12)) if grad is not None else float("inf")
            if err > worst:
                worst, where = err, n
        engine.zero_grad()
        results[name] = {"tiles": tiles, "leaf": bool(getattr(engine.module.model.visual, "_z3_leaf", False)),
                         "loss": float(loss), "ref_loss": ref_loss, "grad_err": worst, "worst": where}
        engine.destroy()
    vlmcp_patch.enable(cp_size=1, vision_tile_patches="auto", vision_dp=True)
    return results
