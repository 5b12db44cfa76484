"""The tests' timeouts: hang guards only, never a speed check.

A test that fails by a timeout must mean a hang, not a slow machine. The measured idle times are small (a 2-process
trainer run ~5-15 s, a server start ~3 s), but a busy 2-core CI machine runs them 10x slower, and the first DeepSpeed
use on a fresh machine JIT-compiles its shm_comm extension (~40 s idle, cached in ~/.cache/torch_extensions; minutes
on a busy machine) where `make setup-extras` has not built it already. Every guard is far above all of that. The
per-test pytest-timeout in pyproject.toml (3600 s) is the outer guard. No test asserts on wall time: speed belongs
to tools/bench.
"""

# one subprocess run that trains or launches ranks (jagg-train, torchrun, deepspeed, mpirun, the bench): idle
# <= ~50 s including DeepSpeed's first-use compile
RUN_S = 1800

# a condition a test waits for (a server listening, a file appearing, a signal handled, a process exiting after
# a signal, one request on loopback): idle <= ~5 s
WAIT_S = 600

# how often a test polls for such a condition
POLL_S = 0.05
