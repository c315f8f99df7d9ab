"""The node variables each launcher sets in a rank's environment, as that launcher sets them, for the tests of the
node size (`tests/test_nodes.py`, `tests/helpers/two_node_script.py`).

`environment(launcher, rank, world, per_node)` is rank `rank`'s variables of a launch of `world` ranks, `per_node`
per node, numbered node by node; `as_launched_by` rewrites this process's environment to hold only those (the
torchrun agents of the two-node test start every rank; the rank then sees what the other launcher would have set).
`RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` stay: the process group's initialization reads them (under
SLURM or MPI the script, or Accelerate / DeepSpeed, sets them from the launcher's own).
"""

from __future__ import annotations

import os

# The variables every launcher below sets about nodes and local ranks (torchrun's elastic agent sets the GROUP_* and
# ROLE_* ones too): removed before one launcher's are set.
NODE_VARIABLES = (
    "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_NNODES",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
    "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "PMI_SIZE", "PMI_RANK",
)

# slurm: srun with --ntasks-per-node; srun: without it (SLURM_TASKS_PER_NODE only, in SLURM's compressed form)
LAUNCHERS = ("torchrun", "deepspeed", "slurm", "srun", "openmpi", "mpich", "none")


def environment(launcher: str, rank: int, world: int, per_node: int) -> dict[str, str]:
    """Rank `rank`'s node variables under `launcher` (`LAUNCHERS`; none: no node variable at all)."""
    node, local = divmod(rank, per_node)
    values = {
        "torchrun": {"LOCAL_WORLD_SIZE": per_node, "LOCAL_RANK": local, "GROUP_RANK": node,
                     "GROUP_WORLD_SIZE": world // per_node},
        "deepspeed": {"LOCAL_SIZE": per_node, "LOCAL_RANK": local, "CROSS_RANK": node, "CROSS_SIZE": world // per_node},
        "slurm": {"SLURM_NTASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
                  "SLURM_LOCALID": local, "SLURM_NODEID": node,
                  "SLURM_NTASKS": world, "SLURM_PROCID": rank, "SLURM_NNODES": world // per_node},
        "srun": {"SLURM_TASKS_PER_NODE": f"{per_node}(x{world // per_node})", "SLURM_LOCALID": local,
                 "SLURM_NODEID": node, "SLURM_NTASKS": world, "SLURM_PROCID": rank, "SLURM_NNODES": world // per_node},
        "openmpi": {"OMPI_COMM_WORLD_LOCAL_SIZE": per_node, "OMPI_COMM_WORLD_LOCAL_RANK": local,
                    "OMPI_COMM_WORLD_SIZE": world, "OMPI_COMM_WORLD_RANK": rank},
        "mpich": {"MPI_LOCALNRANKS": per_node, "MPI_LOCALRANKID": local, "PMI_SIZE": world, "PMI_RANK": rank},
        "none": {},
    }[launcher]
    return {name: str(value) for name, value in values.items()}


def as_launched_by(launcher: str, per_node: int) -> None:
    """Rewrite this process's environment (a rank started by torchrun) to hold only `launcher`'s node variables."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in NODE_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environment(launcher, rank, world, per_node))
