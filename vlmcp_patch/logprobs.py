"""Per-token log-probabilities and entropies of given tokens under CP, for custom RL loops (PPO, GRPO, ...).

    out = vlmcp_patch.token_log_probs(model, input_ids=ids, attention_mask=mask, pixel_values=..., temperature=0.7)
    out.log_probs, out.entropy  # (batch, seq) fp32: position t scores the token at t + 1

The model runs through its wrappers (DDP, DeepSpeed, FSDP2, PEFT) as a forward does; under CP each rank scores
its slice of the packed row in chunks of tokens — never the (sequence x vocabulary) logits — and the per-token
values are gathered over the group, so every rank holds the whole batch's values. They are differentiable:
backward keeps each rank's own slice, so a loss computed from them identically on every rank of the group
gives, summed over the group, the P=1 gradient (docs/integrations.md: "Custom RL loops").
"""

from __future__ import annotations

import torch

from .flags import TOKEN_LOG_PROBS, scoped
from .forward.batch import is_packed_row, text_positions
from .forward.top_level import TokenLogProbsOutput
from .layout import starts_of
from .loss import IGNORE_INDEX, log_probs_and_entropy_of_logits, shifted_labels


def token_log_probs(model, *, targets: torch.Tensor | None = None, temperature: float = 1.0, **inputs):
    """log softmax(logits / temperature) of each target token, and the entropy of that distribution, per position.

    `inputs` are the model's usual inputs (`input_ids` or `inputs_embeds`, `attention_mask`, `position_ids`, vision
    inputs; every form the forward takes, packed rows included). `targets` (batch, seq) names the token scored at
    each position, -100 for none; by default the next input token (none at the last position and at padding).
    Returns a `TokenLogProbsOutput` with `log_probs` and `entropy`, (batch, seq) fp32, 0 where there is no target.
    Equal to `log_softmax(model(**inputs).logits / temperature).gather(-1, targets)` at P=1, and at any CP size.
    """
    targets = next_tokens(inputs) if targets is None else targets
    with scoped(TOKEN_LOG_PROBS, float(temperature)):
        out = model(**inputs, shift_labels=targets)
    if isinstance(out, TokenLogProbsOutput):
        return out
    # Stock's forward ran (inside `disabled()`, the package reverted, a model it does not handle): its full logits
    log_probs, entropy = log_probs_and_entropy_of_logits(out.logits, targets.to(out.logits.device), temperature)
    return TokenLogProbsOutput(log_probs=log_probs, entropy=entropy)


def next_tokens(inputs: dict) -> torch.Tensor:
    """The default targets: each position's next input token; none at the last position, none where the position
    or its next token is padding (a 2D `attention_mask`), and none across the samples of a packed row."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None:
        raise ValueError("token_log_probs needs `targets` when the inputs have no input_ids")
    targets = shifted_labels(ids)
    if mask is not None and mask.ndim == 2:
        real = mask.bool()
        targets = targets.masked_fill(~real | ~shifted_labels(real.long()).bool(), IGNORE_INDEX)
    if is_packed_row(inputs):
        starts = text_positions(inputs)
        starts = starts_of(starts) if starts is not None else torch.zeros_like(ids, dtype=torch.bool)
        for name in ("attention_mask", "cu_seq_lens_q"):
            cu = inputs.get(name)
            if cu is not None and cu.ndim == 1:
                starts[0, cu[1:-1].long()] = True
        targets[:, :-1] = targets[:, :-1].masked_fill(starts[:, 1:], IGNORE_INDEX)
    return targets
