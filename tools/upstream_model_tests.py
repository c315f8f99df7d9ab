"""Run transformers' own model tests for the patched families, stock and with vlmcp_patch, and diff the outcomes.

With context parallelism off (``VLMCP_CP_SIZE`` unset) ``import vlmcp_patch`` must leave the models behaving exactly
like stock transformers, so every upstream test must end the same way in both runs. This script runs pytest twice on
the same files, in two concurrent subprocesses: once stock and once with ``-p vlmcp_patch`` (pytest imports the
package as a plugin, which applies the patches); ``VLMCP_CP_SIZE`` and ``VLMCP_DISABLE`` are removed from both
environments. It prints per-file counts and every test whose outcome differs; the exit code is 1 if any does.

The upstream test tree is not shipped with transformers' wheel. Build it outside this repository, for the installed
release (never commit it):

* ``pip download transformers==X.Y.Z --no-binary :all: --no-deps`` and unpack the sdist's ``tests/`` (the common
  mixins such as ``tests/test_modeling_common.py``) and ``pyproject.toml`` (pytest settings) into ``ROOT``;
* add from the huggingface/transformers repository, at the commit closest to the release: ``conftest.py``,
  ``tests/__init__.py``, ``tests/models/{qwen3_vl,qwen3_vl_moe,qwen3_5,qwen3_5_moe}/`` (``__init__.py`` and
  ``test_modeling_*.py``), ``tests/generation/``, ``tests/exporters/``, ``tests/utils/test_configuration_utils.py``,
  ``tests/utils/tiny_model_summary.json``, ``tests/causal_lm_tester.py``, ``tests/multimodal_tester.py``,
  ``tests/vlm_tester.py``, ``tests/pipelines/`` (when ``tests/test_pipeline_mixin.py`` imports it),
  ``utils/test_module/`` and ``utils/fetch_hub_objects_for_ci.py``;
* link ``ROOT/src/transformers`` to the installed package (some test helpers read it from there);
* install the test-only packages they import: ``pip install parameterized httpx pytest-xdist`` (transformers'
  conftest registers xdist hooks).

Example: ``python tools/upstream_model_tests.py /work/upstream-tests/5.24.0 --families qwen3_5 -k generate``
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
MESSAGE_LINES = 6


def run_pytest(root, files, args, junit, patched, log):
    """Start one pytest run (stock or patched) in ``root``, its output to ``log``; returns the Popen."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLMCP_CP_SIZE", "VLMCP_DISABLE")}
    env.setdefault("OMP_NUM_THREADS", "1")  # the two runs share the machine
    cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    cmd += ["-p", "vlmcp_patch"] if patched else []
    cmd += ["-k", args.k] if args.k else []
    cmd += [f"--junitxml={junit}", *files]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def outcomes(junit):
    """{(file, test id): (outcome, message)} from a junit xml; empty if pytest wrote none."""
    if not junit.exists():
        return {}
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        path, test_id = module.replace(".", "/") + ".py", f"{cls}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = summarize(child)
                break
        result[(path, test_id)] = (outcome, message)
    return result


def summarize(node):
    """The message's first lines, then every traceback line that names vlmcp_patch."""
    text = node.get("message", "") + "\n" + (node.text or "")
    lines = [line for line in text.splitlines() if line.strip()]
    ours = [line.strip() for line in lines if "vlmcp_patch" in line]
    head = lines[:MESSAGE_LINES]
    errors = [line for line in lines if line.startswith("E ")][:MESSAGE_LINES]
    return "\n".join(dict.fromkeys(head + errors + ours[:MESSAGE_LINES]))


def wait(procs, timeout):
    """Wait for both runs; a run still going after ``timeout`` seconds (from now) is killed."""
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"{name} run exceeded {timeout:.0f} s and was killed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="upstream test tree root (holds conftest.py and tests/)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("-k", help="pytest -k expression, passed to both runs")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed to each run (default 3600)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with transformers and vlmcp_patch")
    args = parser.parse_args()

    root = args.root.resolve()
    files = [f"tests/models/{f}/test_modeling_{f}.py" for f in args.families]
    probe = [args.python, "-c", "import transformers; print(transformers.__version__)"]
    version = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    print(f"transformers {version}; tests from {root}")

    with tempfile.TemporaryDirectory() as tmp:
        junits = {name: Path(tmp, f"{name}.xml") for name in ("stock", "patched")}
        with (
            open(junits["stock"].with_suffix(".log"), "w") as log_a,
            open(junits["patched"].with_suffix(".log"), "w") as log_b,
        ):
            procs = {
                "stock": run_pytest(root, files, args, junits["stock"], False, log_a),
                "patched": run_pytest(root, files, args, junits["patched"], True, log_b),
            }
            wait(procs, args.timeout)
        results = {name: outcomes(junit) for name, junit in junits.items()}
        for name, junit in junits.items():
            if not results[name]:
                print(f"{name} run produced no results; its output ends with:")
                print("\n".join(junit.with_suffix(".log").read_text().splitlines()[-20:]))

    stock, patched = results["stock"], results["patched"]
    per_file, differing = defaultdict(lambda: [0, 0, 0]), []
    for key in sorted(stock.keys() | patched.keys()):
        a, b = stock.get(key, ("absent", "")), patched.get(key, ("absent", ""))
        counts = per_file[key[0]]
        counts[0] += 1
        counts[1 if a[0] == b[0] else 2] += 1
        if a[0] != b[0]:
            differing.append((key, a, b))
    for name, res in results.items():
        tally = defaultdict(int)
        for outcome, _ in res.values():
            tally[outcome] += 1
        print(f"{name}: " + ", ".join(f"{n} {o}" for o, n in sorted(tally.items())))
    print(f"{'file':<60} {'tests':>6} {'same':>6} {'differ':>6}")
    for path, (total, same, diff) in sorted(per_file.items()):
        print(f"{path:<60} {total:>6} {same:>6} {diff:>6}")
    for (path, test_id), a, b in differing:
        print(f"\nDIFFERS {path}::{test_id}\n  stock:   {a[0]}\n  patched: {b[0]}")
        for label, (outcome, message) in (("stock", a), ("patched", b)):
            if message and outcome != "skipped":
                print(f"  {label} message:\n" + "\n".join("    " + line for line in message.splitlines()))
    print(f"\n{len(differing)} test(s) differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
