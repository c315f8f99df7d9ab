"""What cannot run exactly under CP, and what stock's compute would trip on: every refusal of a forward, each with
its message (the tests pin them word for word).

The rules are derived from what stock transformers does with each input:

* tokens: exactly one of `input_ids` (in the vocabulary) and `inputs_embeds`;
* `attention_mask`: none, a 2D (batch, seq) padding mask of any pattern (stock attends causally among each
  row's real tokens, so dropping the padding is exact; Qwen3.5's DeltaNet layers also run through padding
  as zeros, which equals dropping it only where a row's real tokens are contiguous), or — the official
  Qwen3-VL fine-tuning script's packed rows — the 1D cumulative sample lengths of one row. A 4D mask cannot
  be split;
* `position_ids`: none (computed as stock computes them), 2D text positions, or 3 (mRoPE) / 4 (text + mRoPE)
  rows, used as given; a packed row's cumulative lengths and positions must agree;
* attention segments: stock splits a row at restarting text positions when there is no mask (sdpa without a
  cache, flash-attention on one row) — which Qwen3.5's DeltaNet layers do not follow;
* `cu_seq_lens_q/k`, `max_length_q/k`: a packed row's sample boundaries; beside an ordinary batch (a collator may add
  `[0, L]` to every one-row batch) only for one row, and describing the samples its mask and positions make;
* labels: the batch's shape, each in the vocabulary or -100, none at a padding position (padding is not
  computed); with `logits_to_keep` (the top-level forward's), the kept logits' count, as stock's loss pairs them
  (`keep.py`), and none at a kept padding position;
* vision: grids of positive sizes divisible by the merge size, pixel rows matching the grids, as many image
  / video tokens as the grids give;
* the model and the call's options: the attention implementation, head counts, no KV cache, `logits_to_keep` only
  where the caller scores the kept logits itself (the top-level forward: not TRL's fused head, not
  `token_log_probs`) and only as stock's slice takes it, no MoE router loss.

The rules judge the call and what `batch.read_batch` read of it; they ask the batch nothing themselves.
`first_refusal` runs them in the order above and returns the first that fails as a `Problem` (a rule raises
`Rejected` through `reject`); `plan.plan_forward` puts it in the plan, so that the ranks of a CP group first agree
(`agreement.py`) and then all raise together — no rank is left waiting in a collective the others never reach.
"""

from __future__ import annotations

import torch
import transformers

from ..attention.foreign import foreign_attention_problem
from ..attention.heads import has_deltanet, kv_replication, ulysses_of
from ..compat import NEWEST
from ..distributed import CPGroup
from ..errors import CPInputError, PatchTargetError, Problem, UnsupportedSetupError
from ..loss import IGNORE_INDEX, shifted_labels
from ..patching import PATCHES, cp_size
from ..supported import family_of
from .arguments import CU_SEQ_LENS, VISION
from .batch import BatchReading
from .keep import KeptLogits, kept_positions, keeps_every_logit

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")


class Rejected(Exception):
    """A rule failed: carries its `Problem` up to `first_refusal`."""

    def __init__(self, problem: Problem):
        self.problem = problem


def reject(message: str, error: type = CPInputError):
    raise Rejected(Problem(error, message))


def first_refusal(model, cp: CPGroup, call: dict, reading: BatchReading, packed: bool,
                  keeps_logits: bool = False) -> tuple[Problem | None, KeptLogits | None]:
    """The first rule the call breaks (module docstring), in order: the model and the call's options, tokens,
    labels, vision, position shapes, then a packed row's boundaries or an ordinary batch's mask and padding;
    None when every rule holds. `packed`: the call is a packed row (`batch.is_packed_row`). `keeps_logits`: the
    caller scores the logits `logits_to_keep` keeps (the top-level forward); then, beside the refusal, the kept
    logits (`keep.KeptLogits`; None: stock's default, every logit)."""
    try:
        check_setup(model, cp, call, reading.cache_given, keeps_logits)
        shape = _check_tokens(model, call)
        kept = _kept_logits(model, call, shape, reading.real) if keeps_logits else None
        _check_labels(model, call, shape, kept)
        _check_vision(model, call, reading.placeholders)
        _check_position_shape(call, shape)
        (_check_packed_row if packed else _check_ordinary_batch)(model, call, shape, reading)
    except Rejected as rejected:
        return rejected.problem, None
    return None, kept


