"""tools/check_release.py reads a wheel's sources as the import reads the installed ones.

Offline: the "wheel" is a zip of the installed transformers' modeling files (what `pip download` would bring for
the installed release), and a copy with one patched target's source changed.
"""

from __future__ import annotations

import importlib
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
check_release = importlib.import_module("check_release")

TARGET = "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward"


def _wheel(path: Path, change: str | None = None) -> check_release.Release:
    import transformers

    root = Path(transformers.__file__).parent
    with zipfile.ZipFile(path, "w") as wheel:
        for file in [*root.glob("models/qwen3*/modeling_*.py"), root / "generation" / "utils.py"]:
            text = file.read_text()
            if change and file.name == "modeling_qwen3_5.py":
                text = text.replace("batch_size, seq_len, _ = hidden_states.shape", change, 1)
            wheel.writestr(f"transformers/{file.relative_to(root)}", text)
    return check_release.Release(path)


@pytest.fixture(scope="module")
def records():
    import transformers

    records = check_release.patch_records(transformers.__version__)
    return [p for p in records if p.target.startswith("transformers.models.")]


def test_reading_the_records_leaves_the_environment_as_it_was(monkeypatch):
    """The tool imports the package disabled; the processes tests start afterwards must not inherit that."""
    monkeypatch.delenv("VLMCP_DISABLE", raising=False)
    check_release.patch_records("5.25.0")
    import os

    assert "VLMCP_DISABLE" not in os.environ


def test_every_target_of_the_installed_release_verifies_from_its_source(records, tmp_path):
    installed = _wheel(tmp_path / "installed.whl")
    assert len(records) > 20
    assert {p.target: check_release.check(p, installed) for p in records} == {p.target: [] for p in records}


def test_a_changed_target_is_named_with_a_diff(records, tmp_path):
    installed = _wheel(tmp_path / "installed.whl")
    changed = _wheel(tmp_path / "changed.whl", change="batch_size, seq_len, _ = hidden_states.shape  # changed")
    problems = {p.target: check_release.check(p, changed) for p in records}
    assert [t for t, found in problems.items() if found] == [TARGET]
    assert "source changed" in problems[TARGET][0]
    diff = check_release.diff(TARGET, installed, changed, "installed", "changed")
    assert "+        batch_size, seq_len, _ = hidden_states.shape  # changed" in diff
