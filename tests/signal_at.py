"""jagg-train with a real signal sent to one rank at one point of one step: preemption across ranks, as Slurm's
signal reaching one node before the others (tests/parallel/test_preempt_ranks.py).

    JAGG_TEST_SIGNAL=PHASE:STEP:RANK[:NTH]  torchrun --nproc_per_node 2 tests/signal_at.py CONFIG [overrides ...]

PHASE rollout | reward | update | optimizer: stand_ins.signal_in_step (the NTH forward of the phase, or right after
the first optimizer step); eval: as the evaluation after STEP steps begins. The signal is SIGUSR1, Slurm's warning."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stand_ins import signal_in_step  # noqa: E402

from jagg_scale.cli import train_main  # noqa: E402
from jagg_scale.train.trainer import Trainer  # noqa: E402


def main() -> int:
    phase, step, rank, *nth = os.environ["JAGG_TEST_SIGNAL"].split(":")
    if int(os.environ.get("RANK", "0")) == int(rank):
        real_fit = Trainer.fit

        def fit(self):
            if phase == "eval":
                real_evaluate = self.evaluate

                def evaluate(at):
                    if at == int(step):
                        os.kill(os.getpid(), signal.SIGUSR1)
                    return real_evaluate(at)

                self.evaluate = evaluate
            else:
                signal_in_step(self, int(step), phase, int(nth[0]) if nth else 1, signal.SIGUSR1)
            return real_fit(self)

        Trainer.fit = fit
    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
