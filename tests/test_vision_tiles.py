"""The vision tower over tiles of items under CP (`vlmcp_patch/vision_tiles.py`): exact against stock at P=1 with
several tiles really run, each vision parameter's gradient accumulated once per tower call, nothing changed with CP
off; the tiles of a share and their automatic size."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL
from tests.helpers.vision_tile_cases import CASES, run_pixel_moves, run_vision_tile_cases
from tests.helpers.zero3_vision_cases import run_zero3_vision_cases
from vlmcp_patch.vision_tiles import Tile, plan_tiles, tile_patches


def vision_tiles_run(cp_size: int):
    return run_distributed(run_vision_tile_cases, cp_size, timeout=600)


@pytest.mark.parametrize("cp_size", sorted(CASES))
def test_tiled_vision_tower_equals_stock(cp_size, once):
    ran, results = 0, once(vision_tiles_run, cp_size)
    for case in results[0]:  # the group takes one path: every rank tiles the same tower calls (ZeRO-2 needs it)
        assert len({per_case[case]["tiles"]["calls"] for per_case in results}) == 1, case
    for rank, per_case in enumerate(results):
        for case, m in per_case.items():
            where = f"{case}, P={cp_size}, rank {rank}"
            if not m["stock_cut"]:  # stock's reference is wrong on this release (tests/helpers/cases.py)
                assert m["loss_err"] <= TOL and m["logits_err"] <= TOL, where
                assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
            assert m["missing_grads"] == [], where
            tiles = m["tiles"]
            # the training step and the logits' forward: each tiled tower call ran every tile forward, the step's
            # once more in backward
            assert tiles["forward_tiles"] >= tiles["calls"] > 0, (where, tiles)
            assert tiles["backward_tiles"] * 2 <= tiles["forward_tiles"], (where, tiles)
            ran += tiles["backward_tiles"]
            # one accumulation per vision parameter per tower call: stock's (images, videos), then CP's
            assert len(m["accumulations"]) == 1, (where, m["accumulations"])
        assert per_case[next(iter(per_case))]["tiles"]["backward_tiles"] >= 2, (rank, per_case)
    assert ran > 0


def test_zero3_tiles_the_tower_inside_one_gathered_call_like_p1():
    """DeepSpeed ZeRO-3 at P=2 (gloo): the tower a ZeRO-3 leaf, gathered whole once per call, its tiles inside that
    call — four on rank 0, one on rank 1: different numbers of tiles, the same collectives — and every parameter's
    full gradient equal to stock's at P=1; the same leaf tower called twice per forward (images, then the video), tiled
    and untiled, each parameter reduced once; with vision tiling off, a tower gathered module by module (its MLPs no
    leaves: two calls of a leaf per forward reduced twice) called twice."""
    pytest.importorskip("deepspeed")
    results = run_distributed(run_zero3_vision_cases, 2, timeout=600)
    assert [r["uneven tiles"]["tiles"]["forward_tiles"] for r in results] == [4, 1]
    for rank, per_case in enumerate(results):
        for case, m in per_case.items():
            where = f"{case}, rank {rank}"
            assert m["leaf"] == (case != "vision tiling off"), where
            assert abs(m["loss"] - m["ref_loss"]) <= TOL * abs(m["ref_loss"]), where
            assert m["grad_err"] <= TOL, (where, m["worst"], m["grad_err"])
        tiles = per_case["uneven tiles"]["tiles"]
        assert tiles["calls"] == 1 and tiles["backward_tiles"] == tiles["forward_tiles"], (rank, tiles)
        assert per_case["tiled and untiled calls"]["tiles"]["calls"] == 1, rank  # the video's call: tiled
        assert per_case["untiled calls"]["tiles"]["calls"] == 0, rank


def test_cp_off_never_tiles(reapply):
    """With CP off (P=1) a one-patch tile changes nothing: no tile runs, the loss and every gradient equal stock's bit
    for bit."""
    import vlmcp_patch
    from tests.helpers.tile_cases import stock_step
    from tests.helpers.vision_tile_cases import VIDEO_GROUPS, _model_and_batch
    from vlmcp_patch.vision_tiles import VISION_TILES

    model, batch = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    vlmcp_patch.revert()
    ref_loss, ref_grads = stock_step(model, batch)
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1, vision_tile_patches=1)
    VISION_TILES.drain()
    try:
        loss, grads = stock_step(model, batch)
    finally:
        vlmcp_patch.enable(vision_tile_patches="auto")
    assert VISION_TILES.drain()["calls"] == 0
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_tiles_are_whole_temporal_groups_in_order():
    """Units (frames, height, width) split into their temporal groups, packed in pixel-row order up to the budget, a
    larger group alone; consecutive groups of one unit one grid row."""
    tiles = plan_tiles([(3, 4, 4), (1, 2, 4), (2, 4, 6)], budget=40, merge_unit=4)
    assert tiles == [Tile((0, 32), ((2, 4, 4),), (0, 8)), Tile((32, 56), ((1, 4, 4), (1, 2, 4)), (8, 14)),
                     Tile((56, 80), ((1, 4, 6),), (14, 20)), Tile((80, 104), ((1, 4, 6),), (20, 26))]
    assert [t.grid for t in plan_tiles([(3, 4, 4)], budget=1, merge_unit=4)] == [((1, 4, 4),)] * 3
    assert plan_tiles([(3, 4, 4), (1, 2, 4)], budget=10**6, merge_unit=4) == [
        Tile((0, 56), ((3, 4, 4), (1, 2, 4)), (0, 14))]


@pytest.mark.parametrize("patches, configured, expected", [
    (1_000_000, "auto", 6_411),  # 156 tiles: a tile's activations within the share's kept features
    (20_000, "auto", 5_000),  # the tile's floor, MIN_TILE, in equal tiles
    (3_000, "auto", 3_000),  # shorter than a tile: one tile, the stock tower
    (100, 7, 7),
    (100, 0, 100),  # 0: untiled
])
def test_tile_size(patches, configured, expected):
    # Qwen3-VL-8B's tower: 27 blocks of width 1152 and MLP 4304, features 4096 x (1 + 3 deepstack levels) per merged
    # token of 4 patches
    work, kept = 27 * (13 * 1152 + 2 * 4304), 4096 * 4 / 4
    assert tile_patches(patches, work, kept, configured) == expected


def test_tiles_equal_the_whole_tower_with_pixel_gradients():
    """The function alone on a real tower (tiny Qwen3-VL, a video of eight temporal groups, tiles of three groups and
    less): the features, the pixels' gradient and every weight's gradient equal the whole tower's, each weight's
    gradient accumulated once."""
    from tests.helpers.vision_tile_cases import VIDEO_GROUPS, _model_and_batch
    from vlmcp_patch.forward.vision import _joined_features, _TiledOutput
    from vlmcp_patch.vision_tiles import VISION_TILES, vision_in_tiles

    model, batch = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    tower = model.model.visual
    pixels = batch["pixel_values_videos"].clone().requires_grad_(True)
    grid = batch["video_grid_thw"]
    whole = _joined_features(tower(pixels, grid_thw=grid))
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(0))
    (whole * weights).sum().backward()
    expected = [p.grad.clone() for p in tower.parameters()] + [pixels.grad.clone()]
    tower.zero_grad(set_to_none=True)
    pixels.grad = None
    fired = []
    for p in tower.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    tiles = plan_tiles(grid.tolist(), budget=3 * 16, merge_unit=4)
    encode = _TiledOutput()
    VISION_TILES.drain()
    placement = {"device": pixels.device, "dtype": pixels.dtype}
    tiled = vision_in_tiles(lambda tile, rows: encode.joined(tower(rows, grid_thw=torch.tensor(tile.grid))), tower,
                            tiles, placement, pixels, None, list(tower.parameters()))
    (tiled * weights).sum().backward()
    assert len(tiles) == 3 and VISION_TILES.drain() == {"calls": 1, "forward_tiles": 3, "backward_tiles": 3}
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)
    assert len(fired) == len(list(tower.parameters()))  # once each
    for got, want in zip([p.grad for p in tower.parameters()] + [pixels.grad], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_tiles_in_bf16_are_as_near_the_exact_gradient_as_the_untiled_tower(capsys):
    """bf16 tower (tiny Qwen3-VL, a video of 128 temporal groups of 2 x 2 patches): every weight's gradient summed over
    the tiles in fp32 and cast once stays within 1.1 x the untiled tower's error against fp64 at 1, 16 and 128 tiles
    (summed in bf16: 1.38 x at 16, 2.66 x at 128). Integration tier: 128 tiles of the tower are slow on a loaded CPU;
    the default tier checks the same function (`tiled_recompute.py`) on the MLPs and norms."""
    from tests.helpers.tile_cases import BF16_TILE_COUNTS, bf16_gradient_errors
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.forward.vision import _joined_features, _TiledOutput
    from vlmcp_patch.vision_tiles import vision_in_tiles

    tower = build_model(tiny_qwen3_vl_config(), seed=1).model.visual.double()
    grid = torch.tensor([[128, 2, 2]])
    c = tower.config
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(512, c.in_channels * c.temporal_patch_size * c.patch_size**2, dtype=torch.float64,
                         generator=generator)
    grad = torch.randn(_joined_features(tower(pixels, grid_thw=grid)).shape, dtype=torch.float64, generator=generator)

    def step(tower, tiles):
        dtype = tower.dtype
        if tiles == 0:
            out = _joined_features(tower(pixels.to(dtype), grid_thw=grid))
        else:
            tiled, encode = plan_tiles(grid.tolist(), budget=512 // tiles, merge_unit=4), _TiledOutput()
            assert len(tiled) == tiles
            out = vision_in_tiles(lambda tile, rows: encode.joined(tower(rows, grid_thw=torch.tensor(tile.grid))),
                                  tower, tiled, {"device": pixels.device, "dtype": dtype}, pixels.to(dtype), None,
                                  list(tower.parameters()))
        out.backward(grad.to(dtype))

    errors = bf16_gradient_errors(tower, step)
    with capsys.disabled():
        print(f"\nvision tower bf16 gradient error against fp64 by tiles (0: untiled): {errors}")
    for tiles in BF16_TILE_COUNTS:
        assert errors[tiles] <= 1.1 * errors[0], (tiles, errors)


def test_a_cp_step_moves_each_tiles_pixel_rows_not_the_share():
    """A real CP step at P=2 with the pixels where the tower is not (every move of the caller's pixels copies, as from
    the host): untiled, each rank moves its share once; in tiles, only a tile's rows at a time, forward and again in
    the tile's recompute — the share's rows twice over, never the share at once (`forward.vision.encode_items` hands
    the tiled tower the caller's view). The loss is the same either way."""
    results = run_distributed(run_pixel_moves, 2, timeout=600)
    for rank, by_tile in enumerate(results):
        (share,), tiled = by_tile[0]["rows"], by_tile[32]["rows"]
        assert len(tiled) >= 4 and sum(tiled) == 2 * share, (rank, by_tile)
        assert max(tiled) < share, (rank, by_tile)
        assert by_tile[32]["loss"] == pytest.approx(by_tile[0]["loss"], rel=1e-6)


def test_each_tile_moves_its_own_pixel_rows_when_it_runs():
    """Pixels where the tower is not (the host under CP; here another dtype, which moves them the same way): each
    tile's rows are moved to the tower's device and dtype when the tile runs, in forward and again in its recompute,
    so no copy of the whole share is ever made; the features equal the whole tower's on the moved pixels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.helpers.vision_tile_cases import VIDEO_GROUPS, _model_and_batch
    from vlmcp_patch.forward.vision import _joined_features, _TiledOutput
    from vlmcp_patch.vision_tiles import vision_in_tiles

    model, batch = _model_and_batch("qwen3_vl", False, VIDEO_GROUPS)
    tower = model.model.visual
    pixels, grid = batch["pixel_values_videos"].double(), batch["video_grid_thw"]  # "the host's": float64
    whole = _joined_features(tower(pixels.float(), grid_thw=grid))

    class Moves(TorchDispatchMode):
        rows: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float64:
                self.rows.append(out.shape[0])
            return out

    tiles = plan_tiles(grid.tolist(), budget=3 * 16, merge_unit=4)
    encode = _TiledOutput()
    with Moves() as moves:
        tiled = vision_in_tiles(lambda tile, rows: encode.joined(tower(rows, grid_thw=torch.tensor(tile.grid))),
                                tower, tiles, {"device": pixels.device, "dtype": torch.float32}, pixels, None,
                                list(tower.parameters()))
        tiled.sum().backward()
    per_tile = [tile.rows[1] - tile.rows[0] for tile in tiles]
    assert moves.rows == per_tile + per_tile  # forward, then the recompute: a tile's rows each time
    assert max(moves.rows) < pixels.shape[0]
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)
