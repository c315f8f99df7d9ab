"""A patched call's arguments as one dict, and the names of its keys (the questions asked of them are `batch.py`'s)."""

from __future__ import annotations

import inspect

import torch

from ..errors import CPInputError

# The batch's pixel values. Under CP the training integrations leave them on the host (each rank copies its own
# share to its device: forward/vision.py, integrations/placement.py).
PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
# Beside pixel values cut to one rank's share on the host, the record of the cut (`host_pixels.py`).
SHARE_RECORDS = {"pixel_values": "vlmcp_pixel_values_share", "pixel_values_videos": "vlmcp_pixel_values_videos_share"}
# Each modality's arguments: (modality, pixels, grid, the config's placeholder token id).
VISION = (("image", "pixel_values", "image_grid_thw", "image_token_id"),
          ("video", "pixel_values_videos", "video_grid_thw", "video_token_id"))
# A packed row's sample boundaries for flash-attention, as `DataCollatorWithFlattening` gives them.
CU_SEQ_LENS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# The spellings of the KV-cache argument across the supported transformers: `cache` from 5.24 (`past_key_values`
# still accepted there, deprecated), `past_key_values` before.
CACHE_KEYWORDS = ("past_key_values", "cache")


def call_arguments(wrapped, args, kwargs) -> dict:
    """All arguments of a call as keywords, including those collected by the target's `**kwargs`."""
    sig = inspect.signature(wrapped)
    call = dict(sig.bind_partial(*args, **kwargs).arguments)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if var_kw is not None:
        call.update(call.pop(var_kw, {}))
    return call


def pixels_on_device(call: dict, device) -> dict:
    """`call` with its pixel values on `device`: a stock pass under a CP launch (`generate()`, `disabled()`) takes
    them where the model is, and the integrations may have left them on the host. Pixel values cut to one rank's
    share (`host_pixels.py`) cannot serve it: that raises."""
    cut = [key for key, record in SHARE_RECORDS.items() if call.get(record) is not None]
    if cut:
        raise CPInputError(
            f"{', '.join(cut)} hold only this rank's share of the rows (vlmcp_patch cut them on the host for the CP "
            "forward), and a pass without CP (generate(), disabled()) needs them whole: build this batch inside "
            "vlmcp_patch.disabled(), or switch the cut off (VLMCP_HOST_PIXEL_SHARES=0)")
    return {k: v.to(device) if k in PIXEL_KEYS and torch.is_tensor(v) else v for k, v in call.items()}
