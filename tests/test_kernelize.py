"""Hub kernels (`kernels.kernelize`) on Qwen3.5's gated DeltaNet: as stock with CP off; on the package's path (CP,
a packed row at P=1) either the package's path, exactly, or a refusal on every rank before compute that says how to
run.

Where `kernels` is installed, `kernels.kernelize` itself runs, with an in-process repository of CPU stand-in
kernels; otherwise the forwards are replaced exactly as kernelize replaces them (tests/helpers/kernelize_cases.py
says why: transformers 5.25 needs kernels>=0.19.1, and real kernels come from the hub).
"""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.kernelize_cases import run_kernelize_cases


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_kernelize_cases, 2, timeout=240)


def test_a_kernelized_layer_runs_as_stock_with_cp_off_and_is_refused_on_the_packages_path(results):
    from tests.helpers.kernelize_cases import _kernels

    for rank, res in enumerate(results):
        assert res["mechanism"] == ("kernels.kernelize" if _kernels() else "as kernelize does"), rank
        assert res["layer_p1_equal"], rank  # CP off: the kernel runs, bit for bit as on stock transformers
        packed = res["layer_p1_packed"]  # a packed row at P=1 takes the package's path: refused as well
        assert packed["error"] == "UnsupportedSetupError" and "kernelize" in packed["message"], (rank, packed)
        layer = res["layer"]
        assert layer["error"] == "UnsupportedSetupError", (rank, layer)
        assert "kernelize" in layer["message"] and "del layer.forward" in layer["message"], (rank, layer["message"])
        assert layer["kernel_calls"] == 0 and layer["seconds"] < 10, (rank, layer)  # before any compute


def test_a_kernelized_conv_runs_on_the_cp_path_exactly(results):
    """The conv kernelized, the layer left to kernelize's fallback (the class's forward bound on the instance: the
    control of the refusal above, which runs); up to 5.14, where kernelize reaches neither, the conv kernel the layer
    keeps on itself (causal-conv1d's, tests/helpers/kernelize_cases.py)."""
    for rank, res in enumerate(results):
        assert res["conv_installed"], (rank, res["conv_mechanism"])
        assert res["conv_p1_err"] <= 1e-5, rank
        conv = res["conv"]
        assert conv["error"] is None, (rank, conv)
        assert conv["err"] <= 1e-5 and conv["kernel_calls"] > 0, (rank, conv)


def _transformers_wrapper(is_new_implementation: bool, supported_devices):
    """The shape of transformers' `use_kernel_func_from_hub_with_fallback` wrapper: its decision in closure cells."""

    def wrapped(*args, **kwargs):
        return is_new_implementation, supported_devices

    return wrapped


def test_the_cp_path_reads_which_kernel_transformers_resolved():
    """Packed-sequence arguments go only to a kernel that takes them on the inputs' device: transformers 5.25 sends
    inputs on other devices (CPU) to the torch path, which refuses them; with `kernels` installed the wrapper is
    the forward of a function module, and one kernelize replaced is called per sample."""
    import torch

    from vlmcp_patch.models.qwen3_5 import _takes_packed_sequences

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fla = _transformers_wrapper(True, ("cuda",))
    assert _takes_packed_sequences(fla, cuda) and not _takes_packed_sequences(fla, cpu)
    assert _takes_packed_sequences(_transformers_wrapper(True, None), cpu)  # 5.16-5.24: no device check
    assert not _takes_packed_sequences(_transformers_wrapper(False, None), cuda)  # the torch reference

    class Func(torch.nn.Module):  # kernels' `use_kernel_forward_from_hub` on a function
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    func = fla
    module = Func()
    assert _takes_packed_sequences(module, cuda) and not _takes_packed_sequences(module, cpu)
    module.forward = Func.forward.__get__(module)  # kernelize's fallback: the class's own forward, bound
    assert _takes_packed_sequences(module, cuda)
    module.forward = lambda *args, **kwargs: None  # a hub kernel bound by kernelize: its stock signature only
    assert not _takes_packed_sequences(module, cuda)
