"""Fixtures shared by the test modules.

Most tests read the results of a spawned or launched multi-process run (tests/helpers/): `once(runner, *args)`
runs each (runner, arguments) a single time per session and hands every test that asks for it the same result,
so a run that several tests check costs one launch.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def once():
    done = {}

    def run(runner, *args):
        key = (runner.__module__, runner.__qualname__, args)
        if key not in done:
            done[key] = runner(*args)
        return done[key]

    return run


@pytest.fixture
def reapply():
    """Tests that revert or reconfigure the package leave it applied, at P=1, as they found it."""
    import vlmcp_patch

    yield
    vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=1)
