"""The README's main job runs under torchrun and prints the CP loss beside an equal P=1 loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.harness import free_port


def test_demo_cp2_matches_p1():
    env = {**os.environ, "VLMCP_CP_SIZE": "2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["-m", "vlmcp_patch.demo"]
    out = subprocess.run(cmd + ["--steps", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CP size 2" in out.stdout
    rows = re.findall(r"^\s*\d+\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", out.stdout, re.M)
    assert len(rows) == 3, out.stdout
    for cp_loss, ref_loss, diff in rows:
        assert float(diff) <= 1e-5
