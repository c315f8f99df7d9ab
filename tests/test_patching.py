"""Patch records: idempotent apply, exact revert, loud drift errors, and bit-identity at P=1."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import transformers
from transformers.modeling_utils import AttentionInterface
from transformers.models.qwen3_vl import modeling_qwen3_vl as mq

import vlmcp_patch
from vlmcp_patch.compat import check_transformers_version
from vlmcp_patch.patching import Patch, PatchSet, RegistryPatch, source_digest

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


def test_every_patch_matches_the_installed_versions():
    """Each declared patch resolves, has the parameters it relies on and, where it re-implements or rescales
    upstream code, the pinned source digest; such a patch also declares the versions it was checked on."""
    import importlib.util

    for patch in vlmcp_patch.PATCHES.patches:
        package = getattr(patch, "requires", None)
        if package is None or importlib.util.find_spec(package.split(".")[0]) is not None:
            patch.check()
        if getattr(patch, "mirrors", None):
            assert patch.checked_on, patch.target
    scaled = [p for p in vlmcp_patch.PATCHES.patches if "avg_scatter_grads" in p.target]
    assert scaled and scaled[0].mirrors and scaled[0].checked_on.startswith("deepspeed")


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
        from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
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
        print(any(s["applied"] for s in vlmcp_patch.status()), vlmcp_patch.cp_size(), vlmcp_patch.get_cp_group())
    """
    assert _run(code, VLMCP_DISABLE="1", VLMCP_CP_SIZE="2") == "False 1 None"
    control = """
        import vlmcp_patch
        print(any(s["applied"] for s in vlmcp_patch.status()), vlmcp_patch.cp_size())
    """
    assert _run(control, VLMCP_DISABLE="", VLMCP_CP_SIZE="2") == "True 2"  # the same import, not disabled


def test_reverted_package_reports_p1(restore):
    vlmcp_patch.enable(cp_size=2)
    assert vlmcp_patch.cp_size() == 2
    vlmcp_patch.revert()
    assert vlmcp_patch.cp_size() == 1 and vlmcp_patch.get_cp_group() is None
    assert vlmcp_patch.data_parallel_world_size() == 1 and vlmcp_patch.data_parallel_rank() == 0


def test_bad_cp_size_env_is_a_clear_error():
    code = """
        try:
            import vlmcp_patch
        except Exception as e:
            print(type(e).__name__, e)
    """
    assert "VLMCP_CP_SIZE='two' is not an integer" in _run(code, VLMCP_CP_SIZE="two")


def test_python_m_vlmcp_patch_reports_and_self_tests():
    out = subprocess.run([sys.executable, "-m", "vlmcp_patch"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for section in ("== versions", "== optional kernels", "== CP layout of this launch", "== patches", "== self-test"):
        assert section in out.stdout
    assert out.stdout.count("PASS") == 2 and "FAIL" not in out.stdout
    assert "checked on deepspeed>=0.19,<0.20" in out.stdout
