"""Explicit vision tiles with CP off under DeepSpeed data replicas (`vlmcp_patch/vision_tiles.py`), run inside the
spawned ranks: P=1, two replicas, each its own row — rank 0's video in four tiles, rank 1's in one — against stock's
gradients averaged over the two rows in one process."""

from __future__ import annotations

import copy
import os

import torch

from tests.helpers.vision_tile_cases import _model_and_batch
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch

# Per rank, its row: a video of eight temporal groups of 16 patches (four tiles of 32 patches), and one of two (one);
# or text alone on rank 1, which runs a placeholder through the tower (`VLMCP_MATCH_VISION_PASSES=1`)
ROWS = {"videos": [[[S(text=5), S(video=(8, 16, 16)), S(text=4)]], [[S(text=7), S(video=(2, 16, 16)), S(text=6)]]],
        "text beside a video": [[[S(text=5), S(video=(8, 16, 16)), S(text=4)]], [[S(text=23)]]]}


def stock_mean_grads(model, rows: list) -> dict:
    """Every parameter's gradient of stock (the package reverted) averaged over the replicas' rows, as ZeRO-2's
    reduction averages them."""
    import vlmcp_patch

    total: dict = {}
    vlmcp_patch.revert()
    try:
        for seed, layout in enumerate(rows):
            ref = copy.deepcopy(model)
            ref(**make_batch(layout, seed=seed)).loss.backward()
            for n, p in ref.named_parameters():
                if p.grad is not None:
                    total[n] = total.get(n, 0) + p.grad / len(rows)
    finally:
        vlmcp_patch.apply()
    return total


# (name, `VLMCP_VISION_TILE_PATCHES` per rank, ZeRO stage, rows, `VLMCP_MATCH_VISION_PASSES`): the same setting on
# both replicas; rank 1 untiled with the passes matched (every call through the tiled function: one order); the
# control, rank 1 untiled without matching; rank 1 with text alone; ZeRO-3
REPLICA_CASES = [("same setting", [32, 32], 2, "videos", True), ("rank 1 untiled", [32, 0], 2, "videos", True),
                 ("rank 1 untiled, unmatched", [32, 0], 2, "videos", False),
                 ("placeholder", [32, 32], 2, "text beside a video", True), ("zero3", [32, 32], 3, "videos", True)]


def run_replica_cases(rank: int, world_size: int) -> dict:
    """Per case of `REPLICA_CASES`: `_replica_step`."""
    return {name: _replica_step(rank, tiles[rank], stage, rows, match)
            for name, tiles, stage, rows, match in REPLICA_CASES}


def _replica_step(rank: int, tiles: int, stage: int, rows: str, match: bool) -> dict:
    """One backward at P=1 under ZeRO stage `stage` with `VLMCP_VISION_TILE_PATCHES=tiles` and
    `VLMCP_MATCH_VISION_PASSES=match`, each rank its row of `ROWS[rows]`: this rank's tower tiles and the largest
    relative error of any parameter's reduced gradient against stock's mean (with its name)."""
    import deepspeed

    import vlmcp_patch
    from vlmcp_patch.vision_tiles import VISION_TILES

    os.environ.setdefault("LOCAL_RANK", str(rank))
    layouts = ROWS[rows]
    model, _ = _model_and_batch("qwen3_vl", False, layouts[0])
    want = stock_mean_grads(model, layouts)
    vlmcp_patch.enable(cp_size=1, vision_tile_patches=tiles, match_vision_passes=match)
    try:
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=config)
        VISION_TILES.drain()
        engine.backward(engine(**make_batch(layouts[rank], seed=rank)).loss)
        tiles = VISION_TILES.drain()
        worst, where = 0.0, None
        for n, p in engine.module.named_parameters():
            grad = deepspeed.utils.safe_get_full_grad(p)
            if n not in want:
                continue
            err = float((grad - want[n]).norm() / want[n].norm().clamp_min(1e-12)) if grad is not None else float("inf")
            if err > worst:
                worst, where = err, n
        engine.destroy()
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto")
    return {"tiles": tiles, "grad_err": worst, "worst": where}
