"""The run-time check that every torch.distributed call of the package goes through its wrapper.

The wrapper is `vlmcp_patch.collectives.communication`: `communicate(op, group, count, run)` records the collective
and hands `run` to `raising`, which applies the CP groups' timeout and names the layer on a failure. A call outside it
would hang silently on a failed peer, name no site and be missing from the ranks' debug comparison.

`install()` (each rank of the suite's CP runs: `harness.run_distributed` and `run_script` call it before anything
else) replaces every communicating callable of torch.distributed with a checker of the same behaviour:

- the functions of `torch.distributed` (also bound in `distributed_c10d`), `torch.distributed.nn(.functional)` and
  the functional collectives (`torch.distributed._functional_collectives`);
- the methods of `ProcessGroup` and of its backends (`Backend`: gloo, NCCL), and `Work.wait`;
- the operators beneath them, called from Python (`torch.ops._c10d_functional.*`, `torch.ops.c10d.*`).

Fail-closed: everything callable there is checked except the local queries named in `LOCAL` (ranks, sizes, names,
availability, teardown). A package module that bound one of torch's functions before `install()` ran (a
from-import or an alias; the package is already imported when a spawned rank unpickles its function) gets the
checker too.

The rule a checker applies, from the frame that called it: instrumentation frames are skipped (this module, the
tests' probes in `vlmcp_patch.fixtures`); if the caller is a frame of the package, the call must be made
by the wrapper's `raising` itself (a callable it was handed, e.g. a `functools.partial`) or by the function `raising`
called (the `run=lambda: ...` handed to `communicate` or `raising`), with only frames outside the package between
them (torch.compile's eager-disable wrapper). Anything else is recorded (`violations()`), and the rank fails at the
end of its run (`failure()`): raising at the call would leave the other ranks waiting in the collective. A call made
by torch itself (`all_gather_object`'s own `all_gather`) or by another library is not the package's call.

Calls that Dynamo traces (`torch.compiler.is_compiling()`) run unchecked: the frames then are the tracer's.
"""

from __future__ import annotations

import collections
import functools
import sys
import types

import torch

PACKAGE = "vlmcp_patch"
WRAPPER = ("vlmcp_patch.collectives.communication", "raising")
# Frames that only pass a call on: this module's checkers, the tests' and benchmarks' probes (they wrap
# torch.distributed's functions too).
INSTRUMENTATION = (__name__, "vlmcp_patch.fixtures")
# Not the runtime: the demo is a user's main job (its own init_process_group, its final barrier).
OUTSIDE_THE_RUNTIME = ("vlmcp_patch.demo",)

# What does not communicate ("module": in every module checked): queries of the process groups and the environment, their settings, their teardown.
LOCAL = {
    "module": {
        "get_rank", "get_world_size", "is_initialized", "is_available", "get_backend", "get_backend_config",
        "get_debug_level", "set_debug_level", "set_debug_level_from_env", "get_default_backend_for_device",
        "get_global_rank", "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks",
        "is_backend_available", "is_gloo_available", "is_mpi_available", "is_nccl_available", "is_ucc_available",
        "is_xccl_available", "is_torchelastic_launched", "supports_complex", "destroy_process_group",
        "register_rendezvous_handler", "_rank_not_in_group", "_get_process_group_name",
        "_compute_bucket_assignment_by_size", "_is_spmd_types_available", "_make_nccl_premul_sum",
        "_create_store_from_options", "_test_python_store", "_time_estimator", "_register_comm_hook",
        "_register_builtin_comm_hook", "allow_inflight_collective_as_graph_input_ctx",
    },
    "ProcessGroup": {
        "rank", "size", "name", "_get_backend", "_get_backend_name", "_device_types", "_id", "_backend_id",
        "_has_hooks", "_get_sequence_number_for_group", "_set_sequence_number_for_group", "_register_backend",
        "_set_default_backend", "_set_group_desc", "_set_group_name", "_enable_collectives_timing",
        "_register_on_completion_hook", "set_timeout", "get_group_store", "boxed", "unbox", "abort", "shutdown",
        "use_pg_for_symm_mem_rendezvous",
    },
    "Backend": {
        "rank", "size", "name", "_get_backend_name", "_get_sequence_number_for_group",
        "_set_sequence_number_for_group", "supports_coalescing", "supports_shrinking", "supports_splitting",
        "supports_tensor_alloc", "supports_time_estimate", "mem_allocator", "memory_stats", "allocate_tensor",
        "set_timeout", "abort", "shutdown", "suspend", "resume", "setUsePgForSymmMemRendezvous",
    },
}
# The operators' namespaces (`torch.ops.NAMESPACE`) of the collectives.
OPERATOR_NAMESPACES = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::")
# Of a communication's handle, what waits for it (the wrapper's `raising` waits for a ring pass it started).
WORK_WAITS = ("wait",)

