"""One small collective per CP forward: the ranks of a group agree that they can run it, on the same data, the
same way.

Every rank of a CP group must compute on the same micro-batch with the same weights, and take the same path with
it. Before any compute, each rank all-gathers one short float64 vector over its group: whether its plan holds a
refusal, the model's dtype, at the first CP forward of a model and after each `load_state_dict` a checksum of its
parameters, a digest of its plan (`ForwardPlan.digest`: path, row, split, vision shares, attention), then a
fingerprint of every tensor argument of the forward (shape, dtype, device type and two order-sensitive weighted
sums of the values). A difference raises on every rank at once, naming the argument and its likely cause.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from ..collectives.communication import all_gather_small
from ..errors import CPInputError, UnsupportedSetupError
from ..sharding import is_partitioned
from .plan import ForwardPlan

# The forward arguments fingerprinted in their own slot; any other tensor argument shares the last one.
FIELDS = (
    "input_ids", "inputs_embeds", "attention_mask", "position_ids", "mm_token_type_ids", "labels", "shift_labels",
    "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "num_items_in_batch",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
)
OTHER = "other tensor arguments"
PER_FIELD = 4  # present, meta (shape / dtype / device type), two weighted sums
HEADER = 6  # refused, model dtype, weights checked, two weight sums, plan digest

_TOKENS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "mm_token_type_ids", "image_grid_thw",
           "video_grid_thw", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
SHARDING_HINT = (
    "every rank of a CP group must get the same micro-batch: shard the data over "
    "vlmcp_patch.data_parallel_rank() / data_parallel_world_size(), not over the global rank (a "
    "DistributedSampler built from the world size does that), keep the row order the same on every rank, "
    "and use the same tokenizer / processor in every process"
)
HINTS = {
    "pixel_values": "the images differ while their tokens agree: a random augmentation drawn per rank? Seed it "
    "identically on the ranks of a group (e.g. from data_parallel_rank()) or apply it before sharding. Shares "
    "decoded per rank (vlmcp_patch.ShareDecoding) agree by their recipe: the same items under the same keys, "
    "processor settings and dtype on every rank",
    "labels": "the targets differ while the tokens agree: labels built per rank (random masking?) must be drawn "
    "identically on the ranks of a group",
    "num_items_in_batch": "each rank counted its own targets: count them over the data-parallel replicas "
    "(the HF Trainer does this under CP), not per rank",
}
HINTS["pixel_values_videos"] = HINTS["pixel_values"]
HINTS["shift_labels"] = HINTS["labels"]


_NAN, _POSINF = 7.3e3, 9.1e3  # finite stand-ins for non-finite values in fingerprints


def _stable_hash(text: str) -> float:
    return float(zlib.crc32(text.encode()))


def _weights(n: int, step: float, device) -> torch.Tensor:
    return 1 + torch.remainder(torch.arange(1, n + 1, device=device, dtype=torch.float64) * step, 1.0)


def tensor_fingerprint(t: torch.Tensor) -> list[float]:
    """[meta, s1, s2]: meta hashes shape, dtype and device type; s1, s2 are r_k^T T c_k for the tensor viewed
    as (rows, last dim), with fixed irrational weights r_k, c_k: a permutation along any dimension changes
    them. One pass over the data (a two-column matmul in fp32, or fp64 for integer tensors)."""
    meta = _stable_hash(f"{tuple(t.shape)}|{t.dtype}|{t.device.type}")
    if t.numel() == 0:
        return [meta, 0.0, 0.0]
    t = t.detach()
    matrix = t.reshape(-1, t.shape[-1]) if t.ndim else t.reshape(1, 1)
    compute = torch.float32 if t.is_floating_point() else torch.float64
    cols = torch.stack([_weights(matrix.shape[1], 0.6180339887498949, t.device),
                        _weights(matrix.shape[1], 0.7548776662466927, t.device)], dim=1).to(compute)
    rows = torch.stack([_weights(matrix.shape[0], 0.5698402909980532, t.device),
                        _weights(matrix.shape[0], 0.3247179572447460, t.device)], dim=1)
    sums = ((matrix.to(compute) @ cols).double() * rows).sum(0)
    if not bool(sums.isfinite().all()):
        # NaN / inf in the data (a diverged batch, as stock would run it): fingerprint them by position with
        # finite stand-ins, so identical batches agree (NaN != NaN) and differing ones still differ.
        finite = torch.nan_to_num(matrix.to(compute), nan=_NAN, posinf=_POSINF, neginf=-_POSINF)
        sums = ((finite @ cols).double() * rows).sum(0)
    return [meta, float(sums[0]), float(sums[1])]


def _value_fingerprint(value) -> list[float] | None:
    if torch.is_tensor(value):
        return [1.0, *tensor_fingerprint(value)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [1.0, _stable_hash(type(value).__name__), float(value), 0.0]
    return None


def batch_fingerprint(call: dict, known: dict[str, list[float]] | None = None) -> list[float]:
    """The fingerprint slots of a forward's arguments, in the fixed order of FIELDS + OTHER. `known`: tensor
    fingerprints (`tensor_fingerprint`) taken before the call, by argument name, used in place of the argument's
    (pixel values cut to one rank's share: their whole tensor's, `host_pixels.py`)."""
    out, known = [], known or {}
    for name in FIELDS:
        out += ([1.0, *known[name]] if name in known else _value_fingerprint(call.get(name))) or [0.0] * PER_FIELD
    other = [0.0] * PER_FIELD
    for name, value in call.items():
        fp = None if name in FIELDS else _value_fingerprint(value)
        if fp is not None:
            salt = _stable_hash(name)
            other = [a + b * (1 + salt / 2**32) for a, b in zip(other, fp)]
    return out + other


# ---------------------------------------------------------------------------------------------
# Weights


def _mark_weights_unchecked(model, *args) -> None:
    model._vlmcp_weights_checked = False


def weights_fingerprint(model, force: bool = False) -> list[float] | None:
    """[s1, s2] over the parameters in order, at the first CP forward of `model` and after each
    `load_state_dict` (or when `force`d); None when there is nothing to check now."""
    if getattr(model, "_vlmcp_weights_checked", False) and not force:
        return None
    if not hasattr(model, "_vlmcp_weights_hook"):
        model._vlmcp_weights_hook = model.register_load_state_dict_post_hook(_mark_weights_unchecked)
    model._vlmcp_weights_checked = True
    params = list(model.parameters())
    if not params or any(is_partitioned(p) for p in params):
        return None
    return _checksum(params)


def _checksum(params) -> list[float]:
    s1 = s2 = 0.0
    for i, p in enumerate(params):
        _, a, b = tensor_fingerprint(p)
        weight = 1 + math.fmod((i + 1) * 0.6180339887498949, 1.0)
        s1, s2 = s1 + a * weight, s2 + b * weight
    return [s1, s2]


def _dtype_code(model) -> float:
    param = next(model.parameters(), None)
    return 0.0 if param is None else _stable_hash(str(param.dtype))


# ---------------------------------------------------------------------------------------------
# The collective


@dataclass
class _Gathered:
    table: torch.Tensor  # (ranks, values)

    def differing(self, start: int, width: int) -> bool:
        block = self.table[:, start : start + width]
        return not bool((block == block[0]).all())


def _describe(fields: list[str]) -> str:
    first = fields[0]
    hint = HINTS.get(first) if not any(f in _TOKENS for f in fields) else None
    return f"{', '.join(fields)} differ between the ranks of this CP group: {hint or SHARDING_HINT}."


def agree(plan: ForwardPlan, call: dict, model, known: dict[str, list[float]] | None = None) -> None:
    """Raise on every rank of the plan's group if any rank's plan holds a refusal, or a rank got another batch or
    other weights, or planned another way. `known`: fingerprints of arguments taken before the call
    (`batch_fingerprint`).

    At P=1 it only raises this rank's own refusal.
    """
    cp, problem = plan.cp, plan.refusal
    if cp.size == 1:
        if problem is not None:
            problem.raise_it()
        return
    weights = weights_fingerprint(model)
    header = [float(problem is not None), _dtype_code(model), float(weights is not None), *(weights or [0.0, 0.0]),
              plan.digest]
    local = torch.tensor(header + batch_fingerprint(call, known), dtype=torch.float64, device=plan.device)
    gathered = _Gathered(all_gather_small(local, cp.group, cp.size))
    if problem is not None:
        problem.raise_it()
    failed = gathered.table[:, 0].nonzero().flatten().tolist()
    if failed:
        raise CPInputError(f"CP rank(s) {failed} of this group rejected the batch; see the error on those ranks")
    if gathered.differing(1, 1):
        raise UnsupportedSetupError(
            "the model's dtype differs between the ranks of this CP group (e.g. bf16 on one rank, fp32 on another): "
            "build or load it the same way in every process"
        )
    weights = gathered.table[:, 2:5]
    if bool(weights[:, 0].any()) and not bool(weights[:, 0].all()):
        # Some ranks (re)loaded weights since their last check, others did not: the others checksum now too,
        # in a second collective that only this rare case pays for.
        mine = weights_fingerprint(model, force=True)
        again = torch.tensor([float(mine is not None), *(mine or [0.0, 0.0])], dtype=torch.float64,
                             device=local.device)
        weights = all_gather_small(again, cp.group, cp.size)
    if bool(weights[:, 0].all()) and not bool((weights[:, 1:] == weights[0, 1:]).all()):
        raise UnsupportedSetupError(
            "the model's weights differ between the ranks of this CP group: build it from the same seed or load the "
            "same checkpoint in every process (DDP, DeepSpeed and FSDP broadcast or shard them for you; a raw "
            "training loop must do it itself)"
        )
    names = [*FIELDS, OTHER]
    differing = [n for i, n in enumerate(names) if gathered.differing(HEADER + i * PER_FIELD, PER_FIELD)]
    if differing:
        raise CPInputError(_describe(differing))
    if gathered.differing(5, 1):
        raise UnsupportedSetupError(
            "the ranks of this CP group planned this forward differently on the same batch (another path, split, "
            "vision share or attention implementation): configure every process alike (VLMCP_* settings, "
            "attn_implementation)"
        )
