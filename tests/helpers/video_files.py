"""Small encoded video files for the video tests of `ShareDecoding`, written with PyAV, and the stock processor's
output for them (the processor given the frames `transformers.video_utils.load_video(path, backend="pyav")` reads
with the processor's own sampling: its default backend, torchcodec, needs FFmpeg's shared libraries)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# Needs torchvision (the video processor's transforms) and PyAV: the main environment's '+cpu' torch has no
# torchvision that imports.
VIDEO_VENV = ("needs torchvision and PyAV: python3 -m venv .venv-video && . .venv-video/bin/activate && "
              "pip install torch==2.14.1 torchvision==0.29.1 av && pip install -e '.[test]'")


def missing() -> str | None:
    """Why the video tests cannot run here (None: they can)."""
    try:
        import av  # noqa: F401
        from torchvision.transforms.v2 import functional  # noqa: F401
    except Exception as error:  # noqa: BLE001 - the '+cpu' torch's torchvision raises RuntimeError at import
        return f"{VIDEO_VENV} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return None


def codec() -> str:
    import av

    for name in ("libx264", "h264", "mpeg4"):
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # noqa: BLE001, S112 - not built in: the next
            continue
    raise RuntimeError("PyAV has no H.264 or MPEG-4 encoder")


def frame_pixels(index: int, width: int, height: int, seed: int) -> np.ndarray:
    """A frame with structure a codec keeps (gradients and a moving block), different per frame."""
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([(x * 255 // max(width - 1, 1) + 7 * index + seed) % 256,
                      (y * 255 // max(height - 1, 1) + 3 * index) % 256,
                      ((x + y + 11 * index + 5 * seed) * 2) % 256], axis=-1).astype(np.uint8)
    top, left = (index * 3) % max(height - 4, 1), (index * 5) % max(width - 4, 1)
    frame[top:top + 4, left:left + 4] = 255
    return frame


def write_video(path: str | os.PathLike, frames: int, width: int, height: int, rate: int = 5, seed: int = 0,
                gop: int = 4, name: str | None = None, pix_fmt: str = "yuv444p", b_frames: int = 0) -> str:
    """`frames` frames of `width` x `height` at `rate` frames per second, a keyframe every `gop` frames, with codec
    `name` (default: H.264 where built in; odd sizes need `yuv444p` for H.264, MPEG-4 takes them in `yuv420p`),
    `b_frames` B-frames between references (H.264: presentation order differs from decoding order)."""
    import av

    name = name or codec()
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(name, rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt
        stream.gop_size = gop
        if name == "libx264":
            stream.options = {"preset": "ultrafast", "bf": str(b_frames), "keyint_min": str(gop)}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height, seed), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


# name: (frames, width, height, frame rate, codec, pixel format, B-frames). Sampled at 2 frames a second (the video
# processor's `fps`), with at least 4 (`min_frames`): odd 53 frames at 7 fps -> 15 sampled, 8 temporal groups, the
# last of one frame; mpeg4 40 at 5 -> 16, 8 groups; b_frames 41 at 7 -> 11, 6 groups; short 3 -> 3, 2 groups;
# single: one frame, shorter than one temporal group (the processor refuses it).
SPECS = {"odd": (53, 31, 21, 7, "libx264", "yuv444p", 0), "mpeg4": (40, 27, 19, 5, "mpeg4", "yuv420p", 0),
         "b_frames": (41, 32, 24, 7, "libx264", "yuv444p", 2), "short": (3, 18, 14, 5, "libx264", "yuv444p", 0),
         "single": (1, 16, 16, 5, "libx264", "yuv444p", 0)}


def videos(folder: Path, names=None) -> dict[str, str]:
    """The test videos (`SPECS`), written once into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names or SPECS:
        frames, width, height, rate, name_, pix_fmt, b_frames = SPECS[name]
        path = folder / f"{name}.mp4"
        if not path.exists():
            part = folder / f"{name}.{os.getpid()}.mp4"
            write_video(part, frames, width, height, rate=rate, seed=len(name), name=name_, pix_fmt=pix_fmt,
                        b_frames=b_frames)
            os.replace(part, path)
        out[name] = str(path)
    return out


def video_processor(**settings):
    """The real Qwen3-VL video processor for the tiny towers, with bounds that keep the test videos small."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from vlmcp_patch.fixtures.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE

    factor = PATCH_SIZE * MERGE_SIZE
    options = {"patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
               "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * 4 * factor * factor},
               "cap_pixels_per_frame": False}
    options.update(settings)
    accepted = getattr(Qwen3VLVideoProcessor, "valid_kwargs", None)
    if accepted is not None and "cap_pixels_per_frame" not in getattr(accepted, "__annotations__", {}):
        options.pop("cap_pixels_per_frame", None)  # before 5.2x: no per-frame cap
    return Qwen3VLVideoProcessor(**options)


def processor(**settings):
    """The tiny processor with the real video processor."""
    from vlmcp_patch.fixtures.processor import tiny_processor

    out = tiny_processor()
    out.video_processor = video_processor(**settings)
    return out


def stock(processor, text, videos: list, **kwargs):
    """The processor's own output for `videos` (paths read by PyAV with the processor's sampling, as its own call
    reads a path with the backend it names; arrays and frames as they are)."""
    from functools import partial

    from transformers.video_utils import load_video

    vp = processor.video_processor
    loaded, metadata = [], []
    for video in videos:
        if isinstance(video, (str, os.PathLike)):
            options = {k: getattr(vp, k) for k in ("fps", "num_frames") if getattr(vp, k, None) is not None}
            frames, meta = load_video(str(video), backend="pyav", sample_indices_fn=partial(vp.sample_frames, **options))
            loaded.append(frames)
            metadata.append(meta)
        else:
            loaded.append(video)
            metadata.append(None)
    if all(m is not None for m in metadata):
        kwargs = dict(kwargs, video_metadata=metadata, do_sample_frames=False)
    return processor(text=text, videos=loaded, return_tensors="pt", **kwargs)
