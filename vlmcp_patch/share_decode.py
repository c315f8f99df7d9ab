"""Each rank decodes only its share: a batch built with the pixel values of this rank's images and video frames alone.

Under CP every rank of a group receives the same rows, but encodes only its share of the vision items by items
(`layout.VisionShare`): a function of the grids and P. Today's data loaders decode the whole row on every rank and
the package cuts the share after (`forward.host_pixels.keep_pixel_share`), so at its peak a rank holds the row's pixel
values twice over (docs/memory.md, "Pixel values on the host"). `ShareDecoding` builds the batch the processor would
give, but decodes and processes only this rank's items:

1. each item's grid comes from what is known before decoding: an image's size (a `PIL.Image.open` reads the header
   only; the processor's own resize rule, `image_grid`), a video's grid from its caller (`VideoItem`);
2. the tokens are the processor's own: it expands the placeholders from those grids (`_GridsOnly` stands in for its
   image / video processor for that call, so every release's own expansion runs, timestamps included);
3. the rows this rank encodes are `host_pixels.host_rows` — the same rule the forward plans by — and only the items
   and temporal groups in them are decoded, each written into one tensor of the share (`dtype`: the processor's, or
   the one the model's patch embedding casts to, which changes nothing: Qwen's patch embeddings cast their input to
   their weight's dtype first);
4. beside them goes the record the forward reads (`SHARE_RECORDS`), whose fingerprint is a digest of the recipe (the
   items' keys and grids, the sub-processor's class and settings, the releases, the dtype) since no rank holds the
   whole tensor: ranks given different recipes raise on every rank before compute. An image's key is its content (a
   file's bytes, or its pixels); a video's is the caller's, and must name everything its rows depend on.

With CP off (no group, or vision data parallelism or `host_pixel_shares` off) every item is decoded and no record is
added: the batch then equals the processor's own output. Where the items do not balance (the forward shares them by
patches) that modality is decoded whole, as the cut keeps it whole.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .forward.arguments import SHARE_RECORDS
from .forward.host_pixels import host_rows, this_ranks_cut
from .video_share import VideoItem, say_once

# Video groups decoded per call of `VideoItem.rows`: the share's tensor plus this many groups is a rank's peak.
GROUPS_PER_CALL = 16


@dataclass(frozen=True)
class _Source:
    grid: tuple[int, int, int]
    rows: Callable[[int, int], torch.Tensor]
    key: str


def image_grid(image_processor, height: int, width: int) -> tuple[int, int, int]:
    """(1, h, w) in patches: the grid the Qwen image processor gives an image of `height` x `width` pixels, by its own
    resize rule (`smart_resize` with its patch and merge sizes and pixel bounds), checked against its own patch count
    (`get_number_of_image_patches`, which vLLM relies on)."""
    smart_resize = sys.modules[type(image_processor).__module__].smart_resize  # the processor's own module's
    size = image_processor.size
    min_pixels, max_pixels = size["shortest_edge"], size["longest_edge"]
    patch, merge = image_processor.patch_size, image_processor.merge_size
    resized_h, resized_w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels,
                                        max_pixels=max_pixels)
    grid = (1, resized_h // patch, resized_w // patch)
    counted = image_processor.get_number_of_image_patches(height, width, {})  # 5.2 reads the dict unguarded
    if grid[1] * grid[2] != counted:
        raise ValueError(f"the image processor counts {counted} patches for a {height} x {width} image, and its resize "
                         f"rule gives {grid[1]} x {grid[2]}: vlmcp_patch's reading of {type(image_processor).__name__} "
                         "does not hold for this release; decode the row whole (the processor itself)")
    return grid


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_backed(image) -> bool:
    """A PIL image opened from a file by its name and not decoded yet (`tile` set): its content is the file's."""
    name = getattr(image, "filename", "") or ""
    return bool(name and getattr(image, "tile", None) and os.path.isfile(name))


