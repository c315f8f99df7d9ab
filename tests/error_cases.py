"""Bad inputs and unsupported setups under CP, run on every rank of a CP group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vlmcp_patch.testing import Segment, build_model, make_batch, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment
LAYOUT = [[S(text=5), S(image=(16, 24)), S(text=7)]]


def _left_padded(batch):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lengths = mask.sum(1)
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        for key in ("input_ids", "mm_token_type_ids", "attention_mask", "labels"):
            batch[key][b] = torch.roll(batch[key][b], ids.shape[1] - n)
    return batch


def _scenarios(rank):
    """name -> (model factory, batch factory, extra call kwargs)."""
    base = lambda: build_model(tiny_qwen3_vl_config(), seed=0)  # noqa: E731
    batch = lambda: make_batch(LAYOUT, seed=3)  # noqa: E731
    pair = lambda: make_batch([[S(text=9)], [S(text=4), S(image=(16, 16)), S(text=2)]], seed=3)  # noqa: E731

    def mismatch():
        b = batch()
        b["input_ids"][0, 7] = 5  # one image placeholder token replaced by text
        return b

    def other_batch_on_rank1():
        return make_batch(LAYOUT, seed=3 + rank)

    def left_padded_on_rank1():
        return _left_padded(pair()) if rank == 1 else pair()

    def text_llm():
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        )
        return Qwen3ForCausalLM(config)

    def cache():
        from transformers import DynamicCache

        return {"past_key_values": DynamicCache()}

    def packed():
        from vlmcp_patch.testing import make_packed_batch

        return make_packed_batch([LAYOUT[0], [S(text=6)]], seed=3, return_cu_seq_lens=True)[0]

    def packed_with_wrong_cu():
        row = packed()
        row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = torch.tensor([0, 5, row["input_ids"].shape[1]], dtype=torch.int32)
        return row

    def packed_with_padding():
        row = packed()
        row["attention_mask"] = torch.ones_like(row["input_ids"])
        row["attention_mask"][0, -2:] = 0
        return row

    return {
        "packed_inconsistent_cu_seq_lens": (base, packed_with_wrong_cu, {}),
        "packed_with_padding": (base, packed_with_padding, {}),
        "eager_attention": (lambda: build_model(tiny_qwen3_vl_config(attn_implementation="eager")), batch, {}),
        "heads_not_splittable": (
            lambda: build_model(tiny_qwen3_vl_config(num_attention_heads=3, num_key_value_heads=1)), batch, {},
        ),
        "linear_heads_not_splittable": (
            lambda: build_model(tiny_qwen3_5_config(linear_num_key_heads=1, linear_num_value_heads=3)), batch, {},
        ),
        "unsupported_model": (text_llm, lambda: {"input_ids": torch.randint(1, 100, (1, 12))}, {}),
        "text_model_called_directly": (lambda: base().model, batch, {}),
        "image_token_mismatch": (base, mismatch, {}),
        "left_padding": (base, lambda: _left_padded(pair()), {}),
        "past_key_values": (base, batch, cache()),
        "logits_to_keep": (base, batch, {"logits_to_keep": 1}),
        "one_rank_left_padded": (base, left_padded_on_rank1, {}),
        "different_batches": (base, other_batch_on_rank1, {}),
        "cp_size_not_dividing_world": (base, batch, {"_cp_size": 4}),
        "use_cache_true_is_fine": (base, batch, {"use_cache": True}),
    }


def run_error_cases(rank: int, world_size: int, names: list[str]) -> dict:
    import vlmcp_patch

    results = {}
    scenarios = _scenarios(rank)
    for name in names:
        make_model, make_inputs, extra = scenarios[name]
        extra = dict(extra)
        vlmcp_patch.enable(cp_size=extra.pop("_cp_size", world_size))
        model, inputs = make_model(), make_inputs()
        try:
            out = model(**inputs, **extra)
            results[name] = {"error": None, "past_key_values": getattr(out, "past_key_values", "n/a") is None}
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[name] = {"error": type(exc).__name__, "message": str(exc)}
        finally:
            vlmcp_patch.enable(cp_size=1)
    # Collectives are still matched after all of that: a normal CP step runs.
    vlmcp_patch.enable(cp_size=world_size)
    out = build_model(tiny_qwen3_vl_config(), seed=0)(**make_batch(LAYOUT, seed=3))
    out.loss.backward()
    results["after"] = float(out.loss)
    # generate() runs with CP bypassed, and gives what it gives at P=1.
    model = build_model(tiny_qwen3_vl_config(), seed=0)
    prompt = make_batch(LAYOUT, seed=3, labels=False)
    generated = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    vlmcp_patch.enable(cp_size=1)
    reference = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    results["generated"] = generated.shape[1] - prompt["input_ids"].shape[1]
    results["generated_equals_p1"] = torch.equal(generated, reference)
    dist.barrier()
    return results
