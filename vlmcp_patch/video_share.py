"""A video as the user has it, for `ShareDecoding`: a path, a 4D array or tensor, or a list of frames, planned from
what is known before decoding and decoded by temporal groups.

Everything that decides the rows is the video processor's own code, run as its `preprocess` runs, with two of its
steps stood in for (`_run`): its decode-and-sample step (`_decode_and_sample_videos`, the same signature in
transformers 5.2, 5.6 and 5.25) and, for a part of the video, the frame count its size rule reads.

1. The plan (`plan_video`): the metadata a decoder would return (a file's header through PyAV, as transformers'
   `read_video_pyav` reads it: frame count, frame rate, size; an array's shape), the frames the processor's own
   `sample_frames` picks with the options the processor's call passes it, and the grid its own `_preprocess` gives
   those frames, run on a tensor on torch's meta device (shapes only: nothing decoded, nothing computed).
2. The rows of groups `first..first+count-1` (`VideoPlan.rows`): their sampled frames alone are decoded (a file by
   seeking: `PyAVFrames`) and given to the same `preprocess`, its resize pinned to the whole video's size (the size
   rule reads the number of frames: `_pinned_resize`). Resizing, rescaling, normalising and patching act frame by
   frame and group by group, so these rows equal the whole video's rows bit for bit (tests/test_share_decode_video.py
   checks it per release); the last group is padded with its last frame as the processor pads it.

A file's frame `i` is the `i`-th frame PyAV decodes from its start, as `read_video_pyav` counts them; a seek finds it
through the presentation times of the stream's packets (read, not decoded). Where the packets do not count the
header's frames (a stream without a frame count in its header), the frames are decoded from the start, as
`read_video_pyav` decodes them, and that is logged once.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

@dataclass(frozen=True)
class VideoItem:
    """One video of a row, known before decoding: `grid` (temporal patch groups, height and width in patches), as the
    video processor's `video_grid_thw` gives it; `rows(first, count)` the pixel rows of groups first..first+count-1,
    ((count * h * w), values), exactly as the processor's `pixel_values_videos` hold them (every frame resized to the
    whole video's size); `key` what names its rows for the ranks' agreement — the file's content (a hash), the frames
    chosen, any transform and its seed: ranks whose keys agree are taken to decode the same rows; `metadata` what
    the processor's text expansion reads (Qwen3-VL: a `VideoMetadata` with `fps` and `frames_indices`, or a dict of
    them; None: every frame, no frame rate)."""

    grid: tuple[int, int, int]
    rows: Callable[[int, int], torch.Tensor]
    key: str
    metadata: object = None


LOGGER = logging.getLogger("vlmcp_patch")
_SAID: set[str] = set()

INSTALL = ("pip install torch==2.14.1 torchvision==0.29.1 av (a torch whose torchvision imports: not a '+cpu' torch "
           "build, whose torchvision fails at import)")


def say_once(key: str, message: str) -> None:
    """Logs `message` once per process for `key` (logger `vlmcp_patch`, warning)."""
    if key not in _SAID:
        _SAID.add(key)
        LOGGER.warning(message)


def torchvision_error() -> str | None:
    """None where the video processor's transforms can run (torchvision imports); else why not, with the install."""
    try:
        from torchvision.transforms.v2 import functional  # noqa: F401
    except Exception as error:  # noqa: BLE001 - an ImportError, or the '+cpu' build's RuntimeError at import
        return (f"Qwen3-VL's video processor needs torchvision, which does not import here ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); install one that does: {INSTALL}")
    return None


def _av():
    try:
        import av
    except ImportError as error:
        raise ImportError(f"ShareDecoding decodes a video file with PyAV, which is not installed: {INSTALL}") from error
    return av


# ---------------------------------------------------------------------------------------------------------------------
# A file, read by PyAV


