"""Gradients that are each rank's share: an optimizer step taken on them, unsummed, raises.

After a backward under CP each rank holds its slice's share of every gradient; their sum over the CP group is the
P=1 gradient. The training integrations sum them (DDP and FSDP2 through Accelerate, DeepSpeed's engine, a
data-parallel wrapper the script applies itself with the loss scaled by P); a raw loop calls
`vlmcp_patch.sum_over_cp_group`. A raw loop that forgets to would train every rank on its own share, silently, with
every forward exact. So:

- a CP forward notes its model (`cp_forward_started`): managed when a data-parallel wrapper reduces its gradients
  (registered by the integrations, `reduced_by_wrapper`; or run inside a `DistributedDataParallel` forward);
- the functions whose backward keeps each rank's share (the loss's sum, the gathers of logits and hidden states)
  mark their output (`shares_of`): when its gradient arrives in backward, an unmanaged model's gradients are noted as
  shares (`_PENDING`);
- `sum_over_cp_group` clears the note (`shares_summed`);
- a global optimizer step pre-hook (installed on the first note) raises `UnsummedGradientsError` before any weight
  changes when the optimizer holds a parameter of a model with shares pending. Every rank of a group runs the same
  loop, so every rank raises at the same step.

Several backwards before one step (gradient accumulation) add up shares; one sum before the step covers them all.
Nothing is noted at P=1, so nothing changes there.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import UnsummedGradientsError

_REDUCED_BY_WRAPPER: weakref.WeakSet = weakref.WeakSet()  # models whose wrapper sums their gradients over CP
_PENDING: weakref.WeakSet = weakref.WeakSet()  # models holding unsummed shares since the last sum
_LAST_FORWARD: list = [None]  # a weak reference to the model of the last CP forward
_STEP_HOOK: list = []


def reduced_by_wrapper(model) -> None:
    """`model` (and the supported model inside it) trains under a data-parallel wrapper that sums its gradients over
    the CP group: the integrations call this when they prepare it."""
    from .supported import find_supported_model

    for each in (model, find_supported_model(model)):
        if each is not None:
            _REDUCED_BY_WRAPPER.add(each)


def _inside_ddp_forward() -> bool:
    # DDP reduces in backward over all W ranks; its raw-loop contract is the loss scaled by P (docs/integrations.md)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module() is not None


def cp_forward_started(model) -> None:
    """A CP forward of `model` begins: the gradient shares of what follows belong to it."""
    if _inside_ddp_forward():
        _REDUCED_BY_WRAPPER.add(model)
    _LAST_FORWARD[0] = weakref.ref(model)


def _partitioned(model) -> bool:
    # ZeRO-3 partitions and FSDP2 modules: their wrapper reduce-scatters every gradient in backward. FSDP2 is told by
    # its modules, not its parameters: while it has a module's weights gathered (in backward, when the shares are
    # noted) that module's parameters are plain tensors, not DTensors
    from torch.distributed.fsdp import FSDPModule

    return any(hasattr(p, "ds_id") for p in model.parameters()) or any(
        isinstance(m, FSDPModule) for m in model.modules())


def _note_shares(model) -> None:
    if model is None or model in _REDUCED_BY_WRAPPER or _partitioned(model):
        return
    _PENDING.add(model)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_unsummed_step))


def shares_of(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, the output of a function whose backward keeps this rank's share: when its gradient arrives, the
    model of the last CP forward holds shares until they are summed."""
    if tensor.requires_grad and _LAST_FORWARD[0] is not None:
        model = _LAST_FORWARD[0]
        tensor.register_hook(lambda grad: _note_shares(model()))
    return tensor


def shares_summed() -> None:
    """The gradients were summed over the CP group (`sum_over_cp_group`)."""
    _PENDING.clear()


def _refuse_unsummed_step(optimizer, args, kwargs) -> None:
    if not _PENDING:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in list(_PENDING):
        if any(id(p) in stepped for p in model.parameters()):
            raise UnsummedGradientsError(
                f"vlmcp-patch: {type(optimizer).__name__}.step() after a backward under CP whose gradients were not "
                f"summed over the CP group: each rank holds only its slice's share of {type(model).__name__}'s "
                "gradients, and a step on them trains each rank on its share. In a raw loop call "
                "`vlmcp_patch.sum_over_cp_group(p.grad for p in model.parameters())` after backward and before the "
                "step (once, after all gradient-accumulation backwards); under a DDP or FSDP2 wrapper of your own, "
                "scale the loss by `vlmcp_patch.cp_size()` instead. The HF Trainer, Accelerate, DeepSpeed and TRL do "
                "this themselves. No weight was changed."
            )
