"""jagg-scale: GRPO fine-tuning of flow-matching diffusion transformers with JAGG.

The algorithm lives in `jagg_scale.jagg` (start with `jagg/backward.py`); the Flow-GRPO pieces in
`jagg_scale.grpo`; the trainer in `jagg_scale.train`. Both algorithm packages depend on torch and
`jagg_scale.cond` only; models, rewards, data, parallel engines and checkpoints sit above them.
"""

__version__ = "0.1.0"
