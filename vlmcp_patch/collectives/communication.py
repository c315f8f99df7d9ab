"""Every communication of the CP groups, its failures made errors, and the ranks' debug comparison.

**Failures become errors that name their cause.** Every communication goes through `communicate`: a collective that
does not complete within the CP groups' timeout (`VLMCP_TIMEOUT`, else the user's), or whose peer failed, raises
`CollectiveError` naming the collective, the layer (`record.site`) and the phase, on every rank that can raise; an
out-of-memory stays `torch.OutOfMemoryError`, naming the site, on the rank where it happened; what torch.distributed
refuses of this rank's own arguments reads as this rank's error. A wait for a communication started earlier (a ring
pass) goes through `raising`.

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


# What gloo and NCCL say when the other side of a collective is gone or late (gloo raises them as plain RuntimeErrors;
# NCCL as DistBackendError): a peer's absence or failure. Anything else a collective raises is this rank's own.
_PEER_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "pair closure", "closed by peer",
               "broken pipe", "aborted", "peer", "ncclremoteerror", "socket")


def _a_peers_doing(error: RuntimeError) -> bool:
    if isinstance(error, (dist.DistBackendError, getattr(dist, "DistNetworkError", dist.DistBackendError))):
        return True
    text = str(error).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def raising(op: str, group, run):
    """`run()`, its failure raised as what it is, naming the communication `op`, its group, the site and the phase
    (not recorded: the wait of a communication `communicate` started):

    - out of memory on this rank: `torch.OutOfMemoryError`, as torch raises it, with the site;
    - a peer that failed, exited or did not arrive within the timeout (module docstring): `CollectiveError` saying so;
    - anything else (a split or shape this rank gave that torch.distributed refuses): `CollectiveError` naming it as
      this rank's own error — no peer is to blame."""
    try:
        return run()
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"vlmcp-patch: out of memory on global rank {dist.get_rank()} in the {op} over the {group_name(group)} "
            f"group at {current_site() or 'the CP forward'} ({phase()}): {error}"
        ) from error
    except RuntimeError as error:
        where = f"the {op} over the {group_name(group)} group at {current_site() or 'the CP forward'} ({phase()})"
        if not _a_peers_doing(error):
            raise CollectiveError(
                f"vlmcp-patch: {where} failed on global rank {dist.get_rank()} itself: {error}. torch.distributed "
                "refused what this rank gave it (its sizes or splits), before any other rank was involved; please "
                "report this with the batch's layout."
            ) from error
        raise CollectiveError(
            f"vlmcp-patch: {where} did not complete on global rank {dist.get_rank()}: {error}. Another rank of the "
            "group failed, exited or did not reach the same collective within the CP groups' timeout (VLMCP_TIMEOUT, "
            "or the timeout given to init_process_group). VLMCP_DEBUG_COLLECTIVES=1 compares every rank's "
            "collectives after each forward and backward."
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


def all_reduced(values: list[float], op, group, device: torch.device) -> list[float]:
    """`values` reduced with `op` over `group`, through the package's collective wrapper, on `device` (the batch's:
    NCCL reduces device tensors only)."""
    flags = torch.tensor(values, dtype=torch.float64, device=device)
    communicate("all-reduce", group, flags.numel(), lambda: dist.all_reduce(flags, op=op, group=group))
    return flags.tolist()
