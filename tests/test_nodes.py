"""Across nodes: the Ulysses subgroups (the all-to-all of every layer) inside a node, the ring across nodes.

The layout arithmetic alone for large launches (P = 64 over nodes of 8, and random sizes): U divides the node size,
so every subgroup lies inside a node; within one node nothing changes; VLMCP_ULYSSES_SIZE is checked against the
heads and the node size. The launcher's node size is checked (`agreed_node_size`). And a launch of two torchrun
agents of 2 processes on this host (P = 4 over 2 "nodes"): every subgroup inside a node, the ring across them, loss
and every gradient equal to stock at P=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.harness import HANG_TIMEOUT, ROOT, _dump_stacks_then_kill, free_port
from tests.helpers.launcher_envs import NESTED, NODE_VARIABLES, environment
from tests.helpers.parity import TOL
from vlmcp_patch.distributed import NodeAgreement, agree_on_node_size, agreed_node_size, launcher_node
from vlmcp_patch.errors import UnsupportedSetupError
from vlmcp_patch.launcher import NODE_SOURCES, NodeStatement, launch
from vlmcp_patch.layout import node_spans, ulysses_degree


def test_sixty_four_ranks_over_nodes_of_eight_keep_the_all_to_all_inside_a_node():
    for heads in ([16], [32], [64], [64, 48]):
        ulysses = ulysses_degree(64, heads, node_size=8)
        assert ulysses == 8, heads
        assert node_spans(64, ulysses, 8, world=128) == {"ulysses_inside_node": True, "ring_crosses_nodes": True}
    # the control: the heads alone pick U = 16 or more, whose subgroups span two nodes
    assert ulysses_degree(64, [16]) == 16
    assert not node_spans(64, 16, 8, world=128)["ulysses_inside_node"]
    # heads that allow less than a node: the subgroups are smaller, still inside
    assert ulysses_degree(64, [4], node_size=8) == 4 and ulysses_degree(48, [12], node_size=8) == 4
    assert ulysses_degree(16, [2, 8], node_size=8) == 2


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 48), node=st.sampled_from([1, 2, 4, 6, 8]), heads=st.lists(st.integers(1, 64), min_size=1,
                                                                                         max_size=2))
def test_the_subgroups_lie_inside_a_node_and_within_one_node_nothing_changes(size, node, heads):
    ulysses = ulysses_degree(size, heads, node_size=node)
    assert size % ulysses == 0 and node % ulysses == 0 and all(h % ulysses == 0 for h in heads)
    world = size * node  # several CP groups, every node whole
    assert node_spans(size, ulysses, node, world=world)["ulysses_inside_node"]
    # the largest such U: no larger divisor of the node size fits the heads and P
    assert not any(node % u == 0 and size % u == 0 and all(h % u == 0 for h in heads)
                   for u in range(ulysses + 1, size + 1))
    if node % size == 0:  # every CP group inside one node: the choice without nodes
        assert ulysses == ulysses_degree(size, heads)
    if ulysses < size and size > node:
        assert node_spans(size, ulysses, node, world=world)["ring_crosses_nodes"]


def test_the_override_is_checked_against_the_heads_and_the_node_size():
    assert ulysses_degree(16, [16], node_size=8, override=4) == 4
    assert ulysses_degree(16, [16], node_size=8, override=16) == 16  # whole nodes per subgroup: allowed by choice
    assert ulysses_degree(1, [16], node_size=8, override=4) == 1  # P=1: no subgroups
    with pytest.raises(UnsupportedSetupError, match=r"VLMCP_ULYSSES_SIZE=3 .*must divide the CP size 16"):
        ulysses_degree(16, [16], node_size=8, override=3)
    with pytest.raises(UnsupportedSetupError, match=r"head counts \[16, 2\]"):
        ulysses_degree(16, [16, 2], override=4)
    with pytest.raises(UnsupportedSetupError, match="would straddle nodes of 4 ranks"):
        ulysses_degree(12, [12], node_size=4, override=6)


TORCHRUN = NODE_SOURCES[0]


def _nodes(local, groups, hosts, variables=TORCHRUN):
    """Each rank's `launcher_node()` where one launcher (`variables`) states the node size `local[r]` (None: not set)
    and the node index `groups[r]`."""
    return [{"statements": () if n is None else (NodeStatement(variables, n, None, g, None),), "host": h,
             "ulysses_size": 0} for n, g, h in zip(local, groups, hosts, strict=True)]


def test_the_launchers_node_size_is_checked_against_the_hosts():
    assert agreed_node_size(_nodes([None] * 4, [None] * 4, "aaaa")) is None  # no launcher, one host: one node
    assert agreed_node_size(_nodes([2] * 4, [0, 0, 1, 1], "aabb")) == 2
    assert agreed_node_size(_nodes([2] * 4, [0, 0, 1, 1], "aaaa")) == 2  # two agents on one host
    with pytest.raises(UnsupportedSetupError, match=r"different LOCAL_WORLD_SIZE \(torchrun / Accelerate\) values"):
        agreed_node_size(_nodes([2, 2, 4, 4], [0, 0, 1, 1], "aabb"))
    with pytest.raises(UnsupportedSetupError, match="run on hosts"):
        agreed_node_size(_nodes([2] * 4, [0, 0, 1, 1], "abab"))
    with pytest.raises(UnsupportedSetupError, match="GROUP_RANK 1, not 0: the ranks are not numbered node by node"):
        agreed_node_size(_nodes([2] * 4, [0, 1, 0, 1], "aaaa"))
    with pytest.raises(UnsupportedSetupError, match=r"LOCAL_WORLD_SIZE=4 \(torchrun / Accelerate\) does not divide "
                       "the world size 6"):
        agreed_node_size(_nodes([4] * 6, [None] * 6, "aaaaaa"))
    with pytest.raises(UnsupportedSetupError, match=r"set on ranks \[0, 1\] and not on ranks \[2, 3\]"):
        agreed_node_size(_nodes([2, 2, None, None], [0, 0, None, None], "aabb"))
    differing = _nodes([None] * 2, [None] * 2, "aa")
    differing[1]["ulysses_size"] = 2  # one rank launched with VLMCP_ULYSSES_SIZE=2, the other without
    with pytest.raises(UnsupportedSetupError, match=r"different VLMCP_ULYSSES_SIZE values \[0, 2\]"):
        agreed_node_size(differing)


def _launch_views(monkeypatch, world: int, per_node: int, *launchers: str, host=lambda rank: "one-host",
                  extra=lambda rank: {}) -> list[dict]:
    """Each rank's `launcher_node()` read from its environment as `launchers` set it, then `extra` (every other
    launcher's node variables removed), rank by rank in this process."""
    views = []
    for rank in range(world):
        for name in NODE_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
        for launcher in launchers:
            env.update(environment(launcher, rank, world, per_node))
        env.update(extra(rank))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr("socket.gethostname", lambda rank=rank: host(rank))
        views.append(launcher_node())
    return views


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "slurm", "srun", "openmpi", "mpich"])
def test_each_launchers_variables_give_the_node_size_and_the_layout_torchruns_give(launcher, monkeypatch):
    """Two nodes of 4 ranks (P = 8, 8 heads): every launcher's own variables give N = 4, named as the source, and the
    layout torchrun's give (U = 4 inside each node, a ring of 2 across); `python -m vlmcp_patch` names the source."""
    from vlmcp_patch.layout import hybrid_rank_lists
    from vlmcp_patch.report import node_lines

    agreed = agree_on_node_size(_launch_views(monkeypatch, 8, 4, launcher, host=lambda r: f"host{r // 4}"))
    variable = {"torchrun": "LOCAL_WORLD_SIZE", "deepspeed": "LOCAL_SIZE", "slurm": "SLURM_TASKS_PER_NODE",
                "srun": "SLURM_TASKS_PER_NODE", "openmpi": "OMPI_COMM_WORLD_LOCAL_SIZE", "mpich": "MPI_LOCALNRANKS"}[launcher]
    assert agreed.size == 4 and agreed.source.startswith(variable), agreed
    ulysses = ulysses_degree(8, [8], agreed.size)
    assert ulysses == 4 and hybrid_rank_lists(8, 8, ulysses) == hybrid_rank_lists(8, 8, ulysses_degree(8, [8], 4))
    assert node_lines(launch())[0].startswith(f"  ranks per node: 4, from {variable} (")
    # the control: the same ranks with no launcher's variables and one host count as one node, U = 8 across both
    assert agreed_node_size(_launch_views(monkeypatch, 8, 4, "none")) is None and ulysses_degree(8, [8], None) == 8


