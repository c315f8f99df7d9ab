"""A family whose patch targets did not verify: stock with CP off, refused under CP.

On a transformers release newer than those the package was checked on, a target may have changed (another source
digest, a parameter gone). `PatchSet` then leaves that family stock and installs only `unverified_guard` on its
top-level forwards: with CP off (or inside `vlmcp_patch.disabled()`) the call goes to stock untouched; under CP
the first forward raises on every rank of the group before any compute (the agreement collective), naming the
targets, the installed release and the newest release checked. The refusal itself is a rule
(`refusals.unverified_problem`); the guard puts it in a plan and is the top that calls the agreement, as
`top_level.enter_cp_forward` is for a verified family. `refusals.check_setup` gives the same refusal to the entry
points that enter the CP forward themselves (TRL's fused head, `token_log_probs`).
"""

from __future__ import annotations

from ..distributed import active_cp_group
from ..flags import BYPASS
from .agreement import agree
from .arguments import call_arguments
from .batch import batch_device
from .plan import CP, ForwardPlan
from .refusals import unverified_problem


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
