"""A tiny tokenizer and a Qwen3-VL processor for the tiny test models, built in code (nothing is downloaded).

The tokenizer is character-level (printable ASCII and newline) with the Qwen chat special tokens; the
multimodal tokens get exactly the ids of `vlmcp_patch.testing` (`<|image_pad|>` = IMAGE_TOKEN_ID, ...),
so every id stays inside the tiny vocabulary. Its chat template renders conversations Qwen-style,
with an image content item as `<|vision_start|><|image_pad|><|vision_end|>`; the processor expands each
`<|image_pad|>` into one token per merged patch, as the released processors do.

`Qwen3VLProcessor` builds a video processor, which needs torchvision. `TinyQwen3VLProcessor` is the stock
class with only the image processor and the tokenizer as attributes: everything else (text
replacement, `mm_token_type_ids`, `apply_chat_template`) is the stock code.
"""

from __future__ import annotations

import string

from transformers import Qwen3VLProcessor

from .testing import (
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    TEXT_TOKEN_RANGE,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB_SIZE,
    image_processor,
)

PAD_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MULTIMODAL_TOKENS = {
    "<|image_pad|>": IMAGE_TOKEN_ID,
    "<|video_pad|>": VIDEO_TOKEN_ID,
    "<|vision_start|>": VISION_START_TOKEN_ID,
    "<|vision_end|>": VISION_END_TOKEN_ID,
}
UNK_TOKEN = "<unk>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _vocab() -> dict[str, int]:
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))  # letters, digits, punctuation, space, newline
    specials = [UNK_TOKEN, IM_START, IM_END]
    low, high = TEXT_TOKEN_RANGE
    if len(chars) + len(specials) > high - low:
        raise AssertionError("the tiny vocabulary does not fit below the multimodal ids")
    vocab = {PAD_TOKEN: PAD_TOKEN_ID}
    for i, token in enumerate(specials + chars):
        vocab[token] = low + i
    vocab.update(MULTIMODAL_TOKENS)
    assert max(vocab.values()) < VOCAB_SIZE
    return vocab


def tiny_tokenizer():
    """A character-level `PreTrainedTokenizerFast` with the Qwen special tokens at the tiny model's ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    specials = [PAD_TOKEN, IM_START, IM_END, *MULTIMODAL_TOKENS]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        padding_side="right",
        chat_template=CHAT_TEMPLATE,
    )
    for token, token_id in [(PAD_TOKEN, PAD_TOKEN_ID), *MULTIMODAL_TOKENS.items()]:
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    return tokenizer


class TinyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` with only `image_processor` and `tokenizer` as attributes (no video processor)."""

    # ProcessorMixin reads the attributes off this signature: no `video_processor` here.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def tiny_processor():
    """The stock Qwen3-VL processor logic over the tiny tokenizer and the real Qwen2-VL PIL image processor."""
    return TinyQwen3VLProcessor(
        image_processor=image_processor(), tokenizer=tiny_tokenizer(), chat_template=CHAT_TEMPLATE
    )
