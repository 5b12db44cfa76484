"""The evaluation grid: one row per prompt (its images left to right), its prompt and scores written beside it.

Unlabelled, a grid of 20 prompts' images cannot be read without eval.json open next to it; so each row starts with
a label column (PIL's built-in bitmap font, the same on every machine): the prompt, wrapped, and short lines such
as its reward and diversity. The prompt is cut with "..." where the row is too short for all of it; the short
lines are kept whole. Rows have one height, so `grid_rows` cuts the grid back into per-prompt strips (the panels
wandb shows).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["LABEL_WIDTH", "PAD", "edit_rows", "grid_rows", "image_grid", "to_uint8", "video_frames_row",
           "write_gifs"]

LABEL_WIDTH = 180  # ~28 characters of the 6-px bitmap font: a digits prompt on one line
PAD = 2


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] (or videos [N, 3, F, H, W]) float in [0, 1] -> uint8 on the CPU (what a grid shows: a quarter of
    float32's bytes)."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def _wrap(text: str, font, width: int) -> list[str]:
    """Greedy word wrap to `width` pixels; a word wider than a line is cut by characters."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if font.getlength(candidate) <= width:
            line = candidate
            continue
        if line:
            lines.append(line)
        while font.getlength(word) > width and len(word) > 1:
            cut = len(word) - 1
            while cut > 1 and font.getlength(word[:cut]) > width:
                cut -= 1
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    return lines + ([line] if line else [])


def _label_lines(label: str, font, width: int, max_lines: int) -> list[str]:
    """The first line of `label` (the prompt) wrapped, then its other lines whole, within max_lines."""
    title, *details = label.split("\n")
    room = max(1, max_lines - len(details))
    wrapped = _wrap(title, font, width)
    if len(wrapped) > room:
        wrapped = wrapped[:room]
        last = wrapped[-1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        wrapped[-1] = last + "..."
    return (wrapped + details)[:max_lines]


def image_grid(images: torch.Tensor, ncols: int, min_size: int = 64, labels: list[str] | None = None) -> Image.Image:
    """[N, 3, H, W] in [0, 1] (or uint8 from `to_uint8`) -> one PIL image, ncols per row; small images are upscaled
    (nearest) for viewing. With `labels` (one per row) a label column of LABEL_WIDTH px comes first."""
    n, _, h, w = images.shape
    scale = max(1, min_size // max(h, w))
    arr = (images if images.dtype == torch.uint8 else to_uint8(images)).permute(0, 2, 3, 1).cpu().numpy()
    arr = arr.repeat(scale, axis=1).repeat(scale, axis=2)
    nrows = (n + ncols - 1) // ncols
    h, w = h * scale, w * scale
    left = LABEL_WIDTH if labels is not None else 0
    grid = np.full((nrows * (h + PAD) + PAD, left + ncols * (w + PAD) + PAD, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, ncols)
        y, x = PAD + r * (h + PAD), left + PAD + c * (w + PAD)
        grid[y:y + h, x:x + w] = arr[i]
    out = Image.fromarray(grid)
    if labels is not None:
        font = ImageFont.load_default_imagefont()  # bitmap: identical pixels whatever FreeType is installed
        line_h = font.getbbox("Ag")[3] + 2
        draw = ImageDraw.Draw(out)
        for r, label in enumerate(labels[:nrows]):
            lines = _label_lines(label, font, LABEL_WIDTH - 2 * PAD, max(1, (h - PAD) // line_h))
            for k, line in enumerate(lines):
                draw.text((PAD, PAD + r * (h + PAD) + 1 + k * line_h), line, fill=(0, 0, 0), font=font)
    return out


def edit_rows(inputs: torch.Tensor, before: torch.Tensor | None, after: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, int]:
    """An editing grid's images and columns: row r = inputs[r] | before[r k:(r+1) k] (the base model's edits, when
    given) | after[r k:(r+1) k]. All uint8 [., 3, H, W]; a row cut short (the grid's last) is padded white."""
    def cells(images: torch.Tensor, r: int) -> torch.Tensor:  # row r's k images, a short last row padded white
        row = images[r * k:(r + 1) * k]
        return torch.cat([row, torch.full((k - len(row), *row.shape[1:]), 255, dtype=row.dtype)])

    rows = [torch.cat([inputs[r:r + 1], *([cells(before, r)] if before is not None else []), cells(after, r)])
            for r in range(inputs.shape[0])]
    return torch.cat(rows), 1 + k * (2 if before is not None else 1)


def grid_rows(grid: Image.Image, nrows: int) -> list[Image.Image]:
    """The `nrows` rows of an `image_grid` (label column included), each without the padding around it."""
    row_h = (grid.height - PAD) // max(1, nrows)
    return [grid.crop((0, PAD + r * row_h, grid.width, PAD + (r + 1) * row_h - PAD)) for r in range(nrows)]


def video_frames_row(videos: torch.Tensor) -> torch.Tensor:
    """uint8 videos [N, 3, F, H, W] -> their frames [N F, 3, H, W] in order (a grid of F columns a video)."""
    return videos.transpose(1, 2).flatten(0, 1)


def write_gifs(videos: torch.Tensor, out_dir, fps: int) -> list[str]:
    """Each uint8 video [3, F, H, W] of `videos` as out_dir/video_NNN.gif (looping, `fps` frames a second, upscaled
    like the grid for viewing); returns the file names."""
    from pathlib import Path

    names = []
    for i, video in enumerate(videos):
        frames = video.permute(1, 2, 3, 0).numpy()  # [F, H, W, 3]
        scale = max(1, 64 // max(frames.shape[1:3]))
        pil = [Image.fromarray(f.repeat(scale, axis=0).repeat(scale, axis=1)) for f in frames]
        names.append(f"video_{i:03d}.gif")
        pil[0].save(Path(out_dir) / names[-1], save_all=True, append_images=pil[1:], duration=round(1000 / fps),
                    loop=0)
    return names
