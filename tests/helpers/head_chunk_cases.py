"""Attention by head chunks (`attention/head_chunks.py`), run inside the spawned ranks.

Each case runs one model and batch three ways: stock at P=1 (patches reverted), CP unchunked and CP by head chunks;
the chunked run is compared with stock (`parity.compare`: loss, logits, every gradient summed over the group) and with
the unchunked run on the same rank (loss, logits and this rank's own gradients). The exchanges each run made are
counted: the chunked path makes more, smaller ones.
"""

from __future__ import annotations

import torch

from tests.helpers.cases import MULTI_IMAGE, PADDED_PAIR, build_batch
from vlmcp_patch.fixtures.data import Segment, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment
EIGHT_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 2}
CONFIGS = {
    "qwen3_vl-8": lambda attn: tiny_qwen3_vl_config(attn_implementation=attn, **EIGHT_HEADS),
    "qwen3_vl-4": lambda attn: tiny_qwen3_vl_config(attn_implementation=attn),  # 4 query heads, 2 KV heads
    "qwen3_5-8": lambda attn: tiny_qwen3_5_config(attn_implementation=attn, **EIGHT_HEADS),
}  # built with sdpa; the flash_attention_2 runs switch to flash-attn's CPU stand-in (`flash_standin.use_flash`)
PACKED = [[S(text=6), S(image=(24, 16)), S(text=9)], [S(text=11)], [S(text=3), S(image=(16, 16)), S(text=4)]]
LAYOUTS = {"multi_image": MULTI_IMAGE, "padded_pair": PADDED_PAIR}


def _batch(layout: str):
    if layout == "packed":
        batch, _ = make_packed_batch(PACKED, seed=5)
        return batch
    return build_batch(LAYOUTS[layout], seed=7)


def _cp_run(model, batch: dict, cp_size: int, chunks: int) -> dict:
    """Loss, full logits and this rank's gradients of one CP forward and backward with `chunks` head chunks; the ranks
    compare their collectives after the forward and the backward (`VLMCP_DEBUG_COLLECTIVES`)."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    vlmcp_patch.enable(cp_size=cp_size, head_chunks=chunks, debug_collectives=True)
    try:
        model.zero_grad(set_to_none=True)
        with CollectiveProbe() as probe:
            out = model(**batch)
            out.loss.backward()
        with torch.no_grad():
            logits = model(**no_labels).logits
    finally:
        vlmcp_patch.enable(cp_size=1, head_chunks=1, debug_collectives=False)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.detach().float(), "logits": logits.float(), "grads": grads,
            "exchanges": probe.calls["all_to_all_single"]}


def _against(run: dict, ref: dict) -> dict:
    from vlmcp_patch.fixtures.compare import rel_err

    errs = {n: rel_err(g, ref["grads"][n]) for n, g in ref["grads"].items() if n in run["grads"]}
    worst = max(errs, key=errs.get)
    return {"loss_err": rel_err(run["loss"], ref["loss"]), "logits_err": rel_err(run["logits"], ref["logits"]),
            "grad_err": errs[worst], "worst_grad": worst, "missing": sorted(set(ref["grads"]) - set(run["grads"]))}


def _floats(batch: dict, dtype) -> dict:
    return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in batch.items()}


def bf16_errors(model, batch: dict, cp_size: int, chunks: int, fp32: dict) -> dict:
    """The model in bf16, unchunked and chunked under CP, each against the fp32 unchunked run (`fp32`)."""
    model.to(torch.bfloat16)
    try:
        runs = {n: _against(_cp_run(model, _floats(batch, torch.bfloat16), cp_size, n), fp32) for n in (1, chunks)}
    finally:
        model.to(torch.float32)
    return {"unchunked": runs[1], "chunked": runs[chunks]}


def run_head_chunk_cases(rank: int, world_size: int, cases: list, attn: str = "sdpa", bf16: bool = False) -> dict:
    """`cases`: (config, layout, chunks, ulysses or 0). Per case: the chunked run against stock and against the
    unchunked run, the exchanges of both, and the layout; with `bf16`, the first case in bf16 too
    (`bf16_errors`)."""
    import vlmcp_patch
    from tests.helpers import flash_standin
    from tests.helpers.packing_cases import compare_packed
    from tests.helpers.parity import compare
    from vlmcp_patch.attention.heads import ulysses_of

    if attn == "flash_attention_2":
        flash_standin.install()
    results = {}
    for config_name, layout, chunks, ulysses in cases:
        vlmcp_patch.enable(ulysses_size=ulysses)
        config = CONFIGS[config_name]("sdpa")
        model = build_model(config, seed=1)
        if attn == "flash_attention_2":
            flash_standin.use_flash(model)
        batch = _batch(layout)
        vlmcp_patch.enable(head_chunks=chunks)
        try:
            if layout == "packed":
                stock = compare_packed(model, *make_packed_batch(PACKED, seed=5), world_size)
            else:
                stock = compare(model, batch, world_size)
        finally:
            vlmcp_patch.enable(head_chunks=1)
        unchunked = _cp_run(model, batch, world_size, 1)
        chunked = _cp_run(model, batch, world_size, chunks)
        results[f"{config_name} {layout} N={chunks} U={ulysses}"] = {
            "stock": {k: stock[k] for k in ("loss_err", "logits_err", "grad_err", "worst_grad", "missing_grads",
                                            "per_rank_grads_equal_reference")},
            "unchunked": _against(chunked, unchunked),
            "exchanges": (unchunked["exchanges"], chunked["exchanges"]),
            "ulysses": ulysses_of(config.get_text_config(), world_size),
        }
        if bf16 and len(results) == 1:
            results[f"{config_name} {layout} N={chunks} U={ulysses}"]["bf16"] = bf16_errors(
                model, batch, world_size, chunks, unchunked)
        vlmcp_patch.enable(ulysses_size=0)
    return results


def refused(rank: int, world_size: int, chunks: int) -> dict:
    """A forward with head chunks that do not divide each rank's heads: the error every rank raises, and whether the
    vision tower ran before it (it must not)."""
    import vlmcp_patch
    from vlmcp_patch.errors import UnsupportedSetupError
    from vlmcp_patch.stats import STATS

    model = build_model(CONFIGS["qwen3_vl-8"]("sdpa"), seed=1)
    batch = build_batch(MULTI_IMAGE, seed=7)
    vlmcp_patch.enable(cp_size=world_size, head_chunks=chunks)
    STATS.drain()
    try:
        model(**batch)
        message = None
    except UnsupportedSetupError as error:
        message = str(error)
    finally:
        vlmcp_patch.enable(cp_size=1, head_chunks=1)
    return {"message": message, "vision_passes": STATS.vision_passes}
