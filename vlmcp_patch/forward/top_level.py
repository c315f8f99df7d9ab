"""The patched user-facing forward (`...ForConditionalGeneration`, `...ForCausalLM`).

Under CP — and at P=1 for a batch in the packed-row convention — one forward:

1. checks the model and the batch and agrees with the other ranks of the group (one small collective);
   anything that cannot run exactly raises on every rank before compute;
2. lays the batch out as one packed row of its real tokens (`rows.py`) and creates the `CPContext`;
3. runs the stock forward with that context current: the vision tower (each rank its share of the
   images), image placement and deepstack features on the whole row, then the text decoder on this
   rank's slice (`decoder.py`). The stock LM head is asked for no position (`logits_to_keep`);
4. computes the loss from the decoder's slice in chunks, without full-vocabulary logits (`loss.py`), and
   the logits when they are wanted, gathered and in the caller's batch layout.

Every other call goes to the stock forward untouched.
"""

from __future__ import annotations

import torch

from ..context import CPContext
from ..distributed import SINGLE_RANK, active_cp_group
from ..flags import BYPASS, FULL_LOGITS
from ..loss import sharded_causal_lm_loss
from ..settings import SETTINGS
from ..stats import STATS
from .agreement import agree_on_batch
from .arguments import batch_reference, call_arguments
from .checks import batch_problem, setup_problem
from .rows import is_packed_row, packed_row_of_batch


def full_logits_requested() -> bool:
    """Forwards with labels return full logits too: `VLMCP_GATHER_LOGITS=1`, or a caller that keeps them
    (the Trainer's prediction step)."""
    return SETTINGS.gather_logits_with_labels or FULL_LOGITS.get()


def enter_cp_forward(model, call: dict) -> CPContext | None:
    """Checks, agreement and the packed-row layout of one forward of `model`; its arguments in `call` are
    rewritten in place as the packed row. Returns the forward's `CPContext`, or None when the call runs
    stock (CP off and not a packed row).

    The caller runs the stock forward inside `ctx.running()`: the top-level forward here, TRL's fused LM
    head (which calls the backbone itself) in integrations/trl.py.
    """
    cp = active_cp_group()
    if cp is None:
        if not is_packed_row(call):
            return None  # P=1, not packed: exactly stock
        cp = SINGLE_RANK  # P=1 packed row: the same path, no exchanges
    problem = setup_problem(model, cp, call) or batch_problem(model, call)
    agree_on_batch(cp, problem, call, model)
    segments, rows = packed_row_of_batch(getattr(model, "model", None), call)
    ctx = CPContext(cp=cp, segments=segments, rows=rows)
    STATS.record(ctx)
    return ctx


def cp_top_level_forward(wrapped, instance, args, kwargs):
    """The patched top-level forward; see the module docstring for its contract."""
    if BYPASS.get():
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    ctx = enter_cp_forward(instance, call)
    if ctx is None:
        return wrapped(*args, **kwargs)
    shift_labels = call.pop("shift_labels", None)
    num_items_in_batch = call.pop("num_items_in_batch", None)
    return_dict = call.pop("return_dict", None)
    call["logits_to_keep"] = torch.zeros(0, dtype=torch.long, device=batch_reference(call).device)
    with ctx.running():
        out = wrapped(**call, return_dict=True)

    fields = {k: v for k, v in out.items() if k != "logits"}
    hidden = ctx.last_hidden_state
    if shift_labels is not None:
        fields["loss"] = sharded_causal_lm_loss(
            hidden, instance.lm_head, ctx, shift_labels, num_items_in_batch, SETTINGS.loss_chunk_tokens
        )
    if shift_labels is None or full_logits_requested():
        fields["logits"] = ctx.to_caller(ctx.gather(instance.lm_head(hidden), dim=1))
    out = type(out)(**fields)
    return out.to_tuple() if return_dict is False else out
