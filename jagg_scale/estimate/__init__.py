"""jagg-estimate: what a training config needs per GPU before a cluster is booked.

    jagg-estimate CONFIG [key=value ...] --world-size N --gpu-mem GIB [--headroom 0.1]   fits? the largest
                                                                micro-batch that does (exit 1 when it does not fit),
                                                                and the step's seconds per phase beside Flow-GRPO's
    jagg-estimate --counts                                      parameter counts of the committed shapes

    shapes.py       model shapes: a pipeline directory's configs or the committed shapes/*.json, on the meta device
    activations.py  measured activation coefficients (coefficients.json) and their composition over the depth
    measure.py      the CPU measurement of those coefficients (--measure)
    memory.py       the per-rank, per-phase memory model (docs/scale.md); sampling.chunk_size auto
    steptime.py     the step-time model: each phase's passes at rates measured on a GPU (passes.json)
    cli.py          the command

The estimate reads what the trainer does from the trainer's own pieces: the rows each rank samples and trains
(train/rows.py), the planner's with-grad rows per pass (jagg/planners.py), the LoRA targets (models/lora.py).
"""

from .memory import choose_micro, estimate, fits, prepare, report

__all__ = ["choose_micro", "estimate", "fits", "prepare", "report"]
