"""`vlm_judge`: a VLM judge behind any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, llama.cpp's
server, a hosted API) scores each image.

Each row is one chat request: the image as a PNG data URL (resized to `resize` x `resize` first when set), then the
template's text with the row's prompt in it, at temperature 0. Two ways to read a score:

    score: text       the answer's text matched by `pattern` (its first group, a number), divided by `score_max`
    score: yes_prob   one token with its top log-probabilities: p(yes) / (p(yes) + p(no)) over the tokens that
                      read "yes" / "no" (case and spaces aside); the judge's answer need not be parsed at all

Built-in templates: `unifiedreward` (Flow-GRPO's UnifiedReward-over-SGLang reward, value for value:
flow_grpo/rewards.py:284-357 at ac4c86e: the question at :315 with its "<image>" line, the image first as a PNG data
URL at :295, images resized to 512 x 512 at :350, temperature 0 at :334, "Final Score: [1-5]" at :300, divided by 5 at
:355) and `yes_no` ("Does this image show {prompt}? Answer yes or no.", for yes_prob). `template_file`: a UTF-8 text
file holding {prompt} (read once, at build time, at most 64 KB).

Where we depart from Flow-GRPO: an answer the pattern does not match, or a refused request (4xx), is a failed row (NaN:
masked and counted against reward.max_fail_frac, info judge_unparsed / judge_failed), not a score of 0, which would
train the policy as if the image were the worst. Rows go out `concurrency` at a time (Flow-GRPO: all of a batch at
once), each with `timeout_s` x (retries + 1) + backoff, which the config check keeps inside reward.deadline_s."""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .base import Reward, RewardOutput, cancel_event, cancellable, register
from .remote import JsonPoster, RemoteRewardError
from .server import encode_images

__all__ = ["TEMPLATES", "VLMJudge", "yes_probability"]

TEMPLATES = {
    # flow_grpo/rewards.py:315 (ac4c86e), as its SGLang client sends it
    "unifiedreward": (
        "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
        "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
        "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
        "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
        "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
        "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: "
        "[{prompt}]"),
    "yes_no": "Does this image show {prompt}? Answer yes or no.",
}
UNIFIEDREWARD_PATTERN = r"Final Score:\s*([1-5](?:\.\d+)?)"  # flow_grpo/rewards.py:300
MAX_TEMPLATE_BYTES = 64 << 10
MAX_SIDE = 4096  # the reward server's per-image pixel limit (server_limits.MAX_IMAGE_PIXELS = 4096^2)


def yes_probability(top_logprobs: list) -> float:
    """p(yes) / (p(yes) + p(no)) from one position's top log-probabilities ([{"token", "logprob"}, ...]); NaN when
    neither appears."""
    p = {"yes": 0.0, "no": 0.0}
    for entry in top_logprobs or []:
        if not isinstance(entry, dict):
            continue
        word = str(entry.get("token", "")).strip().lower()
        logprob = entry.get("logprob")
        if word in p and isinstance(logprob, (int, float)) and math.isfinite(logprob):
            p[word] += math.exp(logprob)
    total = p["yes"] + p["no"]
    return p["yes"] / total if total > 0 else math.nan


def _data_url(image: torch.Tensor) -> str:
    """[3, H, W] in [0, 1] -> a PNG data URL (Flow-GRPO's "data:image;base64," prefix: flow_grpo/rewards.py:295),
    quantised by the rule every reward uses (server.encode_images)."""
    return "data:image;base64," + encode_images(image[None])[0]