# ---------------------------------------------------------------------------------------------------------
# The model and the call's options


def check_model_config(text_config, size: int) -> None:
    """Raise `UnsupportedSetupError` if a text config cannot run exactly at CP size `size`."""
    impl = text_config._attn_implementation
    if impl not in SUPPORTED_ATTENTION and not (size == 1 and impl == "eager"):  # eager: a packed row at P=1
        raise UnsupportedSetupError(
            f"attn_implementation={impl!r} is not supported under CP (VLMCP_CP_SIZE={cp_size()}); load the model "
            "with attn_implementation='sdpa' or 'flash_attention_2'."
        )
    ulysses = ulysses_of(text_config, size)
    kv_replication(text_config.num_attention_heads, text_config.num_key_value_heads, ulysses, "softmax attention")
    if has_deltanet(text_config):
        kv_replication(
            text_config.linear_num_value_heads, text_config.linear_num_key_heads, ulysses, "gated DeltaNet",
            ("value", "key"),
        )


def unverified_message(family: str) -> str | None:
    """Why `family` cannot run under CP with the installed transformers, or None when all its targets verified."""
    entries = PATCHES.unverified_for(family)
    if not entries:
        return None
    targets = ", ".join(target for target, _ in entries)
    details = " ".join(why.rstrip(".") + "." for _, why in entries)
    return (
        f"{family} models cannot run under CP with transformers {transformers.__version__}: the patch target(s) "
        f"{targets} did not verify, and the newest release vlmcp-patch was checked on is transformers {NEWEST}. "
        f"With CP off these models run as stock. To use CP, install transformers=={NEWEST} (or an older checked "
        f"release) or a vlmcp-patch release checked on {transformers.__version__}; or set VLMCP_CP_SIZE=1. "
        f"({details})"
    )


def unverified_problem(family: str | None) -> Problem | None:
    message = None if family is None else unverified_message(family)
    return None if message is None else Problem(PatchTargetError, message)


def family_problem(model) -> Problem | None:
    """What the model's family cannot run on the package's path (under CP, or a packed row at P=1): a target of it
    that did not verify on this transformers (the family is stock), and the family's own check (`Family.cp_check`)."""
    family = family_of(model)
    if family is None:
        return None
    problem = unverified_problem(family.name)
    if problem is None and family.cp_check is not None:
        message = family.cp_check(model)
        problem = None if message is None else Problem(UnsupportedSetupError, message)
    return problem


def check_setup(model, cp: CPGroup, call: dict, cache_given: bool, keeps_logits: bool = False) -> None:
    """The model and the call's options against CP (its family, attention, heads, cache, logits_to_keep where the
    caller does not score the kept logits itself, router loss)."""
    problem = family_problem(model)
    if problem is not None:
        reject(problem.message, problem.error)
    text_config = model.config.get_text_config()
    try:
        check_model_config(text_config, cp.size)
    except UnsupportedSetupError as exc:
        reject(str(exc), UnsupportedSetupError)
    foreign = foreign_attention_problem(model) if cp.size > 1 else None  # at P=1 it sees the whole row
    if foreign is not None:
        reject(foreign, UnsupportedSetupError)
    if cache_given:
        reject("a past_key_values cache (incremental decoding) cannot be used under CP; generate() runs with CP "
               "bypassed by itself, or run the call inside `with vlmcp_patch.disabled():`.", UnsupportedSetupError)
    if not keeps_logits and not keeps_every_logit(call.get("logits_to_keep", 0)):
        reject("logits_to_keep is supported under CP by the model's own forward only, not in this call (TRL's fused "
               "LM head, vlmcp_patch.token_log_probs): leave it out, or run the call inside "
               "`with vlmcp_patch.disabled():`.", UnsupportedSetupError)
    router = call.get("output_router_logits")
    if router is None:
        router = getattr(text_config, "output_router_logits", False)
    if router:
        reject("the MoE router auxiliary loss (output_router_logits=True) is not supported under CP yet; "
               "set config.text_config.output_router_logits=False.", UnsupportedSetupError)