class PyAVFrames:
    """A video file's metadata from its header, and its frames by index, decoded by seeking. `decoded` counts the
    frames the decoder gave (those a seek lands before included), `kept` the frames converted to arrays."""

    def __init__(self, path: str):
        self.path = path
        self.decoded = 0
        self.kept = 0
        self._pts: list[int] | None = None
        self._keyframes: list[int] | None = None

    def metadata(self):
        """What `transformers.video_utils.read_video_pyav` reads before decoding, field for field."""
        from transformers.video_utils import VideoMetadata

        with _av().open(self.path) as container:
            stream = container.streams.video[0]
            total, rate = stream.frames, stream.average_rate
            duration = total / rate if rate else 0
            return VideoMetadata(total_num_frames=int(total), fps=float(rate) if rate else None,
                                 duration=float(duration), video_backend="pyav", height=stream.height,
                                 width=stream.width)

    def _index(self, container) -> bool:
        """The presentation times of the stream's frames in order, from its packets (demuxed, not decoded), and its
        keyframes'; False where the packets do not count the header's frames."""
        if self._pts is None:
            stream = container.streams.video[0]
            packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None and p.size]
            packets.sort()
            self._pts = [pts for pts, _ in packets]
            self._keyframes = [pts for pts, key in packets if key]
            container.seek(0)
        return len(self._pts) == container.streams.video[0].frames and bool(self._keyframes)

    def frames(self, indices) -> np.ndarray:
        """Frames `indices` (ascending) as `read_video_pyav` gives them: (n, height, width, 3) uint8 RGB."""
        import bisect

        indices = [int(i) for i in indices]
        wanted: dict[int, int] = {}
        out = []
        with _av().open(self.path) as container:
            stream = container.streams.video[0]
            if not self._index(container) or max(indices) >= len(self._pts):
                say_once(f"sequential:{self.path}",
                         f"ShareDecoding: {self.path}: its packets do not count the {stream.frames} frames its header "
                         "gives; its frames are decoded from the start (as transformers' read_video_pyav decodes "
                         "them), not by seeking")
                container.seek(0)
                keep = set(indices)
                for i, frame in enumerate(container.decode(stream)):
                    self.decoded += 1
                    if i > indices[-1]:
                        break
                    if i in keep:
                        out.append(frame.to_ndarray(format="rgb24"))
                        self.kept += 1
                return np.stack(out)
            wanted = {self._pts[i]: i for i in indices}
            position = None  # presentation time of the last frame decoded
            frames = None
            for i in indices:
                target = self._pts[i]
                key = self._keyframes[bisect.bisect_right(self._keyframes, target) - 1]
                if position is None or target <= position or key > position:
                    container.seek(key, stream=stream, backward=True, any_frame=False)
                    frames = container.decode(stream)
                for frame in frames:
                    self.decoded += 1
                    position = frame.pts
                    if frame.pts == target:
                        out.append(frame.to_ndarray(format="rgb24"))
                        self.kept += 1
                        break
                    if frame.pts is not None and frame.pts > target:
                        raise RuntimeError(f"{self.path}: seeking to frame {i} (pts {target}) decoded past it")
                else:
                    raise RuntimeError(f"{self.path}: frame {i} (pts {target}) was not decoded")
        del wanted
        return np.stack(out)


# ---------------------------------------------------------------------------------------------------------------------
# The processor's own steps


def _plain_resize(video_processor):
    """The first `resize` in the video processor's classes that resizes to a given size (no size rule: it takes no
    `factor`): transformers 5.25's Qwen3-VL `resize` applies the size rule and calls it; 5.2 and 5.6 apply the rule in
    `_preprocess` and call it directly."""
    for klass in type(video_processor).__mro__:
        method = klass.__dict__.get("resize")
        if method is not None and "factor" not in inspect.signature(method).parameters:
            return method
    raise TypeError(f"{type(video_processor).__name__} has no resize to a given size")


def _pinned_resize(video_processor, height: int, width: int):
    """A `resize` that resizes to (`height`, `width`) whatever the frame count, with the processor's own resample:
    called as the processor calls its `resize`."""
    from transformers.image_utils import SizeDict

    plain = _plain_resize(video_processor)
    accepted = inspect.signature(plain).parameters

    def resize(*args, **kwargs):
        videos = args[0] if args else kwargs.pop("videos", kwargs.pop("image", None))
        options = {k: v for k, v in kwargs.items() if k in accepted and k not in ("size", "image", "videos", "self")}
        return plain(video_processor, videos, size=SizeDict(height=height, width=width), **options)

    return resize


