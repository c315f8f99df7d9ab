"""A CLI's own data sharding and its own sequence parallelism under CP (issue 64).

Under CP the ranks of a CP group must get the same rows. A CLI that builds its own sampler (torch's
`DistributedSampler` left to its defaults; ms-swift's `BatchSamplerShard`) splits by the global rank and never passes
through Accelerate's loader: under CP they split by the data-parallel replica, as the Accelerate integration does
(integrations/samplers.py); what cannot be made to (a world split given explicitly, ms-swift's iterable-data
dispatcher, AutoTP) is refused when it is built. A CLI's own sequence parallelism beside the package's (ms-swift's
`--sequence_parallel_size`, axolotl's `context_parallel_size` / `sequence_parallel_degree`) is refused at setup,
naming both (integrations/cli_parallelism.py).

Every class here is the real one. torch's sampler runs everywhere; ms-swift's and axolotl's tests run where those
packages are installed (each pins a stack of its own: CI installs ms-swift 4.6.0 and axolotl 0.19.0 in its third
environment) and are skipped elsewhere, naming what to install.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.harness import run_distributed

ROWS = 16
SWIFT = "ms-swift 4 is not installed (it pins a stack of its own): pip install 'ms-swift==4.6.0'"
AXOLOTL = ("axolotl is not installed (it pins a stack of its own): pip install --no-deps 'axolotl==0.19.0', then what "
           "`import axolotl.loaders.model` asks for")


def _apply(cp: int):
    """The package applied at CP size `cp` (an optional package's modules are watched from here on; one already
    imported is patched now)."""
    import vlmcp_patch

    vlmcp_patch.revert()
    vlmcp_patch.enable(cp_size=cp)
    vlmcp_patch.apply()
    return vlmcp_patch


def _outcome(build) -> str | None:
    """None where `build()` ran; the package's refusal; or `stock <error>` where the wrapped call itself raised (a
    patch that let the call through to code that cannot run here)."""
    from vlmcp_patch import UnsupportedSetupError

    try:
        build()
    except UnsupportedSetupError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the stock call's own error: it was reached
        return f"stock {type(exc).__name__}"
    return None


def _flat(rows) -> list[int]:
    return sorted(i for x in rows for i in (x if isinstance(x, list) else [x]))


def _same_rows_per_group(out: list[dict], keys) -> None:
    """4 ranks at P = 2: ranks 0-1 and 2-3 are CP groups, 2 data-parallel replicas that split the rows."""
    for key in keys:
        got = [r[key] for r in out]
        assert got[0] == got[1] and got[2] == got[3], f"{key}: the ranks of a CP group got different rows: {got}"
        assert _flat(got[0]) != _flat(got[2]) and sorted(_flat(got[0]) + _flat(got[2])) == list(range(ROWS)), (
            f"{key}: the two replicas must split the rows between them: {got}")


def torch_sampler_rows(rank, world):
    from torch.utils import data

    vlmcp_patch = _apply(2)
    rows = list(range(ROWS))
    out = {
        "default": list(data.DistributedSampler(rows, seed=3)),
        "replicas given": list(data.DistributedSampler(rows, num_replicas=world // 2, seed=3)),
        "replicas and rank given": list(data.DistributedSampler(rows, num_replicas=world // 2, rank=rank // 2,
                                                                seed=3)),
        # a split given explicitly, neither the world's nor the replicas': kept as given
        "explicit": list(data.DistributedSampler(rows, num_replicas=3, rank=rank % 3, shuffle=False)),
        "world given": _outcome(lambda: data.DistributedSampler(rows, num_replicas=world, rank=rank)),
        "rank alone": _outcome(lambda: data.DistributedSampler(rows, rank=rank)),
    }
    with vlmcp_patch.disabled():  # outside CP forwards: stock
        out["disabled"] = list(data.DistributedSampler(rows, seed=3))
    vlmcp_patch.enable(cp_size=1)  # CP off: stock
    out["off"] = list(data.DistributedSampler(rows, seed=3))
    out["stock"] = list(data.DistributedSampler(rows, num_replicas=world, rank=rank, seed=3))
    out["explicit stock"] = list(data.DistributedSampler(rows, num_replicas=3, rank=rank % 3, shuffle=False))
    return out


def test_torchs_distributed_sampler_gives_the_ranks_of_a_cp_group_the_same_rows():
    out = run_distributed(torch_sampler_rows, 4, timeout=300)
    _same_rows_per_group(out, ("default", "replicas given", "replicas and rank given"))
    assert [r["explicit"] for r in out] == [r["explicit stock"] for r in out]
    assert all(r["default"] == r["replicas given"] == r["replicas and rank given"] for r in out)
    for r in out:
        assert r["world given"] and "DistributedSampler(num_replicas=4, rank=" in r["world given"]
        assert "data_parallel_world_size() (2)" in r["world given"] and "vlmcp_patch.disabled()" in r["world given"]
        assert r["rank alone"] and "DistributedSampler(num_replicas=None" in r["rank alone"]
        assert r["disabled"] == r["off"] == r["stock"]  # CP off, or outside CP forwards: the world's split
    assert out[0]["off"] != out[1]["off"]


def swift_sampler_rows(rank, world):
    from torch.utils import data

    vlmcp_patch = _apply(2)
    from swift.dataloader import BatchSamplerShard, DataLoaderDispatcher

    out = {
        "swift": [list(b) for b in BatchSamplerShard(ROWS, batch_size=2, shuffle=True, drop_last=False,
                                                     data_seed=42)],
        "swift in order": [list(b) for b in BatchSamplerShard(ROWS, batch_size=3, shuffle=False, drop_last=False,
                                                              data_seed=None)],
        "autotp": _outcome(lambda: BatchSamplerShard(ROWS, 2, True, False, 42, tp_size=2)),
        "dispatcher": _outcome(lambda: DataLoaderDispatcher(data.DataLoader(list(range(ROWS))))),
    }
    with vlmcp_patch.disabled():
        out["disabled"] = [list(b) for b in BatchSamplerShard(ROWS, 2, True, False, 42)]
    vlmcp_patch.enable(cp_size=1)  # CP off: stock
    out["off"] = [list(b) for b in BatchSamplerShard(ROWS, 2, True, False, 42)]
    out["dispatcher off"] = _outcome(lambda: DataLoaderDispatcher(data.DataLoader(list(range(ROWS)))))
    return out


def test_ms_swifts_batch_sampler_gives_the_ranks_of_a_cp_group_the_same_rows():
    """ms-swift 4's `BatchSamplerShard` and `DataLoaderDispatcher` (`swift.dataloader`), 4 ranks at P = 2."""
    pytest.importorskip("swift.dataloader.shard", reason=SWIFT)
    out = run_distributed(swift_sampler_rows, 4, timeout=300)
    _same_rows_per_group(out, ("swift", "swift in order"))
    for r in out:
        assert r["autotp"] and "BatchSamplerShard" in r["autotp"] and "tp_size=2" in r["autotp"], r["autotp"]
        assert r["dispatcher"] and "DataLoaderDispatcher" in r["dispatcher"] and "--streaming" in r["dispatcher"]
        assert r["dispatcher off"] is None and r["disabled"] == r["off"]
    assert out[0]["off"] != out[1]["off"]  # ms-swift's own split, by the global rank


