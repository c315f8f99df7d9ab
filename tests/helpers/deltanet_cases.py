"""One gated DeltaNet layer under CP against the stock layer, on odd shapes (run in spawned ranks)."""

from __future__ import annotations

import torch


def _layer(num_k: int, num_v: int):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from vlmcp_patch.fixtures.models import tiny_qwen3_5_config

    config = tiny_qwen3_5_config(text_only=True, linear_num_key_heads=num_k, linear_num_value_heads=num_v)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # lively random weights: a layer test need not mimic an initialised model
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def run_layer_cases(rank: int, world_size: int) -> dict:
    import vlmcp_patch
    from vlmcp_patch.context import CPContext
    from vlmcp_patch.fixtures.compare import rel_err, summed_over_group
    from vlmcp_patch.fixtures.probes import CollectiveProbe
    from vlmcp_patch.layout import segments_from_lengths
    from vlmcp_patch.models.qwen3_5 import _HeadShare

    cp = vlmcp_patch.get_cp_group(world_size)
    results = {}
    cases = {
        # name: (key heads, value heads, sample lengths, as a right-padded batch (else one packed row))
        "padded_batch_one_key_head": (1, 4, [13, 9], True),
        "odd_length": (2, 4, [11], False),
        "packed_samples": (2, 8, [5, 9, 3], False),
    }
    for name, (num_k, num_v, lengths, padded) in cases.items():
        layer = _layer(num_k, num_v)
        g = torch.Generator().manual_seed(1)
        row = torch.randn(1, sum(lengths), layer.hidden_size, generator=g)
        weights = torch.randn(1, sum(lengths), layer.hidden_size, generator=g)  # a loss that mixes every output
        segments = segments_from_lengths(lengths)

        # Stock: each sample alone, or the right-padded batch (what padding-free must equal on real tokens).
        layer.zero_grad()
        x_ref = row.clone().requires_grad_(True)
        if padded:
            width = max(lengths)
            mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
            batch = torch.zeros(len(lengths), width, layer.hidden_size).index_put(
                (mask.nonzero()[:, 0], mask.nonzero()[:, 1]), x_ref[0])
            out = layer(batch, attention_mask=mask)
            ref_out = out[mask.bool()][None]
        else:
            ref_out = torch.cat([layer(x_ref[:, a:b]) for a, b in segments], dim=1)
        (ref_out * weights).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}

        # CP: this rank's slice of the packed row through the patched layer.
        ctx = CPContext(cp=cp, segments=segments)
        layer.zero_grad()
        x_cp = row.clone().requires_grad_(True)
        with CollectiveProbe() as counter:
            local = layer(ctx.shard(x_cp, dim=1), attention_mask=None, vlmcp_ctx=ctx)
            forward_bytes = counter.bytes["all_to_all_single"]
            full = ctx.gather(local, dim=1)
            (full * weights).sum().backward()
        grads = summed_over_group({n: p.grad for n, p in layer.named_parameters()}, cp.group)
        x_grad = summed_over_group({"x": x_cp.grad}, cp.group)["x"]
        results[name] = {
            "out_err": rel_err(full, ref_out),
            "input_grad_err": rel_err(x_grad, x_ref.grad),
            "param_grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads),
            "exchanges": counter.calls["all_to_all_single"],
            # all-to-all send buffers of the group per token of the row, forward, fp32, and the formula they
            # must match: q and k (key heads after replication), v, the two gate inputs and the output.
            "a2a_bytes_per_token": forward_bytes * world_size / ctx.padded_len,
            "a2a_bytes_formula": 4 * (2 * layer.num_k_heads * _HeadShare.of(layer, ctx).repeat * layer.head_k_dim
                                      + 2 * layer.num_v_heads * layer.head_v_dim + 2 * layer.num_v_heads),
        }
    return results
