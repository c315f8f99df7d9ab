"""A packed row equals its samples run one by one through stock transformers (run in spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmcp_patch.fixtures.data import Segment, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment
# One sample with several images, one with an image near its end, one text-only: 48 tokens. The shard
# edges fall inside samples at P=2 (24) and inside image spans at P=4 (12 and 36).
PACKED = [
    [S(text=6), S(image=(16, 24)), S(text=3), S(image=(16, 16)), S(text=2)],
    [S(text=5), S(image=(24, 16)), S(text=1)],
    [S(text=9)],
]
CONFIGS = {
    "qwen3_vl": tiny_qwen3_vl_config,
    "qwen3_vl_moe": lambda: tiny_qwen3_vl_config(moe=True),
    "qwen3_5": tiny_qwen3_5_config,
    "qwen3_5_moe": lambda: tiny_qwen3_5_config(moe=True),
}


def sample_alone(batch: dict) -> dict:
    """One sample's inputs for stock without a cache: no labels, and an explicit mask of ones (it has no padding).
    Without a mask and a cache transformers 5.2 reads the position ids as packed-sequence boundaries, taking the
    mRoPE temporal row for them, which cuts a sample at each image; with the mask every release attends over the
    whole sample."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    inputs.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
    return inputs


def _alone_reference(model, alone: list[dict]):
    """Stock transformers, one sample at a time: loss over all their tokens, logits, gradients."""
    import vlmcp_patch

    vlmcp_patch.revert()
    try:
        model.zero_grad(set_to_none=True)
        logits, sums, count = [], [], 0
        for batch in alone:
            out = model(**sample_alone(batch), use_cache=False)
            targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
            sums.append(F.cross_entropy(out.logits.float()[0], targets[0], ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
            logits.append(out.logits.detach())
        loss = torch.stack(sums).sum() / count
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), torch.cat(logits, dim=1), grads
    finally:
        vlmcp_patch.apply()


def compare_packed(model, row: dict, alone: list[dict], world_size: int) -> dict:
    """The packed row under CP (or the package's P=1 path) against its samples run one by one through stock."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    ref_loss, ref_logits, ref_grads = _alone_reference(model, alone)
    vlmcp_patch.enable(cp_size=world_size)
    try:
        model.zero_grad(set_to_none=True)
        with CollectiveProbe() as counter:
            out = model(**row)
            out.loss.backward()
        with torch.no_grad():
            logits = model(**{k: v for k, v in row.items() if k != "labels"}).logits
    finally:
        vlmcp_patch.enable(cp_size=1)
    group = vlmcp_patch.get_cp_group(world_size).group if world_size > 1 else None
    per_rank = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    grads = summed_over_group({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, group)
    errors, decay = gradient_errors(grads, ref_grads)
    worst = max(errors, key=errors.get)
    return {
        "loss": float(out.loss.detach()),
        "loss_err": rel_err(out.loss, ref_loss),
        "logits_err": rel_err(logits, ref_logits),
        "grad_err": errors[worst],
        "worst_grad": worst,
        "decay_path_grad_err": max(decay.values(), default=0.0),
        "missing_grads": sorted(set(ref_grads) - set(grads)),
        "exchanges": counter.calls["all_to_all_single"],
        "ring_sends": counter.calls["batch_isend_irecv"],
        "per_rank_grads_equal_reference": all(torch.equal(per_rank.get(n, torch.zeros_like(g)), g)
                                              for n, g in ref_grads.items()),
    }


def run_packing_cases(rank: int, world_size: int, families: list[str], cu_seq_lens: bool = False) -> dict:
    from tests.helpers.cases import crosses_shard_edge, vision_exchanges

    results = {}
    for family in families:
        model = build_model(CONFIGS[family](), seed=1)
        row, alone = make_packed_batch(PACKED, seed=3, return_cu_seq_lens=cu_seq_lens)
        metrics = compare_packed(model, row, alone, world_size)
        local = -(-row["input_ids"].shape[1] // world_size)
        edges = range(local, row["input_ids"].shape[1], local)
        starts = (row["position_ids"][0] == 0).nonzero().flatten().tolist() + [row["input_ids"].shape[1]]
        results[family] = {
            **metrics,
            "vision_exchanges": vision_exchanges(row, world_size) if world_size > 1 else 0,
            "edges_inside_samples": all(any(a < e < b for a, b in zip(starts[:-1], starts[1:])) for e in edges),
            "edge_inside_image": crosses_shard_edge(row["input_ids"], world_size),
            "seq_len": row["input_ids"].shape[1],
        }
    return results
