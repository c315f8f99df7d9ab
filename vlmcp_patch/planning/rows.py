"""The row a plan prices: its decoder tokens, vision tokens and patches, and its samples."""

from __future__ import annotations

from dataclasses import dataclass

from .dims import ModelDims


@dataclass(frozen=True)
class Row:
    """One packed row: `tokens` decoder tokens, of which `vision_tokens` are merged vision tokens (each of merge^2
    patches); `sample_tokens` is the longest packed sample (causal attention runs within samples; default: the
    whole row is one sample); `patches_per_item` the patches a vision attention spans (one image, or one temporal
    patch group of a video)."""

    tokens: int
    vision_tokens: int = 0
    sample_tokens: int = 0
    patches_per_item: int = 0
    samples: int = 1

    @property
    def longest_sample(self) -> int:
        return self.sample_tokens or self.tokens

    def patches(self, dims: ModelDims) -> int:
        return self.vision_tokens * dims.merge**2

    @staticmethod
    def text(tokens: int) -> Row:
        return Row(tokens=tokens)

    @staticmethod
    def video(tokens: int, side: int = 448, patch: int = 16, merge: int = 2, question: int = 256) -> Row:
        """A row of one long video (frames of side x side pixels) and a short question, `tokens` in all: the frames
        are cut in temporal patch groups of (side / patch)^2 patches, one vision attention each."""
        per_group = (side // patch) ** 2
        return Row(tokens=tokens, vision_tokens=max(0, tokens - question), patches_per_item=per_group)

    @staticmethod
    def from_items(text: int = 0, images: tuple = (), videos: tuple = (), patch: int = 16, merge: int = 2,
                   temporal: int = 2) -> Row:
        """A row of `text` text tokens, images (height, width) and videos (frames, height, width) in pixels, one
        sample; sides are rounded to whole merged patches as Qwen's processor does."""
        unit = patch * merge
        side = lambda px: max(unit, round(px / unit) * unit) // patch  # noqa: E731 - patches along a side
        vision, largest = 0, 0
        for h, w in images:
            n = side(h) * side(w)
            vision, largest = vision + n // merge**2, max(largest, n)
        for frames, h, w in videos:
            n = side(h) * side(w)
            groups = max(1, -(-frames // temporal))
            vision, largest = vision + groups * n // merge**2, max(largest, n)
        return Row(tokens=text + vision, vision_tokens=vision, patches_per_item=largest)

