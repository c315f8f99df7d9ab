"""What the launchers tell this process through its environment: the one reader of `WORLD_SIZE`, `RANK` and of
every launcher's node variables (`NODE_SOURCES`: torchrun / Accelerate, the `deepspeed` launcher, Open MPI, MPICH,
SLURM), used by the groups (`distributed.launcher_node`, the node size the layout places subgroups by) and the report.

Launchers nest: torchrun or the `deepspeed` launcher started inside an `sbatch` script or by `srun`, `mpirun` inside
a SLURM allocation. A process then holds the variables of every launcher above it, and only the one that started it
describes it. So each launcher's variables are read, in the order of `NODE_SOURCES` (the launchers that start the
training processes themselves first, the scheduler last), only where they describe this process: a launcher that
states how many processes it started and this process's index among them (SLURM_NTASKS / SLURM_PROCID, Open MPI's,
MPICH's) must state the world's size and this rank (`NodeStatement.describes`). The ranks' agreement then leaves a
launcher out on every rank where it does not describe every rank (`distributed.agree_on_node_size`): SLURM_PROCID 0
equals RANK 0 on a torchrun's first rank by chance only.

Read at each call, never cached: a test or a script may set the variables after the import. A variable that is not
set, or not a number, reads as unknown. Imports nothing of the package.
"""

from __future__ import annotations

import math
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
    return counts if counts and all(counts) else None


@dataclass(frozen=True)
class NodeVariables:
    """The names of one launcher's variables: ranks per node (`size`), this process's index inside its node, the
    node's index, the number of processes the launcher started and this process's index among them (None: it does
    not set one; torchrun and the deepspeed launcher set the world's own `WORLD_SIZE` and `RANK`).

    `per_node_list`: `size` lists every node's count in SLURM's compressed form (`8(x2),4`). `request_unless`: `size`
    is what was asked for, and the variable named here, when set, is what the launcher did (SLURM_NTASKS_PER_NODE is
    a maximum per node when `--ntasks` is given too: `-N4 -n4 --ntasks-per-node=4` runs one task per node)."""

    launcher: str
    size: str
    local_rank: str
    node: str | None = None
    started: str | None = None
    rank: str | None = None
    per_node_list: bool = False
    request_unless: str | None = None

    def read(self) -> NodeStatement | None:
        """What these variables say in this process now; None where the size is not set (or only requested)."""
        if self.request_unless and os.environ.get(self.request_unless, "").strip():
            return None
        local, node = _number(self.local_rank), _number(self.node)
        if not self.per_node_list:
            size = _number(self.size)
            if size is None:
                return None
            return NodeStatement(variables=self, size=size, local_rank=local, node=node, started=_number(self.started),
                                 rank=_number(self.rank))
        counts = _tasks_per_node(os.environ.get(self.size, ""))
        if counts is None or (node is not None and node >= len(counts)) or (node is None and len(set(counts)) > 1):
            return None
        # nodes of unequal counts (`8,4`): the layout's nodes are blocks of their greatest common divisor, each inside
        # one node (8 ranks, then 4: blocks of 4, two in the first node), as long as ranks are numbered node by node
        return NodeStatement(variables=self, size=math.gcd(*counts), local_rank=local, node=node,
                             started=_number(self.started), rank=_number(self.rank), counts=tuple(counts))


