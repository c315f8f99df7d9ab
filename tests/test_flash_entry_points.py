"""flash-attn's entry points, wrapped when flash-attn is importable (`vlmcp_patch/attention/flash.py`): outside a CP
decoder forward the wrappers are the original functions — the same results, bit for bit — and `revert()` puts the
originals back. (Under CP, a script's own call: `tests/test_trainer.py`, the official script's packing.)"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import flash_standin


@pytest.fixture
def flash_installed(reapply):
    """flash-attn (the CPU stand-in) importable, and the package applied after it, as at an import that finds it."""
    import transformers.modeling_flash_attention_utils as fa_utils

    import vlmcp_patch

    saved = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface",
                                                     "flash_attn.bert_padding")}
    checks = {name: getattr(fa_utils, name) for name in dir(fa_utils)
              if name.startswith("is_flash_attn_") or name == "_loaded_implementation"}
    flash_standin.install()
    vlmcp_patch.revert()
    vlmcp_patch.apply()
    yield sys.modules["flash_attn"]
    vlmcp_patch.revert()
    for name, value in checks.items():
        setattr(fa_utils, name, value)
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def test_outside_a_cp_forward_the_wrappers_are_the_original_functions(flash_installed):
    import vlmcp_patch

    flash_attn = flash_installed
    interface = sys.modules["flash_attn.flash_attn_interface"]
    for module in (flash_attn, interface):
        for name in ("flash_attn_varlen_func", "flash_attn_func"):
            assert getattr(module, name).vlmcp_original is getattr(flash_standin, name), (module, name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, 4, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    ours = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    dense = flash_attn.flash_attn_func(q[None], k[None], v[None], causal=True)
    assert torch.equal(ours, flash_standin.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True))
    assert torch.equal(dense, flash_standin.flash_attn_func(q[None], k[None], v[None], causal=True))
    vlmcp_patch.revert()
    assert flash_attn.flash_attn_varlen_func is flash_standin.flash_attn_varlen_func
    assert interface.flash_attn_func is flash_standin.flash_attn_func
