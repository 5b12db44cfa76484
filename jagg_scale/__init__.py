"""jagg-scale: GRPO fine-tuning of flow-matching diffusion transformers with JAGG.

The algorithm lives in `jagg_scale.jagg` (start with `jagg/backward.py`); the Flow-GRPO pieces in
`jagg_scale.grpo`; the trainer in `jagg_scale.train`.
"""

__version__ = "0.1.0"
