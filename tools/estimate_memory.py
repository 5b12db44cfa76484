"""The memory estimate as a tool script: `python tools/estimate_memory.py ...` is `jagg-estimate ...`
(jagg_scale/estimate/, which holds the model, the shapes and the measured coefficients)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jagg_scale.estimate.cli import main

if __name__ == "__main__":
    sys.exit(main())