def _image_key(image) -> str:
    """What names an image's content for the agreement: a path, or a PIL image opened from a file and not decoded yet,
    a hash of the file's bytes (read, not decoded); any other image (decoded: its pixels may have been changed since),
    a hash of its pixels with its mode, size, palette and transparency. `ShareDecoding` never decodes a caller's
    lazily opened image in place (`_decodable`), so its key stays the file's from one epoch to the next."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        return "file-sha256:" + _file_digest(os.fspath(image))
    if not isinstance(image, Image.Image):
        import numpy as np

        array = np.ascontiguousarray(image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image))
        return f"array-sha256:{hashlib.sha256(array.tobytes()).hexdigest()}:{array.shape}:{array.dtype}"
    if _file_backed(image):
        return "file-sha256:" + _file_digest(image.filename)
    digest = hashlib.sha256(image.tobytes())
    digest.update(repr((image.mode, image.size, image.getpalette(), image.info.get("transparency"))).encode())
    return "pixels-sha256:" + digest.hexdigest()


# EXIF orientations that swap an image's width and height (`PIL.ImageOps.exif_transpose`: transpose, rotations by 90
# and 270 degrees, transverse).
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)


def _height_width(image) -> tuple[int, int]:
    """An image's size in pixels as the image processor will see it, read without decoding it: a path's as
    transformers' `load_image` leaves it (its header's size, width and height swapped where its EXIF orientation
    turns it by 90 degrees: `load_image` applies `exif_transpose`); a PIL image's header; an array's shape, channels
    where the image processor would find them."""
    from PIL import ExifTags, Image

    if isinstance(image, (str, os.PathLike)):
        with Image.open(os.fspath(image)) as header:
            width, height = header.size
            orientation = header.getexif().get(ExifTags.Base.Orientation, 1)
        return (width, height) if orientation in SWAPPING_ORIENTATIONS else (height, width)
    if hasattr(image, "size") and not callable(image.size) and not hasattr(image, "shape"):
        width, height = image.size
        return height, width
    from transformers.image_utils import get_image_size, infer_channel_dimension_format, to_numpy_array

    array = to_numpy_array(image)
    return get_image_size(array, channel_dim=infer_channel_dimension_format(array))


def _flat_images(images) -> list:
    """The images of a call as the processor flattens them (one image, a list, a list of lists per row). Paths stay
    paths: the image processor loads them itself (transformers' `load_image`, which turns a photo by its EXIF
    orientation)."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        images = [images]
    return [image for item in images for image in (item if isinstance(item, (list, tuple)) else [item])]


def _decodable(image):
    """What the image processor is given to decode `image`: a path as it is (the processor's own loading); a lazily
    opened file opened anew from its name (the caller's object is never decoded in place: its key, the file's hash,
    stays, and it does not keep the decoded pixels); any other image as it is."""
    from PIL import Image

    if isinstance(image, Image.Image) and _file_backed(image):
        return Image.open(image.filename)
    return image


def _image_source(image, image_processor) -> _Source:
    height, width = _height_width(image)

    def rows(first: int, count: int) -> torch.Tensor:
        return image_processor(images=[_decodable(image)], return_tensors="pt")["pixel_values"]

    return _Source(image_grid(image_processor, height, width), rows, _image_key(image))


