"""CP with no line changed: `AUTOWRAPT_BOOTSTRAP=vlmcp_patch` applies the package when a program first imports
transformers (autowrapt's startup file, the package's `vlmcp_patch` entry point, `vlmcp_patch_autowrapt.py`).

A process that never imports transformers imports nothing of the package, torch or transformers; one that does
holds the patches (also where TRL imports transformers inside its own import), and without the variable it does not
(the control). Launched, each at `VLMCP_CP_SIZE=2` on 2 processes and equal to the same command as one process, with
the variable-less two-process launch as the control (DDP shards the data, the weights differ): TRL's `trl sft` CLI on
a tiny local checkpoint and data set; a stock HF Trainer script that imports nothing of the package
(`tests/helpers/stock_trainer_script.py`) under `accelerate launch` with a config file, torchrun and the `deepspeed`
launcher (DDP over the launcher's ranks, and ZeRO-3).

These need the package installed with its entry point and autowrapt (`pip install -e ".[test]"`): the startup file
lives in site-packages. They are skipped, saying so, where that is not the case; `python -m vlmcp_patch` says it
too (a warning where the variable is set and cannot act).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import ROOT, _dump_stacks_then_kill, free_port, launch
from vlmcp_patch.fixtures.compare import state_dict_error


def _bootstrap_installed() -> bool:
    """autowrapt is installed and this checkout's entry point `transformers` is in the `vlmcp_patch` group."""
    entries = importlib.metadata.entry_points(group="vlmcp_patch")
    return importlib.util.find_spec("autowrapt") is not None and any(
        e.name == "transformers" and e.value.startswith("vlmcp_patch_autowrapt:") for e in entries)


NEEDS_BOOTSTRAP = pytest.mark.skipif(not _bootstrap_installed(), reason="needs autowrapt and the package's entry "
                                     "point installed: pip install -e '.[test]'")

ON, OFF = {"AUTOWRAPT_BOOTSTRAP": "vlmcp_patch"}, {"AUTOWRAPT_BOOTSTRAP": ""}  # autowrapt ignores an empty value


def _python(code: str, env: dict) -> str:
    """The stdout of `python -c code` in a fresh interpreter (its startup files processed), with `env` added."""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@NEEDS_BOOTSTRAP
def test_a_process_that_never_imports_transformers_imports_nothing_of_the_package():
    code = "import sys, json; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(_python(code, ON)))
    assert "vlmcp_patch_autowrapt" in loaded  # the control: the bootstrap did run (wrapt loads the entry point)
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("vlmcp_patch", "torch", "transformers"))
    assert heavy == [], heavy
    assert "vlmcp_patch_autowrapt" not in set(json.loads(_python(code, OFF)))  # unset: not even the hook module


@NEEDS_BOOTSTRAP
@pytest.mark.parametrize("first_import,installed", [
    ("import transformers", ""),
    pytest.param("import trl; trl.SFTConfig", "", marks=pytest.mark.integration),  # a TRL import: 17 s
    pytest.param("from trl import SFTTrainer", "trl.trainer.sft_trainer.add_fused_lm_head",
                 marks=pytest.mark.integration),
    pytest.param("from trl import GRPOConfig", "trl.trainer.grpo_config.GRPOConfig.__post_init__",
                 marks=pytest.mark.integration),
])
def test_importing_transformers_applies_the_patches_only_with_the_variable(first_import, installed):
    """Also where transformers is first imported by a module that holds a patch target, whose top-level code is
    still running when the package arrives (TRL's `sft_trainer` and `grpo_config` import transformers first): that
    module's patches are installed when its import ends, none refused (no circular import, no half-run module)."""
    code = (f"{first_import}; import sys; m = sys.modules.get('vlmcp_patch'); "
            "print(m is not None and m.PATCHES.active, m is not None and m.cp_size(), "
            "m is not None and ','.join(sorted(t for t in m.PATCHES._undo if t.startswith('trl.'))), "
            "m is not None and sorted(m.PATCHES.refused))")
    assert _python(code, {**ON, "VLMCP_CP_SIZE": "2"}) == f"True 2 {installed} []"
    assert _python(code, {**OFF, "VLMCP_CP_SIZE": "2"}) == "False False False False"  # the control: inert when unset


def _optional_patches() -> list:
    import vlmcp_patch

    return [p for p in vlmcp_patch.PATCHES.patches if getattr(p, "requires", None)]


