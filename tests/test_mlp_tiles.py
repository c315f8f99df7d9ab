"""The decoder and vision MLPs (dense and MoE experts) in sequence tiles under CP (`vlmcp_patch/tiles.py`): exact
against stock at P=1 with several tiles really run, each parameter's gradient accumulated once per backward, and
nothing changed with CP off. The same runs recompute the decoder's RMSNorms (`test_norms.py` for their tiles)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cases import stock_cuts_the_row
from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL
from tests.helpers.tile_cases import (
    BF16_TILE_COUNTS,
    CASES,
    bf16_gradient_errors,
    run_fsdp2_mlp_units,
    run_tile_cases,
    stock_step,
)
from vlmcp_patch.tiles import NORMS, TILES, mlp_tile_tokens, tile_bounds, tile_tokens, tokenwise_tiles


def tiles_run(cp_size: int):
    return run_distributed(run_tile_cases, cp_size, timeout=600)


@pytest.mark.parametrize("cp_size", sorted(CASES))
def test_tiled_mlps_equal_stock(cp_size, once):
    for rank, per_case in enumerate(once(tiles_run, cp_size)):
        for case, m in per_case.items():
            if stock_cuts_the_row(*case.split()):
                continue  # stock's reference is wrong on this release (tests/helpers/cases.py)
            where = f"{case}, P={cp_size}, rank {rank}"
            assert m["loss_err"] <= TOL and m["logits_err"] <= TOL, where
            assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
            assert m["missing_grads"] == [], where
            tiles = m["tiles"]
            # every tiled call cut its tokens in at least two tiles; on average several
            assert tiles["calls"] > 0 and tiles["forward_tiles"] >= 3 * tiles["calls"], (where, tiles)
            assert tiles["backward_tiles"] > 0, (where, tiles)
            norms = m["norms"]  # every family's RMSNorms went through the recompute, forward and backward
            assert norms["calls"] > 0 and norms["backward_tiles"] > 0, (where, norms)
            # one accumulation per parameter per backward: stock's, then CP's
            assert m["accumulations"] == [2], (where, m["accumulations"])


def test_cp_off_is_stock_bit_for_bit(reapply):
    """With CP off (P=1) and the default settings, a budget nothing fits changes nothing (the choice by need acts under
    CP only): no tile runs, the loss and every gradient equal stock's bit for bit. Explicit tiles at P=1:
    `test_by_need.py`."""
    import vlmcp_patch
    from tests.helpers.tile_cases import _model_and_batch

    model, batch = _model_and_batch("qwen3_vl", "moe_multi_image")
    vlmcp_patch.revert()
    ref_loss, ref_grads = stock_step(model, batch)
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1, device_memory_gib=1e-9)
    TILES.drain()
    NORMS.drain()
    try:
        loss, grads = stock_step(model, batch)
    finally:
        vlmcp_patch.enable(device_memory_gib=0)
    assert TILES.drain()["calls"] == 0 and NORMS.drain()["calls"] == 0
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_one_tile_runs_the_tiled_function_and_equals_stock(reapply):
    """A switch on means the tiled function, even where the tokens make one tile (`VLMCP_MLP_TILE_TOKENS` larger than
    every MLP's input here): every MLP goes through it once per call as one tile — the point in backward where its
    weights' gradients arrive is set by the switch alone, never by the row (replicas agree on switches, `by_need`) —
    and the loss and every gradient equal stock's (fp32, within 1e-5)."""
    import vlmcp_patch
    from tests.helpers.tile_cases import _model_and_batch

    model, batch = _model_and_batch("qwen3_vl", "moe_multi_image")
    vlmcp_patch.revert()
    ref_loss, ref_grads = stock_step(model, batch)
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1, mlp_tile_tokens=100_000)
    TILES.drain()
    try:
        loss, grads = stock_step(model, batch)
    finally:
        vlmcp_patch.enable(mlp_tile_tokens="auto")
    tiles = TILES.drain()
    assert tiles["calls"] > 0 and tiles["forward_tiles"] == tiles["calls"] == tiles["backward_tiles"], tiles
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_an_empty_slice_makes_one_empty_tile():
    """No tokens (an MLP's input of zero rows): one empty tile, its output and gradients empty or zero, no error."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.GELU(), torch.nn.Linear(24, 8))
    x = torch.randn(0, 8, requires_grad=True)
    assert tile_bounds(0, tile_tokens(0, 8, 24)) == [(0, 0)]
    out = tokenwise_tiles(mlp.forward, tile_bounds(0, 1), TILES, [x], list(mlp.parameters()))
    out.sum().backward()
    assert out.shape == (0, 8) and x.grad.shape == (0, 8)
    assert all(p.grad is not None and not p.grad.any() for p in mlp.parameters())


def test_a_tiled_function_is_recomputed_under_its_own_forwards_switches(reapply):
    """A tiled function whose code reads a switch (the tiled vision tower reads the MLP switch in its blocks' MLPs) is
    recomputed in backward under the choice of the forward that ran it, not the last forward's: here two forwards
    under other choices, then one backward. The control (no forward's choice around the first run) reads the last
    choice in backward."""
    import vlmcp_patch
    from vlmcp_patch import switches

    def choice(mlp: bool):
        return switches.Choice(switches.Switches(mlp=mlp), (), "", 0.0, None, 1, 0, 2, 2, 1, 1)

    seen = []
    layer = torch.nn.Linear(4, 4)

    def fn(x):
        seen.append(switches.mlp_tiles_on())
        return layer(x)

    x = torch.randn(6, 4, requires_grad=True)
    vlmcp_patch.enable(cp_size=2)  # the switches alone: no collective runs
    try:
        outs = []
        for mlp in (True, False):
            with switches.under_choice(choice(mlp)):
                outs.append(tokenwise_tiles(fn, tile_bounds(6, 3), TILES, [x], list(layer.parameters())))
        switches.STATE.choice = choice(False)  # what the last forward chose
        seen.clear()
        sum(outs).sum().backward()
        recomputed = list(seen)
        seen.clear()
        out = tokenwise_tiles(fn, tile_bounds(6, 3), TILES, [x], list(layer.parameters()))  # the control
        switches.STATE.choice = choice(True)
        out.sum().backward()
    finally:
        switches.STATE.choice = None
        vlmcp_patch.enable(cp_size=1)
    # backward runs the second forward's tiles first, then the first one's: each under its own choice
    assert recomputed == [False, False, True, True], recomputed
    assert seen == [False, False, True, True], seen  # the control: forward outside any choice, backward the last one


def test_tiles_sum_each_parameter_gradient_before_delivering_it():
    """The function alone: outputs and input gradients per tile, parameter gradients summed over the tiles and
    accumulated once — an accumulation per tile (DeepSpeed TiledMLP's problem) would fire the hook five times."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.GELU(), torch.nn.Linear(24, 8))
    x = torch.randn(37, 8, requires_grad=True)
    mlp(x).square().sum().backward()
    expected = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    fired = []
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    TILES.drain()
    tokenwise_tiles(mlp.forward, tile_bounds(37, 8), TILES, [x], list(mlp.parameters())).square().sum().backward()
    assert TILES.drain() == {"calls": 1, "forward_tiles": 5, "backward_tiles": 5}
    assert len(fired) == 4  # two weights, two biases: once each
    for got, want in zip([p.grad for p in mlp.parameters()] + [x.grad], expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_tiles_in_bf16_are_as_near_the_exact_gradient_as_the_untiled_mlp(capsys):
    """bf16 weights: each tile's weight gradient (bf16, as autograd computes it) is summed over the tiles in fp32 and
    cast once, so at 1, 16 and 128 tiles the gradients are within 1.1 x the untiled MLP's error against fp64 (summed
    in bf16, the error grew with the tiles: 1.36 x at 16, 2.67 x at 128)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextMLP

    from vlmcp_patch.fixtures.models import tiny_qwen3_vl_config

    torch.manual_seed(0)
    rows = 128 * 32
    x, grad = torch.randn(rows, 32, dtype=torch.float64), torch.randn(rows, 32, dtype=torch.float64)

    def step(mlp, tiles):
        dtype = mlp.down_proj.weight.dtype
        inputs = x.to(dtype).requires_grad_(True)
        out = mlp(inputs) if tiles == 0 else tokenwise_tiles(
            mlp.forward, tile_bounds(rows, rows // tiles), TILES, [inputs], list(mlp.parameters()))
        out.backward(grad.to(dtype))

    errors = bf16_gradient_errors(Qwen3VLTextMLP(tiny_qwen3_vl_config().text_config).double(), step)
    with capsys.disabled():
        print(f"\nMLP bf16 gradient error against fp64 by tiles (0: untiled): {errors}")
    for tiles in BF16_TILE_COUNTS:
        assert errors[tiles] <= 1.1 * errors[0], (tiles, errors)


@pytest.mark.parametrize("tokens, configured, expected", [
    (100_000, "auto", 8334),  # 12 tiles: a tile's intermediates (4 x 3 x hidden per token) within the hidden states
    (5_000, "auto", 1250),  # the tile's floor, MIN_TILE, in equal tiles
    (700, "auto", 700),  # shorter than a tile: one tile (still through the tiled function)
    (0, "auto", 1),  # an empty slice: one empty tile
    (100, 7, 7),
    (100, 0, 100),  # 0: untiled
])
def test_tile_size(tokens, configured, expected):
    assert tile_tokens(tokens, hidden_size=1024, intermediate_width=4 * 3072, configured=configured) == expected


@pytest.mark.parametrize("tokens, hidden, configured, expected", [
    (500_000, 4096, "auto", 4066),  # 123 tiles of about hidden_size tokens (ALST's shards), not 12 of 41,667
    (100_000, 1024, "auto", 1031),  # at most hidden_size, at least MIN_TILE: 97 tiles
    (5_000, 1024, "auto", 1250),  # MIN_TILE bounds the count: 4 tiles
    (20_000, 4096, "auto", 1667),  # below 12 x hidden_size tokens the intermediates' bound is the tighter
    (700, 4096, "auto", 700),  # one tile (still through the tiled function)
    (500_000, 4096, 0, 500_000),
    (500_000, 4096, 9_000, 9_000),
])
def test_mlp_tile_size(tokens, hidden, configured, expected):
    assert mlp_tile_tokens(tokens, hidden, 4 * 3 * hidden, configured) == expected


def test_a_zero3_mlp_gathering_child_by_child_runs_untiled_unless_it_is_a_leaf():
    """Under ZeRO-3 each child Linear of an MLP gathers its weight at its own call: tiles would issue one gather per
    tile, differing between ranks. Such an MLP runs whole; made a ZeRO-3 leaf (what the package's DeepSpeed
    integration does before `deepspeed.initialize`) it is tiled."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextMLP

    from vlmcp_patch.fixtures.models import tiny_qwen3_vl_config
    from vlmcp_patch.sharding import gathers_per_submodule_call
    from vlmcp_patch.tiles import gather_whole_mlps_under_zero3

    pytest.importorskip("deepspeed")  # the leaf flags are set and read through `deepspeed.utils`
    mlp = Qwen3VLTextMLP(tiny_qwen3_vl_config().text_config)
    assert not gathers_per_submodule_call(mlp)
    for i, p in enumerate(mlp.parameters()):
        p.ds_id = i  # as ZeRO-3 partitions them
    assert gathers_per_submodule_call(mlp)
    gather_whole_mlps_under_zero3(torch.nn.Sequential(mlp))
    assert mlp._z3_leaf and not gathers_per_submodule_call(mlp)


def test_zero3_leaves_the_vision_mlps_to_their_tower():
    """The vision blocks' MLPs are no ZeRO-3 leaves (the tower runs once per modality: a leaf would be reduced twice
    per backward); inside a leaf tower (their weights carry it) they tile, in a tower gathered module by module not."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionMLP

    from vlmcp_patch.fixtures.models import tiny_qwen3_vl_config
    from vlmcp_patch.sharding import gathers_per_submodule_call
    from vlmcp_patch.tiles import gather_whole_mlps_under_zero3

    pytest.importorskip("deepspeed")
    mlp = Qwen3VLVisionMLP(tiny_qwen3_vl_config().vision_config)
    for i, p in enumerate(mlp.parameters()):
        p.ds_id = i
    gather_whole_mlps_under_zero3(torch.nn.Sequential(mlp))
    assert not getattr(mlp, "_z3_leaf", False) and gathers_per_submodule_call(mlp)
    tower = torch.nn.Sequential(mlp)
    for p in mlp.parameters():
        p.ds_z3_leaf_module = tower  # as ZeRO-3 marks the weights of a leaf's modules
    assert not gathers_per_submodule_call(mlp)


@pytest.mark.integration
def test_fsdp2_units_inside_an_mlp_run_it_whole():
    """FSDP2 (gloo, P=2): MLPs whose Linear layers are FSDP2 units of their own (a size-based policy) would gather
    them once per tile, and ranks with different numbers of tiles would issue different collectives: they run whole,
    and the step completes and equals stock P=1. The control: MLPs gathered whole with the root unit tile."""
    results = run_distributed(run_fsdp2_mlp_units, 2, timeout=600)
    for rank, per_wrapping in enumerate(results):
        assert per_wrapping["children"]["tiles"]["calls"] == 0, (rank, per_wrapping)
        assert per_wrapping["root"]["tiles"]["calls"] > 0, (rank, per_wrapping)
        for wrapping, m in per_wrapping.items():
            where = f"{wrapping}, rank {rank}"
            assert abs(m["loss"] - m["ref_loss"]) <= TOL * abs(m["ref_loss"]), (where, m)
            assert m["grad_err"] <= TOL and m["compared"] == m["params"], (where, m)