def _run(video_processor, kwargs: dict, decode, pin: tuple[int, int] | None = None):
    """`video_processor(videos, **kwargs)` as the processor calls it, with its decode-and-sample step replaced by
    `decode(sample_indices_fn or None, video_metadata)` -> (frames, metadata) for one video, and, with `pin`, its
    resize to (height, width)."""
    shadow = copy.copy(video_processor)

    def decode_and_sample(videos, video_metadata=None, do_sample_frames=None, sample_indices_fn=None):
        frames, metadata = decode(sample_indices_fn if do_sample_frames else None, video_metadata)
        return [frames], [metadata]

    shadow._decode_and_sample_videos = decode_and_sample
    if pin is not None:
        shadow.resize = _pinned_resize(video_processor, *pin)
    return shadow(None, **dict(kwargs, return_metadata=True, return_tensors="pt"))


@dataclass
class VideoPlan:
    """One video of a call, planned: `grid`, `metadata` (the processor's: `frames_indices` the frames sampled),
    `key`; `rows(first, count)` the pixel rows of groups first..first+count-1."""

    grid: tuple[int, int, int]
    metadata: object
    key: str
    frames: object  # (positions in the sampled frames) -> the frames, as the decoder gives them
    video_processor: object
    kwargs: dict
    reader: PyAVFrames | None = None
    calls: list = field(default_factory=list)

    def rows(self, first: int, count: int) -> torch.Tensor:
        temporal = self.video_processor.temporal_patch_size
        sampled = len(self.metadata.frames_indices)
        positions = list(range(first * temporal, min((first + count) * temporal, sampled)))
        self.calls.append((first, count))
        frames = self.frames(positions)
        pin = (self.grid[1] * self.video_processor.patch_size, self.grid[2] * self.video_processor.patch_size)
        metadata = copy.deepcopy(self.metadata)
        out = _run(self.video_processor, self.kwargs, lambda _sample, _given: (frames, metadata), pin)
        if [int(n) for n in out["video_grid_thw"][0][1:]] != list(self.grid[1:]):
            raise AssertionError(f"groups {first}..{first + count - 1} came out {out['video_grid_thw'][0].tolist()}, "
                                 f"the video {self.grid}")
        return out["pixel_values_videos"]


def _meta_like(frames_shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(frames_shape), dtype=dtype, device="meta")


_NUMPY_TO_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32,
                   np.dtype(np.float64): torch.float64, np.dtype(np.int64): torch.int64}


def _grid_and_metadata(video_processor, kwargs: dict, metadata, shape, dtype):
    """The grid and sampled metadata the processor's own call gives a video of `shape` (frames first, as its decoder
    gives them) whose metadata before sampling is `metadata`: its `preprocess` on a meta tensor."""
    def decode(sample, _given):
        meta = copy.deepcopy(metadata)
        if sample is not None:
            indices = sample(metadata=meta)
        else:
            indices = np.asarray(meta.frames_indices if meta.frames_indices is not None else range(shape[0]))
        meta.frames_indices = indices
        return _meta_like((len(indices), *shape[1:]), dtype), meta

    out = _run(video_processor, kwargs, decode)
    return tuple(int(n) for n in out["video_grid_thw"][0]), out["video_metadata"][0]


def _array_digest(array) -> str:
    array = np.ascontiguousarray(array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array))
    return f"array-sha256:{hashlib.sha256(array.tobytes()).hexdigest()}:{array.shape}:{array.dtype}"


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "file-sha256:" + digest.hexdigest()


def is_natural_video(video) -> bool:
    from transformers.video_utils import is_valid_video

    return isinstance(video, (str, os.PathLike)) or is_valid_video(video)


def natural_videos(videos) -> list:
    """The videos of a call, one entry each, as the video processor batches them (`make_batched_videos`): a path, a 4D
    array or tensor, a list of frames (PIL images or 3D arrays), a `VideoItem`, or a list of them; a 5D array is a
    batch. Anything else raises, saying what to pass."""
    from transformers.video_utils import is_valid_video


    if videos is None:
        return []
    if isinstance(videos, (VideoItem, str, os.PathLike)) or is_valid_video(videos):
        return [videos]
    if isinstance(videos, (np.ndarray, torch.Tensor)) and videos.ndim == 5:
        return list(videos)
    if isinstance(videos, (list, tuple)):
        flat = []
        for video in videos:
            if isinstance(video, (list, tuple)) and video and not is_valid_video(video):
                flat.extend(natural_videos(video))
            else:
                flat.append(video)
        for i, video in enumerate(flat):
            if not (isinstance(video, VideoItem) or is_natural_video(video)):
                raise TypeError(_what_to_pass(video, i))
        return flat
    raise TypeError(_what_to_pass(videos, 0))


