"""Input images of edit prompts: `EditPrompt` (an instruction that carries its image) and the one bounded decoder.

An editing data set (FLUX.1-Kontext) pairs an instruction with an input image. The instruction stays a `str` through
the stack (rewards, logs, grids and the prompt sampler see text, as for any prompt); `EditPrompt.image` carries the
image to the model's `encode_prompts` and to the editing rewards. Its equality and hash include the image, so one
instruction on two images is two prompts.

    image sources   a path (a jsonl record's `image`, resolved inside the prompt file's folder: load_prompts), the
                    encoded bytes of a shard's image member, or a PIL image
    bounds          at most MAX_IMAGE_BYTES read and MAX_IMAGE_PIXELS decoded per image (checked from the header,
                    before decoding), so a hostile file cannot exhaust memory; a bad one fails naming its source
    checked early   each edit record's image is decoded as the record is loaded (a prompt file's in threads:
                    check_images) or read from a shard (check_image): a bad one costs its record (skipped with a
                    warning naming file:line or shard and key)
"""

from __future__ import annotations

import io
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["EditPrompt", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "check_image", "check_images", "load_rgb"]

MAX_IMAGE_BYTES = 64 << 20  # an encoded input image: a 4k PNG is ~25 MB
MAX_IMAGE_PIXELS = 50_000_000  # a decoded one: 200 MB as RGBA


class EditPrompt(str):
    """An instruction (the str itself) and its input image (`image`: a path, encoded bytes or a PIL image)."""

    image: object

    def __new__(cls, text: str, image):
        obj = super().__new__(cls, text)
        obj.image = image
        return obj

    def __reduce__(self):  # pickled as text and image (the prompt stream all-gathers records across ranks)
        return (EditPrompt, (str(self), self.image))

    def __eq__(self, other):
        if isinstance(other, EditPrompt):
            return str(self) == str(other) and _image_key(self.image) == _image_key(other.image)
        return NotImplemented if not isinstance(other, str) else False

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash((str(self), _image_key(self.image)))

    def strip(self, chars=None) -> "EditPrompt":
        return EditPrompt(str(self).strip(chars), self.image)


def _image_key(image):
    return image if isinstance(image, (str, bytes)) else id(image)


def check_image(source, name: str | None = None) -> None:
    """Decode `source` whole (a path or encoded bytes) within the bounds: a ValueError naming `name` (default: the
    path) unless it is an image. Run on every edit record as it is loaded (a prompt file: check_images) or read (a
    shard), so a truncated PNG, a text file or a pixel bomb costs its record there, not the run at its first step."""
    _open(source, name)


#: threads that decode a prompt file's input images at once. PIL decodes without the GIL: 40 PNGs of 1024^2 took
#: 0.64 s in one thread and 0.34 s in two on a 2-core CPU (a 10k-image edit set: ~2 min of every rank's start-up in
#: one). At most this many images are decoded at a time per rank: 8 x 200 MB at the pixel bound.
IMAGE_THREADS = 8


def check_images(items: Sequence[tuple[object, str]]) -> list[Exception | None]:
    """check_image over (source, name) pairs in up to IMAGE_THREADS threads: each item's ValueError (OSError for a
    file gone since) or None, in order."""

    def one(item) -> Exception | None:
        try:
            _decode(*item)
        except (ValueError, OSError) as err:
            return err
        return None

    threads = min(len(items), IMAGE_THREADS, len(os.sched_getaffinity(0)))
    # the threads leave the warning filters alone (catch_warnings is not thread-safe): this thread sets them once
    with _no_bomb_warning():
        if threads <= 1:
            return [one(item) for item in items]
        with ThreadPoolExecutor(threads, thread_name_prefix="check_image") as pool:
            return list(pool.map(one, items))


def load_rgb(source, size: int, name: str | None = None) -> torch.Tensor:
    """An image as float32 RGB [3, size, size] in [0, 1]: its shorter side resized to `size` (Lanczos, as diffusers'
    image processor), then centre-cropped. `source`: a path, encoded bytes or a PIL image; `name` for errors."""
    from PIL import Image

    image = _open(source, name)
    width, height = image.size
    scale = size / min(width, height)
    image = image.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.LANCZOS)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return pixels.permute(2, 0, 1).float() / 255


def _open(source, name: str | None):
    """`source` decoded to an RGB PIL image: at most MAX_IMAGE_BYTES read, MAX_IMAGE_PIXELS checked from the header
    before anything is decoded; any failure a ValueError (FileNotFoundError for a missing path) naming it."""
    with _no_bomb_warning():
        return _decode(source, name)


@contextmanager
def _no_bomb_warning():
    """PIL's DecompressionBombWarning silenced: the pixel bound (_decode) is the check, and says it in our words."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def _decode(source, name: str | None):
    """_open without touching the warning filters (check_images' threads)."""
    from PIL import Image

    if name is None:
        name = "an input image's bytes" if isinstance(source, (bytes, bytearray)) else f"input image {source}"
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (bytes, bytearray)):
            data = bytes(source)
        else:
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"input image not found: {path}")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ValueError(f"{name} is {path.stat().st_size} bytes, over {MAX_IMAGE_BYTES}")
            data = path.read_bytes()
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"{name} is {len(data)} bytes, over {MAX_IMAGE_BYTES}")
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size  # from the header: nothing decoded yet
        except Image.DecompressionBombError:  # PIL's own bound (past 2x its limit) met first: ours, in our words
            raise ValueError(f"{name} is over {MAX_IMAGE_PIXELS} pixels (by its header)") from None
        except Image.UnidentifiedImageError:
            raise ValueError(f"{name} could not be read: not an image in a format PIL reads") from None
        except Exception as err:  # PIL raises several types for a header it cannot parse
            raise ValueError(f"{name} could not be read: {err}") from None
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(f"{name} is {width}x{height} pixels, over {MAX_IMAGE_PIXELS}")
    try:
        return image.convert("RGB")  # decodes it all: a truncated file fails here
    except Exception as err:
        raise ValueError(f"{name} could not be decoded: {err}") from None
