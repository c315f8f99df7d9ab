"""What the benchmarks share: models with the released models' per-token proportions (fewer layers), the
samples they run, and the probes that measure memory and traffic inside each rank.

Run the benchmarks from the repository root as modules (`python -m benchmarks.memory`); every number they
print comes from one run, as ratios between the CP sizes of that run.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vlmcp_patch.fixtures.data import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    Segment,
    make_packed_batch,
)
from vlmcp_patch.fixtures.models import build_model

MIB = 2**20


def _check_scale(scale: int) -> int:
    """Widths are divided by `scale`; the patch side by its square root, so that a pixel row (3 x 2 x patch^2)
    keeps its proportion to a hidden state."""
    side = math.isqrt(scale)
    if side * side != scale or 64 % scale:
        raise ValueError(f"scale must be 1, 4 or 16, got {scale}")
    return side


def _released_vision(depth: int, scale: int = 1) -> dict:
    """The released models' vision tower (1024 wide, 16 heads, patch 16) with `depth` blocks, widths / `scale`."""
    return dict(depth=depth, hidden_size=1024 // scale, intermediate_size=4096 // scale, num_heads=16, in_channels=3,
                patch_size=16 // _check_scale(scale), spatial_merge_size=2, temporal_patch_size=2,
                out_hidden_size=2048 // scale, num_position_embeddings=2304)


def _mrope_sections(sections: list[int], half: int) -> list[int]:
    """mRoPE sections (frequencies per axis) of a rotary half-width `half`, in the released proportions."""
    scaled = [max(1, round(s * half / sum(sections))) for s in sections]
    scaled[0] += half - sum(scaled)
    return scaled


def _released_config(config_class, text: dict, vision: dict):
    config = config_class(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                          video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_TOKEN_ID,
                          vision_end_token_id=VISION_END_TOKEN_ID, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return config


def qwen3_vl_2b_like(layers: int = 2, vision_depth: int = 3, scale: int = 1, heads: int = 16):
    """Qwen3-VL-2B's vocabulary, hidden size and heads (text: 16 query / 8 KV heads of 128; vision: 1024
    wide, 16 heads, patch 16, three deepstack levels), with `layers` decoder layers; every width and the
    vocabulary divided by `scale` (the head counts kept); `heads` query heads (half as many KV heads) to take a CP
    size beyond them."""
    from transformers import Qwen3VLConfig

    head_dim = 128 // scale
    text = dict(vocab_size=151936 // scale, hidden_size=2048 // scale, intermediate_size=6144 // scale,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                head_dim=head_dim,
                max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "mrope_section": _mrope_sections([24, 20, 20], head_dim // 2)})
    vision = {**_released_vision(vision_depth, scale), "deepstack_visual_indexes": list(range(vision_depth))}
    return _released_config(Qwen3VLConfig, text, vision)


def qwen3_5_like(layers: int = 2, vision_depth: int = 3, scale: int = 1, heads: int = 16):
    """Qwen3.5's vocabulary and heads (16 query / 4 KV heads of 256; DeltaNet 16 key / 32 value heads of 128)
    with hidden size 2048 and `layers` layers: DeltaNet layers with a full-attention layer last (Qwen3.5 has
    three DeltaNet layers per full-attention layer; two layers keep four ranks of the 248,320-word model
    within 24 GiB); every width and the vocabulary divided by `scale` (the head counts kept)."""
    from transformers import Qwen3_5Config

    kinds = ["linear_attention"] * (layers - 1) + ["full_attention"]
    head_dim = 256 // scale
    text = dict(vocab_size=248320 // scale, hidden_size=2048 // scale, intermediate_size=6144 // scale,
                num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4),
                head_dim=head_dim, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128 // scale, linear_value_head_dim=128 // scale, linear_conv_kernel_dim=4,
                max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": _mrope_sections([11, 11, 10], head_dim // 8)})
    return _released_config(Qwen3_5Config, text, _released_vision(vision_depth, scale))


MODELS = {"qwen3-vl": qwen3_vl_2b_like, "qwen3.5": qwen3_5_like}

S = Segment
# Packed rows of two samples each (a packed row also takes the package's path at P=1: the CP path's own
# one-rank baseline). Text-heavy: one picture per sample and long text. Image-heavy: eight pictures of
# mixed sizes, little text.
SAMPLES = {
    "text-heavy": [[S(text=700), S(image=(256, 256)), S(text=240)], [S(text=500), S(image=(224, 320)), S(text=300)]],
    "image-heavy": [
        [S(text=12), S(image=(384, 384)), S(text=6), S(image=(224, 224)), S(text=6), S(image=(384, 384)),
         S(text=6), S(image=(384, 256)), S(text=20)],
        [S(text=10), S(image=(224, 224)), S(text=6), S(image=(384, 256)), S(text=6), S(image=(448, 256)),
         S(text=6), S(image=(320, 256)), S(text=20)],
    ],
}


def real_image_processor(patch_size: int = 16):
    """The real Qwen2-VL PIL image processor for a released vision tower of `patch_size` (merge 2, temporal 2)."""
    from vlmcp_patch.fixtures.data import pil_image_processor

    factor = 2 * patch_size
    return pil_image_processor(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                               size={"shortest_edge": factor * factor, "longest_edge": 2048 * factor * factor})


def packed_sample(name: str) -> dict:
    """The packed row of SAMPLES[name], its pictures processed for a patch-16 vision tower."""
    return make_packed_batch(SAMPLES[name], seed=0, processor=real_image_processor())[0]


def build_benchmark_model(name: str, layers: int = 2, vision_depth: int = 3, scale: int = 1, **heads):
    """The model, its (tied) embeddings frozen: their gradient would be the largest tensor of every rank and
    does not depend on P; activations do not change."""
    model = build_model(MODELS[name](layers=layers, vision_depth=vision_depth, scale=scale, **heads), seed=0)
    model.get_input_embeddings().requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------------------
# Probes


class ModuleStack:
    """The qualified name of the innermost module running now (forward hooks on every module)."""

    def __init__(self, model):
        self.names = {m: n for n, m in model.named_modules()}
        self.stack = ["(outside modules)"]
        self.handles = []

    def __enter__(self):
        for module in self.names:
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _enter(self, module, args):
        self.stack.append(self.names.get(module) or "(model)")

    def _leave(self, module, args, out):
        self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1]


class SavedTensors:
    """Bytes of the tensors autograd saves for backward (each storage once, parameters and `existing` tensors left
    out), by module."""

    def __init__(self, model, modules: ModuleStack, existing=()):
        self.modules = modules
        # Parameters, and whatever else exists before the step (the caller's batch): saved, they cost nothing.
        self.params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *existing]}
        self.seen: set[int] = set()
        self.by_module: dict[str, int] = collections.defaultdict(int)

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.by_module[self.modules.current] += storage.nbytes()
        return t

    @contextlib.contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.by_module.values())