def _what_to_pass(video, i: int) -> str:
    got = type(video).__name__
    if isinstance(video, (np.ndarray, torch.Tensor)):
        got += f" of shape {tuple(video.shape)}"
    return (f"ShareDecoding cannot take video {i} ({got}): pass a path to a video file, a 4D array or tensor of frames "
            "(frames, height, width, channels or frames, channels, height, width), a list of frames (PIL images or 3D "
            "arrays), or a vlmcp_patch.VideoItem (its grid, rows and key)")


def plan_video(video, video_processor, kwargs: dict, metadata=None) -> VideoPlan:
    """The plan of one natural video (module docstring) for the processor's video options `kwargs` (what the
    processor's call passes its video processor) and the caller's `metadata` for it (an array's frame rate ...)."""
    from transformers.video_utils import VideoMetadata, make_batched_metadata, make_batched_videos

    error = torchvision_error()
    if error:
        raise ImportError(f"ShareDecoding cannot process this video: {error}")
    if isinstance(video, (str, os.PathLike)):
        path = os.fspath(video)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ShareDecoding: no video file at {path!r} (it takes a local path)")
        reader = PyAVFrames(path)
        header = reader.metadata()
        shape = (header.total_num_frames, header.height, header.width, 3)
        grid, sampled = _grid_and_metadata(video_processor, kwargs, header, shape, torch.uint8)
        indices = [int(i) for i in sampled.frames_indices]
        return VideoPlan(grid, sampled, _file_digest(path), lambda positions: reader.frames([indices[p] for p in positions]),
                         video_processor, kwargs, reader)
    array = make_batched_videos(video)[0]  # a list of frames stacked as the processor stacks them
    given = metadata if metadata is not None else None
    meta = make_batched_metadata([array], video_metadata=copy.deepcopy(given) if given is not None else None)[0]
    if not isinstance(meta, VideoMetadata):
        meta = VideoMetadata(**meta)
    dtype = _NUMPY_TO_TORCH.get(array.dtype, torch.uint8) if isinstance(array, np.ndarray) else array.dtype
    grid, sampled = _grid_and_metadata(video_processor, kwargs, meta, tuple(array.shape), dtype)
    indices = np.asarray(sampled.frames_indices)
    key = _array_digest(array) + (f":metadata={dict(given)!r}" if given is not None else "")
    return VideoPlan(grid, sampled, key, lambda positions: array[indices[positions]], video_processor, kwargs)


def check_video_item(item, video_processor, kwargs: dict) -> None:
    """Raises where a `VideoItem`'s grid is not the one the processor's rule gives the frames its metadata names (their
    count: `frames_indices`, else `total_num_frames`; their size: `height`, `width`); nothing to check without them.
    Every rank checks the same item the same way, so a mismatch raises on every rank."""
    metadata = item.metadata
    if metadata is None:
        return
    get = metadata.get if isinstance(metadata, dict) else (lambda name, default=None: getattr(metadata, name, default))
    height, width = get("height"), get("width")
    indices = get("frames_indices")
    frames = len(indices) if indices is not None else get("total_num_frames")
    if not (height and width and frames):
        return
    error = torchvision_error()
    if error:
        say_once("video-item-unchecked", f"ShareDecoding: a VideoItem's grid is not checked against the video "
                                          f"processor's rule: {error}")
        return
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=frames, fps=get("fps"), height=height, width=width,
                         frames_indices=list(range(frames)))
    grid, _ = _grid_and_metadata(video_processor, dict(kwargs, do_sample_frames=False), meta,
                                 (frames, int(height), int(width), 3), torch.uint8)
    if tuple(int(n) for n in item.grid) != grid:
        raise ValueError(f"VideoItem {item.key!r}: its grid {tuple(item.grid)} is not the {grid} that "
                         f"{type(video_processor).__name__} gives {frames} frames of {height} x {width} (its metadata); "
                         "give the grid the processor gives, or pass the video itself (a path, an array, its frames)")
