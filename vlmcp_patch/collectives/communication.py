"""Every communication of the CP groups, its failures made errors, and the ranks' debug comparison.

**Failures become errors.** Every communication goes through `communicate`: a backend error or a collective that
does not complete within the CP groups' timeout (`VLMCP_TIMEOUT`, else the user's) raises `CollectiveError` naming
the collective, the layer (`record.site`) and the phase, on every rank that can raise. A wait for a communication
started earlier (a ring pass) goes through `raising`.

**A check that sees order.** With `VLMCP_DEBUG_COLLECTIVES=1`, `communicate` records each collective in this rank's
`record.CollectiveLog`; `check_collectives` (after each CP forward and each backward) compares what the ranks
recorded since the last comparison (one small all-gather) and, on a difference, every rank raises naming the first
one. Off, nothing is recorded and nothing compared.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..settings import SETTINGS
from .record import Record, collective_log, current_site, first_difference, group_name, phase


def communicate(op: str, group, count: int, run):
    """Run one communication `run()` of the CP group `group`: recorded in debug mode; a failure or a timeout raises
    `CollectiveError` naming it (module docstring)."""
    if SETTINGS.debug_collectives:
        collective_log().add(Record(phase(), op, group_name(group), count, current_site()))
    return raising(op, group, run)


def raising(op: str, group, run):
    """`run()`, a backend error or timeout raised as `CollectiveError` naming the communication `op` (not recorded:
    the wait of a communication `communicate` started)."""
    try:
        return run()
    except RuntimeError as error:  # gloo's and NCCL's errors (DistBackendError is one), timeouts included
        raise CollectiveError(
            f"vlmcp-patch: the {op} over the {group_name(group)} group at {current_site() or 'the CP forward'} "
            f"({phase()}) did not complete on global rank {dist.get_rank()}: {error}. Another rank of the group "
            "failed, exited or did not reach the same collective within the CP groups' timeout (VLMCP_TIMEOUT, or "
            "the timeout given to init_process_group). VLMCP_DEBUG_COLLECTIVES=1 compares every rank's collectives "
            "after each forward and backward."
        ) from error


def check_collectives(group, size: int, when: str = "since the last check") -> None:
    """With `VLMCP_DEBUG_COLLECTIVES=1`, compare this rank's collectives since the last comparison with the other
    members of the CP group `group` (collective: every member calls it); raises `CollectiveError` on every member
    at the first difference. Off, nothing."""
    if SETTINGS.debug_collectives:
        _compare(group, size, when)


def _compare(group, size: int, when: str) -> None:
    if size == 1:  # nothing to compare with: the records wait for the CP group's next check
        return
    pending = collective_log().take_pending()
    # gathered as objects: torch puts them on the device the group's backend takes (CPU for gloo, GPU for NCCL)
    everyone = [None] * size
    mine = (len(pending), zlib.crc32("\n".join(pending).encode()))
    raising("debug check's all-gather", group, lambda: dist.all_gather_object(everyone, mine, group=group))
    if len(set(everyone)) == 1:
        return
    sequences = [None] * size
    raising("debug check's all-gather", group, lambda: dist.all_gather_object(sequences, pending, group=group))
    raise CollectiveError(first_difference(sequences, when))


def torch_collective(name: str, before_2_13: str):
    """torch.distributed's collective `name`, or its name before torch 2.13 renamed it (deprecating the old one);
    looked up at each call, as torch.distributed's functions are (the collective probes wrap them there)."""
    return getattr(dist, name, None) or getattr(dist, before_2_13)


def all_gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank's `x` (the same shape everywhere) concatenated along `dim` in rank order: one
    all_gather_into_tensor (no autograd)."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))
    gather = torch_collective("all_gather_single", "all_gather_into_tensor")
    communicate("all-gather", group, front.numel(), lambda: gather(out, front, group=group))
    return out.movedim(0, dim)


def all_gather_small(values: torch.Tensor, group, size: int) -> torch.Tensor:
    """Gather a small 1-D tensor from every rank of the group (no autograd): shape (size, n)."""
    return all_gather_along(values, 0, group, size).view(size, -1)


def group_timeout(group):
    """The timeout the group was created with (None where the backend does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - a private API, and a group without that device's backend
            continue
    return None
