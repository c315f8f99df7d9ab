"""Model dimensions: what the cost model needs of a model, written down from the public configs (no download), or
read from a config (object, dict or config.json)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """What the cost model needs of a model. Counts are per model; `layer_types` lists "full" (softmax attention)
    and "linear" (gated DeltaNet) layers in order. Vision fields are zero for a text-only model."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    linear_layers: int = 0  # gated DeltaNet layers among `layers`
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 4
    vision_depth: int = 0
    vision_width: int = 0
    vision_intermediate: int = 0
    vision_heads: int = 0
    patch: int = 16
    temporal_patch: int = 2
    merge: int = 2
    deepstack: int = 0  # Qwen3-VL's deepstack mergers
    # distinct block outputs the mergers read (the last block's and the deepstack levels'); 0: 1 + deepstack (the
    # released models tap blocks other than the last)
    vision_taps: int = 0
    attention_gate: bool = False  # Qwen3.5 (`attn_output_gate`): q_proj also makes a gate of H x D per token

    @property
    def full_layers(self) -> int:
        return self.layers - self.linear_layers

    def head_counts(self) -> list[int]:
        """The head counts U must divide (the package's rule: query heads, and DeltaNet value heads)."""
        return [self.heads] + ([self.linear_v_heads] if self.linear_layers else [])

    # parameters ------------------------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        gate = self.heads * d * h if self.attention_gate else 0  # q_proj's second half: the output gate
        return h * d * (self.heads + 2 * self.kv_heads) + self.heads * d * h + gate

    def deltanet_params(self) -> int:
        h, k, v = self.hidden, self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        conv = (2 * k + v) * self.conv_kernel
        return h * (2 * k + 2 * v) + h * 2 * self.linear_v_heads + conv + v * h

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def vision_params(self) -> int:
        w, i = self.vision_width, self.vision_intermediate
        if not self.vision_depth:
            return 0
        block = 4 * w * w + 2 * w * i
        merger = (4 * w) * (4 * w) + (4 * w) * self.hidden
        return self.vision_depth * block + (1 + self.deepstack) * merger + self.patch_values * w

    @property
    def patch_values(self) -> int:
        """Pixel values per patch: 3 channels x temporal patch x patch side squared (the patch embedding's input)."""
        return 3 * self.temporal_patch * self.patch**2

    @property
    def merger_inputs(self) -> int:
        return self.vision_taps or 1 + self.deepstack

    def params(self) -> int:
        """All parameters (the vision tower's included)."""
        decoder = self.full_layers * self.attention_params() + self.linear_layers * self.deltanet_params()
        decoder += self.layers * self.mlp_params()
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return decoder + embed + self.vision_params()


