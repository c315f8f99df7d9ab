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
from vlmcp_patch.compat import NEWEST, OLDEST, check_transformers_version
from vlmcp_patch.patching import Patch, PatchSet, RegistryPatch, applies_here, source_digest, target_module

CLASS_FORWARD = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLForConditionalGeneration.forward"


def _targets():
    return (
        mq.Qwen3VLForConditionalGeneration.__dict__["forward"],
        mq.Qwen3VLTextModel.__dict__["forward"],
        AttentionInterface._global_mapping["sdpa"],
        AttentionInterface._global_mapping["flash_attention_2"],
    )


def test_apply_twice_is_a_noop(reapply):
    vlmcp_patch.apply()
    before = _targets()
    vlmcp_patch.apply()
    assert all(a is b for a, b in zip(before, _targets()))
    installed = {s["target"] for s in vlmcp_patch.status() if s["applied"]}
    # an optional package's patch installs once the module holding its target is imported, not the package alone
    expected = {p.target for p in vlmcp_patch.PATCHES.patches
                if (getattr(p, "requires", None) is None or target_module(p.target) in sys.modules)
                and applies_here(p)}
    assert installed == expected


def test_revert_restores_the_exact_originals(reapply):
    vlmcp_patch.revert()
    originals = _targets()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert originals[2] is sdpa_attention_forward
    vlmcp_patch.apply()
    assert all(a is not b for a, b in zip(originals, _targets()))
    vlmcp_patch.revert()
    assert all(a is b for a, b in zip(originals, _targets()))
    assert not any(s["applied"] for s in vlmcp_patch.status())


def test_patched_functions_read_like_the_originals(reapply):
    """Name, docs, signature and annotations are the originals' (transformers' own tests read a forward's return
    annotation), and there is no `__wrapped__` for Accelerate's `unwrap_model` to strip the patch through."""
    import inspect

    vlmcp_patch.revert()
    originals = _targets()[:2]
    vlmcp_patch.apply()
    for original, patched in zip(originals, _targets()[:2]):
        assert patched is not original and patched.vlmcp_original is original
        for attribute in ("__name__", "__qualname__", "__module__", "__doc__", "__annotations__"):
            assert getattr(patched, attribute) == getattr(original, attribute), attribute
        assert inspect.signature(patched) == inspect.signature(original)
        assert not hasattr(patched, "__wrapped__")
    assert mq.Qwen3VLForConditionalGeneration.forward.__annotations__["return"] is not None


def test_every_patch_matches_the_installed_versions():
    """Each declared patch resolves, has the parameters it relies on and, where it re-implements or rescales
    upstream code, the pinned source digest; such a patch also declares the versions it was checked on."""
    import importlib.util

    for patch in vlmcp_patch.PATCHES.patches:
        package = getattr(patch, "requires", None)
        if applies_here(patch) and (package is None or importlib.util.find_spec(package.split(".")[0]) is not None):
            patch.check()  # a patch declared `since` a newer release has no target here
        if getattr(patch, "mirrors", None):
            assert patch.checked_on, patch.target
    scaled = [p for p in vlmcp_patch.PATCHES.patches if "avg_scatter_grads" in p.target]
    assert scaled and scaled[0].mirrors and scaled[0].checked_on.startswith("deepspeed")


@pytest.mark.integration
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
    # A parameter renamed across the supported releases verifies under any of its spellings, and only under those.
    Patch(target=CLASS_FORWARD, wrapper=_noop, reason="test", expects=(("past_key_values", "cache"),)).check()
    with pytest.raises(vlmcp_patch.PatchTargetError, match="gone_a"):
        Patch(target=CLASS_FORWARD, wrapper=_noop, reason="test", expects=(("gone_a", "gone_b"),)).check()


def test_changed_source_is_drift():
    good = source_digest(mq.Qwen3VLTextModel._deepstack_process)
    target = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextModel._deepstack_process"
    Patch(target=target, wrapper=_noop, reason="test", mirrors={"0" * 16: "older", good: "this release"}).check()
    with pytest.raises(vlmcp_patch.PatchTargetError, match=f"digest {good}.* none of those .*checked on"):
        Patch(target=target, wrapper=_noop, reason="test", mirrors={"0" * 16: "transformers>=9"}).check()


def test_missing_registry_entry_is_drift():
    bad = RegistryPatch(registry="transformers.modeling_utils.AttentionInterface", key="nope", factory=id, reason="t")
    with pytest.raises(vlmcp_patch.PatchTargetError, match="nope"):
        bad.check()