class LiveBytes(TorchDispatchMode):
    """Every tensor storage created inside the block and when it is freed: the peak of live bytes, with or
    without the parameter gradients (which stay alive to the end and do not depend on P)."""

    def __init__(self, existing=()):
        super().__init__()
        # Storages that exist before the step (parameters, buffers, the batch): their views are not allocations.
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.events: list[tuple[int, int]] = []  # (allocation id, +bytes / -bytes)
        self.alive: dict[int, tuple[int, int]] = {}  # data_ptr -> (allocation id, bytes)
        self.ids = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage.data_ptr()
        if key in self.alive or key in self.existing or storage.nbytes() == 0:
            return
        ident, size = next(self.ids), storage.nbytes()
        self.alive[key] = (ident, size)
        self.events.append((ident, size))
        weakref.finalize(storage, self._free, key, ident, size)

    def _free(self, key: int, ident: int, size: int) -> None:
        if self.alive.get(key, (None,))[0] == ident:
            del self.alive[key]
            self.events.append((ident, -size))

    def peak(self, excluded: set[int] = frozenset()) -> int:
        live = top = 0
        for ident, delta in self.events:
            if ident not in excluded:
                live += delta
                top = max(top, live)
        return top

    def ids_of(self, tensors) -> set[int]:
        return {self.alive[t.untyped_storage().data_ptr()][0] for t in tensors
                if t is not None and t.untyped_storage().data_ptr() in self.alive}


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start