def swift_sequence_parallel(rank, world, cp):
    _apply(cp)
    from swift.sequence_parallel import sequence_parallel

    # no model is passed: a call let through reaches ms-swift's own `prepare`, which fails on it (`stock ...`)
    return {
        "sp 2": _outcome(lambda: sequence_parallel.prepare(2, None, None, padding_free=True)),
        "sp 2 by keyword": _outcome(lambda: sequence_parallel.prepare(sp_size=2, model=None, tokenizer=None,
                                                                      padding_free=True)),
        "sp 1": _outcome(lambda: sequence_parallel.prepare(1, None, None, padding_free=True)),
    }


def test_ms_swifts_own_sequence_parallelism_beside_the_packages_is_refused_at_setup_naming_both():
    pytest.importorskip("swift.sequence_parallel.sequence_parallel", reason=SWIFT)
    (out,) = run_distributed(swift_sequence_parallel, 1, 2, timeout=300)
    for key in ("sp 2", "sp 2 by keyword"):
        assert out[key] and "ms-swift's sequence parallelism (--sequence_parallel_size 2)" in out[key], out
        assert "VLMCP_CP_SIZE=2" in out[key] and "unset VLMCP_CP_SIZE" in out[key], out[key]
    assert out["sp 1"] == "stock AttributeError", out  # the CLI's own left off: ms-swift's call runs
    (off,) = run_distributed(swift_sequence_parallel, 1, 1, timeout=300)
    assert all(v == "stock AttributeError" for v in off.values()), off  # CP off: the CLI's own runs