# Public configs, written down (no download). Where a number is from memory of the config and not checked against
# the file, docs/plan.md says so.
MODELS: dict[str, ModelDims] = {
    # Qwen/Qwen3-VL-8B-Instruct config.json: text 4096 wide, 36 layers, 32 / 8 heads of 128, MLP 12288, vocab
    # 151936, untied; vision 27 blocks 1152 wide (MLP 4304, 16 heads, patch 16, temporal 2, merge 2), deepstack 3.
    "qwen3-vl-8b": ModelDims("qwen3-vl-8b", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                             intermediate=12288, vocab=151936, tied=False, vision_depth=27, vision_width=1152,
                             vision_intermediate=4304, vision_heads=16, deepstack=3),
    # Qwen/Qwen3.5-27B config.json (the file itself is not in the code index; checked against copies of its text
    # and vision configs in public code, docs/plan.md): 5120 wide, 64 layers, 3 gated DeltaNet per softmax layer;
    # softmax 24 / 4 heads of 256 with the output gate (attn_output_gate); DeltaNet 16 key / 48 value heads of 128,
    # conv 4; MLP 17408; vocab 248320, untied; vision 27 x 1152 (MLP 4304, 16 heads, patch 16), no deepstack.
    "qwen3.5-27b": ModelDims("qwen3.5-27b", hidden=5120, layers=64, heads=24, kv_heads=4, head_dim=256,
                             intermediate=17408, vocab=248320, tied=False, linear_layers=48, linear_k_heads=16,
                             linear_v_heads=48, linear_k_dim=128, linear_v_dim=128, vision_depth=27,
                             vision_width=1152, vision_intermediate=4304, vision_heads=16, attention_gate=True),
    # meta-llama/Llama-3.1-8B config.json: 4096 wide, 32 layers, 32 / 8 heads of 128, MLP 14336, vocab 128256.
    "llama-3.1-8b": ModelDims("llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                              intermediate=14336, vocab=128256, tied=False),
    # Qwen/Qwen3-4B config.json: 2560 wide, 36 layers, 32 / 8 heads of 128, MLP 9728, vocab 151936, tied.
    "qwen3-4b": ModelDims("qwen3-4b", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                          intermediate=9728, vocab=151936, tied=True),
}


def mlp_width(text: dict) -> int:
    """The MLP width one token passes through: a dense MLP's `intermediate_size`; in a MoE layer (Qwen3.5-MoE's config
    has no dense width) its k routed experts' and the shared expert's widths together."""
    if text.get("intermediate_size"):
        return text["intermediate_size"]
    routed = (text.get("moe_intermediate_size") or 0) * (text.get("num_experts_per_tok") or 1)
    return routed + (text.get("shared_expert_intermediate_size") or 0)


def dims_from_config(config, name: str = "config") -> ModelDims:
    """ModelDims of a Hugging Face config: a config object, or its dict (config.json), multimodal or text-only."""
    as_dict = config if isinstance(config, dict) else config.to_dict()
    text = as_dict.get("text_config") or as_dict
    vision = as_dict.get("vision_config") or {}
    kinds = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    return ModelDims(
        name=name, hidden=text["hidden_size"], layers=text["num_hidden_layers"], heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate=mlp_width(text), vocab=text["vocab_size"],
        tied=bool(as_dict.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        linear_layers=sum(k == "linear_attention" for k in kinds),
        linear_k_heads=text.get("linear_num_key_heads", 0) or 0,
        linear_v_heads=text.get("linear_num_value_heads", 0) or 0,
        linear_k_dim=text.get("linear_key_head_dim", 0) or 0, linear_v_dim=text.get("linear_value_head_dim", 0) or 0,
        conv_kernel=text.get("linear_conv_kernel_dim", 4) or 4,
        vision_depth=vision.get("depth", 0), vision_width=vision.get("hidden_size", 0),
        vision_intermediate=vision.get("intermediate_size", 0), vision_heads=vision.get("num_heads", 0),
        patch=vision.get("patch_size", 16), temporal_patch=vision.get("temporal_patch_size", 2),
        merge=vision.get("spatial_merge_size", 2), deepstack=len(vision.get("deepstack_visual_indexes") or []),
        vision_taps=len({*(vision.get("deepstack_visual_indexes") or []), vision.get("depth", 0) - 1}) if vision else 0,
        attention_gate=has_output_gate(as_dict, text))


GATED_FAMILIES = ("qwen3_5", "qwen3_next")  # transformers' softmax attention there always makes the output gate


def has_output_gate(config: dict, text: dict) -> bool:
    """Whether the softmax attention's q_proj also makes an output gate (Qwen3.5, Qwen3-Next): the released
    config.json says so (`attn_output_gate`); transformers' config object has no such field, its model type does."""
    if "attn_output_gate" in text:
        return bool(text["attn_output_gate"])
    kind = str(text.get("model_type") or config.get("model_type") or "")
    return kind.startswith(GATED_FAMILIES)


def model_dims(model) -> ModelDims:
    """A known name (MODELS), tiny-qwen3-vl / tiny-qwen3.5 (the test fixtures), a config.json path or folder, a
    config object or dict, or ModelDims itself."""
    if isinstance(model, ModelDims):
        return model
    if isinstance(model, str):
        if model.lower() in MODELS:
            return MODELS[model.lower()]
        if model in ("tiny-qwen3-vl", "tiny-qwen3.5"):
            from ..fixtures.models import tiny_qwen3_5_config, tiny_qwen3_vl_config

            config = (tiny_qwen3_vl_config if model == "tiny-qwen3-vl" else tiny_qwen3_5_config)()
            return dims_from_config(config, model)
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if os.path.isfile(path):
            with open(path) as f:
                return dims_from_config(json.load(f), os.path.basename(os.path.dirname(path)) or path)
        raise ValueError(f"unknown model {model!r}: a name of {sorted(MODELS)}, tiny-qwen3-vl, tiny-qwen3.5, "
                         "or a config.json path")
    return dims_from_config(model, getattr(model, "name_or_path", "") or "config")