# ---------------------------------------------------------------------------------------------------------
# Tokens, labels, vision, position shapes: every batch


def _check_tokens(model, call: dict) -> tuple[int, int]:
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        reject("You must specify exactly one of input_ids or inputs_embeds", ValueError)
    if ids is not None:
        if ids.ndim != 2:
            reject(f"input_ids must be (batch, seq); got shape {tuple(ids.shape)}")
        vocab = model.get_input_embeddings().num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
            reject(f"input_ids hold {bad}, outside the vocabulary [0, {vocab}) of the embedding")
        return tuple(ids.shape)
    if embeds.ndim != 3:
        reject(f"inputs_embeds must be (batch, seq, hidden); got shape {tuple(embeds.shape)}")
    return tuple(embeds.shape[:2])


def _kept_logits(model, call: dict, shape: tuple[int, int], real: torch.Tensor | None) -> KeptLogits | None:
    """The logits `logits_to_keep` keeps, with their targets (`keep.py`); None for stock's default (every logit). What
    stock's slice or its loss would refuse is refused here, and a target at a kept padding position."""
    keep = call.get("logits_to_keep", 0)
    if keeps_every_logit(keep):
        return None
    try:
        flat = kept_positions(model, keep, shape)
    except (IndexError, ValueError, TypeError, RuntimeError) as exc:
        shown = keep if not torch.is_tensor(keep) else keep.tolist() if keep.numel() <= 16 else \
            f"<a tensor of shape {tuple(keep.shape)}>"
        reject(f"logits_to_keep={shown} cannot slice tokens of shape {shape}, as stock's forward would: {exc}",
               type(exc))
    labels, shift_labels = call.get("labels"), call.get("shift_labels")
    targets = None
    if shift_labels is not None:
        name, targets = "shift_labels", shift_labels.reshape(-1)
    elif labels is not None:
        name, targets = "labels", shifted_labels(labels).reshape(-1)
    count = flat.numel()
    if targets is not None and targets.numel() != count:
        given = call[name]
        reject(f"{name} have shape {tuple(given.shape)} ({given.numel()} targets) but logits_to_keep keeps {count} "
               f"logits (shape {tuple(flat.shape)}): stock's loss pairs the kept logits one to one with the labels "
               f"(shifted by the loss), so give the labels of the kept positions, shape {tuple(flat.shape)}",
               ValueError)
    kept = KeptLogits.of(flat, real, targets)
    if targets is not None and bool(((kept.rows < 0) & (targets.cpu() != IGNORE_INDEX)).any()):
        reject("labels of kept logits at padding positions (attention_mask 0) must be -100 under CP: padding is not "
               "computed. Mask them as most collators do (labels[attention_mask == 0] = -100).")
    return kept


def _check_labels(model, call: dict, shape: tuple[int, int], kept: KeptLogits | None = None) -> None:
    vocab = model.config.get_text_config().vocab_size
    for name in ("labels", "shift_labels"):
        labels = call.get(name)
        if labels is None:
            continue
        if kept is None and tuple(labels.shape) != shape:
            reject(f"{name} have shape {tuple(labels.shape)} but the tokens {shape}: give one label per token "
                   "(-100 where there is no target)", ValueError)
        valid = labels[labels != IGNORE_INDEX]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            bad = int(valid.max()) if int(valid.max()) >= vocab else int(valid.min())
            reject(f"{name} hold {bad}, outside the vocabulary [0, {vocab}) (and not -100): the loss would fail "
                   f"with 'Target {bad} is out of bounds'")


def _check_grid(grid: torch.Tensor, name: str, merge: int) -> None:
    if grid.ndim != 2 or grid.shape[-1] != 3 or grid.is_floating_point():
        reject(f"{name} must be an integer (items, 3) tensor of (t, h, w) patch counts; got {tuple(grid.shape)}")
    if grid.numel() and (bool((grid < 1).any()) or bool((grid[:, 1:] % merge).any())):
        reject(f"{name} rows must be positive (t, h, w) with h and w multiples of the merge size {merge}; got "
               f"{grid.tolist()}")


