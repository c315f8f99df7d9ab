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

Up to 5.14 transformers marks neither the layer nor its conv for kernelize: the layer keeps its conv on itself
(`layer.causal_conv1d_fn`, causal-conv1d's function where that package is installed, else None), set at its
construction and called with causal-conv1d's keywords (`x=`). There the conv stand-in is put where that release's
layer calls it, as an installed causal-conv1d puts its function, with causal-conv1d's signature; the whole layer is
still replaced as kernelize would replace it, which the package refuses the same way on every release.
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


def keeps_conv_on_layer(model) -> bool:
    """Whether the installed release's DeltaNet layer calls the conv it keeps on itself (up to 5.14), not its modeling
    module's kernel wrapper: the package's own declaration (`models/qwen3_5.py`)."""
    from vlmcp_patch.models.qwen3_5 import _keeps_kernels_on_layer

    return _keeps_kernels_on_layer(type(_layers(model)[0]))


def mark_as_transformers_does(model) -> None:
    """What transformers' decorators do with `kernels>=0.19.1` installed: the layer class marked for kernelize, the
    module-level conv an nn.Module kernelize can replace, listed in each layer's `_kernel_funcs`. Up to 5.14 the
    module-level conv is causal-conv1d's function or None, which no release wraps: it stays as it is."""
    kernels, modeling = _kernels(), _modeling(model)
    layer_class = type(_layers(model)[0])
    if keeps_conv_on_layer(model):
        if kernels is not None:
            kernels.replace_kernel_forward_from_hub(layer_class, "Qwen3_5GatedDeltaNet")
    elif not isinstance(modeling.causal_conv1d_fn, torch.nn.Module):
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


def _padded_causal_conv(x, weight, bias, activation):
    """The depthwise causal conv (B, C, T) -> (B, C, T), computed another way than stock's (explicit left padding)."""
    CALLS["conv"] += 1
    padded = F.pad(x.to(weight.dtype), (weight.shape[-1] - 1, 0))
    out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=x.shape[1])
    out = F.silu(out) if activation in ("silu", "swish") else out
    return out.to(x.dtype)


class HubCausalConv(torch.nn.Module):
    """A stand-in hub kernel for `causal_conv1d_fn` (5.15 on), with the stock function's signature."""

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        return _padded_causal_conv(hidden_states, weight, bias, activation)


def causal_conv1d_on_the_layer(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                               final_states_out=None, activation=None):
    """A stand-in for causal-conv1d's `causal_conv1d_fn` as a layer that keeps its conv on itself (up to 5.14) holds
    it, with causal-conv1d's signature: one sequence per call (`seq_idx` None, as those layers pass it)."""
    assert seq_idx is None and initial_states is None and not return_final_states, "one whole sequence per call"
    return _padded_causal_conv(x, weight, bias, activation)


def install_conv(model) -> str:
    """The conv stand-in put where the installed release's layer calls it: kernelize's replacement of the modeling
    module's conv (5.15 on; the layer left to kernelize's fallback, the class's forward bound on the instance), or,
    where the layer keeps its conv on itself, that attribute, as an installed causal-conv1d sets it. Returns how."""
    if keeps_conv_on_layer(model):
        for layer in _layers(model):
            layer.causal_conv1d_fn = causal_conv1d_on_the_layer
        return "on the layer, as causal-conv1d's"
    mark_as_transformers_does(model)
    return kernelize(model, {"causal_conv1d_fn": HubCausalConv})


def conv_installed(model, how: str) -> bool:
    """Whether the installed layers call the stand-in, and only it: the control that the CP path runs what they call."""
    layers = _layers(model)
    if how.startswith("on the layer"):
        return all(layer.causal_conv1d_fn is causal_conv1d_on_the_layer and "forward" not in vars(layer)
                   for layer in layers)
    bound = vars(_modeling(model).causal_conv1d_fn).get("forward")
    return (all("forward" in vars(layer) for layer in layers)  # kernelize's fallback: the class's forward, bound
            and getattr(bound, "__func__", None) is HubCausalConv.forward)


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

    # The conv replaced by a kernel (`install_conv`), the layer's own forward (after the import the CP path): the CP
    # path calls the kernel on this rank's heads over the whole row.
    conv_model = _model()
    out["conv_mechanism"] = install_conv(conv_model)
    out["conv_installed"] = conv_installed(conv_model, out["conv_mechanism"])
    vlmcp_patch.enable(cp_size=1)
    out["conv_p1_err"] = _rel(_logits(conv_model, batch), stock)
    vlmcp_patch.enable(cp_size=world_size)
    CALLS["conv"] = 0
    out["conv"] = _cp_run(conv_model, batch, stock)
    out["conv"]["kernel_calls"] = CALLS["conv"]
    vlmcp_patch.enable(cp_size=1)
    return out
