"""A family whose patch targets did not verify: stock with CP off, refused under CP.

On a transformers release newer than those the package was checked on, a target may have changed (another source
digest, a parameter gone). `PatchSet` then leaves that family stock and installs only `unverified_guard` on its
top-level forwards: with CP off (or inside `vlmcp_patch.disabled()`) the call goes to stock untouched; under CP
the first forward raises on every rank of the group before any compute (the agreement collective), naming the
targets, the installed release and the newest release checked. `refusals.check_setup` gives the same refusal to the
entry points that enter the CP forward themselves (TRL's fused head, `token_log_probs`).
"""

from __future__ import annotations

import transformers

from ..compat import NEWEST
from ..distributed import active_cp_group
from ..errors import PatchTargetError, Problem
from ..flags import BYPASS
from .agreement import agree
from .arguments import call_arguments
from .batch import batch_device
from .plan import CP, ForwardPlan


def unverified_message(family: str) -> str | None:
    """Why `family` cannot run under CP with the installed transformers, or None when all its targets verified."""
    from ..patching import PATCHES  # patching is imported by everything; read it at call time

    entries = PATCHES.unverified_for(family)
    if not entries:
        return None
    targets = ", ".join(target for target, _ in entries)
    details = " ".join(why.rstrip(".") + "." for _, why in entries)
    return (
        f"{family} models cannot run under CP with transformers {transformers.__version__}: the patch target(s) "
        f"{targets} did not verify, and the newest release vlmcp-patch was checked on is transformers {NEWEST}. "
        f"With CP off these models run as stock. To use CP, install transformers=={NEWEST} (or an older checked "
        f"release) or a vlmcp-patch release checked on {transformers.__version__}; or set VLMCP_CP_SIZE=1. "
        f"({details})"
    )


def unverified_problem(family: str | None) -> Problem | None:
    message = None if family is None else unverified_message(family)
    return None if message is None else Problem(PatchTargetError, message)


def unverified_guard(family: str):
    """The wrapper installed on `family`'s top-level forwards when one of its targets did not verify."""

    def guard(wrapped, instance, args, kwargs):
        cp = active_cp_group()
        problem = unverified_problem(family)
        if cp is None or BYPASS.get() or problem is None:
            return wrapped(*args, **kwargs)
        try:
            call = call_arguments(wrapped, args, kwargs)
        except TypeError:  # the target's signature changed: fingerprint what was passed by keyword
            call = dict(kwargs)
        agree(ForwardPlan(CP, cp, refusal=problem, device=batch_device(call)), call, instance)  # raises on every rank
        problem.raise_it()  # not reached: agree raised this rank's problem

    return guard
