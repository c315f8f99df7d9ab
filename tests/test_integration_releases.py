"""The releases of Accelerate, DeepSpeed, PEFT and TRL the package trains with (integrations/releases.py,
docs/versions.md), and the records' checks that decide it.

The launched runs on the oldest releases are the integration tests themselves (test_trainer.py, test_deepspeed.py,
test_trl.py, test_trl_rl.py), run in an environment holding those releases (`.ci/run`, the oldest environment).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

import vlmcp_patch
from vlmcp_patch.errors import PatchTargetError
from vlmcp_patch.integrations.releases import OLDEST, TRL_TRAINERS, check_release, check_trl_trainer
from vlmcp_patch.patching import Patch, resolve, source_digest


@pytest.mark.parametrize("package", sorted(OLDEST))
def test_a_release_older_than_the_oldest_checked_is_refused_naming_it(package):
    oldest = OLDEST[package]
    major, minor, *_ = (int(x) for x in oldest.split("."))
    older = f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0"
    with pytest.raises(vlmcp_patch.UnsupportedSetupError, match=f"{package} {older} is not supported"):
        check_release(package, older)
    for version in (oldest, "9.0.0"):  # newer releases are decided by the patch records, not refused here
        check_release(package, version)


@pytest.mark.parametrize("trainer,version,trains", [
    ("SFTTrainer", "0.24.0", True), ("DPOTrainer", "0.24.0", False), ("GRPOTrainer", "0.28.0", False),
    ("SFTTrainer", "0.29.1", True), ("DPOTrainer", "1.14.2", True), ("KTOTrainer", "1.14.2", False),
    ("GRPOTrainer", "1.14.2", False), ("SFTTrainer", "1.15.0", False), ("RLOOTrainer", "1.16.0", True),
    ("GRPOTrainer", "1.17.0", True), ("SFTTrainer", "0.23.1", False),
])
def test_trl_trainers_refused_where_that_release_does_not_train_them_exactly(trainer, version, trains):
    if trains:
        check_trl_trainer(trainer, version)
        return
    with pytest.raises(vlmcp_patch.UnsupportedSetupError, match=f"{version}"):
        check_trl_trainer(trainer, version)


@pytest.mark.parametrize("version,loss_type,trains", [("1.14.2", "chunked_nll", False), ("1.14.2", "nll", True),
                                                      ("1.16.0", "chunked_nll", True), ("0.29.1", None, True)])
def test_trl_sfts_chunked_loss_before_the_fused_head_is_refused(version, loss_type, trains):
    """TRL 1.4 to 1.14's SFT `loss_type="chunked_nll"` runs the backbone past the model's forward (its first forward
    under CP would raise "called directly"): refused when the trainer is built, naming the release and the way out."""
    trainer = type("SFTTrainer", (), {"__module__": "trl.trainer.sft_trainer"})()
    trainer.args = types.SimpleNamespace(loss_type=loss_type)
    if trains:
        check_trl_trainer(trainer, version)
        return
    with pytest.raises(vlmcp_patch.UnsupportedSetupError, match=f"TRL {version}'s SFTTrainer.*loss_type='nll'"):
        check_trl_trainer(trainer, version)


def test_every_trl_release_range_lists_sft():
    assert all("SFTTrainer" in names for names in TRL_TRAINERS.values())


def test_a_target_whose_module_fails_to_import_does_not_verify(monkeypatch):
    """TRL < 0.29 on transformers 5: `trl.trainer.dpo_trainer` raises RuntimeError through TRL's lazy module (a
    missing mergekit). The target does not verify; the import of the package goes on."""

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise RuntimeError(f"Failed to import {self.__name__}.{name}: No module named 'mergekit'")

    monkeypatch.setitem(sys.modules, "vlmcp_lazy_stack", Lazy("vlmcp_lazy_stack"))
    with pytest.raises(PatchTargetError, match="cannot be imported.*mergekit"):
        resolve("vlmcp_lazy_stack.trainer.Trainer.compute_loss")
    with pytest.raises(PatchTargetError):
        Patch(target="vlmcp_lazy_stack.trainer.Trainer.compute_loss", wrapper=lambda *a: None, reason="",
              requires="vlmcp_lazy_stack").check()


def _decorated():
    def instrument(func):  # as DeepSpeed's instrument_w_nvtx: a wrapper of another name, without functools.wraps
        def wrapped_fn(*args, **kwargs):
            return func(*args, **kwargs)

        return wrapped_fn

    class Optimizer:
        @instrument
        def __scatter(self, params):
            return params

    return Optimizer


def test_a_pinned_digest_is_the_targets_source_not_its_decorators():
    """The digest of a method under a decorator that does not use functools.wraps is its own source's: before, it was
    the decorator's wrapper (the same for every method it wraps), so a changed DeepSpeed method still verified."""
    import inspect

    target = _decorated()._Optimizer__scatter
    ours = source_digest(target, "_Optimizer__scatter")
    wrapper = source_digest(target)
    import hashlib

    inner = target.__closure__[0].cell_contents
    assert ours == hashlib.sha256(inspect.getsource(inner).encode()).hexdigest()[:16]
    assert ours != wrapper


def test_the_pinned_deepspeed_digest_is_of_avg_scatter_grads_itself():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from vlmcp_patch.integrations.deepspeed import ZERO3_AVG_SCATTER_GRADS

    name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
    assert source_digest(getattr(DeepSpeedZeroOptimizer_Stage3, name), name) in ZERO3_AVG_SCATTER_GRADS