def test_the_startup_hooks_watch_every_module_that_holds_an_optional_target():
    """The hook module's list (`OPTIONAL_TARGET_MODULES`) is the package's optional targets' modules, and each
    target lives in the module `target_module` names (a module's function or a module's class's attribute), for every
    optional package installed here."""
    import importlib

    import vlmcp_patch_autowrapt
    from vlmcp_patch.patching import applies_here, target_module

    optional = _optional_patches()
    assert set(vlmcp_patch_autowrapt.OPTIONAL_TARGET_MODULES) == {target_module(p.target) for p in optional}
    checked = 0
    for patch in optional:
        if importlib.util.find_spec(patch.requires.split(".")[0]) is None or not applies_here(patch):
            continue
        obj = importlib.import_module(target_module(patch.target))
        for part in patch.target[len(target_module(patch.target)) + 1:].split("."):
            obj = getattr(obj, part)
            assert not isinstance(obj, type(importlib)), f"{patch.target}: {part} is a module, not an attribute"
        checked += 1
    assert checked >= 20, checked


THREADED_PACKAGE = {
    "__init__.py": "",
    # each module's body runs long enough for the other thread to arrive while it is still importing
    "first.py": "import time\nfrom threaded_targets import shared\ntime.sleep(0.5)\n\n\ndef f():\n    return 1\n",
    "second.py": "import time\nfrom threaded_targets import shared\ntime.sleep(0.5)\n\n\nclass K:\n"
                 "    def g(self):\n        return 1\n",
    "shared.py": "import time\ntime.sleep(0.5)\n\n\ndef h():\n    return 1\n",
}

THREADS = """
    import sys, threading, time, warnings
    sys.path.insert(0, {folder!r})
    warnings.simplefilter("error")  # a refused patch's warning fails the run
    from vlmcp_patch.patching import Patch, PatchSet

    def plus_one(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) + 1

    patches = PatchSet([Patch(target=t, wrapper=plus_one, reason="t", requires="threaded_targets") for t in
                        ("threaded_targets.first.f", "threaded_targets.second.K.g", "threaded_targets.shared.h")])
    errors = []

    def run(name):
        try:
            __import__(name)
        except BaseException as error:
            errors.append(repr(error))

    threads = [threading.Thread(target=run, args=(f"threaded_targets.{{m}}",)) for m in ("first", "second")]
    if {before!r}:
        patches.apply()  # hooked first: both imports end in their own thread's hook
    for t in threads:
        t.start()
    if not {before!r}:
        time.sleep(0.2)
        patches.apply()  # while the other threads are inside their imports: wait for them, then install
    for t in threads:
        t.join()
    from threaded_targets import first, second, shared
    print(errors, sorted(patches._undo), patches.refused, sorted(patches._pending), first.f(), second.K().g(),
          shared.h())
"""


@pytest.mark.parametrize("before", [pytest.param(True, marks=pytest.mark.integration, id="applied-before"),
                                    pytest.param(False, id="applied-during")])
def test_two_threads_importing_patch_targets_at_once_install_every_patch(before, tmp_path):
    """Two threads import two modules holding patch targets at once (both import a third that holds one too), with
    the patches applied before (each import's hook runs in its own thread) or while both imports are running in the
    other threads (applying waits for each, then installs: a module whose body has not finished is never patched
    half-made). Every patch is installed and works, none refused or left pending, no import fails. (TRL's own
    trainers cannot be imported from two threads at once, even without the package: its lazy modules and
    Accelerate's state then import in a circle.)"""
    folder = tmp_path / "threaded_targets"
    folder.mkdir()
    for name, text in THREADED_PACKAGE.items():
        (folder / name).write_text(text)
    out = _python(textwrap.dedent(THREADS.format(folder=str(tmp_path), before=before)), OFF)
    targets = ["threaded_targets.first.f", "threaded_targets.second.K.g", "threaded_targets.shared.h"]
    assert out == f"[] {targets} {{}} [] 2 2 2", out


FAILING = """
    import sys, warnings
    sys.path.insert(0, {folder!r})
    from vlmcp_patch.patching import Patch, PatchSet

    def passthrough(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) + 1

    patches = PatchSet([
        Patch(target="frozen_target.Frozen.method", wrapper=passthrough, reason="t", requires="frozen_target"),
        Patch(target="frozen_target.Open.method", wrapper=passthrough, reason="t", requires="frozen_target"),
    ])
    patches.apply()
    assert "frozen_target" not in sys.modules  # deferred: applying imports nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import frozen_target  # the import that runs the hook: it must succeed
    import json
    print(json.dumps({{"refused": patches.refused, "open": frozen_target.Open().method(),
                      "frozen": frozen_target.Frozen().method(), "warnings": [str(w.message) for w in caught]}}))
"""

