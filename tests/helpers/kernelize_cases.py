"""Qwen3.5's DeltaNet layer and conv replaced by hub kernels the way `kernels.kernelize` replaces them, under CP and
with CP off.

`kernels.kernelize` (transformers' `model.kernelize()`, `from_pretrained(..., use_kernels=True)`) installs a kernel
by binding the kernel layer's forward on the module instance: `module.forward = MethodType(kernel.forward, module)`;
with no kernel for the layer it binds the class's own forward the same way. Functions listed in
`use_kernelized_func` are `nn.Module`s made by `use_kernel_forward_from_hub` (a `Func` whose forward calls the
function), replaced the same way.

transformers 5.25 applies those decorators only with `kernels>=0.19.1`, and real kernels come from the hub. So:
where a `kernels` before 0.19 is installed, these cases mark the classes and functions as transformers' decorators
would (`replace_kernel_forward_from_hub`, `use_kernel_forward_from_hub`, `_kernel_funcs`) and run
`kernels.kernelize` itself, with a mapping to an in-process repository that loads the CPU stand-in kernels below (no
hub); with 0.19 or later (transformers decorated the classes itself, each layer with private function wrappers) and
without `kernels` they replace the forwards exactly as kernelize does.
"""

from __future__ import annotations

import inspect
import sys
import time
from types import MethodType

import torch
import torch.nn.functional as F

CALLS = {"conv": 0, "layer": 0}


def _kernels():
    """`kernels` where these cases can drive `kernels.kernelize` itself (the releases before 0.19, whose decorators
    transformers 5.25 leaves unapplied), else None: the forwards are then replaced as kernelize does. From 0.19
    transformers decorates the classes itself, and marking them again here would route a kernel function to itself."""
    try:
        import kernels
    except ImportError:
        return None
    from packaging.version import Version

    if Version(getattr(kernels, "__version__", "0")) >= Version("0.19"):
        return None
    wanted = ("kernelize", "use_kernel_mapping", "Mode", "replace_kernel_forward_from_hub",
              "use_kernel_forward_from_hub")
    return kernels if all(hasattr(kernels, name) for name in wanted) else None


class InProcessRepository:
    """A `kernels` layer repository that loads a class defined here, instead of a kernel from the hub."""

    def __init__(self, layer_name: str, layer: type):
        self.layer_name, self._layer = layer_name, layer

    def load(self) -> type:
        return self._layer


def kernelize(model, replace: dict[str, type]) -> str:
    """Kernelize `model` with `replace` (kernel layer name -> stand-in kernel class): through `kernels.kernelize`
    where `kernels` is installed, else as it does. A marked layer or function left out of `replace` falls back to its
    class's own forward, as kernelize does. Returns the mechanism used."""
    kernels = _kernels()
    if kernels is None:
        for module in _layers(model):
            _bind(module, replace.get("Qwen3_5GatedDeltaNet", type(module)))
        conv = _modeling(model).causal_conv1d_fn
        if isinstance(conv, torch.nn.Module) and "causal_conv1d_fn" in replace:
            _bind(conv, replace["causal_conv1d_fn"])
        return "as kernelize does"
    mapping = {name: {"cpu": InProcessRepository(name, layer)} for name, layer in replace.items()}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    return "kernels.kernelize"


def _bind(module, layer_class):
    module.forward = MethodType(layer_class.forward, module)  # kernels' `_replace_forward`


def mark_as_transformers_does(model) -> None:
    """What transformers' decorators do with `kernels>=0.19.1` installed: the layer class marked for kernelize, the
    module-level conv an nn.Module kernelize can replace, listed in each layer's `_kernel_funcs`."""
    kernels, modeling = _kernels(), _modeling(model)
    layer_class = type(_layers(model)[0])
    if not isinstance(modeling.causal_conv1d_fn, torch.nn.Module):
        func = modeling.causal_conv1d_fn
        if kernels is not None:
            kernels.replace_kernel_forward_from_hub(layer_class, "Qwen3_5GatedDeltaNet")
            modeling.causal_conv1d_fn = kernels.use_kernel_forward_from_hub("causal_conv1d_fn")(func)
        else:
            class Func(torch.nn.Module):
                def forward(self, *args, **kwargs):
                    return func(*args, **kwargs)

            modeling.causal_conv1d_fn = Func()
    for layer in _layers(model):
        if not hasattr(layer, "_kernel_funcs"):  # kernels>=0.19's decorator gives each layer private wrappers of its own
            vars(layer)["_kernel_funcs"] = {"causal_conv1d_fn": modeling.causal_conv1d_fn}
    # kernels checks that a kernel's forward has the replaced forward's parameters, in number and kind
    HubDeltaNet.forward.__signature__ = inspect.signature(layer_class.forward)


def _modeling(model):
    return sys.modules[type(_layers(model)[0]).__module__]


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
    model = _model()
    mark_as_transformers_does(model)

    # The whole layer replaced by a hub kernel: as stock with CP off, refused on the package's path.
    out["mechanism"] = kernelize(model, {"Qwen3_5GatedDeltaNet": HubDeltaNet})
    out["layer_p1_equal"] = bool(torch.equal(_logits(model, batch), stock))  # CP off: the kernel, as on stock
    out["layer_p1_packed"] = _cp_run(model, _packed_row(), stock)  # the package's path at P=1: refused too
    vlmcp_patch.enable(cp_size=world_size)
    CALLS["layer"] = 0
    out["layer"] = _cp_run(model, batch, stock)
    out["layer"]["kernel_calls"] = CALLS["layer"]

    # The conv replaced by a hub kernel, the layer left to kernelize's fallback (its class's forward, after the
    # import the CP path): the CP path calls the kernel on this rank's heads over the whole row.
    conv_model = _model()
    mark_as_transformers_does(conv_model)
    kernelize(conv_model, {"causal_conv1d_fn": HubCausalConv})
    out["fallback_bound"] = all("forward" in vars(layer) for layer in _layers(conv_model))
    bound = vars(_modeling(conv_model).causal_conv1d_fn).get("forward")
    out["conv_replaced"] = getattr(bound, "__func__", None) is HubCausalConv.forward
    vlmcp_patch.enable(cp_size=1)
    out["conv_p1_err"] = _rel(_logits(conv_model, batch), stock)
    vlmcp_patch.enable(cp_size=world_size)
    CALLS["conv"] = 0
    out["conv"] = _cp_run(conv_model, batch, stock)
    out["conv"]["kernel_calls"] = CALLS["conv"]
    vlmcp_patch.enable(cp_size=1)
    return out