@register("vlm_judge")
class VLMJudge(Reward):
    """A judge behind an OpenAI-compatible /chat/completions (module docstring). `url`: the API base ending in /v1."""

    retries_requests = True  # its timeout_s / retries / backoff_s are checked against reward.deadline_s

    def __init__(self, *, url: str, model: str, template: str = "unifiedreward", template_file: str | None = None,
                 score: str = "text", pattern: str | None = None, score_max: float = 5.0,
                 resize: int | None = 512, max_tokens: int | None = None, concurrency: int = 8,
                 timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 1.0, token_env: str | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"vlm_judge: url must start with http:// or https://, got {url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"vlm_judge: model must be the served model's name, got {model!r}")
        if score not in ("text", "yes_prob"):
            raise ValueError(f"vlm_judge: score must be text or yes_prob, got {score!r}")
        if template_file is not None:
            path = Path(template_file)
            if not path.is_file() or path.stat().st_size > MAX_TEMPLATE_BYTES:
                raise ValueError(f"vlm_judge: template_file {template_file!r} is not a file of at most "
                                 f"{MAX_TEMPLATE_BYTES} bytes")
            self.template = path.read_text(encoding="utf-8")
        elif template in TEMPLATES:
            self.template = TEMPLATES[template]
        else:
            raise ValueError(f"vlm_judge: template must be one of {sorted(TEMPLATES)} (or give template_file), "
                             f"got {template!r}")
        if "{prompt}" not in self.template:
            raise ValueError("vlm_judge: the template must hold {prompt}")
        self.pattern = re.compile(pattern or UNIFIEDREWARD_PATTERN) if score == "text" else None
        if self.pattern is not None and self.pattern.groups < 1:
            raise ValueError("vlm_judge: pattern needs a group capturing the score")
        if resize is not None and not (isinstance(resize, int) and 0 < resize <= MAX_SIDE):
            raise ValueError(f"vlm_judge: resize must be an int in [1, {MAX_SIDE}] or null, got {resize!r}")
        if not (isinstance(concurrency, int) and 1 <= concurrency <= 256):
            raise ValueError(f"vlm_judge: concurrency must be an int in [1, 256], got {concurrency!r}")
        if not (score_max > 0 and timeout_s > 0 and backoff_s >= 0) or not (isinstance(retries, int) and retries >= 0):
            raise ValueError("vlm_judge: score_max and timeout_s must be > 0, backoff_s >= 0, retries an int >= 0")
        token = None
        if token_env:
            token = os.environ.get(token_env)
            if not token:
                raise ValueError(f"vlm_judge: token_env {token_env!r} is unset or empty")
        self.model, self.score, self.score_max, self.resize = model, score, float(score_max), resize
        self.max_tokens = max_tokens if max_tokens is not None else (1 if score == "yes_prob" else 512)
        self.concurrency = concurrency
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.poster = JsonPoster(self.endpoint, timeout_s=float(timeout_s), retries=retries,
                                 backoff_s=float(backoff_s), token=token, seed=f"{url}|{model}",
                                 what=f"vlm_judge {model!r}")

    def __repr__(self) -> str:
        return f"VLMJudge(endpoint={self.endpoint!r}, model={self.model!r}, score={self.score!r})"

    def body(self, image: torch.Tensor, prompt: str) -> bytes:
        """One row's chat request."""
        if self.resize is not None and tuple(image.shape[-2:]) != (self.resize, self.resize):
            image = F.interpolate(image[None].float(), size=(self.resize, self.resize), mode="bilinear",
                                  antialias=True, align_corners=False)[0]
        if max(image.shape[-2:]) > MAX_SIDE:
            raise ValueError(f"vlm_judge: an image of {tuple(image.shape[-2:])} exceeds {MAX_SIDE} a side: set resize")
        req = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
               "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": _data_url(image)}},
                   {"type": "text", "text": self.template.replace("{prompt}", str(prompt))}]}]}
        if self.score == "yes_prob":
            req.update(logprobs=True, top_logprobs=20)
        return json.dumps(req).encode()

    def parse(self, reply: dict) -> float:
        """A score from one chat reply, NaN when it holds none (counted as unparsed)."""
        try:
            choice = reply["choices"][0]
            if self.score == "yes_prob":
                return yes_probability(choice["logprobs"]["content"][0]["top_logprobs"])
            match = self.pattern.search(str(choice["message"]["content"] or ""))
            return float(match.group(1)) / self.score_max if match else math.nan
        except (KeyError, IndexError, TypeError, ValueError):
            return math.nan

    def _row(self, image: torch.Tensor, prompt: str) -> tuple[float, str]:
        try:
            reply, _ = self.poster.post(self.body(image, prompt))
        except RemoteRewardError:  # refused (4xx) or out of retries: this row fails, the batch goes on
            return math.nan, "failed"
        s = self.parse(reply)
        return s, ("ok" if math.isfinite(s) else "unparsed")

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        if images.ndim != 4 or len(prompts) != images.shape[0]:
            raise ValueError(f"vlm_judge: {tuple(images.shape)} images for {len(prompts)} prompts (images only)")
        event = cancel_event()  # the chunk's: its rows stop asking once it is past the deadline

        def row(image, prompt):
            with cancellable(event):
                return self._row(image, prompt)

        with ThreadPoolExecutor(min(self.concurrency, max(1, len(prompts)))) as pool:
            rows = list(pool.map(row, images.detach().cpu(), [str(p) for p in prompts]))
        scores = torch.tensor([s for s, _ in rows], dtype=torch.float32)
        return RewardOutput(scores=scores, info={"judge_unparsed": sum(k == "unparsed" for _, k in rows),
                                                 "judge_failed": sum(k == "failed" for _, k in rows)})
