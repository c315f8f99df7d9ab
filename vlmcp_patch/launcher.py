"""What the launcher tells this process through its environment: the one reader of `WORLD_SIZE`, `RANK` and of
every launcher's node variables (`NODE_SOURCES`: torchrun / Accelerate, the `deepspeed` launcher, SLURM, Open MPI,
MPICH), used by the groups (`distributed.launcher_node`, the node size the layout places subgroups by) and the report.

Read at each call, never cached: a test or a script may set the variables after the import. A variable that is not
set, or not a number, reads as unknown. Imports nothing of the package.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


def _number(name: str | None) -> int | None:
    raw = os.environ.get(name, "").strip() if name else ""
    return int(raw) if raw.isdigit() else None


def _tasks_per_node(raw: str) -> list[int] | None:
    """SLURM's compressed list of tasks per node, node by node: `2(x3),1` is [2, 2, 2, 1]; None if malformed."""
    counts: list[int] = []
    for part in raw.replace(" ", "").split(","):
        count, repeated, repeat = part.partition("(x")
        if not count.isdigit() or (repeated and not (repeat.endswith(")") and repeat[:-1].isdigit())):
            return None
        counts += [int(count)] * (int(repeat[:-1]) if repeated else 1)
    return counts or None


@dataclass(frozen=True)
class NodeVariables:
    """How one launcher states this process's node: ranks per node, this process's index inside its node, the node's
    index, and the number of processes the launcher started (None: it sets the world's own `WORLD_SIZE`).
    `per_node_list`: the size variable lists every node's count in SLURM's compressed form, this node's at the index
    `node` gives (the one count where all nodes hold the same)."""

    launcher: str
    size: str
    local_rank: str
    node: str | None = None
    started: str | None = None
    per_node_list: bool = False

    def stated_size(self) -> int | None:
        """The ranks on this process's node, as this launcher's size variable says; None where it does not say (a
        per-node list where the launcher also states the count alone: that one speaks for it)."""
        if not self.per_node_list:
            return _number(self.size)
        if any(v.launcher == self.launcher and not v.per_node_list and _number(v.size) is not None
               for v in NODE_SOURCES):
            return None
        counts = _tasks_per_node(os.environ.get(self.size, ""))
        node = _number(self.node)
        if counts is None:
            return None
        if node is not None:
            return counts[node] if node < len(counts) else None
        return counts[0] if len(set(counts)) == 1 else None


# Every launcher whose node variables the layout reads, in the order the report names them.
NODE_SOURCES = (
    NodeVariables("torchrun / Accelerate", "LOCAL_WORLD_SIZE", "LOCAL_RANK", node="GROUP_RANK"),
    NodeVariables("the deepspeed launcher", "LOCAL_SIZE", "LOCAL_RANK", node="CROSS_RANK"),
    NodeVariables("SLURM", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID", node="SLURM_NODEID", started="SLURM_NTASKS"),
    # set by every srun / sbatch (SLURM_NTASKS_PER_NODE only with --ntasks-per-node): e.g. `4(x2)`
    NodeVariables("SLURM", "SLURM_TASKS_PER_NODE", "SLURM_LOCALID", node="SLURM_NODEID", started="SLURM_NTASKS",
                  per_node_list=True),
    NodeVariables("Open MPI", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  started="OMPI_COMM_WORLD_SIZE"),
    NodeVariables("MPICH", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", started="PMI_SIZE"),
)


@dataclass(frozen=True)
class NodeStatement:
    """What one launcher's variables say in this process (`NODE_SOURCES`); None where it did not say."""

    variables: NodeVariables  # the launcher and the names of its variables
    size: int
    local_rank: int | None
    node: int | None
    started: int | None  # processes that launcher started; None: the world's

    def describes(self, world: int | None) -> bool:
        """This launcher started the ranks of a world of `world` processes itself. An outer launcher that started
        fewer (srun starting one torchrun agent per node) describes its agents, not the ranks: its node size is
        not theirs."""
        return self.started is None or world is None or self.started == world

    @property
    def contradicts_itself(self) -> bool:
        """A local index not below the node size: no launcher numbers so. Accelerate writes `LOCAL_WORLD_SIZE=1`
        (and keeps `LOCAL_RANK`) on CPU when it knows no launcher's variable (the deepspeed launcher's, SLURM's), so
        its rank 1 says LOCAL_RANK=1 of a node of 1: such a variable is not the launcher's, and is left out."""
        return self.local_rank is not None and self.local_rank >= self.size

    @property
    def source(self) -> str:
        """How errors and the report name it: e.g. `LOCAL_SIZE (the deepspeed launcher)`."""
        return f"{self.variables.size} ({self.variables.launcher})"

    @property
    def stated(self) -> str:
        """What it says: e.g. `LOCAL_SIZE=2 (the deepspeed launcher)`."""
        return f"{self.variables.size}={self.size} ({self.variables.launcher})"


def node_statements() -> tuple[NodeStatement, ...]:
    """Each launcher's statement about this process's node, for the launchers whose node-size variable is set."""
    return tuple(NodeStatement(variables=v, size=v.stated_size(),
                               local_rank=_number(v.local_rank), node=_number(v.node), started=_number(v.started))
                 for v in NODE_SOURCES if v.stated_size() is not None)


@dataclass(frozen=True)
class Launch:
    """This process's launch as the launcher set it; None where the launcher did not say."""

    world_size: int | None
    rank: int | None
    statements: tuple[NodeStatement, ...]  # every launcher's node variables set here (`node_statements`)
    host: str

    def stated(self) -> tuple[NodeStatement, ...]:
        """The statements of the launchers that started this world's ranks (`NodeStatement.describes`), less those
        that contradict themselves here."""
        return tuple(s for s in self.statements if s.describes(self.world_size) and not s.contradicts_itself)

    @property
    def node_size(self) -> int | None:
        """Ranks per node as this process's launchers state it; None when none does, or they disagree (the groups'
        agreement then refuses the launch, `distributed.agreed_node_size`)."""
        sizes = {s.size for s in self.stated()}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def several_nodes(self) -> bool:
        """The launch spans more than one node: fewer ranks per node than in the world."""
        return (self.node_size is not None and self.world_size is not None
                and 0 < self.node_size < self.world_size)


def launch() -> Launch:
    """This process's launch, read from the environment now."""
    return Launch(world_size=_number("WORLD_SIZE"), rank=_number("RANK"), statements=node_statements(),
                  host=socket.gethostname())
