"""Pixel values at 1/P on the host: each rank of a CP group keeps only the pixel rows it encodes.

Every rank of a group receives the same micro-batch, but encodes only its share of the images and video frames
(`vision.py`). A share by items (`layout.VisionShare`, `BY_ITEMS`) is a function of the grids and P alone, so the
data-loader side can cut the pixel values down to this rank's rows before the forward, with no model at hand:
`keep_pixel_share` (called by the integrations' batch placement and `PixelShareCollator`) replaces `pixel_values` /
`pixel_values_videos` by a new, compact tensor of this rank's rows (a view would keep the whole storage alive) and
adds beside each a small float64 record (`SHARE_RECORDS`): the CP size and rank it was cut for, the rows it holds,
the rows of the whole, and the agreement's fingerprint of the whole tensor (`agreement.tensor_fingerprint`, taken
before the cut).

The forward (`top_level.enter_cp_forward`) takes the records off the call (`take_records`; a call built from chosen
keys of the batch, as TRL < 1.16's DPOTrainer builds its calls, takes them from the batch (`CARRIED_BATCH`) when its
pixel values are that batch's cut share), plans on stand-ins of the whole tensors' shape (`planning_view`: the rules
check the rows against the grids as for a whole batch), refuses on every rank a share that is not the one its plan
encodes (`held_problem`: another P or rank, rows of another share, a share by patches), and compares the whole
tensors' fingerprints over the group in place of the compact ones' (`whole_fingerprints`): a rank that got other
pixels still raises on every rank before compute. The vision path then reads its rows from the compact tensor
(`vision.share_rows_in`). Pixel values that hold this rank's share with no record are refused on every rank, by name
(`dropped_record_problem`): a tensor that is neither the whole batch's nor a recorded share never computes.

Only what the forward can serve is cut: a share by items. Where the items do not balance (`VisionShare.balanced`)
the forward may share them by patches, whose rows depend on the tower's merge size and heads, so those rows keep the
whole pixel values, as does every row with vision data parallelism off. With CP off (or inside `disabled()`)
nothing is cut. A stock pass (`generate()`, `disabled()`) given a cut batch raises (`arguments.pixels_on_device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..distributed import cp_running
from ..errors import CPInputError, Problem
from ..flags import CARRIED_BATCH
from ..layout import BY_ITEMS, VisionShare
from ..patching import cp_size
from ..settings import SETTINGS
from ..stats import STATS
from .agreement import tensor_fingerprint
from .arguments import SHARE_RECORDS, VISION
from .plan import ForwardPlan

# The record's fields, in order (float64: exact for integers up to 2**53).
SIZE, RANK, START, STOP, WHOLE, FINGERPRINT = 0, 1, 2, 3, 4, 5


def host_rows(grid: torch.Tensor, size: int, rank: int) -> slice | None:
    """The pixel rows rank `rank` of `size` encodes by items for a modality's `grid` (items, 3), or None when the
    forward may share the items another way (they do not balance: module docstring). The share by items and its
    balance do not depend on the merge size."""
    share = VisionShare.of(grid.tolist(), 1, size)
    return share.patch_rows(rank) if share.balanced() else None


def keep_pixel_share(batch: Mapping, size: int, rank: int) -> Mapping:
    """`batch` with each modality's pixel values cut to the rows rank `rank` of a CP group of `size` encodes (a new
    tensor), and their records (`SHARE_RECORDS`) beside them; the batch as it is where nothing can be cut (module
    docstring), already cut, or malformed (the forward's rules then judge it whole). Same mapping type."""
    cut = {}
    for _, pixels_key, grid_key, _ in VISION:
        pixels, grid = batch.get(pixels_key), batch.get(grid_key)
        if not (torch.is_tensor(pixels) and torch.is_tensor(grid)) or SHARE_RECORDS[pixels_key] in batch:
            continue
        if pixels.ndim != 2 or grid.ndim != 2 or grid.shape[-1] != 3 or int(grid.prod(-1).sum()) != pixels.shape[0]:
            continue
        rows = host_rows(grid, size, rank)
        if rows is None:
            continue
        record = [size, rank, rows.start, rows.stop, pixels.shape[0], *tensor_fingerprint(pixels)]
        cut[pixels_key] = pixels[rows].clone()
        cut[SHARE_RECORDS[pixels_key]] = torch.tensor(record, dtype=torch.float64)
    if not cut:
        return batch
    merged = {**batch, **cut}
    return merged if isinstance(batch, dict) else type(batch)(merged)


def records_of(batch) -> dict[str, torch.Tensor]:
    """The share records a (collated, cut) `batch` carries, per pixel key."""
    if not isinstance(batch, Mapping):
        return {}
    return {key: batch[record] for key, record in SHARE_RECORDS.items() if torch.is_tensor(batch.get(record))}


def _is_the_share(pixels, share: torch.Tensor, record: torch.Tensor) -> bool:
    """Whether `pixels` are the cut `share` (the tensor itself, or a copy on another device) and not the whole."""
    if not (torch.is_tensor(pixels) and torch.is_tensor(share) and pixels.shape == share.shape
            and pixels.dtype == share.dtype):
        return False
    return share.shape[0] != int(record[WHOLE]) and (pixels is share or torch.equal(pixels, share.to(pixels.device)))


def take_records(call: dict) -> dict[str, torch.Tensor]:
    """The share records of a forward's call, per pixel key, taken off the call (empty: it holds whole pixels).
    Pixel values without their record take that of the batch the call was built from (`CARRIED_BATCH`) when they
    are its cut share; the plan then checks their rows, and the agreement the whole tensors' fingerprints."""
    records = {key: call.pop(record) for key, record in SHARE_RECORDS.items() if call.get(record) is not None}
    batch = CARRIED_BATCH.get()
    for key, record in records_of(batch).items():
        if key not in records and _is_the_share(call.get(key), batch.get(key), record):
            records[key] = record
    STATS.host_pixel_shares += bool(records)  # telemetry: the forwards that held a cut share (VLMCPCallback)
    return {key: record.detach().cpu() for key, record in records.items()}


def planning_view(call: dict, records: dict[str, torch.Tensor]) -> dict:
    """`call` as the plan reads it: each cut pixel tensor replaced by a stand-in of the whole's shape on the meta
    device (the plan reads the pixel values' shapes, never their values)."""
    if not records:
        return call
    view = dict(call)
    for key, record in records.items():
        pixels = call.get(key)
        if torch.is_tensor(pixels):
            view[key] = pixels.new_empty((int(record[WHOLE]), *pixels.shape[1:]), device="meta")
    return view


def held_problem(plan: ForwardPlan, call: dict, records: dict[str, torch.Tensor]) -> Problem | None:
    """Why this rank cannot encode its planned share from the cut pixel values it holds (None: it can)."""
    shares = {pixels_key: plan.vision_shares.get(kind) for kind, pixels_key, _, _ in VISION}
    for key, record in records.items():
        size, rank, start, stop = (int(record[i]) for i in (SIZE, RANK, START, STOP))
        share, pixels = shares.get(key), call.get(key)
        planned = share.patch_rows(plan.cp.rank) if share is not None and share.method == BY_ITEMS else None
        if (size, rank) != (plan.cp.size, plan.cp.rank):
            why = f"they were cut for CP rank {rank} of {size}, and this is rank {plan.cp.rank} of {plan.cp.size}"
        elif planned is None:
            why = "this forward does not share them by items"
        elif (planned.start, planned.stop) != (start, stop) or not torch.is_tensor(pixels) \
                or pixels.shape[0] != stop - start:
            why = f"it holds rows {start}:{stop} while this rank encodes rows {planned.start}:{planned.stop}"
        else:
            continue
        return Problem(CPInputError, f"{key} hold one rank's share of the rows (vlmcp_patch cut them on the host), but "
                       f"{why}: pass the batch as the data loader gave it, or switch the cut off "
                       "(VLMCP_HOST_PIXEL_SHARES=0)")
    return None


def dropped_record_problem(plan: ForwardPlan, call: dict, records: dict[str, torch.Tensor]) -> Problem | None:
    """Pixel values with no record that hold this rank's share by items, not the whole: the cut's record was left
    behind between the data loader and the model (None: no such pixel values)."""
    for _, key, grid_key, _ in VISION:
        pixels, grid = call.get(key), call.get(grid_key)
        if key in records or not (torch.is_tensor(pixels) and torch.is_tensor(grid)) or grid.ndim != 2:
            continue
        whole, rows = int(grid.prod(-1).sum()), host_rows(grid, plan.cp.size, plan.cp.rank)
        if rows is not None and pixels.shape[0] == rows.stop - rows.start != whole:
            return Problem(CPInputError, f"{key} hold {pixels.shape[0]} of the {whole} rows {grid_key} asks for, as "
                           "many as this rank's share (vlmcp_patch cuts them so on the host under CP), without the "
                           f"record of the cut that the batch carried beside them ({SHARE_RECORDS[key]!r}): the code "
                           "that built this call from the batch left it behind. Pass that key on with the pixel "
                           "values, or switch the cut off (VLMCP_HOST_PIXEL_SHARES=0)")
    return None


def checked(plan: ForwardPlan, call: dict, records: dict[str, torch.Tensor]) -> ForwardPlan:
    """`plan` with the problem of the pixel values this rank holds as its refusal, raised on every rank by the
    agreement: a share whose record was dropped (which explains the plan's own refusal of their rows), else
    `held_problem` when the plan has no refusal yet."""
    problem = dropped_record_problem(plan, call, records)
    if problem is None and records and plan.refusal is None:
        problem = held_problem(plan, call, records)
    return plan if problem is None else dataclasses.replace(plan, refusal=problem)


def whole_fingerprints(records: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The agreement's fingerprints of the whole pixel tensors, taken before they were cut, per pixel key."""
    return {key: record[FINGERPRINT:].tolist() for key, record in records.items()}



def this_ranks_cut() -> tuple[int, int] | None:
    """(CP size, rank in the group) the integrations cut a batch's pixel values for now: under CP (`cp_running`)
    with vision data parallelism and `host_pixel_shares` on; None: they keep them whole."""
    if not (cp_running() and SETTINGS.vision_dp and SETTINGS.host_pixel_shares):
        return None
    size = cp_size()
    return size, dist.get_rank() % size  # the CP groups are blocks of P consecutive ranks (`distributed.get_cp_group`)


def keep_this_ranks_share(batch):
    """`batch` as this rank keeps it on the host (`keep_pixel_share` under `this_ranks_cut`); anything but a mapping,
    and every batch where nothing is cut, as it is."""
    cut = this_ranks_cut()
    return batch if cut is None or not isinstance(batch, Mapping) else keep_pixel_share(batch, *cut)
