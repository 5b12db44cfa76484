"""Rewards: a name registry of scorers over decoded images, and a wrapper that masks failed samples.

Importing this package registers the built-in rewards (JPEG compressibility/incompressibility), so
`build_reward("jpeg_compressibility")` works without further imports.
"""

from . import jpeg  # noqa: F401  (registers the JPEG rewards)
from . import digits  # noqa: F401  (registers digit_match)
from . import remote  # noqa: F401  (registers remote: rewards served by jagg-reward-server)
from . import server  # noqa: F401  (jagg-reward-server)
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