def _check_vision(model, call: dict, placeholders: dict[str, torch.Tensor]) -> None:
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    for kind, pixels_key, grid_key, _ in VISION:
        pixels, grid = call.get(pixels_key), call.get(grid_key)
        if pixels is None:
            continue
        if grid is None:
            reject(f"{pixels_key} was given without {grid_key}")
        _check_grid(grid, grid_key, merge)
        rows = int(grid.prod(-1).sum())
        if pixels.ndim != 2 or tuple(pixels.shape) != (rows, width):
            reject(f"{pixels_key} has shape {tuple(pixels.shape)} but {grid_key} {grid.tolist()} asks for "
                   f"({rows}, {width}) patch rows; build both with the same processor")
        expected, found = rows // merge**2, int(placeholders[kind].sum())
        if expected != found:
            reject(f"{kind} features and {kind} tokens do not match: {grid_key} gives {expected} {kind} tokens but "
                   f"the tokens hold {found}; build input_ids with the same processor as the {pixels_key}.")


def _check_position_shape(call: dict, shape: tuple[int, int]) -> None:
    positions = call.get("position_ids")
    if positions is None:
        return
    batch, seq = shape
    rows_ok = positions.ndim == 2 or (positions.ndim == 3 and positions.shape[0] in (3, 4))
    if not rows_ok or positions.shape[-1] != seq or positions.shape[-2] not in (1, batch):
        reject(f"position_ids have shape {tuple(positions.shape)}; for tokens {shape} give (batch or 1, seq) text "
               "positions, or (3 or 4, batch or 1, seq) mRoPE positions")


# ---------------------------------------------------------------------------------------------------------
# An ordinary batch: masks, padding, restarts


def _check_ordinary_batch(model, call: dict, shape: tuple[int, int], reading: BatchReading) -> None:
    deltanet = has_deltanet(model.config.get_text_config())
    mask = call.get("attention_mask")
    if mask is not None:
        _check_mask(mask, shape, deltanet)
        _check_padding(call, reading.real, deltanet)
    _check_lengths_of_one_row(call, shape, reading)
    if reading.restarts is not None and deltanet:
        reject("position_ids restart inside a row of this batch: stock splits attention there but runs the "
               "DeltaNet layers across the restarts; pass the samples as one packed row (every layer then "
               "restarts at each sample), or as padded rows with an attention_mask")


def _check_lengths_of_one_row(call: dict, shape: tuple[int, int], reading: BatchReading) -> None:
    """`cu_seq_lens_q/k` / `max_length_q/k` beside an ordinary batch (ms-swift's collator adds `[0, L]` to every
    one-row batch, beside an all-ones mask): they describe the samples of one row, so the batch must be one row, and
    they must describe the samples its mask and positions make (`reading.segments`: its real tokens, split where stock
    restarts), which the row then runs as; they are dropped once checked (`rows.lay_out`)."""
    given = [key for key in CU_SEQ_LENS if call.get(key) is not None]
    if not given:
        return
    if shape[0] != 1:
        reject(f"{' / '.join(given)} describe the samples of one packed row, but this batch has {shape[0]} rows: "
               "pass them with a one-row batch only, or leave them out (the attention_mask gives each row's tokens)")
    samples = [0, *(end for _, end in reading.segments)]
    cu = call.get("cu_seq_lens_q")
    if cu is not None and (cu.ndim != 1 or cu.tolist() != samples):
        by = ("its attention_mask (its real tokens) gives" if reading.real is not None else
              "its position_ids (where they restart) give" if reading.restarts is not None else "its tokens make")
        split = (f" cu_seq_lens_q ends at {cu.flatten()[-1].item()} but the row holds {shape[1]} tokens: were the "
                 "tokens already split across ranks (another sequence parallelism, such as a trainer's own "
                 "sequence_parallel_size)? Under CP every rank of the group takes the whole row; turn the other off."
                 if cu.numel() and cu.flatten()[-1].item() > shape[1] else "")
        reject(f"cu_seq_lens_q {cu.tolist()} does not describe this one-row batch: {by} the samples "
               f"{samples} (cumulative lengths).{split} Pass cu_seq_lens_q = {samples}, or leave it out; to pack "
               "several samples in the row, leave out the attention_mask (a packed row: position_ids restarting at 0 "
               "per sample, or cu_seq_lens_q alone)")
    _check_cu_seq_lens_k(call)
    longest = max(end - start for start, end in reading.segments)
    for key in ("max_length_q", "max_length_k"):
        value = call.get(key)
        if value is not None and int(value) != longest:
            reject(f"{key}={int(value)} but the longest sample of this one-row batch has {longest} tokens")


