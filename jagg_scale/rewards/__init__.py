"""Rewards: a name registry of scorers over decoded images, and a wrapper that masks failed samples.

Importing this package registers the built-in rewards (JPEG compressibility/incompressibility, digit_match,
remote, vlm_judge, dina_lrm, the CLIP family clip_score/pickscore/hps/aesthetic, ocr, imagenet_class, the editing reward
clip_direction, the video rewards video_frames and temporal_consistency), so `build_reward("jpeg_compressibility")`
works without further imports. Model-based rewards import their heavy libraries (transformers, rapidocr) only when
built.
"""

from . import jpeg  # noqa: F401  (registers the JPEG rewards)
from . import digits  # noqa: F401  (registers digit_match)
from . import remote  # noqa: F401  (registers remote: rewards served by jagg-reward-server)
from . import vlm_judge  # noqa: F401  (registers vlm_judge: a judge behind an OpenAI-compatible chat API)
from . import dina_lrm  # noqa: F401  (registers dina_lrm: a latent reward model; diffusers imported on build)
from . import server  # noqa: F401  (jagg-reward-server)
from . import clip  # noqa: F401  (registers clip_score, pickscore, hps, aesthetic; transformers imported on build)
from . import ocr  # noqa: F401  (registers ocr; rapidocr imported on build)
from . import imagenet  # noqa: F401  (registers imagenet_class)
from . import edit  # noqa: F401  (registers clip_direction, the editing reward; transformers imported on build)
from . import video  # noqa: F401  (registers video_frames, temporal_consistency: rewards of a video's frames)
from .base import Reward, RewardOutput, UnknownRewardError, available, build_reward, register, score_safely

__all__ = [
    "Reward",
    "RewardOutput",
    "UnknownRewardError",
    "register",
    "build_reward",
    "available",
    "score_safely",
]
