"""CP process groups (blocks of `P` consecutive ranks, created lazily once torch.distributed is up), the
data-parallel view of the world (W/P replicas), and `gather_sequence`.

While the package is reverted or disabled (`VLMCP_DISABLE=1`) every helper here reports P=1.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives.communication import communicate, group_timeout
from .collectives.differentiable import gather_keep_local_grad
from .errors import UnsupportedSetupError
from .grad_shares import shares_summed
from .flags import BYPASS, scoped
from .launcher import NODE_SOURCES, launch
from .layout import hybrid_rank_lists, ulysses_degree
from .patching import cp_size
from .settings import SETTINGS

_GROUPS: dict[tuple[int, int], object] = {}
_HYBRID: dict[tuple[int, int, int], dict] = {}  # (world, P, U) -> this rank's Ulysses subgroup and ring
_WORLD_GROUP: dict[int, object] = {}
# world size -> the node size every rank agreed on (and its source), or the UnsupportedSetupError the launch gets
_NODE_SIZE: dict[int, NodeAgreement | UnsupportedSetupError] = {}


@dataclass(frozen=True)
class CPGroup:
    """The CP group of this rank: `size` ranks, this one at position `rank`."""

    group: object
    rank: int
    size: int


# A packed row at P=1 takes the CP path with this one-rank "group": the same boundaries, no exchanges.
SINGLE_RANK = CPGroup(group=None, rank=0, size=1)


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _check_world(size: int) -> int:
    if not distributed_ready():
        raise UnsupportedSetupError(
            f"VLMCP_CP_SIZE={size} needs torch.distributed: launch with torchrun / accelerate / deepspeed "
            "(or call torch.distributed.init_process_group) before the first forward, or set VLMCP_CP_SIZE=1."
        )
    world = dist.get_world_size()
    if world % size:
        raise UnsupportedSetupError(
            f"CP size {size} does not divide the world size {world}: launch a multiple of {size} processes "
            f"or choose a CP size among the divisors of {world}."
        )
    return world


def _timeout_of_default_group():
    """The timeout the user gave the default group (init_process_group(timeout=...), the Trainer's
    ddp_timeout): new_group does not inherit it, it would fall back to the backend's default (30 min)."""
    if SETTINGS.timeout:  # VLMCP_TIMEOUT
        return datetime.timedelta(seconds=SETTINGS.timeout)
    from torch.distributed import distributed_c10d as c10d

    return group_timeout(c10d._get_default_group())  # None: the backend default applies


def _release_groups() -> None:
    """Destroy the package's own groups while the interpreter is alive (an atexit hook): a gloo group whose
    last reference goes away only during interpreter shutdown can abort the process there."""
    hybrid = [g for groups in _HYBRID.values() for g in (groups["ulysses"], groups["ring"][0])]
    for group in [*_GROUPS.values(), *_WORLD_GROUP.values(), *hybrid]:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already destroyed with the default group
            pass
    _GROUPS.clear()
    _WORLD_GROUP.clear()
    _HYBRID.clear()
    _NODE_SIZE.clear()


def _warn_if_a_stall_would_hang() -> None:
    """On NCCL a collective returns at once and its stall is ended by the group's watchdog, which aborts the process
    after the timeout — unless asynchronous error handling is off (`0`), when it waits forever (docs/errors.md)."""
    setting = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("NCCL_ASYNC_ERROR_HANDLING"))
    if setting == "0" and dist.get_backend() == "nccl":
        warnings.warn("vlmcp-patch: TORCH_NCCL_ASYNC_ERROR_HANDLING=0 lets a stalled CP collective wait forever (a "
                      "dead or failed rank hangs the job); leave it unset (torch's 3, torchrun's 1) so NCCL's "
                      "watchdog ends every rank after the CP groups' timeout", stacklevel=3)


