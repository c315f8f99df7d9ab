"""Ways package code can call torch.distributed, for `tests/test_collectives_wrapped.py`.

Its functions run as the module `vlmcp_patch.bypass_spellings` (`load_as_package_module()` executes this file under
that name), so their frames are the package's to the run-time check (`wrapped_check`). Each
function sums `x` (one element) over `group` and returns the sum: `BYPASSES` call torch.distributed around the wrapper
(each in one of the spellings a source scan for `dist.NAME(` misses), `WRAPPED` through it.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed
import torch.distributed as dist
import torch.distributed as td
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
from torch import distributed
from torch.distributed import all_reduce
from torch.distributed.distributed_c10d import all_reduce as c10d_all_reduce

from vlmcp_patch.collectives.communication import communicate, raising

NAME = "vlmcp_patch.bypass_spellings"
reduce_everywhere = dist.all_reduce  # an alias made at import


def load_as_package_module():
    """This file executed as the package's module `NAME` (registered in sys.modules, as an imported module is)."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, Path(__file__))
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[NAME]


def full_path(x, group):
    torch.distributed.all_reduce(x, group=group)
    return x


def from_import(x, group):
    all_reduce(x, group=group)
    return x


def module_from_import(x, group):
    distributed.all_reduce(x, group=group)
    return x


def module_alias(x, group):
    td.all_reduce(x, group=group)
    return x


def function_alias(x, group):
    reduce_everywhere(x, group=group)
    return x


def implementation_module(x, group):
    c10d_all_reduce(x, group=group)
    return x


def process_group_method(x, group):
    group.allreduce([x]).wait()
    return x


def backend_method(x, group):
    group._get_backend(x.device).allreduce([x]).wait()
    return x


def functional_collective(x, group):
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def autograd_collective(x, group):
    return dist_nn.all_reduce(x, group=group)


def operator(x, group):
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name))


def wait_outside(x, group):
    """Started through the wrapper, waited for around it (the wait belongs in `raising`)."""
    work = communicate("sum", group, x.numel(), lambda: dist.all_reduce(x, group=group, async_op=True))
    work.wait()
    return x


# spelling -> (its function, what the check names: each call outside the wrapper, the handle's wait included)
FUNCOL = "torch.distributed._functional_collectives"
BYPASSES = {
    "torch.distributed.X": (full_path, {"torch.distributed.all_reduce"}),
    "from torch.distributed import X": (from_import, {"torch.distributed.all_reduce"}),
    "from torch import distributed": (module_from_import, {"torch.distributed.all_reduce"}),
    "import torch.distributed as td": (module_alias, {"torch.distributed.all_reduce"}),
    "X = dist.all_reduce": (function_alias, {"torch.distributed.all_reduce"}),
    "distributed_c10d.X": (implementation_module, {"torch.distributed.all_reduce"}),
    "ProcessGroup method": (process_group_method, {"ProcessGroup.allreduce", "Work.wait"}),
    "Backend method": (backend_method, {"Backend.allreduce", "Work.wait"}),
    "functional collectives": (functional_collective, {f"{FUNCOL}.all_reduce", f"{FUNCOL}.wait_tensor"}),
    "torch.distributed.nn": (autograd_collective, {"torch.distributed.nn.functional.all_reduce"}),
    "Work.wait outside raising": (wait_outside, {"Work.wait"}),
    "torch.ops._c10d_functional": (operator, {"torch.ops._c10d_functional.all_reduce",
                                              "torch.ops._c10d_functional.wait_tensor"}),
}


def communicated(x, group):
    communicate("sum", group, x.numel(), lambda: dist.all_reduce(x, group=group))
    return x


def handed_as_run(x, group):
    run = lambda: torch.distributed.all_reduce(x, group=group)  # noqa: E731 - the spelling the source scan flagged
    communicate("sum", group, x.numel(), run)
    return x


def handed_as_partial(x, group):
    raising("sum", group, functools.partial(all_reduce, x, group=group))
    return x


def functional_handed(x, group):
    return raising("sum", group, lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)))


def operator_handed(x, group):
    def run():
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce.default(
            x, "sum", group.group_name))

    return communicate("sum", group, x.numel(), run)


def waited_in_raising(x, group):
    work = communicate("sum", group, x.numel(), lambda: td.all_reduce(x, group=group, async_op=True))
    raising("sum", group, work.wait)
    return x


WRAPPED = {
    "communicate(lambda: dist.X)": communicated,
    "run = lambda: ...; communicate(run)": handed_as_run,
    "raising(functools.partial(X))": handed_as_partial,
    "raising(lambda: functional collective)": functional_handed,
    "raising(work.wait)": waited_in_raising,
    "communicate(def run: torch.ops overload)": operator_handed,
}


if __name__ == "__main__":  # a launched rank (`run_script`): one call through the wrapper, one around it
    dist.init_process_group("gloo")
    spellings = load_as_package_module()
    through, around = spellings.communicated(torch.ones(1), None), spellings.full_path(torch.ones(1), None)
    print(f"summed {float(through)} and {float(around)}")
    dist.destroy_process_group()