def _runs(grid: list[tuple[int, int, int]], rows: slice) -> list[tuple[int, int, int]]:
    """(item, first group, groups) of each item's temporal groups inside the patch rows `rows` of a modality whose
    items have `grid`, in row order; a share by items starts and stops on group edges."""
    runs, offset = [], 0
    for item, (t, h, w) in enumerate(grid):
        per_group, end = h * w, offset + t * h * w
        start, stop = max(rows.start, offset), min(rows.stop, end)
        if start < stop:
            if (start - offset) % per_group or (stop - offset) % per_group:
                raise AssertionError(f"rows {rows} cut item {item} inside a temporal group")
            runs.append((item, (start - offset) // per_group, (stop - start) // per_group))
        offset = end
    return runs


def _recipe_digest(kind: str, sources: Sequence[_Source], settings: dict, dtype: torch.dtype | None) -> list[float]:
    """Three floats that name what the ranks decode, in place of the whole tensor's fingerprint: the same on every
    rank given the same items, keys, grids, processor settings and dtype (each a 48-bit integer, exact in float64)."""
    text = json.dumps({"kind": kind, "items": [(s.key, list(s.grid)) for s in sources], "settings": settings,
                       "dtype": str(dtype)}, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).digest()
    return [float(int.from_bytes(digest[i:i + 6], "big")) for i in (0, 6, 12)]


def decode_rows(sources: Sequence[_Source], rows: slice, width: int, dtype: torch.dtype | None,
                groups_per_call: int = GROUPS_PER_CALL) -> torch.Tensor:
    """The pixel rows `rows` of a modality (its items `sources`, in order): one tensor (rows, `width`) of `dtype`
    (None: the first decoded rows'), filled by calling each source's `rows` for its groups in the slice only, at most
    `groups_per_call` groups a call. Raises where a source returns other than the rows its grid asks for."""
    out = None
    at = rows.start
    for item, first, groups in _runs([s.grid for s in sources], rows):
        source = sources[item]
        per_group = source.grid[1] * source.grid[2]
        for start in range(first, first + groups, groups_per_call):
            count = min(groups_per_call, first + groups - start)
            part = source.rows(start, count)
            if not torch.is_tensor(part) or tuple(part.shape) != (count * per_group, width):
                got = tuple(part.shape) if torch.is_tensor(part) else type(part).__name__
                raise ValueError(f"item {item} ({source.key}) gave pixel rows of shape {got} for its groups "
                                 f"{start}..{start + count - 1}, and its grid {source.grid} asks for "
                                 f"{(count * per_group, width)}")
            if out is None:
                out = torch.empty((rows.stop - rows.start, width), dtype=dtype or part.dtype)
            out[at - rows.start:at - rows.start + part.shape[0]] = part
            at += part.shape[0]
            del part
    return out if out is not None else torch.empty((0, width), dtype=dtype or torch.float32)


class _GridsOnly:
    """Stands in for a processor's image or video processor while the processor expands the text: it returns the
    grids (and the videos' metadata) the decoded rows will have, and no pixel values; everything else is the real
    sub-processor's. `outputs` may be a function of the options the processor's call passes its sub-processor (the
    videos are planned with exactly those)."""

    def __init__(self, real, outputs):
        self._real, self._outputs = real, outputs

    def __call__(self, *args, **kwargs):
        from transformers import BatchFeature

        outputs = self._outputs(kwargs) if callable(self._outputs) else self._outputs
        return BatchFeature({k: (list(v) if isinstance(v, list) else v) for k, v in outputs.items()})

    def __getattr__(self, name):
        return getattr(self._real, name)


def _pixel_width(sub_processor) -> int:
    """Values per pixel row: RGB x the temporal patch x the patch's area (Qwen's processors convert to RGB)."""
    return 3 * sub_processor.temporal_patch_size * sub_processor.patch_size**2


def _settings(sub_processor) -> dict:
    """What decides the rows besides the items: the sub-processor's class and settings, and the releases that run
    it."""
    import PIL
    import transformers

    kind = type(sub_processor)
    return {"class": f"{kind.__module__}.{kind.__qualname__}", "settings": sub_processor.to_dict(),
            "transformers": transformers.__version__, "PIL": PIL.__version__}


# Image options a processor call may carry besides the image processor's settings (folded into `size` when given).
PIXEL_BOUNDS = ("min_pixels", "max_pixels")


def _refuse_media_options(kwargs: dict, processor) -> None:
    """Raises for an option of the image or video processor in a call's `kwargs` (flat, or under `images_kwargs` /
    `videos_kwargs`), naming the sub-processor that owns it: it would change rows and grids this decoder derives from
    the processor's own settings, and releases read them differently (5.6 ignores `max_pixels` in a call, 5.25
    deprecates it). Text options pass, and so does `video_metadata` (what the caller knows of an array's frames)."""
    owners = {}
    for name in ("video_processor", "image_processor"):  # an option both own is named under the image processor
        if getattr(processor, name, None) is not None:
            owners.update({option: name for option in getattr(processor, name).to_dict()})
    owners.update({bound: "image_processor" for bound in PIXEL_BOUNDS})
    nested = {"images_kwargs": "image_processor", "videos_kwargs": "video_processor"}
    given = sorted(name for name in kwargs if name in owners or name in nested)
    if given:
        where = []
        for name in given:
            if name in nested:
                inner = kwargs[name] if isinstance(kwargs[name], dict) else {}
                where += [f"processor.{owners.get(k, nested[name])}.{k}" for k in sorted(inner)] or [
                    f"processor.{nested[name]}"]
            elif name in PIXEL_BOUNDS:
                where.append("processor.image_processor.size['shortest_edge' / 'longest_edge']")
            else:
                where.append(f"processor.{owners[name]}.{name}")
        raise ValueError(f"ShareDecoding takes the image and video settings from the processor itself, and was given "
                         f"{', '.join(given)} for this call: set {', '.join(where)} on the processor instead (e.g. "
                         "processor.video_processor.fps = 1, or processor.image_processor.size = {'shortest_edge': ..., "
                         "'longest_edge': ...})")


class ShareDecoding:
    """A Qwen-VL processor's call that decodes only this rank's share of the row's images and video groups (module
    docstring).

    `ShareDecoding(processor)(text=..., images=[...], videos=[VideoItem(...)], **kwargs)` returns the processor's
    `BatchFeature` for the batch — `input_ids`, `attention_mask`, `mm_token_type_ids`, `image_grid_thw`,
    `video_grid_thw` of the whole rows — with `pixel_values` / `pixel_values_videos` (rows, values) holding this rank's
    rows only, and their share records. Images as the processor takes them (one, a list, a list per row): PIL images
    opened from files, or their paths, are decoded only on the rank that encodes them (any other image is hashed from
    its pixels on every rank); videos are `VideoItem`s. `dtype`: the pixel values' dtype (None: the processor's,
    fp32); `size`, `rank`: the CP group's size and this rank's place in it (default: the running group,
    `host_pixels.this_ranks_cut`; none: every item decoded, no records). `**kwargs` go to the processor's call: text
    options (padding, truncation, ...); an image or video option raises (`_refuse_media_options`: set it on the
    processor). `return_tensors` is always "pt"."""

    def __init__(self, processor, *, dtype: torch.dtype | None = None, size: int | None = None,
                 rank: int | None = None, groups_per_call: int = GROUPS_PER_CALL):
        if (size is None) != (rank is None):
            raise ValueError("give both size and rank, or neither (then the running CP group's)")
        self.processor, self.dtype, self.groups_per_call = processor, dtype, groups_per_call
        self._cut = (size, rank) if size is not None else None

    def cut(self) -> tuple[int, int] | None:
        """(size, rank) this call decodes the share for; None: it decodes every item."""
        if self._cut is not None:
            return self._cut if self._cut[0] > 1 else None
        return this_ranks_cut()

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader starting its workers by spawn or forkserver, which have no process group), it carries
        the cut of the process that pickles it: the training process, whose group is up by then."""
        state = dict(self.__dict__)
        if state["_cut"] is None:
            state["_cut"] = self.cut() or (1, 0)
        return state

    def __call__(self, text, images: Sequence | None = None, videos=None, **kwargs):
        from PIL import Image

        from .video_share import check_video_item, natural_videos, plan_video

        kwargs = dict(kwargs)
        kwargs.pop("return_tensors", None)
        _refuse_media_options(kwargs, self.processor)
        images, videos = _flat_images(images), natural_videos(videos)
        modalities = []  # (pixels key, grid key, sources, sub-processor)
        stand_ins = {}
        if images:
            sources = [_image_source(image, self.processor.image_processor) for image in images]
            modalities.append(("pixel_values", "image_grid_thw", sources, self.processor.image_processor))
            stand_ins["image_processor"] = {"pixel_values": torch.empty(0), "image_grid_thw": _grid(sources)}
        if videos:
            video_processor = getattr(self.processor, "video_processor", None)
            if video_processor is None:
                raise ValueError(f"{type(self.processor).__name__} has no video processor: it cannot expand videos")
            sources = []  # filled when the processor's call passes its video options (the plans need them)

            def planned(options: dict, videos=videos, video_processor=video_processor, sources=sources) -> dict:
                options = {k: v for k, v in options.items() if k not in ("videos", "return_tensors")}
                given = options.pop("video_metadata", None)
                given = given if isinstance(given, (list, tuple)) else [given] * len(videos)
                if len(given) != len(videos):
                    raise ValueError(f"{len(videos)} videos and {len(given)} video_metadata: give one per video")
                metadata = []
                for video, meta in zip(videos, given):
                    if isinstance(video, VideoItem):
                        check_video_item(video, video_processor, options)
                        sources.append(_Source(tuple(int(n) for n in video.grid), video.rows, str(video.key)))
                        metadata.append(_metadata(video, video_processor))
                    else:
                        plan = plan_video(video, video_processor, options, meta)
                        sources.append(_Source(plan.grid, plan.rows, plan.key))
                        metadata.append(copy.deepcopy(plan.metadata))
                return {"pixel_values_videos": torch.empty(0), "video_grid_thw": _grid(sources),
                        "video_metadata": metadata}

            modalities.append(("pixel_values_videos", "video_grid_thw", sources, video_processor))
            stand_ins["video_processor"] = planned
        # The processor's own expansion over tiny stand-in inputs: its sub-processors are the grids-only stand-ins.
        expanding = copy.copy(self.processor)
        for name, outputs in stand_ins.items():
            setattr(expanding, name, _GridsOnly(getattr(self.processor, name), outputs))
        call = dict(kwargs, return_tensors="pt")
        if images:
            call["images"] = [Image.new("RGB", (1, 1)) for _ in images]
        if videos:
            import numpy as np

            call["videos"] = [np.zeros((1, 1, 1, 3), dtype=np.uint8) for _ in videos]
            call["return_metadata"] = True
        batch = expanding(text=text, **call)
        batch.pop("video_metadata", None)
        cut = self.cut()
        for pixels_key, grid_key, sources, sub_processor in modalities:
            grid = batch[grid_key]
            whole = int(grid.prod(-1).sum())
            rows = host_rows(grid, *cut) if cut is not None else None
            if cut is not None and rows is None:
                say_once(f"whole:{pixels_key}", f"ShareDecoding: {pixels_key} decoded whole on every rank of a CP group "
                         f"of {cut[0]}: the items (grids {grid.tolist()}) do not split into {cut[0]} equal shares of "
                         "whole items and temporal groups, so the forward shares them by patches and each rank needs "
                         "them all (said once)")
            kept = rows if rows is not None else slice(0, whole)
            batch[pixels_key] = decode_rows(sources, kept, _pixel_width(sub_processor), self.dtype,
                                            self.groups_per_call)
            if rows is not None:
                digest = _recipe_digest(pixels_key, sources, _settings(sub_processor),
                                        batch[pixels_key].dtype)
                batch[SHARE_RECORDS[pixels_key]] = torch.tensor([*cut, rows.start, rows.stop, whole, *digest],
                                                                dtype=torch.float64)
        return batch


def _metadata(video: VideoItem, video_processor):
    """The metadata the processor's text expansion reads for `video`, a copy (the expansion pads its frame indices in
    place): the item's (a `VideoMetadata`, or a dict of its fields), or what the video processor makes for frames
    given without metadata (every frame, no frame rate: the expansion then warns and takes 24)."""
    from transformers.video_utils import VideoMetadata

    if video.metadata is None:
        frames = video.grid[0] * video_processor.temporal_patch_size
        return VideoMetadata(total_num_frames=frames, frames_indices=list(range(frames)))
    if isinstance(video.metadata, dict):
        return VideoMetadata(**copy.deepcopy(video.metadata))
    return copy.deepcopy(video.metadata)


def _grid(sources: Sequence[_Source]) -> torch.Tensor:
    return torch.tensor([list(s.grid) for s in sources], dtype=torch.long)