REFUSED_TRAINER = """
    import os
    import vlmcp_patch
    from vlmcp_patch.integrations import releases
    import trl
    from trl import SFTConfig, SFTTrainer
    if os.environ["DROP"] == "1":  # as if the installed TRL's SFTTrainer were not among those it trains exactly
        for spec in releases.TRL_TRAINERS:
            releases.TRL_TRAINERS[spec] = tuple(n for n in releases.TRL_TRAINERS[spec] if n != "SFTTrainer")
    from datasets import Dataset
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.fixtures.processor import tiny_processor
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    class MyTrainer(SFTTrainer):  # a script's subclass is TRL's trainer all the same
        pass
    try:
        MyTrainer(model=build_model(tiny_qwen3_vl_config()), train_dataset=Dataset.from_list([{"messages": chat}]),
                  processing_class=tiny_processor(),
                  args=SFTConfig(output_dir=os.environ["OUT"], report_to=[], use_cpu=True, max_steps=1))
        print("RESULT built")
    except vlmcp_patch.UnsupportedSetupError as exc:
        print("RESULT refused", f"not supported on trl {trl.__version__}" in str(exc))
"""


# Each case imports TRL in a fresh interpreter (about 10 s): the default run keeps the refusal, the controls run with
# `-m integration`
@pytest.mark.parametrize("drop,cp_size,expected", [
    ("1", "2", "refused True"), pytest.param("0", "2", "refused False", marks=pytest.mark.integration),
    pytest.param("1", "1", "built", marks=pytest.mark.integration)])
def test_a_trl_trainer_not_checked_on_the_installed_release_is_refused_when_built(drop, cp_size, expected, tmp_path):
    """Under CP the trainer's construction raises before any step, naming the TRL release. The control (the trainer
    listed) gets past that check, to the next one (one process: no CP group to run in, refused for that); at P=1
    nothing is refused."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import os

    env = {**os.environ, "VLMCP_CP_SIZE": cp_size, "DROP": drop, "OUT": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(REFUSED_TRAINER)], capture_output=True, text=True,
                         env=env, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("RESULT")] == [f"RESULT {expected}"]


def _archive(path, package: str, files: list[str], change: tuple[str, str, str] | None = None, sdist=False):
    """A wheel (or source archive) of the installed `package`'s `files`; `change`: (file, old, new) in one of them."""
    import importlib
    import io
    import tarfile
    import zipfile
    from pathlib import Path

    root = Path(importlib.import_module(package).__file__).parent
    texts = {}
    for name in files:
        text = (root / name).read_text()
        if change and change[0] == name:
            assert change[1] in text
            text = text.replace(change[1], change[2], 1)
        texts[f"{package}/{name}"] = text
    if sdist:
        with tarfile.open(path, "w:gz") as archive:
            for name, text in texts.items():
                data = text.encode()
                info = tarfile.TarInfo(f"{package}-0.0.0/{name}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    else:
        with zipfile.ZipFile(path, "w") as archive:
            for name, text in texts.items():
                archive.writestr(name, text)
    return path


def _tool():
    import importlib
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    return importlib.import_module("check_integration_release")


def test_the_release_checker_reads_the_installed_deepspeed_as_the_import_does(tmp_path):
    """tools/check_integration_release.py on a source archive of the installed DeepSpeed: every record verifies, with
    the digest the import computes; the ZeRO-3 method changed in the archive is reported, the other record not."""
    deepspeed = pytest.importorskip("deepspeed")
    tool = _tool()
    files = ["__init__.py", "runtime/engine.py", "runtime/zero/stage3.py", "runtime/zero/stage_1_and_2.py"]
    records = tool.patch_records("deepspeed", deepspeed.__version__)
    assert records
    same = tool.Sources(_archive(tmp_path / "deepspeed-0.0.0.tar.gz", "deepspeed", files, sdist=True))
    results = {p.target: tool.check(p, same) for p in records}
    assert all(problems == [] for problems, _ in results.values()), results
    target = next(p.target for p in records if p.mirrors)
    from vlmcp_patch.integrations.deepspeed import ZERO3_AVG_SCATTER_GRADS

    assert results[target][1] in ZERO3_AVG_SCATTER_GRADS
    changed = tool.Sources(_archive(tmp_path / "deepspeed-0.0.1.tar.gz", "deepspeed", files, sdist=True, change=(
        "runtime/zero/stage3.py", "grad_partitions_for_rank = reduce_scatter_coalesced(",
        "grad_partitions_for_rank = 2 * reduce_scatter_coalesced(")))
    problems = {p.target: tool.check(p, changed)[0] for p in records}
    assert [t for t, found in problems.items() if found] == [target]


def test_the_release_checker_follows_imports_as_the_import_resolves_them(tmp_path):
    """Accelerate's `accelerate.accelerator.prepare_data_loader` is defined in `accelerate.data_loader` and imported:
    read there, its parameters checked; a parameter renamed in the wheel is reported."""
    accelerate = pytest.importorskip("accelerate")
    tool = _tool()
    files = ["__init__.py", "accelerator.py", "data_loader.py"]
    records = tool.patch_records("accelerate", accelerate.__version__)
    target = "accelerate.accelerator.prepare_data_loader"
    record = next(p for p in records if p.target == target)
    wheel = tool.Sources(_archive(tmp_path / "a.whl", "accelerate", files))
    assert tool.Sources.definition(wheel, target)[2].startswith("accelerate/data_loader.py")
    assert tool.check(record, wheel)[0] == []
    renamed = tool.Sources(_archive(tmp_path / "b.whl", "accelerate", files, change=(
        "data_loader.py", "    torch_device_mesh=None,\n) -> DataLoader:", "    device_mesh_renamed=None,\n) -> DataLoader:")))
    assert "no longer takes ['torch_device_mesh']" in tool.check(record, renamed)[0][0]
