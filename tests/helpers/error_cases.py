"""Bad inputs, unsupported setups, per-rank data differences and awkward inputs that run, on every rank of a CP
group.

Each scenario is a named factory `(rank) -> (model, batch, extra call kwargs)`, so a scenario can give the
ranks of a group different data. Every rank reports what it saw under CP (error type and message, and how
long it took to raise) and, for the same model and batch, at P=1.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from tests.helpers.cases import masked_where_stock_cuts
from vlmcp_patch.fixtures.data import TRAINING_LAYOUTS, Segment, build_sample, make_batch, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config
from vlmcp_patch.fixtures.official import OfficialFlattenedCollator, OfficialPaddedCollator

S = Segment
LAYOUT = [[S(text=5), S(image=(16, 24)), S(text=7)]]
PAIR = [[S(text=9)], [S(text=4), S(image=(16, 16)), S(text=2)]]


def vl_model():
    return build_model(tiny_qwen3_vl_config(), seed=0)


def q35_model():
    return build_model(tiny_qwen3_5_config(), seed=0)


def one_sample():
    return make_batch(LAYOUT, seed=3)


def pair():
    return make_batch(PAIR, seed=3)


def left_padded(batch):
    """The rows moved to the right end; each row's first token without a label (a prompt token), so no padding
    position has a target after the shift (stock would score the padding there)."""
    lengths = batch["attention_mask"].sum(1)
    for b in range(batch["input_ids"].shape[0]):
        shift = batch["input_ids"].shape[1] - int(lengths[b])
        for key in ("input_ids", "mm_token_type_ids", "attention_mask", "labels"):
            batch[key][b] = torch.roll(batch[key][b], shift)
        batch["labels"][b, shift] = -100
    return batch


def packed(**changes):
    row = make_packed_batch([LAYOUT[0], [S(text=6)]], seed=3, return_cu_seq_lens=True)[0]
    row.update(changes)
    return row


def without(batch: dict, *keys) -> dict:
    return {k: v for k, v in batch.items() if k not in keys and not k.startswith(keys)}


SCENARIOS: dict = {}  # name -> factory (rank) -> (model, batch, extra call kwargs)


def scenario(factory, name: str | None = None):
    SCENARIOS[name or factory.__name__] = factory
    return factory


def official(fmt: str):
    model = vl_model()
    samples = [build_sample(TRAINING_LAYOUTS[i], seed=i) for i in range(3)]
    collator = OfficialPaddedCollator if fmt == "padded" else OfficialFlattenedCollator
    return model, collator(model.model.get_rope_index)(samples)


# ---------------------------------------------------------------------------------------------------------
# Setups the package cannot run exactly


@scenario
def cp_size_not_dividing_world(rank):
    return vl_model(), one_sample(), {"_cp_size": 4}




@scenario
def ulysses_size_not_dividing_p(rank):  # VLMCP_ULYSSES_SIZE=4 at P=2
    return vl_model(), one_sample(), {"_ulysses_size": 4}


@scenario
def eager_attention(rank):
    return build_model(tiny_qwen3_vl_config(attn_implementation="eager")), one_sample(), {}


@scenario
def flex_attention(rank):
    model = vl_model()
    model.config.get_text_config()._attn_implementation = "flex_attention"
    return model, one_sample(), {}


@scenario
def unsupported_model(rank):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    return model, {"input_ids": torch.randint(1, 100, (1, 12))}, {}


@scenario
def text_model_called_directly(rank):
    return vl_model().model, one_sample(), {}


@scenario
def past_key_values(rank):
    from transformers import DynamicCache

    return vl_model(), one_sample(), {"past_key_values": DynamicCache()}


@scenario
def cache_keyword(rank):
    from transformers import DynamicCache

    return vl_model(), one_sample(), {"cache": DynamicCache()}


@scenario
def logits_to_keep_with_every_label(rank):
    """Stock's loss pairs the kept logits with the labels one to one: the labels of every position do not pair with
    one kept logit (tests/test_logits_to_keep.py runs the forms that do)."""
    return vl_model(), one_sample(), {"logits_to_keep": 1}


@scenario
def router_logits(rank):
    return build_model(tiny_qwen3_vl_config(moe=True)), one_sample(), {"output_router_logits": True}


@scenario
def four_dimensional_mask(rank):
    batch = one_sample()
    n = batch["input_ids"].shape[1]
    batch["attention_mask"] = torch.ones(n, n).tril().bool()[None, None]
    return vl_model(), batch, {}


@scenario
def deltanet_mask_with_holes(rank):
    batch = pair()
    batch["attention_mask"][0, 3] = 0
    batch["labels"][0, 3] = -100
    return q35_model(), batch, {}


@scenario
def deltanet_rows_restarting(rank):
    batch = without(make_batch([[S(text=10)], [S(text=10)]], seed=3), "attention_mask", "mm_token_type_ids")
    batch["position_ids"] = torch.cat([torch.arange(4), torch.arange(6)])[None].expand(2, -1)
    return q35_model(), batch, {"use_cache": False}


def _script_attention(model, attend):
    """`model` with its text attention's forward replaced, as a script does, by one that computes q, k, v itself and
    hands them to `attend(q, k, v, module)` (heads first)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling

    from vlmcp_patch.attention.foreign import text_attention_modules
    from vlmcp_patch.fixtures.official import attention_inputs

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        q, k, v = attention_inputs(self, hidden_states, position_embeddings, modeling)
        groups = q.shape[1] // k.shape[1]
        out = attend(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), self)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    for module in text_attention_modules(model):
        module.__class__ = type("ScriptAttention", (type(module),), {"forward": forward, "__module__": "a_script"})
    return model