def _new_group(ranks: list[int], role: str):
    """A process group of `ranks` described as `role` (cp, ulysses, ring, world: the collectives' errors and debug
    records name it), with the CP groups' timeout."""
    if not _GROUPS and not _WORLD_GROUP and not _HYBRID:
        atexit.register(_release_groups)
        _warn_if_a_stall_would_hang()
    # a collective of the whole world (every rank creates every group, in the same order)
    return communicate(f"creation of a vlmcp_{role} group", None, len(ranks),
                       lambda: dist.new_group(ranks=ranks, timeout=_timeout_of_default_group(),
                                              group_desc=f"vlmcp_{role}"))


def launcher_node() -> dict:
    """What the launchers say about this process's node (`launcher.node_statements`: torchrun / Accelerate, the
    deepspeed launcher, SLURM, Open MPI, MPICH), and its host; with the Ulysses size this process was given
    (VLMCP_ULYSSES_SIZE, 0: automatic), which every rank must share too."""
    here = launch()
    return {"statements": here.statements, "host": here.host, "ulysses_size": SETTINGS.ulysses_size}


@dataclass(frozen=True)
class NodeAgreement:
    """The node size N every rank of a launch agreed on (None: one node) and where it came from."""

    size: int | None
    source: str


def agree_on_node_size(nodes: list[dict]) -> NodeAgreement:
    """The node size N the layout places groups by, from every rank's `launcher_node()` (index = global rank): the
    one the launchers that started the ranks state, else what the ranks' host names show (consecutive ranks per
    host, the same number on each; one host: one node). Checked where it can be: every launcher and every rank
    states the same N, N divides the world, rank r's node index is r // N and its index inside the node r % N
    where a launcher states them (it numbers ranks node by node), and the ranks of one node share a host (different
    nodes may share one: agents simulating nodes). Ranks on several hosts are never one node. A variable whose local
    index is not below its size on some rank is not a launcher's (Accelerate's CPU default, `NodeStatement.
    contradicts_itself`) and is left out. UnsupportedSetupError otherwise, naming each launcher's variable — the same on every rank, which all see the same list. The ranks'
    Ulysses sizes (VLMCP_ULYSSES_SIZE) must agree as well: ranks that chose different layouts would wait for each
    other forever."""
    _check_ulysses_sizes_agree(nodes)
    world = len(nodes)
    stated = _stated_sizes(nodes, world)
    if not stated:
        return _node_size_from_hosts([n["host"] for n in nodes])
    size, problem = _one_stated_size(stated, world)
    problem = problem or _numbering_problem(nodes, size, world, read=set(stated))
    if problem:
        raise UnsupportedSetupError(
            f"vlmcp-patch places the Ulysses subgroups inside nodes of the size the launcher states, but {problem}. "
            "Launch the same number of processes on every node (ranks numbered node by node), with one launcher's "
            "node variables in the ranks' environment, or none: the ranks' host names then tell the nodes."
        )
    return NodeAgreement(size=size, source=" and ".join(sorted(stated)))


def agreed_node_size(nodes: list[dict]) -> int | None:
    """The node size of `agree_on_node_size` alone (None: one node)."""
    return agree_on_node_size(nodes).size


def _check_ulysses_sizes_agree(nodes: list[dict]) -> None:
    overrides = sorted({n.get("ulysses_size", 0) for n in nodes})
    if len(overrides) > 1:
        raise UnsupportedSetupError(
            f"the ranks were given different VLMCP_ULYSSES_SIZE values {overrides} (0: automatic): set it, or call "
            "enable(ulysses_size=...), alike in every process."
        )


def _stated_sizes(nodes: list[dict], world: int) -> dict[str, dict[int, int]]:
    """Launcher variable -> {rank: the node size it states there}, for the launchers that describe every rank
    (`launcher.NodeStatement.left_out`). One that does not describe some rank is left out on every rank: an outer
    launcher (srun starting one torchrun agent per node; an sbatch script's SLURM_PROCID=0, equal to RANK on
    torchrun's rank 0 by chance), or a variable that contradicts itself (Accelerate's CPU default)."""
    stated: dict[str, dict[int, int]] = {}
    left_out: set[str] = set()
    for rank, node in enumerate(nodes):
        for statement in node["statements"]:
            if statement.left_out(world, rank) is None:
                stated.setdefault(statement.source, {})[rank] = statement.size
            else:
                left_out.add(statement.source)
    return {source: by_rank for source, by_rank in stated.items() if source not in left_out}


