"""The README's main job runs under torchrun and prints the CP loss beside an equal P=1 loss."""

from __future__ import annotations

import re

import pytest

from tests.helpers.harness import ROOT, launch

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)


def test_demo_cp2_matches_p1():
    out = launch(ROOT / "vlmcp_patch" / "demo.py", ["--steps", "3"], procs=2, env={"VLMCP_CP_SIZE": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CP size 2" in out.stdout
    rows = re.findall(r"^\s*\d+\s+(\d+)\s+(\d+)\s+(\d+)/(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", out.stdout,
                      re.M)
    assert len(rows) == 3, out.stdout
    for seq, tokens, patches, all_patches, cp_loss, ref_loss, diff in rows:
        assert float(diff) <= 1e-5
        # CP really ran: rank 0 computed its half of the sequence (padded to a multiple of 2) and its share
        # of the vision patches, not all of them.
        assert int(tokens) == -(-int(seq) // 2), out.stdout
        assert 0 < int(patches) < int(all_patches), out.stdout
    assert "CP=2 matched P=1 within 1e-05 on all 3 steps" in out.stdout