@scenario
def script_attention_computing_itself(rank):
    def attend(q, k, v, module):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=module.scaling)

    return _script_attention(vl_model(), attend), one_sample(), {}


@scenario
def script_flash_attention_bound_before_import(rank):
    from tests.helpers.flash_standin import flash_attn_varlen_func  # the kernel itself, not the package's wrapper

    def attend(q, k, v, module):
        cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
        out = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                     q.shape[2], q.shape[2], causal=True, softmax_scale=module.scaling)
        return out.transpose(0, 1)[None]

    return _script_attention(vl_model(), attend), one_sample(), {}


@scenario
def three_query_heads(rank):  # P=2 does not divide them: a ring of two (U = 1)
    return build_model(tiny_qwen3_vl_config(num_attention_heads=3, num_key_value_heads=1)), one_sample(), {}


@scenario
def three_deltanet_value_heads(rank):
    return build_model(tiny_qwen3_5_config(linear_num_key_heads=1, linear_num_value_heads=3)), one_sample(), {}


# ---------------------------------------------------------------------------------------------------------
# Malformed batches: stock's compute would trip on them (on one rank only, under CP)


@scenario
def image_token_mismatch(rank):
    batch = one_sample()
    batch["input_ids"][0, 7] = 5  # one image placeholder token replaced by text
    return vl_model(), batch, {}


@scenario
def labels_outside_vocabulary(rank):
    batch = one_sample()
    batch["labels"][0, -2] = 300
    return vl_model(), batch, {}


@scenario
def input_ids_outside_vocabulary(rank):
    batch = one_sample()
    batch["input_ids"][0, 1] = 128
    return vl_model(), batch, {}


@scenario
def fewer_pixel_rows(rank):
    batch = one_sample()
    batch["pixel_values"] = batch["pixel_values"][:-4]
    return vl_model(), batch, {}


@scenario
def extra_pixel_rows(rank):
    batch = one_sample()
    batch["pixel_values"] = torch.cat([batch["pixel_values"], batch["pixel_values"][:4]])
    return vl_model(), batch, {}


@scenario
def zero_in_grid(rank):
    batch = one_sample()
    batch["image_grid_thw"] = batch["image_grid_thw"].clone()
    batch["image_grid_thw"][0, 0] = 0
    return vl_model(), batch, {}


