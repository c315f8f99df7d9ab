"""Every call of the package into torch.distributed that communicates goes through the error wrapper and the debug
record (`collectives/communication.communicate`, or `raising` for the wait of a communication started there): read
from the source, each such call must sit inside a function handed to one of them. A collective outside would hang
silently on a failed peer, name no site, and be missing from the ranks' comparison."""

from __future__ import annotations

import ast

from tests.helpers.harness import ROOT

PACKAGE = ROOT / "vlmcp_patch"
COMMUNICATING = {
    "all_reduce", "reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "new_subgroups",
}
WRAPPERS = {"communicate", "raising"}
# Not the runtime: the demo (the main job) ends its run with a barrier as every example does.
OUTSIDE_THE_RUNTIME = {("vlmcp_patch/demo.py", "barrier")}


def _looked_up(tree) -> dict[str, str]:
    """Local names bound to a collective looked up by name: `run = torch_collective("NAME", ...)` -> {run: NAME}."""
    return {node.targets[0].id: ast.literal_eval(node.value.args[0]) for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "torch_collective" and isinstance(node.targets[0], ast.Name)}


def _called_name(call: ast.Call, looked_up: dict[str, str]) -> str | None:
    """The torch.distributed function a call runs: `dist.NAME(...)`, or one `torch_collective` looked up."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "dist":
        return func.attr
    if isinstance(func, ast.Name):
        return looked_up.get(func.id)
    return None


def _wrapped(node, parents: dict) -> bool:
    """Whether `node` lies in a function (lambda) that is an argument of a call to one of the wrappers."""
    while node in parents:
        parent = parents[node]
        if isinstance(node, ast.Lambda) and isinstance(parent, ast.Call) and node in parent.args and \
                getattr(parent.func, "id", None) in WRAPPERS:
            return True
        node = parent
    return False


def communicating_calls() -> list[tuple[str, int, str, bool]]:
    """(file, line, torch.distributed function, wrapped) of every communicating call in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        looked_up = _looked_up(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _called_name(node, looked_up)) in COMMUNICATING:
                found.append((str(path.relative_to(ROOT)), node.lineno, name, _wrapped(node, parents)))
    return found


def test_every_communication_goes_through_the_wrapper():
    calls = communicating_calls()
    bypassing = [c for c in calls if not c[3] and (c[0], c[2]) not in OUTSIDE_THE_RUNTIME]
    assert not bypassing, f"torch.distributed called outside communicate / raising: {bypassing}"
    # the reader sees them: the all-to-alls, the renamed gathers, the groups' creation and the vision agreement
    names = {c[2] for c in calls}
    assert {"all_to_all_single", "all_gather_single", "reduce_scatter_single", "new_group", "all_reduce",
            "batch_isend_irecv", "all_gather_object", "broadcast_object_list"} <= names, names


def test_the_reader_finds_a_bypass():
    """The control: a module calling a collective outside the wrapper is caught."""
    source = "import torch.distributed as dist\ndef f(x, g):\n    dist.all_reduce(x, group=g)\n" \
             "    communicate('ok', g, 1, lambda: dist.all_reduce(x, group=g))\n" \
             "    run = torch_collective('reduce_scatter_single', 'reduce_scatter_tensor')\n    run(x, x, group=g)\n"
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    looked_up = _looked_up(tree)
    seen = [(name, _wrapped(n, parents)) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and (name := _called_name(n, looked_up)) in COMMUNICATING]
    assert sorted(seen) == [("all_reduce", False), ("all_reduce", True), ("reduce_scatter_single", False)]