def test_slurms_compressed_tasks_per_node_list_gives_each_nodes_count(monkeypatch):
    """`SLURM_TASKS_PER_NODE` lists every node's tasks (`2(x3),1`); a malformed list says nothing. Nodes of unequal
    counts are laid out in blocks of the counts' greatest common divisor, each block inside one node."""
    from vlmcp_patch.launcher import _tasks_per_node

    assert _tasks_per_node("2(x3),1") == [2, 2, 2, 1] and _tasks_per_node("8") == [8]
    assert _tasks_per_node("2(x") is None and _tasks_per_node("") is None and _tasks_per_node("a,2") is None
    assert _tasks_per_node("0,2") is None
    views = _launch_views(monkeypatch, 12, 4, "srun", extra=lambda r: {
        "SLURM_TASKS_PER_NODE": "8,4", "SLURM_NODEID": str(r // 8), "SLURM_LOCALID": str(r % 8)})
    assert [{(st.size, st.first_of_node, st.node_count) for st in view["statements"]} for view in views] == (
        [{(4, 0, 8)}] * 8 + [{(4, 8, 4)}] * 4)
    assert [st.stated for st in views[0]["statements"]] == [
        "SLURM_TASKS_PER_NODE=8,4 (SLURM: nodes of 8 and 4 ranks, laid out in blocks of 4)"]


def _nested_views(monkeypatch, nested) -> list[dict]:
    """Each rank's `launcher_node()` with exactly `nested`'s variables for that rank (RANK and WORLD_SIZE as the
    script or the launcher sets them) and its machine's host name."""
    return _launch_views(monkeypatch, nested.world, 1, "none", host=lambda r: f"node{nested.node_of(r)}",
                         extra=nested.variables)


@pytest.mark.parametrize("name", list(NESTED))
def test_every_launch_as_it_really_runs_is_accepted_with_its_node_size_or_refused_naming_the_contradiction(
        name, monkeypatch):
    """Launchers inside launchers, with every variable each one leaves in a rank's environment
    (`launcher_envs.NESTED`): the launcher that started the ranks gives the node size; a scheduler's variables count
    only where they describe these very ranks on every rank (SLURM_PROCID = RANK and SLURM_NTASKS = WORLD_SIZE);
    the launch is refused only where variables that describe the ranks contradict each other, naming both."""
    nested = NESTED[name]
    views = _nested_views(monkeypatch, nested)
    if nested.refused:
        with pytest.raises(UnsupportedSetupError, match=nested.refused):
            agree_on_node_size(views)
        return
    assert agree_on_node_size(views) == NodeAgreement(size=nested.size, source=nested.source)
    # the layout's nodes really lie inside the machines: every block of `size` consecutive ranks on one host
    assert all(len({nested.node_of(r) for r in range(first, first + nested.size)}) == 1
               for first in range(0, nested.world, nested.size))


@pytest.mark.parametrize("name", [name for name, nested in NESTED.items() if not nested.refused])
def test_each_rank_reads_the_ranks_of_its_own_node_from_the_launcher_that_started_it(name, monkeypatch):
    """`Launch.ranks_on_this_node` (what the host's room is shared by) on every rank of every launch as it really
    runs: the ranks on that rank's machine, the entry for its node on SLURM's uneven nodes (8 and 4, 3 and 1), where
    the layout's node size is the counts' greatest common divisor; an outer launcher's variables do not count."""
    nested = NESTED[name]
    for rank in range(nested.world):
        _launch_views(monkeypatch, 1, 1, "none", extra=lambda _, rank=rank: {
            "RANK": str(rank), "WORLD_SIZE": str(nested.world), **nested.variables(rank)})
        on_machine = sum(nested.node_of(other) == nested.node_of(rank) for other in range(nested.world))
        assert launch().ranks_on_this_node == on_machine, (name, rank)


def test_the_report_names_why_an_outer_launchers_variables_are_left_out(monkeypatch):
    """torchrun inside `sbatch --ntasks-per-node=8`, on rank 1: the script's SLURM variables are named, with why."""
    from vlmcp_patch.report import node_lines

    _nested_views(monkeypatch, NESTED["torchrun inside sbatch --ntasks-per-node=8"])  # leaves rank 7's environment
    lines = node_lines(launch())
    assert lines[0] == "  ranks per node: 8, from LOCAL_WORLD_SIZE (torchrun / Accelerate)", lines
    assert ("  SLURM_TASKS_PER_NODE=8 (SLURM) left out: that launcher numbers this process SLURM_PROCID=0, not RANK=7 "
            "(an outer launcher)") in lines, lines


def test_without_launcher_variables_the_host_names_tell_the_nodes(monkeypatch):
    """No launcher's node variable: consecutive ranks per host, the same number on each, make the nodes; hosts that
    hold ranks out of node order or unequal numbers are refused (never one node over several hosts)."""
    views = _launch_views(monkeypatch, 4, 2, "none", host=lambda r: f"host{r // 2}")
    assert agree_on_node_size(views) == NodeAgreement(size=2, source="the ranks' host names")
    assert agreed_node_size(_nodes([None] * 6, [None] * 6, "aaabbb")) == 3
    with pytest.raises(UnsupportedSetupError, match=r"host 'a' holds ranks \[0, 2\], not consecutive"):
        agreed_node_size(_nodes([None] * 4, [None] * 4, "abab"))
    with pytest.raises(UnsupportedSetupError, match=r"different numbers of ranks \{'a': 3, 'b': 1\}"):
        agreed_node_size(_nodes([None] * 4, [None] * 4, "aaab"))


def test_launchers_that_disagree_are_refused_naming_each_and_an_outer_launcher_is_left_out(monkeypatch):
    # srun starting one torchrun agent per node: SLURM started 2 tasks, not the world's 8 — torchrun's variables rule
    outer = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_LOCALID": "0"}
    views = _launch_views(monkeypatch, 8, 4, "torchrun", host=lambda r: f"host{r // 4}",
                          extra=lambda r: {**outer, "SLURM_NODEID": str(r // 4)})
    assert agree_on_node_size(views).size == 4
    from vlmcp_patch.report import node_lines

    assert "SLURM_NTASKS_PER_NODE=1 (SLURM) left out: that launcher started 2 processes" in "\n".join(
        node_lines(launch()))
    # the control: launchers that both started the ranks and state different node sizes
    views = _launch_views(monkeypatch, 8, 4, "torchrun", extra=lambda r: {"MPI_LOCALNRANKS": "8", "PMI_SIZE": "8"})
    with pytest.raises(UnsupportedSetupError, match=r"state different node sizes: LOCAL_WORLD_SIZE \(torchrun / "
                       r"Accelerate\) = 4, MPI_LOCALNRANKS \(MPICH\) = 8"):
        agree_on_node_size(views)
    # Accelerate on CPU under the deepspeed launcher writes LOCAL_WORLD_SIZE=1 and keeps LOCAL_RANK: rank 1 then says
    # LOCAL_RANK=1 of a node of 1, a variable no launcher sets so, left out; LOCAL_SIZE rules
    views = _launch_views(monkeypatch, 4, 2, "deepspeed", extra=lambda r: {"LOCAL_WORLD_SIZE": "1"})
    assert agree_on_node_size(views) == NodeAgreement(size=2, source="LOCAL_SIZE (the deepspeed launcher)")
    assert "  LOCAL_WORLD_SIZE=1 (torchrun / Accelerate) left out: this process's LOCAL_RANK=1 is not below it" in (
        node_lines(launch()))
    # a local rank out of node order (SLURM_LOCALID) is refused too
    views = _launch_views(monkeypatch, 4, 2, "slurm", extra=lambda r: {"SLURM_LOCALID": str(1 - r % 2)})
    with pytest.raises(UnsupportedSetupError, match="rank 0 has SLURM_NODEID 0 and SLURM_LOCALID 1, which numbering "
                       "node by node gives rank 1"):
        agree_on_node_size(views)


def _agents(out: Path, procs_per_node: int = 2, nodes: int = 2) -> list[list[str]]:
    """The commands of `nodes` torchrun agents joined by one local rendezvous (a c10d store on this host)."""
    endpoint = f"127.0.0.1:{free_port()}"
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
             "--nproc-per-node", str(procs_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
             "--rdzv-id", "vlmcp-two-nodes", "-m", "tests.helpers.run_script", "tests/helpers/two_node_script.py",
             str(out)]
            for node in range(nodes)]


def launch_two_nodes(out: Path, timeout: float = 300, env: dict | None = None) -> list[dict]:
    """Both agents, bounded in time (collectives at HANG_TIMEOUT): every rank's result, written into `out`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLMCP_TIMEOUT": str(HANG_TIMEOUT), "VLMCP_CP_SIZE": "1",
           **(env or {})}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                              start_new_session=True) for cmd in _agents(out)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                _dump_stacks_then_kill(lambda sig, p=p: os.killpg(p.pid, sig))
            raise
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-4000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def _assert_two_node_layout(results: list[dict], override: int | None) -> None:
    """Every rank of the two-node run: N = 2, U = 2 (or the override), the all-to-all inside a node and the ring
    across both (with U = 4: neither), loss, logits and every gradient equal to stock at P=1."""
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    node_of = {r["rank"]: r["node"] for r in results}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    for r in results:
        where = f"rank {r['rank']}"
        assert r["node_size"] == 2 and r["ulysses"] == (override or 2), where  # the heads alone would give U = 4
        inside = len({node_of[m] for m in r["ulysses_ranks"]}) == 1  # the all-to-all inside one node
        across = len({node_of[m] for m in r["ring_ranks"]}) == 2  # the ring across both
        assert (inside, across) == ((True, True) if override is None else (False, False)), where
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, where
        assert r["grad_err"] <= TOL and r["missing_grads"] == [], f"{where}: {r['worst_grad']}"


@pytest.mark.integration
@pytest.mark.parametrize("override", [None, 4])
def test_two_nodes_on_one_host_keep_the_all_to_all_inside_a_node_and_equal_stock(override, tmp_path):
    """P = 4 over 2 nodes of 2. The control: VLMCP_ULYSSES_SIZE=4 (whole nodes per subgroup, allowed by choice) puts
    the all-to-all across both nodes — what the heads alone choose — and the same assertions see it."""
    env = {"VLMCP_ULYSSES_SIZE": str(override)} if override else {}
    results = sorted(launch_two_nodes(tmp_path, env=env), key=lambda r: r["rank"])
    _assert_two_node_layout(results, override)
    assert {r["node_source"] for r in results} == {"LOCAL_WORLD_SIZE (torchrun / Accelerate)"}


@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["deepspeed", "slurm", "srun", "openmpi", "mpich", "none"])
def test_two_nodes_with_each_launchers_variables_lay_out_as_under_torchrun(launcher, tmp_path):
    """The same two-node run, each rank holding only another launcher's node variables (`launcher_envs`): the same
    layout and exactness as torchrun's. `none`: no node variable, each node's ranks report a host name of their own
    (two machines), so only the host names tell the nodes; with one host name they would be one node (U = 4, the
    control in `test_each_launchers_variables_give_the_node_size_and_the_layout_torchruns_give`)."""
    results = sorted(launch_two_nodes(tmp_path, env={"VLMCP_TEST_LAUNCHER": launcher}), key=lambda r: r["rank"])
    _assert_two_node_layout(results, None)
    source = {"deepspeed": "LOCAL_SIZE (the deepspeed launcher)", "slurm": "SLURM_TASKS_PER_NODE (SLURM)",
              "srun": "SLURM_TASKS_PER_NODE (SLURM)", "openmpi": "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI)", "mpich": "MPI_LOCALNRANKS (MPICH)",
              "none": "the ranks' host names"}[launcher]
    assert {r["node_source"] for r in results} == {source}


def test_the_report_shows_the_layout_per_p_on_nodes_of_a_given_size(capsys):
    from vlmcp_patch.__main__ import main

    assert main(["--no-self-test", "--model", "tiny-qwen3.5", "--node-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "8 query heads, 8 DeltaNet value heads; nodes of 4 ranks" in out
    assert "P=4   U=4 x R=1  (all-to-all only)" in out  # one node: as without nodes
    assert "P=16  U=4 x R=4  (all-to-all among 4, a ring of 4; all-to-all inside a node; ring across nodes)" in out
    assert "P=32  U=4 x R=8" in out  # multiples of the node size up to 8 nodes


def test_the_groups_built_for_sixty_four_ranks_over_nodes_of_eight_follow_the_layout():
    """`distributed.hybrid_groups` itself on torch's fake process group backend (no processes launched): 128 ranks,
    CP groups of 64 as U = 8 (the node-aware choice for 32 heads on nodes of 8) x R = 8; for ranks at both ends and
    inside, the Ulysses subgroup is the rank's node and the ring one member per node of its CP group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vlmcp_patch import distributed

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    ulysses = ulysses_degree(64, [32], node_size=8)
    assert ulysses == 8
    for rank in (0, 13, 64, 127):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=128)
        try:
            groups = distributed.hybrid_groups(distributed.CPGroup(group=None, rank=rank % 64, size=64), ulysses)
            subgroup = dist.get_process_group_ranks(groups.ulysses.group)
            ring = distributed._HYBRID[(128, 64, ulysses)]["ring"][1]
        finally:
            distributed._release_groups()
            dist.destroy_process_group()
        node, block = rank // 8, rank // 64
        assert subgroup == list(range(node * 8, node * 8 + 8)), rank
        assert sorted(r // 8 for r in ring) == list(range(block * 8, block * 8 + 8)), rank  # one member per node
        assert groups.ring.size == 8 and ring[groups.ring.index] == rank, rank
        assert groups.ring.next_rank == ring[(groups.ring.index + 1) % 8], rank


def _forward_with_launcher_env(rank: int, world_size: int) -> dict:
    """One CP forward of the tiny Qwen3-VL at P = world size: the error it raises, if any, and how long it took."""
    import time

    import vlmcp_patch
    from vlmcp_patch.fixtures.data import Segment, make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config(), seed=0)
    batch = make_batch([[Segment(text=12)]], seed=1)
    vlmcp_patch.enable(cp_size=world_size)
    start = time.monotonic()
    try:
        model(**batch)
        return {"error": None}
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    finally:
        vlmcp_patch.enable(cp_size=1)


def test_a_launch_whose_node_size_does_not_fit_is_refused_on_every_rank_before_compute():
    from tests.helpers.harness import run_distributed

    for res in run_distributed(_forward_with_launcher_env, 2, env={"LOCAL_WORLD_SIZE": "3"}, timeout=300):
        assert res["error"] == "UnsupportedSetupError", res
        assert "LOCAL_WORLD_SIZE=3 (torchrun / Accelerate) does not divide the world size 2" in res["message"], res
        assert res["seconds"] < 10, res