FROZEN_MODULE = """
class _NoSetting(type):
    def __setattr__(cls, name, value):
        raise TypeError(f"{cls.__name__} takes no new attributes")


class Frozen(metaclass=_NoSetting):
    def method(self):
        return 1


class Open:
    def method(self):
        return 1
"""


def test_a_patch_that_fails_to_install_is_refused_by_name_and_the_import_that_ran_it_succeeds(tmp_path):
    """A patch whose installation raises something other than a target check (a class that refuses new attributes):
    the import of its module, which runs the post-import hook, succeeds; the patch is refused with a warning naming it
    and the error; the other patch of that module is installed and works (the control: the same wrapper, installed)."""
    (tmp_path / "frozen_target.py").write_text(FROZEN_MODULE)
    out = json.loads(_python(textwrap.dedent(FAILING.format(folder=str(tmp_path))), OFF))
    why = "patch frozen_target.Frozen.method failed to install: TypeError: Frozen takes no new attributes"
    assert out["refused"] == {"frozen_target.Frozen.method": ["frozen_target", why]}, out
    assert out["open"] == 2 and out["frozen"] == 1, out  # the control installed; the failing one left stock
    assert out["warnings"] == [f"vlmcp-patch: {why}. Context parallelism under frozen_target is refused."], out


def test_the_report_says_whether_the_variable_can_act(monkeypatch):
    from vlmcp_patch.report import entry_lines

    monkeypatch.setenv("AUTOWRAPT_BOOTSTRAP", "other_group, vlmcp_patch")
    lines = entry_lines()
    assert lines[0].startswith("  AUTOWRAPT_BOOTSTRAP=vlmcp_patch: set;")
    warned = any("runs WITHOUT CP here" in line for line in lines)
    assert warned != _bootstrap_installed(), lines
    monkeypatch.delenv("AUTOWRAPT_BOOTSTRAP")
    assert entry_lines()[0].startswith("  AUTOWRAPT_BOOTSTRAP=vlmcp_patch: not set;") and len(entry_lines()) == 2


@pytest.fixture(scope="module")
def checkpoint_and_data(tmp_path_factory):
    """A tiny Qwen3-VL checkpoint folder and a file of tokenized samples with pictures, for the stock script."""
    from vlmcp_patch.fixtures.data import IGNORE_INDEX, PAD_TOKEN_ID, synthetic_dataset
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    folder = tmp_path_factory.mktemp("stock-run")
    build_model(tiny_qwen3_vl_config(attn_implementation="sdpa"), seed=0).save_pretrained(folder / "model")
    samples = []
    for sample in synthetic_dataset(32):
        row = sample.as_dict()
        row["labels"] = row["input_ids"].masked_fill(row["mm_token_type_ids"] != 0, IGNORE_INDEX)
        samples.append(row)
    torch.save({"samples": samples, "pad_token_id": PAD_TOKEN_ID}, folder / "samples.pt")
    return folder


SCRIPT = ROOT / "tests" / "helpers" / "stock_trainer_script.py"


def _train(folder: Path, name: str, procs: int, launcher: str, env: dict, extra=()) -> tuple[dict, dict]:
    """(trained weights, run facts) of the stock script launched as given."""
    out = folder / name
    run = launch(SCRIPT, [folder / "model", folder / "samples.pt", out, *extra], procs=procs, launcher=launcher,
                 env=env, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(out / "weights.pt"), json.loads((out / "run.json").read_text())


@pytest.fixture(scope="module")
def one_process(checkpoint_and_data):
    """The reference: the same stock script, one process, no variable (stock transformers)."""
    weights, facts = _train(checkpoint_and_data, "one-process", 1, "python", {**OFF, "VLMCP_CP_SIZE": "1"})
    assert not facts["vlmcp_patch"] and facts["world"] == 1
    return weights


@NEEDS_BOOTSTRAP
@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["accelerate_config", "torchrun", "deepspeed"])
def test_an_unmodified_trainer_script_launched_at_cp2_trains_as_one_process(launcher, checkpoint_and_data,
                                                                             one_process):
    weights, facts = _train(checkpoint_and_data, f"cp2-{launcher}", 2, launcher, {**ON, "VLMCP_CP_SIZE": "2"})
    assert facts["vlmcp_patch"] and facts["world"] == 2  # the script never imported it: the bootstrap did
    assert state_dict_error(weights, one_process) <= 1e-4