def _one_stated_size(stated: dict[str, dict[int, int]], world: int) -> tuple[int, str | None]:
    """The one size the launchers state on every rank, or a problem naming each variable that differs."""
    for source, by_rank in stated.items():
        if len(by_rank) < world:
            missing = sorted(set(range(world)) - set(by_rank))
            return 0, f"{source} is set on ranks {sorted(by_rank)} and not on ranks {missing}"
        if len(set(by_rank.values())) > 1:
            return 0, f"the ranks report different {source} values {sorted(set(by_rank.values()))}"
    sizes = {source: next(iter(by_rank.values())) for source, by_rank in stated.items()}
    if len(set(sizes.values())) > 1:
        each = ", ".join(f"{source} = {size}" for source, size in sorted(sizes.items()))
        return 0, f"the launchers' variables state different node sizes: {each}"
    return next(iter(sizes.values())), None


def _numbering_problem(nodes: list[dict], size: int, world: int, read: set[str]) -> str | None:
    """Whether the ranks are numbered node by node in nodes of `size` on one host each, as far as the node and local
    indices of the launchers `read` (`_stated_sizes`) and the host names show; None when they are."""
    if size < 1 or world % size:
        named = next(s.stated for s in nodes[0]["statements"] if s.source in read)
        return f"{named} does not divide the world size {world}"
    for rank, node in enumerate(nodes):
        for s in (s for s in node["statements"] if s.source in read):
            if (problem := s.misplaced(rank)) is not None:
                return problem
    for first in range(0, world, size):
        hosts = sorted({n["host"] for n in nodes[first:first + size]})
        if len(hosts) > 1:
            return f"ranks {first}..{first + size - 1} (one node of {size}) run on hosts {hosts}"
    return None


def _node_size_from_hosts(hosts: list[str]) -> NodeAgreement:
    """Where no launcher states the node size: the ranks' host names, each host one node of consecutive ranks, the
    same number on each; one host: one node (None). UnsupportedSetupError where the hosts show another layout."""
    runs: list[list] = []  # [host, ranks] for each run of consecutive ranks on one host
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    if len(runs) == 1:
        return NodeAgreement(size=None, source="the ranks' host names (one host: one node)")
    counts = {host: ranks for host, ranks in runs}
    problem = None
    if len(counts) < len(runs):  # a host holds two runs
        host = next(h for i, (h, _) in enumerate(runs) if h in {g for g, _ in runs[:i]})
        where = [rank for rank, h in enumerate(hosts) if h == host]
        problem = f"host {host!r} holds ranks {where}, not consecutive: the ranks are not numbered node by node"
    elif len(set(counts.values())) > 1:
        problem = f"the hosts hold different numbers of ranks {counts}"
    if problem:
        raise UnsupportedSetupError(
            "vlmcp-patch places the Ulysses subgroups inside nodes; no launcher states the node size ("
            f"{', '.join(v.size for v in NODE_SOURCES)}), and from the ranks' host names {problem}. Launch the same "
            "number of processes on every node, ranks numbered node by node."
        )
    return NodeAgreement(size=runs[0][1], source="the ranks' host names")


def node_size() -> int | None:
    """Ranks per node for the layout (`layout.ulysses_degree`): agreed by every rank when the CP groups were created
    (`agree_on_node_size`), else — before that, or without torch.distributed — what this process's launchers state;
    None: unknown (one node)."""
    world = dist.get_world_size() if distributed_ready() else None
    if world not in _NODE_SIZE:
        return launch().node_size
    agreed = _NODE_SIZE[world]
    if isinstance(agreed, UnsupportedSetupError):
        raise UnsupportedSetupError(str(agreed))  # a fresh one each time: every forward of the launch refuses
    return agreed.size


