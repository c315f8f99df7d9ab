"""What the no-code entry (`AUTOWRAPT_BOOTSTRAP=vlmcp_patch`) costs a Python process that never imports transformers:
the wall time of `python -c pass`, median and minimum over N runs, with the variable unset and set, and what the set
variable makes the interpreter import.

    python tools/startup_cost.py [--runs 20] [--without /path/to/a/python/without/autowrapt]

`--without` adds the same measurement for an interpreter whose environment lacks autowrapt (the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def wall_times(python: str, env: dict, runs: int) -> list[float]:
    """Milliseconds of each `python -c pass` run."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([python, "-c", "pass"], env=env, check=True)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def imported(python: str, env: dict) -> list[str]:
    """The modules of the package, its hook, wrapt, torch and transformers present after startup."""
    code = "import sys, json; print(json.dumps(sorted(sys.modules)))"
    names = json.loads(subprocess.run([python, "-c", code], env=env, check=True, capture_output=True,
                                      text=True).stdout)
    return [n for n in names if n.split(".")[0] in ("vlmcp_patch", "vlmcp_patch_autowrapt", "wrapt", "autowrapt",
                                                     "torch", "transformers")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--without", help="an interpreter whose environment has no autowrapt (the baseline)")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "AUTOWRAPT_BOOTSTRAP"}
    cases = [("autowrapt not installed", args.without, base)] if args.without else []
    cases += [("AUTOWRAPT_BOOTSTRAP unset", sys.executable, base),
              ("AUTOWRAPT_BOOTSTRAP=vlmcp_patch", sys.executable, {**base, "AUTOWRAPT_BOOTSTRAP": "vlmcp_patch"})]
    for label, python, env in cases:
        times = wall_times(python, env, args.runs)
        top = sorted({n.split(".")[0] for n in imported(python, env)})
        print(f"{label:34s} median {statistics.median(times):6.1f} ms  min {min(times):6.1f} ms  imports {top}")


if __name__ == "__main__":
    main()