def _check_mask(mask: torch.Tensor, shape: tuple[int, int], deltanet: bool) -> None:
    if mask.ndim == 4:
        reject("a 4D attention_mask (a custom attention pattern) cannot be split under CP; pass the 2D padding "
               "mask, or pack samples into one row with restarting position_ids", UnsupportedSetupError)
    if mask.ndim != 2 or tuple(mask.shape) != shape:
        reject(f"attention_mask has shape {tuple(mask.shape)}; under CP it must be the 2D (batch, seq) padding mask "
               f"for tokens {shape}, or the 1D cumulative sample lengths of a packed row")
    if deltanet and not bool(((mask == 0) | (mask == 1)).all()):
        reject("attention_mask holds values other than 0 and 1: the DeltaNet layers scale their inputs by it")
    if not bool(mask.bool().any()):
        reject("the batch holds no token: attention_mask is all zeros")


def _real_tokens_are_one_run(real: torch.Tensor) -> bool:
    """Whether each row's real tokens (batch, seq) bool form one run (left, right or both-sided padding, no
    holes)."""
    edges = torch.diff(real.int(), dim=-1, prepend=torch.zeros_like(real[:, :1], dtype=torch.int))
    return bool(((edges == 1).sum(-1) <= 1).all())


def _check_padding(call: dict, real: torch.Tensor, deltanet: bool) -> None:
    if deltanet and not _real_tokens_are_one_run(real):
        reject("attention_mask has holes (padding between real tokens of a row): the DeltaNet layers run through "
               "them as zeros, which cannot be split exactly; pad on either side only, or pack the samples")
    if not keeps_every_logit(call.get("logits_to_keep", 0)):
        return  # the labels are those of the kept logits: checked with them (`_kept_logits`)
    targets = call["shift_labels"] if call.get("shift_labels") is not None else (
        None if call.get("labels") is None else shifted_labels(call["labels"]))
    if targets is not None and bool(((targets != IGNORE_INDEX) & ~real.to(targets.device)).any()):
        reject("labels at padding positions (attention_mask 0) must be -100 under CP: padding is not computed. "
               "Mask them as most collators do (labels[attention_mask == 0] = -100).")


# ---------------------------------------------------------------------------------------------------------
# A packed row: its sample boundaries, given more than one way


def _check_packed_row(model, call: dict, shape: tuple[int, int], reading: BatchReading) -> None:
    seq, previous = shape[1], reading.text_starts
    for name, cu, starts in reading.cumulative:
        if starts is None:
            reject(f"{name} {cu.tolist()} must be the cumulative sample lengths [0, l1, l1 + l2, ..., {seq}] of the "
                   f"row ({seq} tokens)")
        if previous is not None and not torch.equal(starts, previous.to(cu.device)):
            reject(f"{name} {cu.tolist()} does not agree with position_ids (sample starts where positions restart "
                   "at 0); pass matching ones or drop one of them")
        previous = starts
    _check_cu_seq_lens_k(call)
    positions = call.get("position_ids")
    if positions is not None and positions.ndim == 3 and bool((positions[..., reading.starts[0]] != 0).any()):
        reject("the mRoPE position_ids of a packed row must start at 0 at every sample start (each sample's positions "
               "computed alone, as the official fine-tuning script and get_rope_index do)")


def _check_cu_seq_lens_k(call: dict) -> None:
    cu_q, cu_k = call.get("cu_seq_lens_q"), call.get("cu_seq_lens_k")
    if cu_k is not None and (cu_q is None or not torch.equal(cu_k.to(cu_q.device), cu_q)):
        reject("cu_seq_lens_k must equal cu_seq_lens_q (self-attention of a packed row)")
    if cu_q is None:
        return
    longest = int(cu_q.diff().max())
    for key in ("max_length_q", "max_length_k"):
        given = call.get(key)
        if given is not None and int(given) != longest:
            reject(f"{key}={int(given)} but the longest packed sample has {longest} tokens")
