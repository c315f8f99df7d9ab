"""The node variables each launcher sets in a rank's environment, as that launcher sets them, for the tests of the
node size (`tests/test_nodes.py`, `tests/helpers/two_node_script.py`).

`environment(launcher, rank, world, per_node)` is rank `rank`'s variables of a launch of `world` ranks, `per_node`
per node, numbered node by node; `as_launched_by` rewrites this process's environment to hold only those (the
torchrun agents of the two-node test start every rank; the rank then sees what the other launcher would have set).
`RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` stay: the process group's initialization reads them (under
SLURM or MPI the script, or Accelerate / DeepSpeed, sets them from the launcher's own).

`NESTED` holds launches where one launcher runs inside another (torchrun inside an sbatch script, mpirun inside a
SLURM allocation, ...): every rank's variables as both launchers leave them. What each sets, from their documents:
torchrun (torch.distributed.run): LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
ROLE_WORLD_SIZE; the deepspeed launcher (deepspeed/launcher/launch.py): LOCAL_RANK, LOCAL_SIZE,
CROSS_RANK, CROSS_SIZE; Open MPI's mpirun: OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_SIZE,LOCAL_RANK,NODE_RANK},
OMPI_UNIVERSE_SIZE; MPICH's hydra: PMI_RANK, PMI_SIZE, MPI_LOCALNRANKS, MPI_LOCALRANKID; SLURM, for each task of a
step (srun) or for the batch script (sbatch, which runs once, as task 0 of the first node): SLURM_NTASKS /
SLURM_NPROCS (tasks of the step or job), SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES,
SLURM_TASKS_PER_NODE (each node's tasks, compressed: `4(x2)`, `8,4`) and, only with --ntasks-per-node,
SLURM_NTASKS_PER_NODE (the request: with -N4 -n4 --ntasks-per-node=4 it says 4 where each node runs 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

# The variables every launcher below sets about nodes and local ranks: removed before one launcher's are set.
NODE_VARIABLES = (
    "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_PROCID", "SLURM_NNODES",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_NODE_RANK", "OMPI_UNIVERSE_SIZE",
    "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "PMI_SIZE", "PMI_RANK",
)

# slurm: srun with --ntasks-per-node; srun: without it (SLURM_TASKS_PER_NODE only, in SLURM's compressed form)
LAUNCHERS = ("torchrun", "deepspeed", "slurm", "srun", "openmpi", "mpich", "none")


def slurm_task(tasks: int, procid: int, nodeid: int, localid: int, tasks_per_node: str,
               ntasks_per_node: int | None = None) -> dict[str, str]:
    """What SLURM sets for task `procid` of a step of `tasks` tasks (srun), or for the batch script (task 0)."""
    nodes = sum(int(p.partition("(x")[2].rstrip(")") or 1) for p in tasks_per_node.split(","))
    values = {"SLURM_NTASKS": tasks, "SLURM_NPROCS": tasks, "SLURM_PROCID": procid, "SLURM_NODEID": nodeid,
              "SLURM_LOCALID": localid, "SLURM_NNODES": nodes, "SLURM_TASKS_PER_NODE": tasks_per_node}
    if ntasks_per_node is not None:
        values["SLURM_NTASKS_PER_NODE"] = ntasks_per_node
    return {name: str(value) for name, value in values.items()}


def environment(launcher: str, rank: int, world: int, per_node: int) -> dict[str, str]:
    """Rank `rank`'s node variables under `launcher` (`LAUNCHERS`; none: no node variable at all)."""
    node, local = divmod(rank, per_node)
    nodes = world // per_node
    if launcher in ("slurm", "srun"):
        return slurm_task(world, rank, node, local, f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
                          per_node if launcher == "slurm" else None)
    values = {
        "torchrun": {"LOCAL_WORLD_SIZE": per_node, "LOCAL_RANK": local, "GROUP_RANK": node, "GROUP_WORLD_SIZE": nodes,
                     "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world},
        "deepspeed": {"LOCAL_SIZE": per_node, "LOCAL_RANK": local, "CROSS_RANK": node, "CROSS_SIZE": nodes},
        "openmpi": {"OMPI_COMM_WORLD_LOCAL_SIZE": per_node, "OMPI_COMM_WORLD_LOCAL_RANK": local,
                    "OMPI_COMM_WORLD_SIZE": world, "OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_NODE_RANK": local,
                    "OMPI_UNIVERSE_SIZE": world},
        "mpich": {"MPI_LOCALNRANKS": per_node, "MPI_LOCALRANKID": local, "PMI_SIZE": world, "PMI_RANK": rank},
        "none": {},
    }[launcher]
    return {name: str(value) for name, value in values.items()}


@dataclass(frozen=True)
class Nested:
    """A launch as it really runs: `world` ranks, each rank's variables (`variables(rank)`) and its machine
    (`node_of(rank)`, the host it reports); the node size the ranks must agree on and the launcher variable it comes
    from, or the refusal (a regular expression) where the variables truly contradict each other."""

    world: int
    variables: Callable[[int], dict[str, str]]
    node_of: Callable[[int], int]
    size: int | None = None
    source: str | None = None
    refused: str | None = None


def _block(counts: list[int]) -> Callable[[int], tuple[int, int]]:
    """(node, local index) of each rank of nodes of `counts` ranks, numbered node by node."""
    starts = [sum(counts[:n]) for n in range(len(counts))]
    return lambda rank: next((n, rank - s) for n, s in reversed(list(enumerate(starts))) if rank >= s)


def _srun(counts: list[int], listed: str, ntasks_per_node: int | None = None) -> Callable[[int], dict[str, str]]:
    """srun starting the ranks itself on nodes of `counts` tasks (SLURM_TASKS_PER_NODE=`listed`)."""
    where = _block(counts)
    return lambda rank: slurm_task(sum(counts), rank, *where(rank), listed, ntasks_per_node)


def _inside(inner: str, per_node: int, world: int, outer: Callable[[int], dict[str, str]]):
    """`inner` (torchrun, the deepspeed launcher, mpirun) starting the ranks, inside `outer`'s task."""
    return lambda rank: {**outer(rank), **environment(inner, rank, world, per_node)}


BATCH_8 = slurm_task(8, 0, 0, 0, "8", ntasks_per_node=8)  # the script of `sbatch -N1 --ntasks-per-node=8`
# one task per node (srun --ntasks-per-node=1 in `sbatch -N2 --ntasks-per-node=8`, or mpirun's daemons on 2 nodes)
PER_NODE_TASK = lambda rank, per_node=8: slurm_task(2, rank // per_node, rank // per_node, 0, "1(x2)", 1)  # noqa: E731

TORCHRUN, DEEPSPEED = "LOCAL_WORLD_SIZE (torchrun / Accelerate)", "LOCAL_SIZE (the deepspeed launcher)"
OPEN_MPI, SLURM = "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI)", "SLURM_TASKS_PER_NODE (SLURM)"

NESTED = {
    # torchrun --nproc-per-node=8 in the script of `sbatch -N1 --ntasks-per-node=8`: every rank inherits the
    # script's SLURM_NTASKS=8 (= WORLD_SIZE), SLURM_PROCID=0, SLURM_LOCALID=0
    "torchrun inside sbatch --ntasks-per-node=8": Nested(
        8, _inside("torchrun", 8, 8, lambda rank: BATCH_8), lambda rank: 0, size=8, source=TORCHRUN),
    # srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=8: SLURM started 2 agents
    "srun starting one torchrun per node": Nested(
        16, _inside("torchrun", 8, 16, PER_NODE_TASK), lambda rank: rank // 8, size=8, source=TORCHRUN),
    # srun -N4 -n4 --ntasks-per-node=4: one task per node; SLURM_NTASKS_PER_NODE=4 is the request
    "srun -N4 -n4 --ntasks-per-node=4": Nested(
        4, _srun([1] * 4, "1(x4)", ntasks_per_node=4), lambda rank: rank, size=1, source=SLURM),
    # srun -N2 -n8 --ntasks-per-node=4
    "srun -N2 -n8 --ntasks-per-node=4": Nested(
        8, _srun([4, 4], "4(x2)", ntasks_per_node=4), lambda rank: rank // 4, size=4, source=SLURM),
    # srun -n12 on a node with 8 free slots and one with 4: blocks of 4 lie inside a node
    "srun on uneven nodes 8,4": Nested(
        12, _srun([8, 4], "8,4"), lambda rank: rank // 8, size=4, source=SLURM),
    "srun on uneven nodes 3,1": Nested(
        4, _srun([3, 1], "3,1"), lambda rank: rank // 3, size=1, source=SLURM),
    # srun -N2 -n8 --distribution=cyclic: rank r on node r % 2 — consecutive ranks on different nodes
    "srun -N2 -n8 --distribution=cyclic": Nested(
        8, lambda rank: slurm_task(8, rank, rank % 2, rank // 2, "4(x2)"), lambda rank: rank % 2,
        refused=r"rank 1 has SLURM_NODEID 1 and SLURM_LOCALID 0, which numbering node by node gives rank 4"),
    # mpirun -np 8 in the script of `sbatch -N1 --ntasks-per-node=8`: forks the ranks, which inherit the script's
    "mpirun inside sbatch, one node": Nested(
        8, _inside("openmpi", 8, 8, lambda rank: BATCH_8), lambda rank: 0, size=8, source=OPEN_MPI),
    # mpirun -np 16 in `sbatch -N2 --ntasks-per-node=8`: Open MPI starts one daemon per node through srun, and the
    # ranks inherit that step's variables (2 tasks, SLURM_PROCID = the node)
    "mpirun inside sbatch, two nodes": Nested(
        16, _inside("openmpi", 8, 16, PER_NODE_TASK), lambda rank: rank // 8, size=8, source=OPEN_MPI),
    # deepspeed (one node, no hostfile) in the script of `sbatch -N1 --ntasks-per-node=8`
    "deepspeed launcher inside sbatch": Nested(
        8, _inside("deepspeed", 8, 8, lambda rank: BATCH_8), lambda rank: 0, size=8, source=DEEPSPEED),
    # srun --ntasks-per-node=1 deepspeed --no_ssh --node_rank=$SLURM_NODEID ...: one launcher per node
    "srun starting one deepspeed launcher per node": Nested(
        16, _inside("deepspeed", 8, 16, PER_NODE_TASK), lambda rank: rank // 8, size=8, source=DEEPSPEED),
    # deepspeed --launcher slurm: `srun -n 16 --nodes 2 python train.py`, srun starts every rank itself
    "deepspeed --launcher slurm": Nested(
        16, _srun([8, 8], "8(x2)"), lambda rank: rank // 8, size=8, source=SLURM),
    # a true contradiction: SLURM started these very ranks (SLURM_PROCID = RANK, SLURM_NTASKS = WORLD_SIZE on every
    # rank) on nodes of 8, and torchrun's variables say nodes of 4
    "torchrun and srun both describing the ranks, nodes of 4 and 8": Nested(
        16, _inside("torchrun", 4, 16, _srun([8, 8], "8(x2)")), lambda rank: rank // 8,
        refused=r"state different node sizes: LOCAL_WORLD_SIZE \(torchrun / Accelerate\) = 4, SLURM_TASKS_PER_NODE "
                r"\(SLURM\) = 8"),
}


def as_launched_by(launcher: str, per_node: int) -> None:
    """Rewrite this process's environment (a rank started by torchrun) to hold only `launcher`'s node variables."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in NODE_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environment(launcher, rank, world, per_node))
