"""One gated DeltaNet layer under CP against the stock layer, on odd shapes (run in spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _layer(num_k: int, num_v: int):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from vlmcp_patch.testing import tiny_qwen3_5_config

    config = tiny_qwen3_5_config(text_only=True, linear_num_key_heads=num_k, linear_num_value_heads=num_v)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # lively random weights: a layer test need not mimic an initialised model
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def run_layer_cases(rank: int, world_size: int) -> dict:
    import vlmcp_patch
    from tests.parity import ExchangeCounter, rel_err
    from vlmcp_patch.attention.linear import _HeadShare
    from vlmcp_patch.context import CPContext

    cp = vlmcp_patch.get_cp_group(world_size)
    results = {}
    cases = {
        # name: (key heads, value heads, batch lengths, packed sample lengths)
        "padded_batch_one_key_head": (1, 4, [13, 9], None),
        "odd_length": (2, 4, [11], None),
        "packed_samples": (2, 8, None, [5, 9, 3]),
    }
    for name, (num_k, num_v, lengths, packed) in cases.items():
        layer = _layer(num_k, num_v)
        seq = max(lengths) if lengths else sum(packed)
        batch = len(lengths) if lengths else 1
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, seq, layer.hidden_size, generator=g)
        weights = torch.randn(batch, seq, layer.hidden_size, generator=g)  # a loss that mixes every output
        mask = None
        if lengths:
            mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()

        # Stock: the full sequence (padded batch) or each packed sample alone (what packing must equal).
        layer.zero_grad()
        x_ref = x.clone().requires_grad_(True)
        if packed:
            edges = [0] + torch.tensor(packed).cumsum(0).tolist()
            ref_out = torch.cat([layer(x_ref[:, a:b]) for a, b in zip(edges[:-1], edges[1:])], dim=1)
        else:
            ref_out = layer(x_ref, attention_mask=mask)
        valid = mask[..., None] if mask is not None else 1
        ((ref_out * weights) * valid).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}

        # CP: this rank's slice through the patched layer, the context built as the model would.
        positions = torch.cat([torch.arange(n) for n in packed])[None] if packed else None
        ctx = CPContext.create(cp, batch, seq, x.device, attention_mask=mask, text_position_ids=positions)
        layer.zero_grad()
        x_cp = x.clone().requires_grad_(True)
        with ExchangeCounter() as counter:
            local = layer(ctx.shard(x_cp, dim=1), attention_mask=None, vlmcp_ctx=ctx)
            forward_bytes = counter.buffer_bytes
            full = ctx.gather(local, dim=1)
            ((full * weights) * valid).sum().backward()
        grads = {}
        for n, p in layer.named_parameters():
            total = p.grad.clone()
            dist.all_reduce(total, group=cp.group)
            grads[n] = total
        x_grad = x_cp.grad.clone()
        dist.all_reduce(x_grad, group=cp.group)
        results[name] = {
            "out_err": rel_err(full * valid, ref_out * valid),
            "input_grad_err": rel_err(x_grad, x_ref.grad),
            "param_grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads),
            "exchanges": counter.calls,
            # all-to-all send buffers of the group per token of the sequence, forward, fp32, and the
            # formula they must match: q and k (key heads after replication), v and the output.
            "a2a_bytes_per_token": forward_bytes * world_size / (batch * ctx.padded_len),
            "a2a_bytes_formula": 4 * (2 * layer.num_k_heads * _HeadShare.of(layer, ctx).repeat * layer.head_k_dim
                                      + 2 * layer.num_v_heads * layer.head_v_dim),
        }
    return results
