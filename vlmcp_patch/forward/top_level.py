"""The patched user-facing forward (`...ForConditionalGeneration`, `...ForCausalLM`).

Under CP — and at P=1 for a batch in the packed-row convention — one forward, top to bottom:

1. **plan** (`plan.py`): the call, the model's config and the CP group become one frozen `ForwardPlan` — the
   path, the row, the positions, each rank's slice and vision share, the attention layout, or a refusal;
2. **agree** (`agreement.py`): one small collective over the group; a refusal, another batch, other weights or
   another plan on any rank raises on every rank before compute;
3. **lay out** (`rows.py`): the batch becomes one packed row of its real tokens, and the `CPContext` of that row;
4. **cut** (`slicing.py`): ids, positions and token types become this rank's slice (labels and vision inputs stay
   as given);
5. **encode and route vision, decoder** — the stock backbone (`model.model`) runs on that slice with the context
   current: each rank encodes its planned share of the images and receives the features of its slice's
   placeholder tokens (`vision.py`), stock places them and the deepstack rows on the slice, and the text decoder
   runs the slice (`decoder.py`); its output comes back as the backbone's `last_hidden_state`;
6. **loss** (`loss.py`): from that slice in chunks, without full-vocabulary logits, and the logits when they are
   wanted, gathered and in the caller's batch layout, in the output class stock returns. With `logits_to_keep`
   (`keep.py`), the loss and the logits of the positions stock keeps, each rank scoring those in its slice.

Every other call goes to the stock forward untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing

import torch
from transformers.utils import ModelOutput

from ..switches import choose_switches, loss_chunk_tokens
from ..context import CPContext
from ..distributed import active_cp_group
from ..errors import CPInputError
from ..grad_shares import cp_forward_started
from ..flags import BYPASS, FULL_LOGITS, TOKEN_LOG_PROBS
from ..loss import IGNORE_INDEX, kept_causal_lm_loss, sharded_causal_lm_loss, token_log_probs_and_entropy
from ..replica_step import tell_the_replicas
from ..settings import SETTINGS
from ..stats import STATS
from . import host_pixels
from .agreement import agree
from .arguments import call_arguments, pixels_on_device
from .batch import batch_device
from .keep import kept_logits
from .plan import STOCK, plan_forward
from .rows import lay_out
from .slicing import cut_to_slice

# What the top-level forward consumes itself rather than passing to the backbone.
TOP_LEVEL_ONLY = ("shift_labels", "num_items_in_batch", "return_dict", "logits_to_keep")


def full_logits_requested() -> bool:
    """Forwards with labels return full logits too: `VLMCP_GATHER_LOGITS=1`, or a caller that keeps them
    (the Trainer's prediction step)."""
    return SETTINGS.gather_logits_with_labels or FULL_LOGITS.get()


@torch.compiler.disable  # data-dependent checks, a collective and (once) process-group creation: eager
def enter_cp_forward(model, call: dict, always: bool = False, keeps_logits: bool = False) -> CPContext | None:
    """Plan, agreement, the packed-row layout and the cut of one forward of `model`; its arguments in `call` are
    rewritten in place as this rank's slice of the packed row (the vision inputs and the labels as given).
    Returns the forward's `CPContext`, or None when the call runs stock (CP off and not a packed row stock gets
    wrong, unless `always`). `keeps_logits`: the caller scores the logits `logits_to_keep` keeps (`ctx.kept`); else
    a `logits_to_keep` other than 0 is refused.

    The caller runs the stock backbone inside `ctx.running()`: the top-level forward here, TRL's fused LM
    head (which calls the backbone itself) in integrations/trl.py, `vlmcp_patch.token_log_probs`.
    """
    device = batch_device(call)
    try:
        records = host_pixels.take_records(call)  # pixel values cut to this rank's share on the host, if they were
        plan = plan_forward(model, host_pixels.planning_view(call, records), active_cp_group(), always,
                            keeps_logits)
        if plan.path == STOCK:
            if records:
                raise CPInputError(f"{', '.join(records)} hold one rank's share of the rows (vlmcp_patch cut them on "
                                   "the host under CP), and this forward runs without CP: it needs them whole")
            return None  # exactly stock
        plan = host_pixels.checked(plan, call, records)
        # a refusal raises here, on every rank of the group; cut pixel values compare their whole tensors' fingerprints
        agree(plan, call, model, host_pixels.whole_fingerprints(records))
        ctx = lay_out(call, plan)
        ctx.groups  # the ring's process groups, created on every rank now (collective), before any compute
    except Exception:
        # the other replicas wait in the switches' agreement over the world: tell them, so every rank raises now
        tell_the_replicas(model, device)
        raise
    # the memory switches this row needs, agreed by the group and the replicas, frozen into this forward's context
    ctx.choice = choose_switches(model, call, ctx, plan.device)
    cut_to_slice(model, call, ctx)
    cp_forward_started(model, ctx.cp)
    STATS.record(ctx)
    return ctx


def run_backbone(model, call: dict, ctx: CPContext):
    """The stock backbone (`model.model`) on the packed row of `call` under `ctx`: its output, whose
    `last_hidden_state` is this rank's slice (1, local, hidden) of the decoder output."""
    with ctx.running():
        return model.model(**call, return_dict=True)


@functools.cache
def output_class(forward) -> type:
    """The output class a stock top-level forward returns (from its return annotation: `tuple | Output`)."""
    hint = typing.get_type_hints(inspect.unwrap(forward)).get("return")
    classes = [c for c in typing.get_args(hint) or (hint,) if isinstance(c, type) and issubclass(c, ModelOutput)]
    return classes[0]


def _build_output(cls: type, backbone_out, **fields):
    """`cls` with `fields`, and every other field it shares with the backbone's output carried over."""
    carried = {f.name: getattr(backbone_out, f.name, None) for f in dataclasses.fields(cls) if f.name not in fields}
    return cls(**fields, **{k: v for k, v in carried.items() if v is not None})


@dataclasses.dataclass
class TokenLogProbsOutput(ModelOutput):
    """Per-token log-probabilities of the targets and entropies, (batch, seq) fp32 each
    (`vlmcp_patch.token_log_probs`)."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def token_log_probs_of_slice(instance, ctx: CPContext, hidden: torch.Tensor, shift_labels: torch.Tensor,
                             temperature: float) -> TokenLogProbsOutput:
    """Log-probabilities and entropies of this rank's slice (1, local, H), gathered over the group in the caller's
    layout; backward keeps each rank's own slice."""
    local = ctx.shard(shift_labels.to(hidden.device), dim=1, value=IGNORE_INDEX).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    log_probs, entropy = token_log_probs_and_entropy(flat, instance.lm_head, local, temperature,
                                                     loss_chunk_tokens(ctx.choice))
    return TokenLogProbsOutput(**{name: ctx.to_caller(ctx.gather(x[None], dim=1))
                                  for name, x in (("log_probs", log_probs), ("entropy", entropy))})


def _kept_fields(instance, ctx: CPContext, hidden: torch.Tensor, num_items_in_batch, return_dict: bool) -> dict:
    """The loss and logits of a forward given `logits_to_keep` (`keep.py`): the loss over the kept logits when they
    have targets, the kept logits (stock's shape) when there is no loss or they are wanted (as without it)."""
    kept, fields = ctx.kept, {}
    if kept.targets is not None:
        entries, rows = kept.local(ctx)
        local = kept.targets.index_select(0, entries.to(kept.targets.device))
        fields["loss"] = kept_causal_lm_loss(hidden, instance.lm_head, ctx, rows, local, kept.targets,
                                             num_items_in_batch, loss_chunk_tokens(ctx.choice))
    if kept.targets is None or full_logits_requested() or not return_dict:
        fields["logits"] = kept_logits(hidden, instance.lm_head, ctx, kept)
    return fields


def cp_top_level_forward(wrapped, instance, args, kwargs):
    """The patched top-level forward; see the module docstring for its contract."""
    if BYPASS.get():
        if SETTINGS.cp_size > 1:  # a stock pass inside `disabled()` of a CP launch: see `pixels_on_device`
            kwargs = pixels_on_device(kwargs, instance.device)
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    temperature = TOKEN_LOG_PROBS.get()
    ctx = enter_cp_forward(instance, call, always=temperature is not None, keeps_logits=temperature is None)
    if ctx is None:
        return wrapped(*args, **kwargs)
    if temperature is not None:
        for key in TOP_LEVEL_ONLY[1:]:
            call.pop(key, None)
        targets = call.pop("shift_labels")
        return token_log_probs_of_slice(instance, ctx, run_backbone(instance, call, ctx).last_hidden_state, targets,
                                        temperature)
    shift_labels, num_items_in_batch, return_dict, _ = (call.pop(key, None) for key in TOP_LEVEL_ONLY)
    if return_dict is None:
        return_dict = getattr(instance.config, "return_dict", True)
    backbone_out = run_backbone(instance, call, ctx)
    hidden = backbone_out.last_hidden_state
    if ctx.kept is not None:  # `logits_to_keep`: stock's loss and logits of the kept positions
        fields = _kept_fields(instance, ctx, hidden, num_items_in_batch, return_dict)
    else:
        fields = {}
        if shift_labels is not None:
            fields["loss"] = sharded_causal_lm_loss(
                hidden, instance.lm_head, ctx, shift_labels, num_items_in_batch, loss_chunk_tokens(ctx.choice)
            )
        if shift_labels is None or full_logits_requested() or not return_dict:  # a tuple keeps stock's positions
            fields["logits"] = ctx.to_caller(ctx.gather(instance.lm_head(hidden), dim=1))
    out = _build_output(output_class(wrapped), backbone_out, **fields)
    return out if return_dict else out.to_tuple()

