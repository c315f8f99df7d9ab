"""Bad inputs, unsupported setups and per-rank data differences under CP, run on every rank of a CP group.

Each scenario is (model factory, batch factory, extra call kwargs); factories take the rank, so a scenario
can give the ranks of a group different data. Every rank reports the error it saw (type and message), or
what the forward returned.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vlmcp_patch.fixtures.data import Segment, make_batch, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment
LAYOUT = [[S(text=5), S(image=(16, 24)), S(text=7)]]
PAIR = [[S(text=9)], [S(text=4), S(image=(16, 16)), S(text=2)]]


def _left_padded(batch):
    lengths = batch["attention_mask"].sum(1)
    for b in range(batch["input_ids"].shape[0]):
        shift = batch["input_ids"].shape[1] - int(lengths[b])
        for key in ("input_ids", "mm_token_type_ids", "attention_mask", "labels"):
            batch[key][b] = torch.roll(batch[key][b], shift)
    return batch


def qwen3_text_model():
    """A model the package does not run under CP (a plain Qwen3 causal LM)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def subclass_model():
    from transformers import Qwen3VLForConditionalGeneration

    class MyQwen3VL(Qwen3VLForConditionalGeneration):
        """A user's subclass: its inherited forward is the patched one."""

    torch.manual_seed(0)
    return MyQwen3VL(tiny_qwen3_vl_config())


def _scenarios(rank):
    """name -> (model factory, batch factory, extra call kwargs)."""
    base = lambda: build_model(tiny_qwen3_vl_config(), seed=0)  # noqa: E731
    batch = lambda: make_batch(LAYOUT, seed=3)  # noqa: E731
    pair = lambda: make_batch(PAIR, seed=3)  # noqa: E731

    def on_rank1(change, make=pair):
        def build():
            b = make()
            return change(b) if rank == 1 else b
        return build

    def mismatch():
        b = batch()
        b["input_ids"][0, 7] = 5  # one image placeholder token replaced by text
        return b

    def packed(**changes):
        row = make_packed_batch([LAYOUT[0], [S(text=6)]], seed=3, return_cu_seq_lens=True)[0]
        row.update(changes)
        return row

    def packed_with_padding():
        row = {k: v for k, v in packed().items() if not k.startswith(("cu_", "max_"))}
        row["attention_mask"] = torch.ones_like(row["input_ids"])
        row["attention_mask"][0, -2:] = 0
        row["labels"][0, -2:] = -100
        return row

    def two_packed_rows():
        row = {k: v for k, v in packed().items() if not k.startswith(("cu_", "max_")) and not k.startswith("pixel")}
        row.pop("image_grid_thw")
        text = row["mm_token_type_ids"] == 0
        return {k: torch.cat([v[:, text[0]]] * 2) for k, v in row.items() if k != "mm_token_type_ids"}

    def cache():
        from transformers import DynamicCache

        return {"past_key_values": DynamicCache()}

    def labels_on_padding():
        b = pair()
        b["labels"] = b["input_ids"].clone()  # padding not masked
        return b

    def swap_rows(b):
        return {k: v.flip(0) if k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids") else v
                for k, v in b.items()}

    def drop_last_token(b):
        b["attention_mask"][:, -1] = 0
        b["labels"][:, -1] = -100
        return b

    def changed(key, fn):
        return lambda b: {**b, key: fn(b[key])}

    def flex():
        model = base()
        model.config.get_text_config()._attn_implementation = "flex_attention"
        return model

    def all_ignored():
        b = batch()
        b["labels"][:] = -100
        return b

    return {
        # setups the package cannot run exactly
        "cp_size_not_dividing_world": (base, batch, {"_cp_size": 4}),
        "heads_not_splittable": (
            lambda: build_model(tiny_qwen3_vl_config(num_attention_heads=3, num_key_value_heads=1)), batch, {},
        ),
        "linear_heads_not_splittable": (
            lambda: build_model(tiny_qwen3_5_config(linear_num_key_heads=1, linear_num_value_heads=3)), batch, {},
        ),
        "eager_attention": (lambda: build_model(tiny_qwen3_vl_config(attn_implementation="eager")), batch, {}),
        "flex_attention": (flex, batch, {}),
        "unsupported_model": (qwen3_text_model, lambda: {"input_ids": torch.randint(1, 100, (1, 12))}, {}),
        "text_model_called_directly": (lambda: base().model, batch, {}),
        "past_key_values": (base, batch, cache()),
        "logits_to_keep": (base, batch, {"logits_to_keep": 1}),
        "router_logits": (lambda: build_model(tiny_qwen3_vl_config(moe=True)), batch, {"output_router_logits": True}),
        # batches the package cannot split exactly
        "image_token_mismatch": (base, mismatch, {}),
        "left_padding": (base, lambda: _left_padded(pair()), {}),
        "labels_on_padding": (base, labels_on_padding, {}),
        "packed_with_padding": (base, packed_with_padding, {}),
        "packed_on_two_rows": (base, two_packed_rows, {}),
        "packed_inconsistent_cu_seq_lens": (base, lambda: packed(cu_seq_lens_q=torch.tensor([0, 5, 31]),
                                                                 cu_seq_lens_k=torch.tensor([0, 5, 31])), {}),
        "vision_without_input_ids": (base, lambda: {**{k: v for k, v in batch().items() if k != "input_ids"},
                                                    "inputs_embeds": torch.zeros(1, 20, 32)}, {}),
        # ranks of a group that received different data or weights
        "one_rank_left_padded": (base, on_rank1(_left_padded), {}),
        "different_input_ids": (base, lambda: make_batch(LAYOUT, seed=3 + rank), {}),
        "rows_in_another_order": (base, on_rank1(swap_rows), {}),
        "different_labels": (base, on_rank1(changed("labels", lambda x: torch.where(x >= 0, (x + 1) % 100, x))), {}),
        "different_attention_mask": (base, on_rank1(drop_last_token), {}),
        "different_mm_token_type_ids": (base, on_rank1(changed("mm_token_type_ids", lambda t: t.roll(1, 1))), {}),
        "augmented_pixels": (base, on_rank1(changed("pixel_values", lambda p: p + 0.01)), {}),
        "different_num_items_in_batch": (base, batch, {"num_items_in_batch": 10 + rank}),
        "different_weights": (lambda: build_model(tiny_qwen3_vl_config(), seed=rank), batch, {}),
        "bf16_on_one_rank": (
            lambda: build_model(tiny_qwen3_vl_config(), dtype=torch.bfloat16 if rank else torch.float32), batch, {},
        ),
        # inputs that run
        "use_cache_true_is_fine": (base, batch, {"use_cache": True}),
        "subclass_of_a_supported_model": (subclass_model, batch, {}),
        "sequence_shorter_than_p": (base, lambda: make_batch([[S(text=1)]], seed=3), {"_cp_size": 2}),
        "labels_all_ignored": (base, all_ignored, {}),
    }


