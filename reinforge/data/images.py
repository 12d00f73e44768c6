"""Images in prompts, for vision-language models: loading them from a record, rendering an image prompt with the
model's processor, and feeding the processed images to a forward pass in the order their tokens appear.

A record's images are its `images` field (one reference or a list) or the `image_url` content parts of its
user message (OpenAI style: `{"type": "image_url", "image_url": {"url": ...}}`); a reference is a path relative to
the data file, an absolute path, or a `data:image/...;base64,` URL. Each is checked (the file exists, is an image,
is at most `MAX_IMAGE_PIXELS` pixels) and a bad one is a one-line `DataError` naming its row.

The processor (Idefics3/SmolVLM's, Qwen-VL's, ...) expands each image placeholder of the rendered chat into the
model's image tokens and turns the images into tensors (`pixel_values`, ...). A prompt keeps both forms
(`ImageInputs`): the tensors, for the trainer and the HF engine, and the images with the prompt before the
expansion, for vLLM, which expands it itself (`multi_modal_data`).

A forward pass over several sequences takes one set of image tensors: the model puts the i-th image's features
at the i-th run of image tokens in its (row-major) input, so `forward_images` lists each prompt's images once, in
the order of their first image token in the layout (packed rows, shared prompts and padded rows alike).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from reinforge.errors import DataError

MAX_IMAGE_PIXELS = 50_000_000  # larger images are refused (PIL's own bomb limit is 89M); resize them first
# Models whose processor gives pixel_values [images, C, H, W] that the model takes as [batch, images, C, H, W]
# (padded to the largest height and width, with pixel_attention_mask); the others take them concatenated along
# their first dimension (Qwen-VL's patches with image_grid_thw, LLaVA's images)
STACKED_IMAGES = frozenset({"idefics3", "smolvlm", "idefics2"})
IMAGE_PARTS = ("image_url", "input_image")  # content parts holding an image: Chat Completions', Responses'


def has_image_parts(content: Any) -> bool:
    """Whether a message's content is a list of parts with an image among them."""
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content)


@dataclass
class ImageInputs:
    """A prompt's images as the processor made them, and as they were loaded."""

    images: list[Image.Image]  # RGB, in the order of the prompt's image placeholders
    tensors: dict[str, torch.Tensor]  # the processor's outputs per image: leading dimension one row per image
    engine_prompt_ids: list[int]  # the prompt with one placeholder token per image (vLLM expands it itself)
    expansions: list[list[int]] = field(default_factory=list)  # each image's tokens, as the processor expands it

    def __len__(self) -> int:
        return len(self.images)

    def digest(self) -> bytes:
        """A digest of the processed images (what the model sees), computed once."""
        if getattr(self, "_digest", None) is None:
            hasher = hashlib.blake2b(digest_size=16)
            for name in sorted(self.tensors):
                hasher.update(name.encode() + self.tensors[name].contiguous().numpy().tobytes())
            self._digest = hasher.digest()
        return self._digest


