"""Video rewards (rewards/video.py): video_frames averages an image reward over a video's frames (a failed frame
left out, a video with none failing), temporal_consistency is adjacent frames' CLIP cosine (1 for a still video),
a remote judge gets videos over the real server; image and video rewards are refused, naming the key, where the
model makes the other kind."""

import pytest
import torch
import torch.nn.functional as F
from extras import need
from tiny_clip import make_tiny_clip

from jagg_scale.rewards import Reward, RewardOutput, build_reward, register
from jagg_scale.train import ConfigError, load_config


@register("_test_frame_mean")
class _FrameMean(Reward):
    """The mean pixel of each frame; NaN for a frame whose metadata says so (a failed frame)."""

    def __call__(self, images, prompts, metadata):
        scores = images.float().mean(dim=(1, 2, 3))
        return RewardOutput(scores=torch.where(torch.tensor([m.get("nan", False) for m in metadata]), torch.nan,
                                               scores), info={"seen": len(prompts)})


def test_video_frames_is_the_mean_of_its_frames_scores():
    videos = torch.rand(2, 3, 6, 8, 8, generator=torch.Generator().manual_seed(0))
    reward = build_reward("video_frames", reward="_test_frame_mean", every=2)
    out = reward(videos, ["a", "b"], [{}, {}])
    want = videos[:, :, ::2].mean(dim=(1, 3, 4)).mean(dim=1)  # frames 0, 2, 4
    assert torch.allclose(out.scores, want) and out.info == {"frames_seen": 6}
    failed = reward(videos, ["a", "b"], [{}, {"nan": True}])
    assert failed.scores[0] == pytest.approx(float(want[0])) and torch.isnan(failed.scores[1])
    with pytest.raises(ValueError, match="scores videos \\[N, 3, F, H, W\\], got a tensor of shape \\(2, 3, 8, 8\\)"):
        reward(videos[:, :, 0], ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="an image reward\\), not .temporal_consistency."):
        build_reward("video_frames", reward="temporal_consistency")


def test_temporal_consistency_is_adjacent_frames_cosine(tmp_path):
    need("transformers")
    reward = build_reward("temporal_consistency", path=str(make_tiny_clip(tmp_path / "clip")), device="cpu")
    gen = torch.Generator().manual_seed(1)
    still = torch.rand(1, 3, 1, 32, 32, generator=gen).expand(1, 3, 4, 32, 32)
    moving = torch.rand(1, 3, 4, 32, 32, generator=gen)
    out = reward(torch.cat([still, moving]), ["a", "b"], [{}, {}])
    emb = F.normalize(reward.backbone.image_embeds(moving[0].transpose(0, 1)), dim=-1)
    assert out.scores[0] == pytest.approx(1.0, abs=1e-5)
    assert out.scores[1] == pytest.approx(float((emb[1:] * emb[:-1]).sum(-1).mean()), abs=1e-5)
    assert out.scores[1] < 1.0 - 1e-4


@pytest.mark.parametrize("overrides, key, message", [
    (["model.kind=wan", "model.pretrained=x", "reward.name=jpeg_compressibility"], "reward.name",
     "'jpeg_compressibility' scores images; model.kind wan makes videos"),
    (["model.kind=wan", "model.pretrained=x", "reward.components={pickscore: {weight: 1}}"],
     "reward.components.pickscore", "video_frames"),
    (["reward.name=video_frames"], "reward.name", "'video_frames' scores videos; model.kind dit makes images"),
    (["model.kind=wan", "model.pretrained=x", "reward.name=remote", "reward.options={url: 'http://h:1', reward: v}"],
     None, None),  # a remote judge takes videos
    (["model.num_frames=9"], "model.num_frames", "is the frame count of a video model (kind wan), not dit"),
])
def test_rewards_that_cannot_score_the_models_samples_are_refused(overrides, key, message):
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    if key is None:
        assert load_config(config, overrides, check_files=False).reward.name == "remote"
        return
    with pytest.raises(ConfigError) as err:
        load_config(config, overrides, check_files=False)
    assert str(err.value).startswith(f"config key '{key}' ") and message in str(err.value)


def test_a_remote_judge_scores_videos_as_the_same_reward_does_locally():
    """The real server (uvicorn on loopback) serving video_frames over jpeg_compressibility and the real `remote`
    client: a video batch travels as `videos` (each video's frames as PNGs), the reward gets [N, 3, F, H, W] back and
    scores as locally; videos of different lengths are a 400 naming the field."""
    import json
    import threading
    import urllib.error
    import urllib.request

    need("uvicorn")
    need("starlette")
    from hang_guard import WAIT_S

    from jagg_scale.rewards.server import encode_images, serve

    videos = (torch.rand(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(2)) * 255).round() / 255
    local = build_reward("video_frames", reward="jpeg_compressibility")
    srv = serve({"frames_jpeg": build_reward("video_frames", reward="jpeg_compressibility")}, host="127.0.0.1", port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        remote = build_reward("remote", url=srv.url, reward="frames_jpeg", retries=0, timeout_s=float(WAIT_S),
                              max_batch=1)  # one video a request: the split along the batch keeps whole videos
        got = remote(videos, ["a", "b"], [{}, {}])
        assert torch.allclose(got.scores, local(videos, ["a", "b"], [{}, {}]).scores, atol=1e-5)
        frames = [encode_images(v.transpose(0, 1)) for v in videos]
        body = json.dumps({"prompts": ["a", "b"], "metadata": [{}, {}], "videos": [frames[0], frames[1][:3]]})
        req = urllib.request.Request(srv.url.rstrip("/") + "/score/frames_jpeg", data=body.encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=WAIT_S)  # a hang guard only
        assert err.value.code == 400 and "field 'videos'" in json.loads(err.value.read())["error"]
    finally:
        srv.shutdown()
        srv.server_close()
