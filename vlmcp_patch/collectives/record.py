"""Where a collective runs, what it is, and this rank's debug record of the sequence it issued.

`site(name)` names the part of the model whose collectives run in a block ("layer 3 (Qwen3_5GatedDeltaNet)"): the
errors and the debug records carry it, and so does the backward of each differentiable collective issued there.
With `VLMCP_DEBUG_COLLECTIVES=1` each rank appends a `Record` (phase, operation, group, element count, site) of every
collective to its `CollectiveLog`; the ranks compare the records since their last comparison after each CP forward
and each backward (`communication.check_collectives`) and, on a difference, every rank raises naming the first one
(`first_difference`). Off, nothing is recorded. This module communicates nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_SITE: contextvars.ContextVar[str] = contextvars.ContextVar("vlmcp_collective_site", default="")


def site(name: str):
    """Name the part of the model whose collectives run in the block (e.g. "layer 3 (Qwen3_5GatedDeltaNet)"):
    errors and debug records carry it, and so does the backward of each differentiable collective issued there."""
    token = _SITE.set(name)
    return reset_on_exit(_SITE, token)


def current_site() -> str:
    """The site the running collectives belong to ("" outside any)."""
    return _SITE.get()


def module_site(module) -> str:
    """The site name of a module's collectives: its class, and its layer where it has one."""
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if layer is None else f" of layer {layer}")


@contextlib.contextmanager
def reset_on_exit(var: contextvars.ContextVar, token):
    """A block at whose end `var` returns to what it was before `var.set` gave `token`."""
    try:
        yield
    finally:
        var.reset(token)


def group_name(group) -> str:
    """The group's role (`distributed` creates them with a description: cp, ulysses, ring; None: the default group,
    the world) and its size."""
    role = "world" if group is None else getattr(group, "group_desc", None) or "group"
    return f"{role}[{dist.get_world_size(group)}]"


def phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@dataclass(frozen=True)
class Record:
    """One collective as a rank issued it. `count`: the elements every member of the group moves alike (uneven
    exchanges: the width of a row)."""

    phase: str
    op: str
    group: str
    count: int
    where: str

    def __str__(self) -> str:
        return f"{self.phase} {self.op} over {self.group}, {self.count} elements, at {self.where or 'the CP forward'}"


@dataclass
class CollectiveLog:
    """This rank's collectives the ranks have not compared yet (`VLMCP_DEBUG_COLLECTIVES=1`), and a count and digest of
    all it issued since `reset`. A comparison takes the pending records away: a long run keeps only those."""

    pending: list[Record] = field(default_factory=list)
    issued: dict[str, int] = field(default_factory=dict)  # per phase: how many collectives since `reset`
    digest: int = 0  # crc32 of every record's text in order since `reset`: equal on ranks that issued the same

    def add(self, record: Record) -> None:
        self.pending.append(record)
        self.issued[record.phase] = self.issued.get(record.phase, 0) + 1
        self.digest = zlib.crc32(f"{record}\n".encode(), self.digest)

    def take_pending(self) -> list[str]:
        """The records since the last comparison, as text; the log keeps none of them."""
        pending, self.pending = [str(r) for r in self.pending], []
        return pending

    def reset(self) -> None:
        """Forget everything (a test's fresh start)."""
        self.pending, self.issued, self.digest = [], {}, 0


def first_difference(sequences: list[list[str]], when: str) -> str:
    """The message naming the first collective at which the ranks' `sequences` (index = group rank) differ."""
    longest = max(len(s) for s in sequences)
    for i in range(longest):
        seen = [s[i] if i < len(s) else "nothing" for s in sequences]
        if len(set(seen)) > 1:
            issued = "; ".join(f"rank {r}: {what}" for r, what in enumerate(seen))
            return (f"vlmcp-patch: the ranks of a CP group issued different collectives {when} (collective {i + 1} "
                    f"of the step differs — {issued}). Ranks that issue different collectives hang; please report "
                    "this with the batch's layout.")
    raise AssertionError("unreachable: the sequences differ")


_LOG = CollectiveLog()


def collective_log() -> CollectiveLog:
    """This rank's record of its collectives (filled only with `VLMCP_DEBUG_COLLECTIVES=1`)."""
    return _LOG