_violations: collections.Counter = collections.Counter()
_through: collections.Counter = collections.Counter()  # torch's callable -> the package's calls of it, wrapped
_checkers: dict[int, object] = {}  # id(torch's callable) -> its checker, one per callable wherever it is bound


def _module_of(frame) -> str:
    return frame.f_globals.get("__name__") or ""


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _in_package(frame) -> bool:
    name = _module_of(frame)
    return _under(name, (PACKAGE,)) and not _under(name, INSTRUMENTATION + OUTSIDE_THE_RUNTIME)


def _is_wrapper(frame) -> bool:
    return (_module_of(frame), frame.f_code.co_name) == WRAPPER


def _through_the_wrapper(caller) -> bool:
    """Whether the package frame `caller` is the wrapper, or the function the wrapper called (frames outside the
    package between them)."""
    if _is_wrapper(caller):
        return True
    frame = caller.f_back
    while frame is not None and not _in_package(frame):
        frame = frame.f_back
    return frame is not None and _is_wrapper(frame)


def _check(spelled: str) -> None:
    caller = sys._getframe(1)  # the checker's, then its caller: instrumentation
    while caller is not None and _under(_module_of(caller), INSTRUMENTATION):
        caller = caller.f_back
    if caller is None or not _in_package(caller):
        return
    if _through_the_wrapper(caller):
        _through[spelled] += 1
    else:
        _violations[(spelled, caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name)] += 1


def _checker(spelled: str, original):
    """`original`, called as before, checked first (`_check`); one checker per callable."""
    if id(original) in _checkers:
        return _checkers[id(original)]

    def checked(*args, **kwargs):  # as a class's attribute, a method: `self` is args[0]
        if not torch.compiler.is_compiling():
            _check(spelled)
        return original(*args, **kwargs)

    functools.update_wrapper(checked, original)
    checked.__vlmcp_checked__ = original
    _checkers[id(original)] = checked
    _checkers[id(checked)] = checked  # installing twice keeps one checker
    return checked


def _module_functions(module, private: bool) -> dict[str, object]:
    """The functions torch.distributed defines that `module` binds (not its helpers imported from elsewhere)."""
    found = {}
    for name, value in vars(module).items():
        if name.startswith("__") or (name.startswith("_") and not private) or name in LOCAL["module"]:
            continue
        if type(value) not in (types.FunctionType, types.BuiltinFunctionType):  # type(): a deprecated name warns
            continue
        if not (getattr(value, "__module__", "") or "").startswith(("torch.distributed", "torch._C._distributed")):
            continue
        if name.endswith(("_setup_context", "_backward", "_meta")):  # autograd and tracing plumbing
            continue
        found[name] = value
    return found


def _wrap_modules() -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.nn as dist_nn
    import torch.distributed.nn.functional as dist_nn_functional

    for module, private in ((dist, True), (funcol, False), (dist_nn_functional, False), (dist_nn, False)):
        for name, value in _module_functions(module, private).items():
            setattr(module, name, _checker(f"{module.__name__}.{name}", value))
    _rebind([c10d])  # the same functions, by the names torch's own code calls them