def axolotl_model_loader(rank, world, cp, folder):
    _apply(cp)
    from axolotl.loaders.model import ModelLoader
    from axolotl.utils.dict import DictDefault

    def build(**cfg):
        return lambda: ModelLoader(DictDefault(base_model=folder, **cfg), None)

    return {
        "cp 2": _outcome(build(context_parallel_size=2)),
        "old spelling": _outcome(lambda: ModelLoader(cfg=DictDefault(base_model=folder, sequence_parallel_degree=4),
                                                     tokenizer=None)),
        "cp 1": _outcome(build(context_parallel_size=1)),
        "none": _outcome(build()),
    }


def test_axolotls_own_context_parallelism_beside_the_packages_is_refused_at_setup_naming_both(tmp_path):
    """axolotl's `ModelLoader` over a tiny Qwen3-VL config on disk: built (stock) where the package lets it through."""
    pytest.importorskip("axolotl.loaders.model", reason=AXOLOTL)
    from vlmcp_patch.fixtures.models import tiny_qwen3_vl_config

    tiny_qwen3_vl_config().save_pretrained(tmp_path)
    (out,) = run_distributed(axolotl_model_loader, 1, 2, str(tmp_path), timeout=300)
    assert out["cp 2"] and "axolotl's context parallelism (context_parallel_size: 2)" in out["cp 2"], out
    assert out["old spelling"] and "(sequence_parallel_degree: 4)" in out["old spelling"], out
    for key in ("cp 2", "old spelling"):
        assert "VLMCP_CP_SIZE=2" in out[key] and "unset VLMCP_CP_SIZE" in out[key], out[key]
    assert out["cp 1"] is None and out["none"] is None, out  # the CLI's own left off: axolotl's loader is built
    (off,) = run_distributed(axolotl_model_loader, 1, 1, str(tmp_path), timeout=300)
    assert all(v is None for v in off.values()), off  # CP off: the CLI's own runs


def test_from_the_environment_a_cli_module_that_imports_transformers_first_gets_its_refusal():
    """`AUTOWRAPT_BOOTSTRAP=vlmcp_patch`: ms-swift's `sequence_parallel` module imports transformers in its first lines,
    so the package arrives while it is still importing; the startup hooks install its patch when that import ends."""
    import importlib.metadata
    import importlib.util
    import os
    import subprocess

    if importlib.util.find_spec("autowrapt") is None or not any(
            e.name == "transformers" for e in importlib.metadata.entry_points(group="vlmcp_patch")):
        pytest.skip("needs autowrapt and the package's entry point installed: pip install -e '.[autowrapt]'")
    pytest.importorskip("swift.sequence_parallel.sequence_parallel", reason=SWIFT)
    code = ("from swift.sequence_parallel import sequence_parallel\n"
            "try:\n    sequence_parallel.prepare(2, None, None, padding_free=True)\n"
            "except Exception as exc:\n    print(type(exc).__name__)\nelse:\n    print('ran')\n")
    env = {**os.environ, "AUTOWRAPT_BOOTSTRAP": "vlmcp_patch"}

    def run(cp: str) -> str:
        return subprocess.run([sys.executable, "-W", "ignore", "-c", code], env={**env, "VLMCP_CP_SIZE": cp},
                              capture_output=True, text=True, timeout=300, check=True).stdout.split()[-1]

    assert run("2") == "UnsupportedSetupError"
    assert run("1") == "AttributeError"  # ms-swift's own prepare, reached (it has no model to prepare here)


def test_the_readme_says_which_pin_the_autowrapt_extra_moves():
    """No autowrapt release takes wrapt 1.x (1.0 finds entry points only through `pkg_resources`, gone from setuptools
    81), so the extra needs wrapt 2: the README says which pin that moves beside a CLI's stack, with the CLI tried."""
    import tomllib

    root = Path(__file__).parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["autowrapt"]
    assert extra == ["autowrapt>=2.0,<3"]
    readme = (root / "README.md").read_text()
    using = readme[readme.index("## Using it"):]
    using = " ".join(using[: using.index("\n## ")].split())  # as read, whatever the line breaks
    assert "axolotl 0.19.0" in using
    assert "wrapt 1.x → 2.x" in using and "aiobotocore" in using and "wrapt<2.0.0" in using