def node_source() -> str | None:
    """Where the node size the ranks agreed on came from (a launcher's variable, or the host names); None before
    the CP groups are created or when the launch was refused."""
    agreed = _NODE_SIZE.get(dist.get_world_size() if distributed_ready() else None)
    return agreed.source if isinstance(agreed, NodeAgreement) else None


def ulysses_for(size: int, heads: list[int]) -> int:
    """U of the P = U x R layout at CP size `size` for these head counts, on this launch's nodes (`node_size`), or
    as VLMCP_ULYSSES_SIZE sets it (checked: UnsupportedSetupError). The same on every rank of a launch."""
    return ulysses_degree(size, heads, node_size(), SETTINGS.ulysses_size or None)


def _agree_on_nodes(world: int) -> None:
    """Every rank's launcher view gathered once per world (collective: with the groups, before any compute); a
    launch that fails the checks raises here on every rank, and again at every later forward."""
    if world not in _NODE_SIZE:
        nodes = [None] * world
        group = world_group()
        communicate("all-gather of the launcher's nodes", group, 1,
                    lambda: dist.all_gather_object(nodes, launcher_node(), group=group))
        try:
            _NODE_SIZE[world] = agree_on_node_size(nodes)
        except UnsupportedSetupError as error:
            _NODE_SIZE[world] = error
    node_size()


def _group_for(size: int):
    world = _check_world(size)
    key = (world, size)
    if key not in _GROUPS:
        # A group of its own even when it spans the world, so the exchanges never interleave with the
        # gradient all-reduces DDP / DeepSpeed issue on the default group. new_group is collective over
        # the whole world: every rank creates every block, in order.
        mine = None
        for start in range(0, world, size):
            group = _new_group(list(range(start, start + size)), "cp")
            if start <= dist.get_rank() < start + size:
                mine = group
        _GROUPS[key] = mine
    _agree_on_nodes(world)  # U depends on it: every rank must place the subgroups alike
    return _GROUPS[key]


@dataclass(frozen=True)
class RingPeers:
    """A rank's ring of the P = U x R layout: the R ranks that hold the same heads in the R Ulysses subgroups. Its
    process group, this rank's index in it, its size, and the global ranks of the next and the previous member."""

    group: object
    index: int
    size: int
    next_rank: int
    prev_rank: int
    timeout: object = None  # what a pass waits at most (`_ring_pass_timeout`)


def _ring_pass_timeout(group):
    """The group's timeout for the ring's point-to-point waits on gloo, whose wait does not apply it by itself; None
    elsewhere (NCCL's watchdog applies it, and a wait given a timeout would hold the host until the pass is done)."""
    return group_timeout(group) if dist.get_backend(group) == "gloo" else None


@dataclass(frozen=True)
class HybridGroups:
    """This rank's groups in the P = U x R layout (`layout.Split`): its Ulysses subgroup (U consecutive ranks, the
    all-to-all of sequence for heads) and its ring (None when R = 1)."""

    ulysses: CPGroup
    ring: RingPeers | None


def hybrid_groups(cp: CPGroup, ulysses: int) -> HybridGroups:
    """The Ulysses subgroup and ring of this rank for a CP group `cp` split as U = `ulysses` times R. With U = P the
    subgroup is the CP group itself: the exchanges of the all-to-all layout, unchanged."""
    if ulysses == cp.size:
        return HybridGroups(ulysses=cp, ring=None)
    world, me = dist.get_world_size(), dist.get_rank()
    key = (world, cp.size, ulysses)
    if key not in _HYBRID:
        # new_group is collective over the whole world: every rank creates every subgroup and ring, in order.
        mine = {}
        for subgroups, rings in hybrid_rank_lists(world, cp.size, ulysses):
            for ranks in subgroups:
                group = _new_group(ranks, "ulysses")
                if me in ranks:
                    mine["ulysses"] = group
            for ranks in rings:
                group = _new_group(ranks, "ring")
                if me in ranks:
                    mine["ring"] = (group, ranks, _ring_pass_timeout(group))
        _HYBRID[key] = mine
    groups = _HYBRID[key]
    ring_group, ranks, timeout = groups["ring"]
    index = ranks.index(me)
    return HybridGroups(
        ulysses=CPGroup(group=groups["ulysses"], rank=cp.rank % ulysses, size=ulysses),
        ring=RingPeers(group=ring_group, index=index, size=len(ranks), next_rank=ranks[(index + 1) % len(ranks)],
                       prev_rank=ranks[(index - 1) % len(ranks)], timeout=timeout),
    )