def record_image_refs(record: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> list[str]:
    """The image references of a record: its `images` (or `image`) field, else the `image_url` parts of `messages`."""
    refs = record.get("images", record.get("image"))
    if refs is not None:
        refs = [refs] if isinstance(refs, str) else refs
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise DataError("the record's images must be a path or data URL, or a list of them")
        return refs
    found = []
    for message in messages or ():
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise DataError("an image_url content part needs image_url.url (a path or data URL)")
                found.append(url)
    return found


def load_image(ref: str, base_dir: Path) -> Image.Image:
    """The image of a reference (a path relative to `base_dir`, an absolute one, or a data URL), as RGB; a
    missing file, a file that is not an image, or an image over MAX_IMAGE_PIXELS is a DataError."""
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if not header.endswith(";base64") or not payload:
            raise DataError(f"image data URL {ref[:40]!r}...: expected data:image/<type>;base64,<data>")
        try:
            source: Any = io.BytesIO(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise DataError(f"image data URL {ref[:40]!r}...: its data is not valid base64") from None
        shown = f"image data URL {ref[:30]!r}..."
    elif ref.startswith(("http://", "https://")):
        raise DataError(f"image {ref[:60]!r}: web URLs are not fetched; download the image and give its path")
    else:
        path = Path(ref) if Path(ref).is_absolute() else base_dir / ref
        if not path.is_file():
            raise DataError(f"image {ref!r}: no such file ({path})")
        source, shown = path, f"image {ref!r}"
    try:
        with Image.open(source) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise DataError(f"{shown} is {width}x{height} pixels, more than {MAX_IMAGE_PIXELS:,}; resize it first")
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise DataError(f"{shown} is not an image PIL can read (PNG, JPEG, WebP, ...)") from None
    except Image.DecompressionBombError:
        raise DataError(f"{shown} is larger than PIL will open; resize it first") from None
    except OSError as exc:
        raise DataError(f"{shown} is damaged ({exc})") from None


def image_messages(messages: list[dict[str, Any]], num_images: int) -> list[dict[str, Any]]:
    """`messages` with the images as the processor's chat templates want them: `{"type": "image"}` parts. A string
    user message gets the images before its text (`num_images` of them, for records with an `images` field);
    `image_url` parts become image parts where they are."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = [{"type": "image"} if p.get("type") in (*IMAGE_PARTS, "image") else _text_part(p) for p in content]
        elif message["role"] == "user" and num_images:
            parts = [{"type": "image"}] * num_images + [{"type": "text", "text": content}]
            num_images = 0
        else:
            parts = [{"type": "text", "text": content}]
        out.append({**message, "content": parts})
    return out


def _text_part(part: dict[str, Any]) -> dict[str, Any]:
    text = part.get("text")
    if not isinstance(text, str):
        raise DataError(f"a content part of type {part.get('type')!r} needs a text string (or is an image_url)")
    return {"type": "text", "text": text}


def process_prompt(
    processor: Any, messages: list[dict[str, Any]], images: list[Image.Image], tools: list[dict] | None = None
):
    """(token ids with each image expanded into its image tokens, the prompt's ImageInputs) of a chat whose
    messages hold `{"type": "image"}` parts, rendered with the processor's chat template (and `tools`)."""
    kwargs = {"tools": tools} if tools else {}
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    placeholders = list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    inputs = process_images(processor, images)
    inputs.engine_prompt_ids = placeholders
    return expand_images(processor, placeholders, inputs.expansions), inputs


def process_images(processor: Any, images: list[Image.Image]) -> ImageInputs:
    """One processor pass over `images`: their tensors (a row per image) and each image's expanded tokens.

    The pass is a batch of one placeholder per image, so each row of its ids is one image's expansion; its
    tensors are those of one prompt holding all the images (the same padding to the largest image)."""
    out = processor(
        text=[processor.image_token] * len(images),
        images=[[image] for image in images],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    expansions = [row[mask.bool()].tolist() for row, mask in zip(out["input_ids"], out["attention_mask"])]
    return ImageInputs(images, _image_tensors(out), [], expansions)


def expand_images(processor: Any, token_ids: list[int], expansions: list[list[int]]) -> list[int]:
    """`token_ids` (a chat template's, one placeholder per image) with the i-th placeholder replaced by the i-th
    image's expanded tokens; a count that differs from the images' is a one-line error."""
    placeholder = _placeholder(processor)
    width, positions, at = len(placeholder), [], 0
    while at <= len(token_ids) - width:
        if token_ids[at : at + width] == placeholder:
            positions.append(at)
            at += width
        else:
            at += 1
    if len(positions) != len(expansions):
        raise DataError(f"the chat template rendered {len(positions)} image placeholders for {len(expansions)} images")
    out, start = [], 0
    for at, expanded in zip(positions, expansions):
        out += token_ids[start:at] + expanded
        start = at + width
    return out + token_ids[start:]


def _placeholder(processor: Any) -> list[int]:
    return list(processor.tokenizer(processor.image_token, add_special_tokens=False)["input_ids"])


def collapse_images(processor: Any, token_ids: list[int], inputs: ImageInputs) -> list[int]:
    """`token_ids` with each image's expanded tokens (in order) folded back into the one placeholder the chat
    template wrote: the prompt as vLLM wants it (it expands the placeholders itself)."""
    placeholder = _placeholder(processor)
    out, start = [], 0
    for expanded in inputs.expansions:
        at = next(
            (
                i
                for i in range(start, len(token_ids) - len(expanded) + 1)
                if token_ids[i : i + len(expanded)] == expanded
            ),
            None,
        )
        if at is None:
            raise DataError("an image's tokens are not in the prompt as its processor expands them")
        out += token_ids[start:at] + placeholder
        start = at + len(expanded)
    return out + token_ids[start:]


def _image_tensors(out: Any) -> dict[str, torch.Tensor]:
    """A processor output's image tensors, one row per image (Idefics3's [images, 1, ...] of a batch of one image
    each flattened; Qwen-VL's patches and LLaVA's [images, C, H, W] are one row per image already)."""
    stacked = {"pixel_values": 5, "pixel_attention_mask": 4}  # Idefics3's [batch, images, ...] dimensions
    return {
        name: value.flatten(0, 1) if value.dim() == stacked.get(name) else value
        for name, value in out.items()
        if name not in ("input_ids", "attention_mask")
    }


def image_token_id(model_config: Any) -> int:
    """The id of the token whose positions take image features (`image_token_id`, or LLaVA's `image_token_index`)."""
    for name in ("image_token_id", "image_token_index"):
        if getattr(model_config, name, None) is not None:
            return int(getattr(model_config, name))
    raise DataError(f"{model_config.model_type} has no image token in its config: is it a vision-language model?")


def merge_images(inputs: list[ImageInputs], model_type: str) -> dict[str, torch.Tensor]:
    """One forward pass's image tensors from prompts' ImageInputs, in that order."""
    if not inputs:
        return {}
    names = inputs[0].tensors.keys()
    if model_type not in STACKED_IMAGES:
        return {name: torch.cat([i.tensors[name] for i in inputs]) for name in names}
    pixels = [i.tensors["pixel_values"] for i in inputs]
    height, width = max(p.shape[-2] for p in pixels), max(p.shape[-1] for p in pixels)
    count = sum(len(p) for p in pixels)
    pixel_values = pixels[0].new_zeros((1, count, pixels[0].shape[1], height, width))
    mask = torch.zeros((1, count, height, width), dtype=torch.long)
    row = 0
    for item, values in zip(inputs, pixels):
        n, h, w = len(values), values.shape[-2], values.shape[-1]
        pixel_values[0, row : row + n, :, :h, :w] = values
        own = item.tensors.get("pixel_attention_mask")
        mask[0, row : row + n, :h, :w] = 1 if own is None else own
        row += n
    return {"pixel_values": pixel_values, "pixel_attention_mask": mask}


def forward_images(
    images: list[ImageInputs | None],
    input_ids_BT: torch.Tensor,
    token_index_BT: torch.Tensor,
    image_token: int,
    model_type: str,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The image tensors of one forward pass over a layout: each sequence's images (`images[b]`) once, ordered by
    where its first image token sits in the layout (`token_index_BT[b, t]`: its flat position); sequences that
    share a prompt share its positions, so its images go in once."""
    first: dict[int, ImageInputs] = {}
    for b, inputs in enumerate(images):
        if inputs is None:
            continue
        columns = (input_ids_BT[b] == image_token).nonzero()
        if len(columns) == 0:
            raise DataError("a sequence with images has no image tokens: its prompt was cut or rendered without them")
        first.setdefault(int(token_index_BT[b, int(columns[0])]), inputs)
    merged = merge_images([first[position] for position in sorted(first)], model_type)
    return {name: value.to(device) for name, value in merged.items()}
