"""Gradients that are each rank's share: an optimizer step taken on them, unsummed, raises.

After a backward under CP each rank holds its slice's share of every gradient; their sum over the CP group is the
P=1 gradient. The training integrations sum them (DDP and FSDP2 through Accelerate, DeepSpeed's engine, a
data-parallel wrapper the script applies itself over a group that spans the CP group, with the loss scaled by P); a
raw loop calls `vlmcp_patch.sum_over_cp_group`. A raw loop that forgets to would train every rank on its own share,
silently, with every forward exact. So the shares are tracked per parameter:

- a CP forward with gradients on (`cp_forward_started`) watches its model's trainable parameters (a hook after each
  gradient accumulation), unless a wrapper sums the model's gradients over the CP group: registered by the
  integrations (`reduced_by_wrapper`), or a `DistributedDataParallel` forward, FSDP2 mesh or ZeRO-3 group whose ranks
  include every rank of the CP group. A wrapper over the data-parallel replicas only sums nothing over CP;
- the functions whose backward keeps each rank's share (the loss's sum, the gathers of logits and hidden states)
  mark their output (`shares_of`): when its gradient arrives, the running backward is a share backward until it
  ends, and every watched parameter whose gradient it accumulates holds shares (`_PENDING`). Parameters upstream of
  the mark accumulate only after it (they depend on its gradient), so the credit goes to the parameters that
  received shares, whatever model ran the last forward. A sharding wrapper whose group does not span the CP group
  accumulates into its own buffers, not through the parameters: all its model's trainable parameters are credited
  when a share backward follows a forward of it;
- `sum_over_cp_group` clears the parameters whose gradient it summed (`shares_summed`), and no other;
- a global optimizer step pre-hook (installed with the first watch) raises `UnsummedGradientsError` before any
  weight changes when the optimizer holds a parameter with shares pending and a gradient. Every rank of a group runs
  the same loop, so every rank raises at the same step.

Several backwards before one step (gradient accumulation) add up shares; one sum before the step covers them all.
Nothing is watched at P=1, so nothing changes there. Known limit: a share mark inside a reentrant checkpoint (a
nested backward) ends with that nested backward, so a parameter outside it is not credited.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import UnsummedGradientsError
from .sharding import sharded


@dataclass
class _Watched:
    param: weakref.ref
    model_name: str
    hook: object  # the accumulation hook's handle; None for a sharded model's parameter, credited as a whole


_REDUCED_BY_WRAPPER: weakref.WeakSet = weakref.WeakSet()  # models whose integration's wrapper sums over CP
_WATCHED: dict[int, _Watched] = {}  # id(parameter) -> its watch
_PENDING: set[int] = set()  # ids of watched parameters holding unsummed shares
_SHARDED_FORWARDS: weakref.WeakSet = weakref.WeakSet()  # sharded models not summed over CP, run since a backward
_IN_SHARE_BACKWARD = [False]
_STEP_HOOK: list = []


def reduced_by_wrapper(model) -> None:
    """`model` (and the supported model inside it) trains under a data-parallel wrapper that sums its gradients over
    the CP group: the integrations call this when they prepare it."""
    from .supported import find_supported_model

    for each in (model, find_supported_model(model)):
        if each is not None:
            _REDUCED_BY_WRAPPER.add(each)
            _unwatch(each)


def cp_forward_started(model, cp) -> None:
    """A CP forward of `model` over the CP group `cp` (a `CPGroup`) begins: watch the gradient shares its backward
    will leave in `model`'s parameters, unless a wrapper sums them over `cp`."""
    if cp.size == 1 or not torch.is_grad_enabled():
        return
    if model in _REDUCED_BY_WRAPPER or _wrapper_spans(model, cp):
        _unwatch(model)
    elif sharded(model):
        _SHARDED_FORWARDS.add(model)
    else:
        _watch(model)


def _wrapper_spans(model, cp) -> bool:
    """Whether a data-parallel wrapper reduces `model`'s gradients over a group holding every rank of `cp`'s group."""
    ranks = _wrapper_ranks(model)
    return ranks is not None and set(dist.get_process_group_ranks(cp.group)) <= ranks