def _run(model, inputs, extra) -> dict:
    try:
        out = model(**inputs, **extra)
        loss = getattr(out, "loss", None)
        return {"error": None, "loss": None if loss is None else float(loss),
                "past_key_values": getattr(out, "past_key_values", "n/a") is None}
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc)}


def run_error_cases(rank: int, world_size: int, names: list[str]) -> dict:
    import vlmcp_patch

    results = {}
    scenarios = _scenarios(rank)
    for name in names:
        make_model, make_inputs, extra = scenarios[name]
        extra = dict(extra)
        size = extra.pop("_cp_size", world_size)
        model, inputs = make_model(), make_inputs()
        vlmcp_patch.enable(cp_size=size)
        try:
            results[name] = _run(model, inputs, extra)
        finally:
            vlmcp_patch.enable(cp_size=1)
        if results[name]["error"] is None:  # an input that runs: its P=1 loss (stock transformers) to compare
            results[name]["p1_loss"] = _run(model, inputs, extra)["loss"]
    # The weights are checked again after load_state_dict: rank 1 loads other weights after a good step.
    model = build_model(tiny_qwen3_vl_config(), seed=0)
    vlmcp_patch.enable(cp_size=world_size)
    try:
        model(**make_batch(LAYOUT, seed=3))
        if rank == 1:
            model.load_state_dict(build_model(tiny_qwen3_vl_config(), seed=5).state_dict())
        results["weights_loaded_differently"] = _run(model, make_batch(LAYOUT, seed=3), {})
    finally:
        vlmcp_patch.enable(cp_size=1)
    # Collectives are still matched after all of that: a normal CP step runs.
    vlmcp_patch.enable(cp_size=world_size)
    out = build_model(tiny_qwen3_vl_config(), seed=0)(**make_batch(LAYOUT, seed=3))
    out.loss.backward()
    results["after"] = float(out.loss)
    vlmcp_patch.enable(cp_size=1)
    dist.barrier()
    return results


def same_loss(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * abs(b)