@scenario
def labels_longer_without_mask(rank):
    batch = one_sample()
    batch["labels"] = torch.cat([batch["labels"], batch["labels"][:, :3]], dim=1)
    return vl_model(), batch, {}


@scenario
def labels_shorter(rank):
    batch = one_sample()
    batch["labels"] = batch["labels"][:, :-3]
    return vl_model(), batch, {}


@scenario
def labels_longer_with_mask(rank):
    batch = pair()
    batch["labels"] = torch.cat([batch["labels"], torch.full((2, 2), -100)], dim=1)
    return vl_model(), batch, {}


@scenario
def positions_longer(rank):
    batch = without(make_batch([[S(text=12)]], seed=3), "mm_token_type_ids")
    batch["position_ids"] = torch.arange(15)[None]
    return vl_model(), batch, {}


@scenario
def packed_row_with_longer_labels(rank):
    row = packed()
    row["labels"] = torch.cat([row["labels"], row["labels"][:, :2]], dim=1)
    return vl_model(), row, {}


@scenario
def input_ids_and_embeds(rank):
    model, batch = vl_model(), without(make_batch([[S(text=12)]], seed=3), "mm_token_type_ids")
    return model, {**batch, "inputs_embeds": model.get_input_embeddings()(batch["input_ids"]).detach()}, {}


@scenario
def image_tokens_on_padding(rank):
    """LLaMA-Factory's collator on a batch without images: a fake image whose tokens are padding (mask 0, no labels),
    so that DDP sees the tower used. Stock runs it (its features reach no loss); under CP those features go to no
    rank, and it runs with stock's loss (issue 64; before, an IndexError on every rank)."""
    from tests.helpers.padding_image_cases import CASES

    return vl_model(), CASES["fake image alone"](), {}


@scenario
def labels_on_padding(rank):
    batch = pair()
    batch["labels"] = batch["input_ids"].clone()  # padding not masked
    return vl_model(), batch, {}


@scenario
def packed_inconsistent_cu_seq_lens(rank):
    length = packed()["input_ids"].shape[1]
    cu = torch.tensor([0, 5, length], dtype=torch.int32)  # the samples do not start at 5
    return vl_model(), packed(cu_seq_lens_q=cu, cu_seq_lens_k=cu), {}


@scenario
def flattened_row_with_bad_lengths(rank):
    model, batch = official("flattened")
    batch["attention_mask"] = batch["attention_mask"].flip(0)
    return model, batch, {}


@scenario
def vision_without_token_types_or_positions(rank):
    return vl_model(), without(one_sample(), "mm_token_type_ids"), {}


# ---------------------------------------------------------------------------------------------------------
# Ranks of a group that received different data or weights


def _on_rank1(change, make=pair):
    def factory(rank):
        batch = make()
        return vl_model(), change(batch) if rank == 1 else batch, {}
    return factory


def _changed(key, fn):
    return lambda b: {**b, key: fn(b[key])}


def _bad_label(batch):
    batch["labels"][0, 2] = 999
    return batch


def _swap_rows(batch):
    return {k: v.flip(0) if k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids") else v
            for k, v in batch.items()}


def _drop_last_token(batch):
    batch["attention_mask"][:, -1] = 0
    batch["labels"][:, -1] = -100
    return batch


scenario(_on_rank1(_bad_label), "one_rank_with_a_bad_label")
scenario(_on_rank1(_swap_rows), "rows_in_another_order")
scenario(_on_rank1(_changed("labels", lambda x: torch.where(x >= 0, (x + 1) % 100, x))), "different_labels")
scenario(_on_rank1(_drop_last_token), "different_attention_mask")
scenario(_on_rank1(_changed("mm_token_type_ids", lambda t: t.roll(1, 1))), "different_mm_token_type_ids")
scenario(_on_rank1(_changed("pixel_values", lambda p: p + 0.01)), "augmented_pixels")


@scenario
def different_input_ids(rank):
    return vl_model(), make_batch(LAYOUT, seed=3 + rank), {}


@scenario
def different_num_items_in_batch(rank):
    return vl_model(), one_sample(), {"num_items_in_batch": 10 + rank}