# Every launcher whose node variables the layout reads: the launchers that start the training processes themselves
# first, the scheduler (whose tasks may be those launchers) last; the report names them in this order.
NODE_SOURCES = (
    NodeVariables("torchrun / Accelerate", "LOCAL_WORLD_SIZE", "LOCAL_RANK", node="GROUP_RANK"),
    NodeVariables("the deepspeed launcher", "LOCAL_SIZE", "LOCAL_RANK", node="CROSS_RANK"),
    NodeVariables("Open MPI", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  started="OMPI_COMM_WORLD_SIZE", rank="OMPI_COMM_WORLD_RANK"),
    NodeVariables("MPICH", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", started="PMI_SIZE", rank="PMI_RANK"),
    # set by every srun and sbatch, for what SLURM started: e.g. `4(x2)`, or `8,4` for uneven nodes
    NodeVariables("SLURM", "SLURM_TASKS_PER_NODE", "SLURM_LOCALID", node="SLURM_NODEID", started="SLURM_NTASKS",
                  rank="SLURM_PROCID", per_node_list=True),
    # set only with --ntasks-per-node: what was asked for; read only where SLURM_TASKS_PER_NODE is not set
    NodeVariables("SLURM", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID", node="SLURM_NODEID", started="SLURM_NTASKS",
                  rank="SLURM_PROCID", request_unless="SLURM_TASKS_PER_NODE"),
)


@dataclass(frozen=True)
class NodeStatement:
    """What one launcher's variables say in this process (`NODE_SOURCES`); None where they do not say.

    `size` is the layout's node: the ranks per node, or for nodes of unequal counts (`counts`, SLURM's list) the
    greatest common divisor of the counts."""

    variables: NodeVariables  # the launcher and the names of its variables
    size: int
    local_rank: int | None
    node: int | None
    started: int | None = None  # processes that launcher started; None: it does not say (the world's)
    rank: int | None = None  # this process's index among them; None: it does not say (the world's RANK)
    counts: tuple[int, ...] | None = None  # every node's count, where the launcher lists them

    @property
    def node_count(self) -> int:
        """The ranks of this process's node."""
        return self.counts[self.node or 0] if self.counts else self.size

    @property
    def first_of_node(self) -> int | None:
        """The global index of the first rank of this process's node, numbering node by node; None where the
        launcher does not say which node this is."""
        if self.node is None:
            return None
        return sum(self.counts[:self.node]) if self.counts else self.node * self.size

    def describes(self, world: int | None, rank: int | None) -> bool:
        """This launcher started this process as rank `rank` of a world of `world` processes (None: unknown, not
        held against it). An outer launcher describes what it started instead: srun starting one torchrun agent per
        node started 2 tasks, not the world's 8; an `sbatch --ntasks-per-node=8` script running torchrun states
        SLURM_NTASKS=8 and SLURM_PROCID=0 on every one of torchrun's 8 ranks."""
        return ((self.started is None or world is None or self.started == world)
                and (self.rank is None or rank is None or self.rank == rank))

    @property
    def contradicts_itself(self) -> bool:
        """A local index not below its node's count: no launcher numbers so. Accelerate writes `LOCAL_WORLD_SIZE=1`
        (and keeps `LOCAL_RANK`) on CPU when it knows no launcher's variable (the deepspeed launcher's, SLURM's), so
        its rank 1 says LOCAL_RANK=1 of a node of 1: such a variable is not the launcher's, and is left out."""
        return self.local_rank is not None and self.local_rank >= self.node_count

    def left_out(self, world: int | None, rank: int | None) -> str | None:
        """Why this statement does not describe this process (None: it does), as the report and errors say it."""
        if self.contradicts_itself:
            return f"this process's {self.variables.local_rank}={self.local_rank} is not below it"
        if self.started is not None and world is not None and self.started != world:
            return (f"that launcher started {self.started} processes, not this world's {world} (an outer "
                    "launcher)")
        if self.rank is not None and rank is not None and self.rank != rank:
            return (f"that launcher numbers this process {self.variables.rank}={self.rank}, not RANK={rank} (an "
                    "outer launcher)")
        return None

    def misplaced(self, rank: int) -> str | None:
        """Why this launcher's node and local indices do not put global rank `rank` where numbering ranks node by
        node puts it, in nodes of this launcher's counts; None where they do, or do not say."""
        v = self.variables
        if self.first_of_node is not None and self.local_rank is not None:
            if self.first_of_node + self.local_rank != rank:
                return (f"rank {rank} has {v.node} {self.node} and {v.local_rank} {self.local_rank}, which numbering "
                        f"node by node gives rank {self.first_of_node + self.local_rank}: the ranks are not numbered "
                        "node by node")
        elif self.first_of_node is not None and not (
                self.first_of_node <= rank < self.first_of_node + self.node_count):
            return (f"rank {rank} has {v.node} {self.node}, not {rank // self.size}: the ranks are not numbered node "
                    "by node")
        elif self.local_rank is not None and self.local_rank != rank % self.size:
            return (f"rank {rank} has {v.local_rank} {self.local_rank}, not {rank % self.size}: the ranks are not "
                    "numbered node by node")
        return None

    @property
    def source(self) -> str:
        """How errors and the report name it: e.g. `LOCAL_SIZE (the deepspeed launcher)`."""
        return f"{self.variables.size} ({self.variables.launcher})"

    @property
    def stated(self) -> str:
        """What it says: e.g. `LOCAL_SIZE=2 (the deepspeed launcher)`, `SLURM_TASKS_PER_NODE=8,4 (SLURM: nodes of
        8 and 4 ranks, the layout's nodes blocks of 4)`."""
        if self.counts is not None and len(set(self.counts)) > 1:
            listed = os.environ.get(self.variables.size, ",".join(map(str, self.counts)))
            return (f"{self.variables.size}={listed} ({self.variables.launcher}: nodes of "
                    f"{' and '.join(map(str, sorted(set(self.counts), reverse=True)))} ranks, laid out in blocks of "
                    f"{self.size})")
        return f"{self.variables.size}={self.size} ({self.variables.launcher})"


def node_statements() -> tuple[NodeStatement, ...]:
    """Each launcher's statement about this process's node, for the launchers whose node-size variable is set, in
    the order of `NODE_SOURCES`."""
    return tuple(s for s in (v.read() for v in NODE_SOURCES) if s is not None)


@dataclass(frozen=True)
class Launch:
    """This process's launch as the launcher set it; None where the launcher did not say."""

    world_size: int | None
    rank: int | None
    statements: tuple[NodeStatement, ...]  # every launcher's node variables set here (`node_statements`)
    host: str

    def stated(self) -> tuple[NodeStatement, ...]:
        """The statements of the launchers that describe this process (`NodeStatement.left_out`)."""
        return tuple(s for s in self.statements if s.left_out(self.world_size, self.rank) is None)

    @property
    def node_size(self) -> int | None:
        """Ranks per node as this process's launchers state it; None when none does, or they disagree (the groups'
        agreement then refuses the launch, `distributed.agreed_node_size`)."""
        sizes = {s.size for s in self.stated()}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def ranks_on_this_node(self) -> int | None:
        """The ranks on this process's own node as its launchers state it: LOCAL_WORLD_SIZE, LOCAL_SIZE,
        OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, or SLURM's entry for this node (SLURM_NODEID's in
        SLURM_TASKS_PER_NODE: 8 on the first node of `8,4`, 4 on the second), never the layout's node size (`node_size`,
        the counts' greatest common divisor on unequal nodes). None when none states it, or they disagree."""
        counts = {s.node_count for s in self.stated()}
        return counts.pop() if len(counts) == 1 else None

    @property
    def several_nodes(self) -> bool:
        """The launch spans more than one node: fewer ranks per node than in the world."""
        return (self.node_size is not None and self.world_size is not None
                and 0 < self.node_size < self.world_size)


def launch() -> Launch:
    """This process's launch, read from the environment now."""
    return Launch(world_size=_number("WORLD_SIZE"), rank=_number("RANK"), statements=node_statements(),
                  host=socket.gethostname())