def get_cp_group(size: int | None = None) -> CPGroup | None:
    """This rank's CP group for `size` (default: the CP size in effect); None when that size is 1."""
    size = cp_size() if size is None else size
    if size == 1:
        return None
    return CPGroup(group=_group_for(size), rank=dist.get_rank() % size, size=size)


def cp_requested() -> bool:
    """CP is in effect for the next forward: size > 1, the package applied, not inside `disabled()`."""
    return cp_size() > 1 and not BYPASS.get()


@contextlib.contextmanager
def disabled():
    """Run the forwards inside this block without CP (each rank computes the full sequence alone).

    Use it for evaluation or generation on a single rank, or for debugging; `generate()` does it itself.
    """
    with scoped(BYPASS, True):
        yield


def active_cp_group() -> CPGroup | None:
    """The CP group of the next forward, or None when it runs without CP."""
    return get_cp_group() if cp_requested() else None


def cp_running() -> bool:
    """CP is requested and torch.distributed is up: the training integrations act."""
    return cp_requested() and distributed_ready()


def world_group():
    """A group of all ranks, separate from the default one (DeepSpeed's sequence-data-parallel group)."""
    world = dist.get_world_size()
    if world not in _WORLD_GROUP:
        _WORLD_GROUP[world] = _new_group(list(range(world)), "world")
    return _WORLD_GROUP[world]


def data_parallel_world_size() -> int:
    """Number of data-parallel replicas: world size / CP size (1 without torch.distributed)."""
    if not distributed_ready():
        return 1
    size = cp_size()
    return dist.get_world_size() if size == 1 else _check_world(size) // size


def data_parallel_rank() -> int:
    """Index of this rank's CP group among the data-parallel replicas (ranks of one group share it)."""
    if not distributed_ready():
        return 0
    size = cp_size()
    if size > 1:
        _check_world(size)
    return dist.get_rank() // size


def sum_over_cp_group(tensors, group=None) -> None:
    """All-reduce (sum) each tensor in place over the CP `group` (default: this rank's group in effect; a no-op
    with CP off). A raw training loop calls it on the parameters' gradients after backward: each rank holds its
    slice's share, their sum is the P=1 gradient (the training integrations reduce gradients themselves)."""
    group = group if group is not None else getattr(get_cp_group(), "group", None)
    if group is None:
        return
    summed = [tensor for tensor in tensors if tensor is not None]
    for tensor in summed:
        communicate("gradient sum (sum_over_cp_group)", group, tensor.numel(),
                    lambda tensor=tensor: dist.all_reduce(tensor, group=group))
    shares_summed(summed)


def gather_sequence(tensor: torch.Tensor, dim: int = 1, length: int | None = None, cp: CPGroup | None = None):
    """Gather a sequence-sharded tensor (e.g. a hidden state of this rank's slice) over the CP group `cp`
    (default: this rank's group in effect).

    Each rank holds a contiguous slice of the sequence padded to a multiple of the CP size; the result
    is the concatenation in rank order, cut to `length` when given. Backward keeps each rank's own slice
    of the gradient: call it on every rank and compute the same thing from the result, as with the loss.
    With CP off it returns `tensor`. Across a ring (a CP size beyond the heads, `layout.Split`) a rank holds two
    chunks of the row, not one slice: the rank order is then not the row's (the forward's own outputs — logits,
    `token_log_probs` — are in row order).
    """
    cp = cp or get_cp_group()
    if cp is None:
        return tensor
    full = gather_keep_local_grad(tensor, dim, cp.group, cp.size, cp.rank)
    return full if length is None else full.narrow(dim, 0, length)