@scenario
def different_weights(rank):
    return build_model(tiny_qwen3_vl_config(), seed=rank), one_sample(), {}


@scenario
def bf16_on_one_rank(rank):
    return build_model(tiny_qwen3_vl_config(), dtype=torch.bfloat16 if rank else torch.float32), one_sample(), {}


@scenario
def vision_dp_off_on_one_rank(rank):
    """The same batch and weights, another setting on one rank: the ranks would plan the forward differently."""
    return vl_model(), one_sample(), {"_vision_dp": rank == 0}


# ---------------------------------------------------------------------------------------------------------
# Awkward inputs stock accepts: they run, with the P=1 loss


@scenario
def use_cache_true(rank):
    return vl_model(), one_sample(), {"use_cache": True}


@scenario
def subclass_of_a_supported_model(rank):
    from transformers import Qwen3VLForConditionalGeneration

    class MyQwen3VL(Qwen3VLForConditionalGeneration):
        """A user's subclass: its inherited forward is the patched one."""

    torch.manual_seed(0)
    return MyQwen3VL(tiny_qwen3_vl_config()), one_sample(), {}


@scenario
def sequence_shorter_than_p(rank):
    return vl_model(), make_batch([[S(text=1)]], seed=3), {}


@scenario
def labels_all_ignored(rank):
    batch = one_sample()
    batch["labels"][:] = -100
    return vl_model(), batch, {}


@scenario
def left_padding(rank):
    return vl_model(), left_padded(pair()), {}


@scenario
def left_padding_qwen3_5(rank):
    return q35_model(), left_padded(pair()), {}


@scenario
def mask_with_holes(rank):
    batch = pair()
    batch["attention_mask"][1, 1] = 0
    batch["labels"][1, 1:3] = -100  # the hole and the token it would predict
    return vl_model(), batch, {}


@scenario
def packed_samples_with_padding(rank):
    row = without(packed(), "cu_", "max_")
    row["attention_mask"] = torch.ones_like(row["input_ids"])
    row["attention_mask"][0, -2:] = 0
    row["labels"][0, -2:] = -100
    return vl_model(), row, {}


@scenario
def packed_samples_on_two_rows(rank):
    row = without(packed(), "cu_", "max_", "pixel", "image_grid_thw")
    text = row["mm_token_type_ids"] == 0
    return vl_model(), {k: torch.cat([v[:, text[0]]] * 2) for k, v in row.items() if k != "mm_token_type_ids"}, {
        "use_cache": False}


@scenario
def four_row_positions_restarting(rank):
    batch = without(make_batch([[S(text=9)]], seed=3), "mm_token_type_ids")
    text = torch.cat([torch.arange(4), torch.arange(5)])[None]
    batch["position_ids"] = torch.cat([text[None], torch.arange(9).view(1, 1, -1).expand(3, 1, -1)])
    return vl_model(), batch, {"use_cache": False}


@scenario
def vision_with_embeddings_only(rank):
    model, batch = vl_model(), one_sample()
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    return model, {**without(batch, "mm_token_type_ids"), "inputs_embeds": embeds}, {}


@scenario
def nan_in_pixel_values(rank):
    batch = one_sample()
    batch["pixel_values"][3, 5] = float("nan")
    return vl_model(), batch, {}


@scenario
def inf_in_inputs_embeds(rank):
    model, batch = vl_model(), without(make_batch([[S(text=12)]], seed=3), "mm_token_type_ids")
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    embeds[0, 4, 0] = float("inf")
    return model, {**batch, "inputs_embeds": embeds}, {}


@scenario
def official_padded_batch(rank):
    return (*official("padded"), {})


@scenario
def official_flattened_row(rank):
    return (*official("flattened"), {})


@scenario
def text_after_an_image_batch(rank):
    # The model keeps the image batch's `rope_deltas`: transformers 5.2 adds them to the positions of the next batch
    # without vision inputs (5.25 ignores them when given input_ids), CP's positions are stock's either way.
    model = vl_model()
    with torch.no_grad():
        model(**one_sample())
    return model, make_batch([[S(text=14)]], seed=4), {}


