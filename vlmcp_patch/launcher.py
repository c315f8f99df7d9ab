"""What the launcher (torchrun / accelerate / deepspeed) tells this process through its environment: the one reader
of `WORLD_SIZE`, `RANK`, `LOCAL_WORLD_SIZE` and `GROUP_RANK`, used by the groups (`distributed.launcher_node`, the
node size the layout places subgroups by) and the report.

Read at each call, never cached: a test or a script may set the variables after the import. A variable that is not
set, or not a number, reads as unknown. Imports nothing of the package.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


def _number(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


@dataclass(frozen=True)
class Launch:
    """This process's launch as the launcher set it; None where the launcher did not say."""

    world_size: int | None
    rank: int | None
    local_world_size: int | None  # ranks per node
    group_rank: int | None  # the node's index
    host: str

    @property
    def several_nodes(self) -> bool:
        """The launch spans more than one node: fewer ranks per node than in the world."""
        return (self.local_world_size is not None and self.world_size is not None
                and 0 < self.local_world_size < self.world_size)


def launch() -> Launch:
    """This process's launch, read from the environment now."""
    return Launch(world_size=_number("WORLD_SIZE"), rank=_number("RANK"),
                  local_world_size=_number("LOCAL_WORLD_SIZE"), group_rank=_number("GROUP_RANK"),
                  host=socket.gethostname())