def _wrapper_ranks(model) -> set[int] | None:
    """The global ranks `model`'s data-parallel wrapper reduces gradients over: the running `DistributedDataParallel`'s
    process group, an FSDP2 unit's mesh or a ZeRO-3 partition's group; None without a wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is not None:
        return set(dist.get_process_group_ranks(ddp.process_group))
    for p in model.parameters():
        if hasattr(p, "ds_process_group"):  # ZeRO-3 reduce-scatters over its data-parallel group
            return set(dist.get_process_group_ranks(p.ds_process_group))
    mesh = _fsdp2_mesh(model)
    return None if mesh is None else set(mesh.mesh.flatten().tolist())


def _fsdp2_mesh(model):
    """The device mesh of an FSDP2 unit at or inside `model` (a hybrid mesh reduces over all its dimensions). While a
    unit has its weights gathered its parameters are plain tensors, so the mesh is read from the unit's state."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                return group.mesh_info.mesh
    return None


def _watch(model) -> None:
    name = type(model).__name__
    for p in model.parameters():
        watched = _WATCHED.get(id(p))
        if p.requires_grad and (watched is None or watched.hook is None):
            _WATCHED[id(p)] = _Watched(_forget_when_freed(p), name, p.register_post_accumulate_grad_hook(_credit))
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_unsummed_step))


def _forget_when_freed(p) -> weakref.ref:
    key = id(p)
    return weakref.ref(p, lambda _: (_WATCHED.pop(key, None), _PENDING.discard(key)))


def _unwatch(model) -> None:
    for p in model.parameters():
        watched = _WATCHED.pop(id(p), None)
        if watched is not None and watched.hook is not None:
            watched.hook.remove()
        _PENDING.discard(id(p))


def _credit(param) -> None:
    if _IN_SHARE_BACKWARD[0]:
        _PENDING.add(id(param))


def shares_of(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, the output of a function whose backward keeps this rank's share: the backward that reaches it leaves
    shares in every watched parameter whose gradient it accumulates."""
    if tensor.requires_grad:
        tensor.register_hook(_share_backward_reached)
    return tensor


def _share_backward_reached(grad) -> None:
    _IN_SHARE_BACKWARD[0] = True
    torch.autograd.Variable._execution_engine.queue_callback(_share_backward_ended)  # runs when this backward ends


def _share_backward_ended() -> None:
    _IN_SHARE_BACKWARD[0] = False
    for model in list(_SHARDED_FORWARDS):
        for p in model.parameters():
            if p.requires_grad:
                if id(p) not in _WATCHED:
                    _WATCHED[id(p)] = _Watched(_forget_when_freed(p), type(model).__name__, None)
                _PENDING.add(id(p))
    _SHARDED_FORWARDS.clear()
    if _PENDING and not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_unsummed_step))


def shares_summed(summed: list) -> None:
    """The tensors `summed` were summed over the CP group (`sum_over_cp_group`): the parameters whose gradient is one
    of them (or lies within one, as a view of a flat buffer) hold no shares any more; a parameter without a gradient
    holds none either."""
    if not _PENDING:
        return
    ids = {id(t) for t in summed}
    spans = [_span(t) for t in summed if type(t) is torch.Tensor]
    for key in list(_PENDING):
        watched = _WATCHED.get(key)
        p = None if watched is None else watched.param()
        grad = None if p is None else p.grad
        if grad is None or id(grad) in ids or (type(grad) is torch.Tensor and _within(_span(grad), spans)):
            _PENDING.discard(key)


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) of the memory `t` covers."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    first = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), first, first + extent * t.element_size()


def _within(span, spans) -> bool:
    return any(span[0] == s[0] and s[1] <= span[1] and span[2] <= s[2] for s in spans)


def _refuse_unsummed_step(optimizer, args, kwargs) -> None:
    if not _PENDING:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            watched = _WATCHED.get(id(p)) if id(p) in _PENDING else None
            if watched is not None and watched.param() is p and p.grad is not None:
                raise _unsummed_error(optimizer, watched.model_name)


def _unsummed_error(optimizer, model_name: str) -> UnsummedGradientsError:
    return UnsummedGradientsError(
        f"vlmcp-patch: {type(optimizer).__name__}.step() after a backward under CP whose gradients were not summed "
        f"over the CP group: each rank holds only its slice's share of {model_name}'s gradients, and a step on them "
        "trains each rank on its share. In a raw loop call `vlmcp_patch.sum_over_cp_group(p.grad for p in "
        "model.parameters())` after backward and before the step (once, after all gradient-accumulation backwards); "
        "under a DDP or FSDP2 wrapper of your own, whose process group (mesh) spans the CP group — all W ranks, not "
        "the W/P data-parallel replicas only — scale the loss by `vlmcp_patch.cp_size()` instead. The HF Trainer, "
        "Accelerate, DeepSpeed and TRL do this themselves. No weight was changed."
    )