def test_a_target_that_does_not_verify_leaves_its_family_stock(reapply):
    """One family's target does not verify: none of that family's patches is installed (its top-level forward
    gets only its guard), a patch of another family is, and nothing raises. Control: the same set with every
    target verifying installs them all."""
    vlmcp_patch.revert()
    before = _targets()
    text = CLASS_FORWARD.replace("Qwen3VLForConditionalGeneration.forward", "Qwen3VLTextModel.forward")
    other = "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextModel.forward"

    def guard(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def records(gone: str):
        return [Patch(target=CLASS_FORWARD, wrapper=_noop, reason="t", family="qwen3_vl", guard=guard),
                Patch(target=text, wrapper=_noop, reason="t", family="qwen3_vl", expects=(gone,)),
                Patch(target=other, wrapper=_noop, reason="t", family="qwen3_5")]

    drifted = PatchSet(records("gone_parameter"))
    drifted.apply()
    try:
        assert list(drifted.unverified) == [text] and "gone_parameter" in drifted.unverified[text][1]
        assert mq.Qwen3VLTextModel.__dict__["forward"] is before[1]  # left stock
        assert mq.Qwen3VLForConditionalGeneration.__dict__["forward"].vlmcp_original is before[0]
        assert drifted.unverified_for("qwen3_vl") and not drifted.unverified_for("qwen3_5")
        from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
        assert getattr(q35.Qwen3_5TextModel.__dict__["forward"], "vlmcp_original", None) is not None
    finally:
        drifted.revert()
    assert all(a is b for a, b in zip(before, _targets()))
    control = PatchSet(records("input_ids"))
    control.apply()
    try:
        assert not control.unverified and getattr(mq.Qwen3VLTextModel.__dict__["forward"], "vlmcp_original", None)
    finally:
        control.revert()


def test_a_transformers_older_than_the_tested_releases_is_refused():
    for older in ("5.1.0", "5.0.0", "4.57.6"):  # 5.0 and 5.1 have another Qwen3.5 (docs/versions.md)
        with pytest.raises(vlmcp_patch.UnsupportedSetupError, match=f"needs transformers {OLDEST} or newer.*{older}"):
            check_transformers_version(older)
    for version in (str(OLDEST), "5.6.0", "5.22.1", str(NEWEST), "5.26.0", "6.0.0"):
        check_transformers_version(version)  # newer releases are decided by their patch targets, not refused


@pytest.mark.integration
@pytest.mark.parametrize("version,warnings", [(transformers.__version__, 0), ("5.26.0.dev0", 1),
                                              pytest.param("5.26.0", 1, marks=pytest.mark.extended)])
def test_an_untested_newer_transformers_imports_with_one_warning(version, warnings):
    code = f"""
        import warnings, transformers
        transformers.__version__ = {version!r}  # every patch target is the installed one: they all verify
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import vlmcp_patch
        from vlmcp_patch.compat import UntestedVersionWarning
        print(sum(issubclass(w.category, UntestedVersionWarning) for w in caught), vlmcp_patch.PATCHES.active)
    """
    assert _run(code) == f"{warnings} True"


@pytest.fixture(scope="module")
def unverified_runs():
    from tests.helpers.harness import run_distributed
    from tests.helpers.unverified_cases import run_unverified_case

    return {how: run_distributed(run_unverified_case, 2, how, timeout=240) for how in ("digest", "parameter")}


@pytest.mark.parametrize("how,target", [("digest", "Qwen3_5GatedDeltaNet.forward"),
                                        ("parameter", "Qwen3VLForConditionalGeneration.forward")])
def test_a_target_that_does_not_verify_warns_runs_stock_at_p1_and_refuses_cp_on_every_rank(how, target,
                                                                                             unverified_runs):
    """A release newer than the checked ones, simulated on the installed one: an unknown digest (the test replaces
    the pinned ones) or a top-level forward without the parameters the patch relies on. Importing never raises: one
    warning names the target and the newest release checked; with CP off the family's model equals stock bit for
    bit and the other family is patched; under CP its first forward raises on both ranks before compute, naming
    the target, the installed release and the newest checked."""
    for rank, res in enumerate(unverified_runs[how]):
        where = f"{how}, rank {rank}"
        assert len(res["warnings"]) == 1 and target in res["warnings"][0], (where, res["warnings"])
        assert str(NEWEST) in res["warnings"][0], where
        assert any(t.endswith(target) for t in res["unverified"]), (where, res["unverified"])
        assert res["p1_identical"] and res["other_patched"], where
        cp = res["cp"]
        assert cp["error"] == "PatchTargetError", (where, cp)
        assert target in cp["message"] and res["version"] in cp["message"] and str(NEWEST) in cp["message"], where
        assert cp["seconds"] < 10, (where, cp)


REFUSED_TRL = """
    import os, warnings
    import vlmcp_patch
    from vlmcp_patch.integrations import trl as ours
    ours.FUSED_LM_HEAD.clear()
    ours.FUSED_LM_HEAD["0" * 16] = "trl>=99"  # as if the installed TRL's pinned source had changed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import trl
        from trl import SFTConfig, SFTTrainer
    status = vlmcp_patch.status()
    refused = [s for s in status if s["refused"]]
    print("RESULT", len(refused) > 0 and all(s["requires"] == "trl" for s in refused),
          any("did not verify" in str(w.message) or "refused" in str(w.message) for w in caught),
          all(s["applied"] for s in status if s["requires"] is None and s["applies_here"]))
    from datasets import Dataset
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    data = Dataset.from_list([{"messages": chat}])
    from vlmcp_patch.fixtures.processor import tiny_processor
    try:
        SFTTrainer(model=build_model(tiny_qwen3_vl_config()), train_dataset=data, processing_class=tiny_processor(),
                   args=SFTConfig(output_dir=os.environ["OUT"], report_to=[], use_cpu=True, max_steps=1))
        print("RESULT built")
    except vlmcp_patch.UnsupportedSetupError as exc:
        print("RESULT refused", "add_fused_lm_head" in str(exc))
"""


@pytest.mark.integration
@pytest.mark.parametrize("cp_size,expected", [("2", "refused True"), ("1", "built")])
def test_an_optional_stack_whose_pinned_source_changed_refuses_that_patch_only(cp_size, expected, tmp_path):
    """A TRL release whose fused head differs from the pinned one: that patch alone is refused (warning), the
    rest of the package is installed, and CP under TRL raises when the trainer is built — before any step —
    while P=1 is unaffected."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from vlmcp_patch.integrations.trl import FUSED_LM_HEAD_SINCE

    if not applies_here(SimpleNamespace(since=FUSED_LM_HEAD_SINCE)):
        pytest.skip("this TRL has no fused head (before 1.15): no pinned source of it to change")
    lines = [line for line in _run(REFUSED_TRL, VLMCP_CP_SIZE=cp_size, OUT=str(tmp_path)).splitlines()
             if line.startswith("RESULT ")]
    assert lines == ["RESULT True True True", f"RESULT {expected}"]


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
        print(type(model).__dict__["forward"].vlmcp_original.__qualname__)
    """
    assert _run(code) == "Qwen3VLForConditionalGeneration.forward"
    code_first = """
        import vlmcp_patch
        from transformers import Qwen3VLMoeForConditionalGeneration as C
        print(C.__dict__["forward"].vlmcp_original.__qualname__)
    """
    assert _run(code_first) == "Qwen3VLMoeForConditionalGeneration.forward"


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


def test_reverted_package_reports_p1(reapply):
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


@pytest.mark.integration
def test_python_m_vlmcp_patch_reports_and_self_tests():
    out = subprocess.run([sys.executable, "-m", "vlmcp_patch"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for section in ("== versions", "== optional kernels", "== CP layout of this launch", "== patches", "== self-test"):
        assert section in out.stdout
    assert out.stdout.count("PASS") == 2 and "FAIL" not in out.stdout
    assert "on deepspeed>=0.16.9,<0.17.2" in out.stdout


def _reloaded_cp_forward(rank, world_size):
    import importlib

    import vlmcp_patch as package
    from vlmcp_patch.fixtures.data import Segment as S
    from vlmcp_patch.fixtures.data import make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    declared = len(package.status())
    package = importlib.reload(package)
    model, batch = build_model(tiny_qwen3_vl_config()), make_batch([[S(text=5), S(image=(16, 16)), S(text=6)]], seed=1)
    p1 = float(model(**batch).loss)
    package.enable(cp_size=world_size)
    try:
        return declared, len(package.status()), float(model(**batch).loss), p1
    finally:
        package.enable(cp_size=1)


@pytest.mark.integration
def test_a_reloaded_package_still_runs_cp():
    from tests.helpers.harness import run_distributed

    for declared, after_reload, cp_loss, p1_loss in run_distributed(_reloaded_cp_forward, 2, timeout=120):
        assert declared == after_reload  # one record per target, not two
        assert abs(cp_loss - p1_loss) <= 1e-5 * abs(p1_loss)


def test_the_cost_model_loads_on_use_not_with_the_package():
    """A training rank's `import vlmcp_patch` does not load the planner; `vlmcp_patch.plan` (and `Row`, `Training`)
    load it when asked."""
    code = """
    import sys
    import vlmcp_patch
    loaded_with_import = any(m.startswith("vlmcp_patch.planning") for m in sys.modules)
    from vlmcp_patch import Row, plan
    print(loaded_with_import, plan.__module__, Row.__module__)
    """
    assert _run(code) == "False vlmcp_patch.planning.table vlmcp_patch.planning.rows"
