"""The decoder's RMSNorms recomputed in backward under CP (`vlmcp_patch/tiles.recomputed_norm_forward`): the real
transformers norm classes, in several row tiles, give the stock output and input gradient bit for bit and the
weight's gradient summed over the tiles, accumulated once; they keep their input only where stock keeps fp32
copies; CP off and `recompute_norms=False` leave them stock. The four families' norms under real CP, exact against
stock, are in `test_mlp_tiles.py` (`tile_cases.run_tile_cases` counts them)."""

from __future__ import annotations

import pytest
import torch

from vlmcp_patch.tiles import NORMS

ROWS, WIDTH = 4096, 64  # four tiles of 1,024 rows (`tiles.tile_tokens` with `NORM_BACKWARD_WIDTH`)


def _norm(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers RMSNorm with a non-trivial weight (Qwen3.5's is zero-centred: `1 + weight`)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    norm = {"qwen3_vl": Qwen3VLTextRMSNorm, "qwen3_5": Qwen3_5RMSNorm}[name](WIDTH, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 1.5, WIDTH))
    return norm.to(dtype)


def _step(norm: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """Output, input and weight gradients, how often the weight's gradient was accumulated, and the bytes autograd
    saved for backward (each storage once, the weight left out)."""
    x = x.detach().requires_grad_(True)
    norm.weight.grad = None
    accumulated = []
    handle = norm.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(1))
    saved: dict[int, int] = {}

    def pack(t):
        if t is not norm.weight:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = norm(x)
    y.backward(grad)
    handle.remove()
    return {"y": y.detach(), "dx": x.grad, "dw": norm.weight.grad, "accumulated": len(accumulated),
            "saved": sum(saved.values())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_recomputed_norms_equal_stock_and_keep_their_input_only(name, dtype, reapply):
    import vlmcp_patch

    torch.manual_seed(0)
    norm = _norm(name, dtype)
    x = torch.randn(1, ROWS, WIDTH).to(dtype)
    grad = torch.randn(1, ROWS, WIDTH).to(dtype)
    vlmcp_patch.enable(cp_size=1)
    NORMS.drain()
    stock = _step(norm, x, grad)
    exact = _step(_norm(name, torch.float64), x.double(), grad.double())["dw"]
    assert NORMS.drain()["calls"] == 0  # CP off: stock
    # the norm alone: no collective runs, only the CP switch is read; set on (by need no CP forward would choose it)
    vlmcp_patch.enable(cp_size=2, recompute_norms=True)
    ours = _step(norm, x, grad)
    counts = NORMS.drain()
    assert counts == {"calls": 1, "forward_tiles": 4, "backward_tiles": 4}
    assert torch.equal(ours["y"], stock["y"]) and torch.equal(ours["dx"], stock["dx"])  # row by row: the same ops
    # the weight's gradient: the tiles' sums added, once (stock sums all rows at once). In fp32 within 1e-5 of
    # stock; in bf16, where each tile's sum is rounded, as near the float64 gradient as stock's, within 4 x
    if dtype == torch.float32:
        torch.testing.assert_close(ours["dw"], stock["dw"], rtol=1e-5, atol=1e-5)
    else:
        assert (ours["dw"].double() - exact).abs().max() <= 4 * (stock["dw"].double() - exact).abs().max()
    assert ours["accumulated"] == stock["accumulated"] == 1
    # kept for backward: the input only; stock keeps the normalized input and, below fp32, the input's fp32 copy
    # (with its cast back: 3 times the input's bytes in bf16, 2 in fp32, its rsqrt besides)
    units = x.numel() * x.element_size()
    assert ours["saved"] == units
    assert stock["saved"] >= (3 if dtype == torch.bfloat16 else 2) * units
    vlmcp_patch.enable(recompute_norms=False)
    try:
        off = _step(norm, x, grad)
    finally:
        vlmcp_patch.enable(recompute_norms="auto")
    assert NORMS.drain()["calls"] == 0 and off["saved"] == stock["saved"]  # VLMCP_RECOMPUTE_NORMS=0: stock
    assert torch.equal(off["dx"], stock["dx"]) and torch.equal(off["dw"], stock["dw"])


def test_norm_tiles_in_bf16_are_as_near_the_exact_gradient_as_the_untiled_norm(capsys):
    """bf16 weight: the weight's gradient summed over the row tiles in fp32 and cast once stays within 1.1 x the
    untiled norm's error against fp64 at 1, 16 and 128 tiles (summed in bf16: 2.05 x at 16, 3.96 x at 128)."""
    from tests.helpers.tile_cases import BF16_TILE_COUNTS, bf16_gradient_errors
    from vlmcp_patch.tiles import tile_bounds, tokenwise_tiles

    torch.manual_seed(0)
    rows = 128 * 32
    x, grad = torch.randn(rows, WIDTH, dtype=torch.float64), torch.randn(rows, WIDTH, dtype=torch.float64)

    def step(norm, tiles):
        dtype = norm.weight.dtype
        out = norm(x.to(dtype)) if tiles == 0 else tokenwise_tiles(
            norm.forward, tile_bounds(rows, rows // tiles), NORMS, [x.to(dtype)], [norm.weight])
        out.backward(grad.to(dtype))

    errors = bf16_gradient_errors(_norm("qwen3_vl", torch.float64), step)
    with capsys.disabled():
        print(f"\nRMSNorm bf16 gradient error against fp64 by tiles (0: untiled): {errors}")
    for tiles in BF16_TILE_COUNTS:
        assert errors[tiles] <= 1.1 * errors[0], (tiles, errors)


def test_no_graph_no_recompute(reapply):
    """Under `torch.no_grad` (generation, evaluation) the norm runs stock: nothing to keep."""
    import vlmcp_patch

    norm = _norm("qwen3_vl", torch.float32)
    vlmcp_patch.enable(cp_size=2)
    NORMS.drain()
    with torch.no_grad():
        norm(torch.randn(1, ROWS, WIDTH))
    assert NORMS.drain()["calls"] == 0


def test_the_switch_is_read_from_the_environment(monkeypatch):
    from vlmcp_patch import settings

    monkeypatch.setenv("VLMCP_RECOMPUTE_NORMS", "0")
    assert settings._from_environment().recompute_norms is False
    monkeypatch.setenv("VLMCP_RECOMPUTE_NORMS", "1")
    assert settings._from_environment().recompute_norms is True
    with pytest.raises(Exception, match="recompute_norms must be True"):
        settings.enable(recompute_norms="yes")
