"""Patch records: idempotent apply, exact revert, loud drift errors, and bit-identity at P=1."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers.models.qwen3_vl import modeling_qwen3_vl as mq
from transformers.modeling_utils import AttentionInterface

import vlmcp_patch
from vlmcp_patch.compat import check_transformers_version
from vlmcp_patch.patching import Patch, PatchSet, RegistryPatch, source_digest
from vlmcp_patch.testing import Segment, build_model, make_batch, tiny_qwen3_vl_config

CLASS_FORWARD = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLForConditionalGeneration.forward"


def _targets():
    return (
        mq.Qwen3VLForConditionalGeneration.__dict__["forward"],
        mq.Qwen3VLTextModel.__dict__["forward"],
        AttentionInterface._global_mapping["sdpa"],
        AttentionInterface._global_mapping["flash_attention_2"],
    )


@pytest.fixture
def restore():
    yield
    vlmcp_patch.enable(cp_size=1)
    vlmcp_patch.apply()


def test_apply_twice_is_a_noop(restore):
    vlmcp_patch.apply()
    before = _targets()
    vlmcp_patch.apply()
    assert all(a is b for a, b in zip(before, _targets()))
    installed = {s["target"] for s in vlmcp_patch.status() if s["applied"]}
    expected = {p.target for p in vlmcp_patch.PATCHES.patches if getattr(p, "requires", None) in (None, *sys.modules)}
    assert installed == expected


def test_revert_restores_the_exact_originals(restore):
    vlmcp_patch.revert()
    originals = _targets()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert originals[2] is sdpa_attention_forward
    vlmcp_patch.apply()
    assert all(a is not b for a, b in zip(originals, _targets()))
    vlmcp_patch.revert()
    assert all(a is b for a, b in zip(originals, _targets()))
    assert not any(s["applied"] for s in vlmcp_patch.status())


def test_every_patch_names_target_and_reason():
    for entry in vlmcp_patch.status():
        assert entry["target"].split(".")[0] in ("transformers", "accelerate", "deepspeed", "trl")
        assert len(entry["reason"]) > 20


def test_optional_packages_are_patched_when_imported():
    code = """
        import sys, vlmcp_patch
        def installed():
            return {s["target"].split(".")[0] for s in vlmcp_patch.status() if s["applied"]}
        assert "deepspeed" not in sys.modules and "deepspeed" not in installed()
        import deepspeed
        assert "deepspeed" in installed()
        print("ok")
    """
    pytest.importorskip("deepspeed")
    assert _run(code).splitlines()[-1] == "ok"


def _noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def test_missing_target_names_path_and_version():
    bad = Patch(target=CLASS_FORWARD.replace("forward", "no_such_method"), wrapper=_noop, reason="test")
    with pytest.raises(vlmcp_patch.PatchTargetError, match=r"Qwen3VLForConditionalGeneration\.no_such_method") as e:
        bad.check()
    assert transformers.__version__ in str(e.value)
    missing_module = Patch(target="transformers.models.no_such_model.modeling.X.forward", wrapper=_noop, reason="t")
    with pytest.raises(vlmcp_patch.PatchTargetError, match="no_such_model"):
        missing_module.check()


def test_changed_signature_is_drift():
    bad = Patch(target=CLASS_FORWARD, wrapper=_noop, reason="test", expects=("input_ids", "gone_parameter"))
    with pytest.raises(vlmcp_patch.PatchTargetError, match="gone_parameter"):
        bad.check()


def test_changed_source_is_drift():
    good = source_digest(mq.Qwen3VLTextModel._deepstack_process)
    target = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextModel._deepstack_process"
    Patch(target=target, wrapper=_noop, reason="test", mirrors=good).check()
    with pytest.raises(vlmcp_patch.PatchTargetError, match="source differs"):
        Patch(target=target, wrapper=_noop, reason="test", mirrors="0" * 16).check()


def test_missing_registry_entry_is_drift():
    bad = RegistryPatch(registry="transformers.modeling_utils.AttentionInterface", key="nope", factory=id, reason="t")
    with pytest.raises(vlmcp_patch.PatchTargetError, match="nope"):
        bad.check()


def test_a_drifted_set_changes_nothing(restore):
    vlmcp_patch.revert()
    before = _targets()
    good = Patch(target=CLASS_FORWARD, wrapper=_noop, reason="test")
    bad = Patch(target=CLASS_FORWARD.replace("forward", "gone"), wrapper=_noop, reason="test")
    with pytest.raises(vlmcp_patch.PatchTargetError):
        PatchSet([good, bad]).apply()
    assert all(a is b for a, b in zip(before, _targets()))


def test_version_range_is_checked():
    with pytest.raises(vlmcp_patch.UnsupportedSetupError, match="supports transformers >=5.23.0,<5.24.0"):
        check_transformers_version("4.57.1")
    with pytest.raises(vlmcp_patch.UnsupportedSetupError):
        check_transformers_version("5.24.0")
    check_transformers_version("5.23.2")


def _run(code: str, **env) -> str:
    import os

    full_env = {**os.environ, **env}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_order_and_models_built_before_import():
    code = """
        from transformers import Qwen3VLForConditionalGeneration
        from vlmcp_patch.testing import build_model, tiny_qwen3_vl_config
        model = build_model(tiny_qwen3_vl_config())   # built before the package is imported
        import vlmcp_patch
        print(type(type(model).__dict__["forward"]).__name__)
    """
    assert _run(code) == "_OurWrapper"
    code_first = """
        import vlmcp_patch
        from transformers import Qwen3VLMoeForConditionalGeneration as C
        print(type(C.__dict__["forward"]).__name__)
    """
    assert _run(code_first) == "_OurWrapper"


def test_vlmcp_disable_turns_the_package_off():
    code = """
        import vlmcp_patch
        print(any(s["applied"] for s in vlmcp_patch.status()))
    """
    assert _run(code, VLMCP_DISABLE="1") == "False"
    assert _run(code) == "True"


def test_bad_cp_size_env_is_a_clear_error():
    code = """
        try:
            import vlmcp_patch
        except Exception as e:
            print(type(e).__name__, e)
    """
    assert "VLMCP_CP_SIZE='two' is not an integer" in _run(code, VLMCP_CP_SIZE="two")


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [False, True])
def test_p1_is_bit_identical_to_stock(moe, restore):
    model = build_model(tiny_qwen3_vl_config(moe=moe), seed=2)
    batch = make_batch(
        [[Segment(text=3), Segment(image=(16, 24)), Segment(text=5)], [Segment(text=6), Segment(image=(8, 16))]],
        seed=4,
    )
    vlmcp_patch.revert()
    ref = _step(model, batch)
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1)
    ours = _step(model, batch)
    assert torch.equal(ref[0], ours[0]) and torch.equal(ref[1], ours[1])
    assert ref[2].keys() == ours[2].keys()
    assert all(torch.equal(ref[2][n], ours[2][n]) for n in ref[2])


def test_p1_generation_with_left_padding_is_stock(restore):
    """Generation builds 4-row position ids with zeros over left padding: not a packed row."""
    model = build_model(tiny_qwen3_vl_config(), seed=3)
    batch = make_batch([[Segment(text=4), Segment(image=(16, 16)), Segment(text=3)], [Segment(text=5)]], seed=1,
                       labels=False)
    lengths = batch["attention_mask"].sum(1)
    for key in ("input_ids", "mm_token_type_ids", "attention_mask"):  # right -> left padding
        for b in range(batch[key].shape[0]):
            batch[key][b] = torch.roll(batch[key][b], int(batch[key].shape[1] - lengths[b]))
    ours = model.generate(**batch, max_new_tokens=3, do_sample=False)
    vlmcp_patch.revert()
    stock = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert torch.equal(ours, stock)