def _wrap_classes() -> None:
    from torch._C import _distributed_c10d as c10d_classes

    instancemethod = type(vars(c10d_classes.ProcessGroup)["rank"])
    for cls, only in ((c10d_classes.ProcessGroup, None), (c10d_classes.Backend, None),
                      (c10d_classes.Work, WORK_WAITS)):
        for name, value in list(vars(cls).items()):
            if not isinstance(value, instancemethod) or name.startswith("_pybind11"):
                continue
            if (only is not None and name not in only) or (only is None and name in LOCAL[cls.__name__]):
                continue
            setattr(cls, name, _checker(f"{cls.__name__}.{name}", getattr(cls, name)))


def _wrap_ops() -> None:
    """The operators under the functional collectives and the process groups (`torch.ops._c10d_functional.*`,
    `torch.ops.c10d.*`), called from Python by their packet or an overload: checked in their classes' `__call__`,
    so every other operator only pays a look at its name."""
    from torch._ops import OpOverload, OpOverloadPacket

    for cls, attribute in ((OpOverloadPacket, "_qualified_op_name"), (OpOverload, "_name")):
        if not hasattr(cls.__call__, "__vlmcp_checked__"):
            cls.__call__ = _operator_checker(cls.__call__, attribute)


def _operator_checker(original, attribute: str):
    def called(self, /, *args, **kwargs):
        name = getattr(self, attribute)
        if name.startswith(OPERATOR_NAMESPACES) and not torch.compiler.is_compiling():
            _check("torch.ops." + name.replace("::", "."))
        return original(self, *args, **kwargs)

    functools.update_wrapper(called, original)
    called.__vlmcp_checked__ = original
    return called


def _rebind(modules) -> None:
    """Where a module holds one of torch's callables this module checks (a from-import, an alias made before
    `install`), give it the checker."""
    for module in modules:
        for name, value in list(vars(module).items()):
            checker = _checkers.get(id(value))
            if checker is not None and checker is not value and getattr(checker, "__vlmcp_checked__", None) is value:
                setattr(module, name, checker)


def install() -> None:
    """Check every communicating torch.distributed call of this process from now on (idempotent; module
    docstring). Call it first in a rank."""
    if not _checkers:
        _wrap_modules()
        _wrap_classes()
        _wrap_ops()
    _rebind([m for name, m in list(sys.modules.items()) if _under(name, (PACKAGE,)) and m is not None])


def original(checked):
    """torch's callable a checker stands for (itself when it is not one)."""
    return getattr(checked, "__vlmcp_checked__", checked)


def installed() -> bool:
    import torch.distributed as dist

    return hasattr(dist.all_reduce, "__vlmcp_checked__")


def violations() -> list[tuple[str, str, int, str, int]]:
    """(torch's callable, file, line, function, calls) of each package call outside the wrapper so far."""
    return [(*site, calls) for site, calls in _violations.items()]


def through_the_wrapper() -> dict[str, int]:
    """torch's callable -> how many times the package called it through the wrapper so far (the check saw them)."""
    return dict(_through)


def take_violations() -> list[tuple[str, str, int, str, int]]:
    """`violations()`, then forget them."""
    found = violations()
    _violations.clear()
    return found


def failure() -> str | None:
    """The message a rank fails with when the package called torch.distributed outside the wrapper, else None."""
    found = violations()
    if not found:
        return None
    sites = "; ".join(f"{spelled} at {file}:{line} in {function} ({calls} call{'s' * (calls > 1)})"
                      for spelled, file, line, function, calls in found)
    return ("vlmcp-patch called torch.distributed outside its wrapper (collectives/communication.py: "
            f"communicate, or raising for a wait): {sites}. Such a call hangs silently on a failed peer, names no "
            "layer and is missing from the ranks' debug comparison; hand it to communicate(op, group, count, "
            "lambda: ...). A torch.distributed function that does not communicate belongs in "
            "tests/helpers/wrapped_check.LOCAL.")