@NEEDS_BOOTSTRAP
@pytest.mark.integration
def test_an_unmodified_zero3_trainer_script_under_the_deepspeed_launcher_at_cp2_trains_as_one_process(
        checkpoint_and_data, one_process):
    config = ROOT / "examples" / "ds_trainer_zero3.json"
    weights, facts = _train(checkpoint_and_data, "cp2-zero3", 2, "deepspeed", {**ON, "VLMCP_CP_SIZE": "2"},
                            extra=[config])
    assert facts["vlmcp_patch"] and facts["wrapper"] == "DeepSpeed ZeRO-3", facts
    assert state_dict_error(weights, one_process) <= 1e-4


@NEEDS_BOOTSTRAP
@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["accelerate_config", "deepspeed"])
def test_without_the_variable_the_same_launch_shards_the_data(launcher, checkpoint_and_data, one_process):
    """The control: VLMCP_CP_SIZE=2 alone does nothing to a script that does not import the package — DDP (ZeRO-3
    under the deepspeed launcher) gives each process different samples, and the weights differ from one process's."""
    extra = [ROOT / "examples" / "ds_trainer_zero3.json"] if launcher == "deepspeed" else []
    weights, facts = _train(checkpoint_and_data, f"stock-{launcher}", 2, launcher, {**OFF, "VLMCP_CP_SIZE": "2"},
                            extra=extra)
    assert not facts["vlmcp_patch"] and facts["world"] == 2
    assert facts["wrapper"] == ("DeepSpeed ZeRO-3" if launcher == "deepspeed" else "DistributedDataParallel"), facts
    assert state_dict_error(weights, one_process) > 1e-2


TRL = Path(sys.executable).with_name("trl")  # the CLI's console script, beside this interpreter
TRL_ARGS = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "3",
            "--learning_rate", "0.05", "--optim", "sgd", "--lr_scheduler_type", "constant", "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--bf16", "false", "--dataloader_drop_last",
            "--seed", "0", "--trust_remote_code", "--attn_implementation", "sdpa", "--dtype", "float32"]


@pytest.fixture(scope="module")
def trl_inputs(tmp_path_factory):
    from tests.helpers.trl_cli_checkpoint import write_checkpoint, write_dataset

    folder = tmp_path_factory.mktemp("trl-cli")
    return write_checkpoint(folder / "model"), write_dataset(folder / "data")


def _trl_sft(inputs, out: Path, procs: int, env: dict) -> dict:
    """`trl sft` on the tiny checkpoint and data, through its Accelerate launcher (the DDP config file), on `procs`
    processes: the weights it saved."""
    from safetensors.torch import load_file

    model, data = inputs
    cmd = [str(TRL), "sft", "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
           *TRL_ARGS, "--config_file", str(ROOT / "tests" / "helpers" / "accelerate_ddp.yaml"), "--num_processes",
           str(procs), "--main_process_port", str(free_port())]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          cwd=out.parent, start_new_session=True) as proc:
        try:
            _, stderr = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            _dump_stacks_then_kill(lambda sig: os.killpg(proc.pid, sig))
            raise
    assert proc.returncode == 0, stderr[-4000:]
    return load_file(out / "model.safetensors")


@NEEDS_BOOTSTRAP
@pytest.mark.integration
@pytest.mark.skipif(not TRL.exists(), reason="TRL's `trl` command is not installed beside this interpreter")
def test_trl_sft_cli_at_cp2_trains_as_one_process(trl_inputs, tmp_path):
    """TRL's own CLI, unmodified, at CP = 2 through its Accelerate launcher, equal to the same command on one process
    (fp32: `--bf16 false`, TRL's default is bf16). The control: without the variable the two processes shard the data.
    TRL imports transformers inside its own `trl.trainer.sft_config` import: the package then comes in as that import
    ends (`vlmcp_patch_autowrapt.on_transformers_import`)."""
    one = _trl_sft(trl_inputs, tmp_path / "one", 1, {**OFF, "VLMCP_CP_SIZE": "1"})
    cp2 = _trl_sft(trl_inputs, tmp_path / "cp2", 2, {**ON, "VLMCP_CP_SIZE": "2"})
    assert state_dict_error(cp2, one) <= 1e-4
    stock = _trl_sft(trl_inputs, tmp_path / "stock2", 2, {**OFF, "VLMCP_CP_SIZE": "2"})
    assert state_dict_error(stock, one) > 1e-3