@scenario
def return_dict_false(rank):
    # Without a cache, stock 5.2 cuts this maskless row at its image (`cases.STOCK_CUTS_ROWS_AT_IMAGES`): there the row
    # gets a mask of ones, so stock's reference attends over the whole row, as CP and every later release do.
    return vl_model(), masked_where_stock_cuts(one_sample(), True), {"return_dict": False, "use_cache": False}


def outcome(model, inputs, extra) -> dict:
    start = time.monotonic()
    try:
        out = model(**inputs, **extra)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    loss = out[0] if isinstance(out, tuple) else getattr(out, "loss", None)
    return {"error": None, "loss": None if loss is None else float(loss), "tuple_len": len(out) if
            isinstance(out, tuple) else None, "cache": getattr(out, "past_key_values", None) is not None}


def run_error_cases(rank: int, world_size: int, names: list[str]) -> dict:
    """Each named scenario under CP (the world's size unless it sets `_cp_size`) and at P=1 (stock, for
    everything but a packed row)."""
    import vlmcp_patch

    results = {}
    for name in names:
        model, inputs, extra = SCENARIOS[name](rank)
        size = extra.pop("_cp_size", world_size)
        vlmcp_patch.enable(cp_size=size, vision_dp=extra.pop("_vision_dp", True),
                           ulysses_size=extra.pop("_ulysses_size", 0))
        try:
            results[name] = outcome(model, inputs, extra)
        finally:
            vlmcp_patch.enable(cp_size=1, vision_dp=True, ulysses_size=0)
        results[name]["p1"] = outcome(model, inputs, extra)
    results["weights_loaded_differently"] = _weights_loaded_differently(rank, world_size)
    # Collectives are still matched after all of that: a normal CP step runs.
    vlmcp_patch.enable(cp_size=world_size)
    out = vl_model()(**one_sample())
    out.loss.backward()
    results["after"] = float(out.loss)
    vlmcp_patch.enable(cp_size=1)
    dist.barrier()
    return results


def _weights_loaded_differently(rank: int, world_size: int) -> dict:
    """The weights are checked again after load_state_dict: rank 1 loads other weights after a good step."""
    import vlmcp_patch

    model = vl_model()
    vlmcp_patch.enable(cp_size=world_size)
    try:
        model(**one_sample())
        if rank == 1:
            model.load_state_dict(build_model(tiny_qwen3_vl_config(), seed=5).state_dict())
        return outcome(model, one_sample(), {})
    finally:
        vlmcp_patch.enable(cp_size=1)


def same_loss(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * abs(b)


def script_flash_boundaries_wrong_on_one_rank(rank: int, world_size: int) -> dict:
    """A script's own `flash_attn_varlen_func` call (flash-attn: the CPU stand-in, wrapped as at an import that finds
    it) inside a CP forward, with the row's boundaries on rank 0 and boundaries of another row on rank 1: what each
    rank raised, and how long it took. Its own process: the stand-in changes what transformers finds installed."""
    from tests.helpers import flash_standin

    flash_standin.install()
    import flash_attn

    import vlmcp_patch

    vlmcp_patch.revert()
    vlmcp_patch.apply()
    batch = one_sample()
    length = batch["input_ids"].shape[1]
    cu = torch.tensor([0, length] if rank == 0 else [0, length - 3, length], dtype=torch.int32)

    varlen = flash_attn.flash_attn_varlen_func  # the package's wrapper, bound after the import as a script does

    def attend(q, k, v, module):
        out = varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, length, length,
                     causal=True, softmax_scale=module.scaling)
        return out.transpose(0, 1)[None]

    vlmcp_patch.enable(cp_size=world_size)
    try:
        result = outcome(_script_attention(vl_model(), attend), batch, {})
    finally:
        vlmcp_patch.enable(cp_size=1)
    dist.barrier()  # the group is still usable: every rank left the forward at the same collective
    return result
