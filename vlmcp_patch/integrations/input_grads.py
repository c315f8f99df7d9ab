"""transformers' `enable_input_require_grads` under CP: the input embeddings' output requires a gradient without
being kept for the whole step.

With frozen input embeddings (LoRA / PEFT, or embeddings left out of training) and gradient checkpointing, the Trainer,
PEFT and TRL call `model.enable_input_require_grads()`: a forward hook on the embedding module turns its output into a
leaf that requires a gradient, so that a reentrant checkpoint's input requires one and gradients reach the layers
inside it. Autograd then keeps that leaf for its gradient accumulator until backward reaches it — the end of backward
— and gives it a `.grad` that nothing reads: two hidden states per token of the rank's slice on the device through
the step, at long rows as much as a decoder layer's whole checkpoint. (Found with the memory benchmark's probe of
what is alive at the peak, whose model has frozen tied embeddings.)

Under CP a second hook, registered right after transformers' own, hands the layers the same values detached and tied
to an empty anchor (`vision_tiles.Tied`): an output that requires a gradient (so reentrant checkpoints still
back-propagate into the layers) and is no leaf (so nothing keeps it: it goes when the layers that read it are done
with it). No gradient
reaches the embeddings either way: they are frozen. With CP off the hook returns nothing: stock's output, unchanged.
"""

from __future__ import annotations

import torch

from ..context import current_cp_forward
from ..patching import Patch
from ..vision_tiles import Tied

# A leaf of no elements that requires a gradient: what the layers' input is tied to (`vision_tiles.Tied`).
_ANCHOR = torch.empty(0, requires_grad=True)


def _no_leaf_under_cp(module, args, output):
    """A forward hook after transformers' `make_inputs_require_grads`: under CP its leaf output is handed on detached
    and tied to `_ANCHOR` (module docstring); otherwise nothing (the output as it is)."""
    ctx = current_cp_forward()
    if ctx is None or ctx.cp.size == 1 or not isinstance(output, torch.Tensor):
        return None
    if not (output.is_leaf and output.requires_grad) or isinstance(output, torch.nn.Parameter):
        return None
    return Tied.apply(output.detach(), _ANCHOR)  # detached: the leaf is not in the graph


def cp_enable_input_require_grads(wrapped, instance, args, kwargs):
    """transformers' `enable_input_require_grads`, then on each embedding module it hooked a second hook that acts
    under CP only; its handle joins `_require_grads_hooks`, so `disable_input_require_grads` removes both."""
    result = wrapped(*args, **kwargs)
    hooks = getattr(instance, "_require_grads_hooks", None)
    if not hooks:
        return result
    hooked = {id(m): m for m in instance.modules() if any(h.id in m._forward_hooks for h in hooks)}
    hooks.extend(m.register_forward_hook(_no_leaf_under_cp) for m in hooked.values())
    return result


def patches() -> list[Patch]:
    return [
        Patch(
            target="transformers.modeling_utils.PreTrainedModel.enable_input_require_grads",
            wrapper=cp_enable_input_require_grads,
            reason="under CP: the frozen input embeddings' output requires a gradient as before but is no leaf, so "
            "it is not kept (with a .grad nothing reads) until the end of backward",
            expects=(),
        ),
    ]
