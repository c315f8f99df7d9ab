"""Qwen3.5's DeltaNet layer and conv replaced as `kernels.kernelize` replaces them, under CP and with CP off.

`kernels.kernelize` (transformers' `model.kernelize()`, `from_pretrained(..., use_kernels=True)`) installs a hub
kernel by binding the kernel layer's forward on the module instance: `module.forward = MethodType(kernel.forward,
module)` (kernels' `_replace_forward`); with no kernel for the device it binds the class's own forward the same way.
Functions listed in `use_kernelized_func` are `nn.Module`s made by `use_kernel_forward_from_hub` (a `Func` whose
forward calls the function), replaced the same way. transformers 5.25 uses that mechanism only with
`kernels>=0.19.1`, which the registries here do not serve, and a real kernel comes from the hub: so these cases
replace the forwards exactly as kernelize does (with `kernels`' own `_replace_forward` and
`use_kernel_forward_from_hub` when an installed `kernels` has them), with CPU stand-ins for the hub kernels.
"""

from __future__ import annotations

import sys
import time
from types import MethodType

import torch
import torch.nn.functional as F

CALLS = {"conv": 0, "layer": 0}


def _replace_forward(module, layer_class):
    try:
        from kernels.layer.layer import _replace_forward as replace
    except ImportError:
        def replace(module, layer):  # kernels' own: bind the layer's forward on the instance
            module.forward = MethodType(layer.forward, module)
    replace(module, layer_class)


def _func_module(name: str, func):
    """What `use_kernel_forward_from_hub(name)` makes of a function: an nn.Module instance calling it."""
    try:
        from kernels import use_kernel_forward_from_hub

        return use_kernel_forward_from_hub(name)(func)
    except ImportError:
        class Func(torch.nn.Module):
            kernel_layer_name = name

            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()


class HubDeltaNet(torch.nn.Module):
    """A stand-in hub kernel for the whole layer: stock's computation of the layer, on what it is given."""

    def forward(self, hidden_states, **kwargs):
        CALLS["layer"] += 1
        stock = type(self).forward
        return getattr(stock, "vlmcp_original", stock)(self, hidden_states, **kwargs)


class HubCausalConv(torch.nn.Module):
    """A stand-in hub kernel for `causal_conv1d_fn`: the same depthwise causal conv, computed another way (explicit
    left padding), with the stock function's signature."""

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        CALLS["conv"] += 1
        width = weight.shape[-1]
        padded = F.pad(hidden_states.to(weight.dtype), (width - 1, 0))
        out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=hidden_states.shape[1])
        out = F.silu(out) if activation in ("silu", "swish") else out
        return out.to(hidden_states.dtype)


def _model():
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config

    return build_model(tiny_qwen3_5_config(), seed=0)


def _batch():
    from vlmcp_patch.fixtures.data import Segment, make_batch

    batch = make_batch([[Segment(text=9), Segment(image=(16, 24)), Segment(text=13)], [Segment(text=20)]], seed=5)
    batch.pop("labels")
    return batch


def _packed_row():
    from vlmcp_patch.fixtures.data import Segment, make_packed_batch

    row = make_packed_batch([[Segment(text=9)], [Segment(text=13)]], seed=5)[0]
    row.pop("labels", None)
    return row


def _layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _cp_run(model, batch, reference) -> dict:
    """The model's forward under CP: its error (type, message, seconds), or its logits' error against `reference`."""
    start = time.monotonic()
    try:
        logits = _logits(model, batch)
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "err": _rel(logits * batch["attention_mask"][..., None],
                                       reference * batch["attention_mask"][..., None])}


def run_kernelize_cases(rank: int, world_size: int) -> dict:
    import vlmcp_patch

    batch, out = _batch(), {}
    vlmcp_patch.enable(cp_size=1)
    stock = _logits(_model(), batch)

    # The whole layer replaced by a hub kernel: as stock with CP off, refused under CP.
    model = _model()
    for layer in _layers(model):
        _replace_forward(layer, HubDeltaNet)
    out["layer_p1_equal"] = bool(torch.equal(_logits(model, batch), stock))  # CP off: the kernel, as on stock
    out["layer_p1_packed"] = _cp_run(model, _packed_row(), stock)  # the package's path at P=1: refused too
    vlmcp_patch.enable(cp_size=world_size)
    CALLS["layer"] = 0
    out["layer"] = _cp_run(model, batch, stock)
    out["layer"]["kernel_calls"] = CALLS["layer"]

    # kernelize with no kernel for the device binds the class's forward, after the import the CP path: it runs.
    model = _model()
    for layer in _layers(model):
        _replace_forward(layer, type(layer))
    out["fallback"] = _cp_run(model, batch, stock)

    # The conv replaced by a hub kernel: the CP path calls it on this rank's heads over the whole row.
    modeling = sys.modules[type(_layers(model)[0]).__module__]
    original = modeling.causal_conv1d_fn
    modeling.causal_conv1d_fn = _func_module("causal_conv1d_fn", original)
    _replace_forward(modeling.causal_conv1d_fn, HubCausalConv)
    try:
        vlmcp_patch.enable(cp_size=1)
        out["conv_p1_err"] = _rel(_logits(_model(), batch), stock)
        vlmcp_patch.enable(cp_size=world_size)
        CALLS["conv"] = 0
        out["conv"] = _cp_run(_model(), batch, stock)
        out["conv"]["kernel_calls"] = CALLS["conv"]
    finally:
        modeling.causal_conv1d_fn = original
        vlmcp_patch.enable(cp_size=1)
    return out
