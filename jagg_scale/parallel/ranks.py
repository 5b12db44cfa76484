"""Find out who we are in a distributed job, in one place.

Jobs get launched by torchrun, by DeepSpeed's launcher (torchrun's variables
but LOCAL_SIZE), by Slurm's ``srun``, by ``mpirun`` (Open MPI or MPICH) or as a
plain single process.  Each launcher describes the process group
with its own environment variables.  Rather than sprinkling ``os.environ``
lookups around the code base, :func:`discover` reads them once, validates them
(a bad value fails here, naming the variable, instead of hanging in
``init_process_group``), and returns a :class:`RankInfo`.  :func:`export_env`
writes that back as the torchrun-style variables so that
``torch.distributed.init_process_group(init_method="env://")`` works whatever
the launcher was.

Precedence is torchrun > Slurm > MPI > single: ``srun torchrun ...`` sets both
torchrun and Slurm variables, and torchrun's are the ones describing the actual
worker processes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, MutableMapping

DEFAULT_PORT = 29500
DEFAULT_ADDR = "127.0.0.1"

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "deepspeed" | "slurm" | "mpi" | "single"


# ---------------------------------------------------------------- parsing


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _port(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    port = _int(env, name, minimum=1)
    if port > 65535:
        raise ValueError(f"{name}={port} is not a valid port (1-65535)")
    return port


def _split_top_level(s: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in nodelist {s!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in nodelist {s!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"bad range {item!r} in nodelist")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in nodelist")
        width = len(lo)  # Slurm keeps the zero padding of the start value
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    return [head + v + rest for v in _expand_range_list(m.group(1)) for rest in _expand_host(tail)]


def expand_nodelist(s: str) -> list[str]:
    """Expand Slurm's compressed host list, e.g. ``"node[01-03,07],gpu5"``.

    >>> expand_nodelist("node[01-02],gpu-b5")
    ['node01', 'node02', 'gpu-b5']
    """
    return [host for part in _split_top_level(s) for host in _expand_host(part)]


def _expand_tasks_per_node(s: str, name: str) -> list[int]:
    """``"4"`` -> [4]; ``"4(x2)"`` -> [4, 4]; ``"2(x2),1"`` -> [2, 2, 1]."""
    out: list[int] = []
    for item in s.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"{name}={s!r} is not a Slurm tasks-per-node value")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    if not out or min(out) < 1:
        raise ValueError(f"{name}={s!r} must list positive task counts")
    return out


# ---------------------------------------------------------------- launchers


def _local_size_var(env: Mapping[str, str]) -> str:
    """torchrun's LOCAL_WORLD_SIZE, or DeepSpeed's LOCAL_SIZE: its launch.py sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT as torchrun does but names the node's process count LOCAL_SIZE (deepspeed 0.19.8,
    deepspeed/launcher/launch.py:182)."""
    return "LOCAL_SIZE" if "LOCAL_WORLD_SIZE" not in env and "LOCAL_SIZE" in env else "LOCAL_WORLD_SIZE"


def _from_torchrun(env: Mapping[str, str]) -> RankInfo:
    local_size = _local_size_var(env)
    missing = [v for v in _TORCHRUN_VARS if v not in env and not (v == "LOCAL_WORLD_SIZE" and local_size in env)]
    if missing:
        raise ValueError(f"RANK/WORLD_SIZE set but torchrun variable(s) missing: {', '.join(missing)}")
    return RankInfo(
        rank=_int(env, "RANK"),
        world_size=_int(env, "WORLD_SIZE", minimum=1),
        local_rank=_int(env, "LOCAL_RANK"),
        local_world_size=_int(env, local_size, minimum=1),
        master_addr=env["MASTER_ADDR"],
        master_port=_port(env),
        source="deepspeed" if local_size == "LOCAL_SIZE" else "torchrun",
    )


def _from_slurm(env: Mapping[str, str]) -> RankInfo:
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            per_node = _expand_tasks_per_node(env[name], name)
            node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
            local_world = per_node[node_id] if node_id < len(per_node) else per_node[-1]
            break
    else:
        raise ValueError("SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE must be set")

    nodelist_var = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
    if nodelist_var not in env:
        raise ValueError("SLURM_JOB_NODELIST (or SLURM_NODELIST) must be set")
    hosts = expand_nodelist(env[nodelist_var])
    if not hosts:
        raise ValueError(f"{nodelist_var}={env[nodelist_var]!r} names no host")

    if "MASTER_PORT" in env:
        port = _port(env)
    elif "SLURM_JOB_ID" in env:
        # Same port on every task of the job, different across concurrent jobs.
        port = 10000 + _int(env, "SLURM_JOB_ID") % 20000
    else:
        port = DEFAULT_PORT

    return RankInfo(
        rank=_int(env, "SLURM_PROCID"),
        world_size=_int(env, "SLURM_NTASKS", minimum=1),
        local_rank=_int(env, "SLURM_LOCALID"),
        local_world_size=local_world,
        master_addr=hosts[0],
        master_port=port,
        source="slurm",
    )


def _mpi_master(env: Mapping[str, str]) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR", DEFAULT_ADDR)
    return addr, (_port(env) if "MASTER_PORT" in env else DEFAULT_PORT)


def _from_mpi_env(env: Mapping[str, str]) -> RankInfo | None:
    if "OMPI_COMM_WORLD_RANK" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env:
        # MPICH/Hydra exports the node-local values as MPI_LOCALRANKID/NRANKS.
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    else:
        return None
    rank_v, size_v, lrank_v, lsize_v = names
    if size_v not in env:
        raise ValueError(f"{rank_v} set but {size_v} missing")
    rank, world = _int(env, rank_v), _int(env, size_v, minimum=1)
    if lrank_v in env and lsize_v in env:
        local_rank, local_world = _int(env, lrank_v), _int(env, lsize_v, minimum=1)
    else:  # no node-local info: assume a single node
        local_rank, local_world = rank, world
    addr, port = _mpi_master(env)
    return RankInfo(rank, world, local_rank, local_world, addr, port, "mpi")


# Variables every MPI launcher we know sets in its ranks (PMIx under srun / Open MPI 5, PMI under Hydra, MVAPICH, Intel
# MPI, Cray ALPS). mpi4py is probed only where one is present: importing it initialises MPI (~1 s, and a singleton
# MPI world) in every plain process otherwise.
_MPI_HINTS = ("PMIX_", "PMI_", "OMPI_", "MV2_", "I_MPI_", "HYDRA_", "MPI_LOCALRANKID", "ALPS_APP_PE", "CRAY_MPICH")


def _from_mpi4py(env: Mapping[str, str]) -> RankInfo | None:
    if not any(k.startswith(_MPI_HINTS) for k in env):
        return None
    try:
        from mpi4py import MPI  # optional; only imported when asked for
    except Exception:  # not installed, or no MPI library underneath
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() <= 1:
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    addr, port = _mpi_master(env)
    return RankInfo(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(), addr, port, "mpi")


def _check(info: RankInfo, names: tuple[str, str, str, str]) -> RankInfo:
    rank_v, world_v, lrank_v, lworld_v = names
    if info.rank >= info.world_size:
        raise ValueError(f"{rank_v}={info.rank} must be < {world_v}={info.world_size}")
    if info.local_rank >= info.local_world_size:
        raise ValueError(f"{lrank_v}={info.local_rank} must be < {lworld_v}={info.local_world_size}")
    if info.local_world_size > info.world_size:
        raise ValueError(f"{lworld_v}={info.local_world_size} exceeds {world_v}={info.world_size}")
    return info


# ---------------------------------------------------------------- public API


def discover(env: Mapping[str, str] | None = None, *, use_mpi: bool = True) -> RankInfo:
    """Return this process's :class:`RankInfo` (torchrun > Slurm > MPI > single).

    Raises ValueError naming the offending variable when values are malformed
    or inconsistent.  ``use_mpi=False`` skips the (lazy) mpi4py probe.
    """
    env = os.environ if env is None else env

    if "RANK" in env and "WORLD_SIZE" in env:
        return _check(_from_torchrun(env), (*_TORCHRUN_VARS[:3], _local_size_var(env)))

    if "SLURM_PROCID" in env:
        tpn = "SLURM_NTASKS_PER_NODE" if "SLURM_NTASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
        return _check(_from_slurm(env), ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", tpn))

    info = _from_mpi_env(env)
    if info is not None:
        names = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_RANK" in env
                 else ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
        return _check(info, names)
    if use_mpi:
        info = _from_mpi4py(env)
        if info is not None:
            return info

    addr, port = _mpi_master(env)
    return RankInfo(0, 1, 0, 1, addr, port, "single")


def export_env(info: RankInfo, env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Write ``info`` as torchrun variables so ``init_method="env://"`` works; returns ``env``."""
    env = os.environ if env is None else env
    env.update({
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
    })
    return env


def default_backend() -> str:
    """``"nccl"`` when CUDA is usable, else ``"gloo"``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(host: str = DEFAULT_ADDR) -> int:
    """A TCP port free right now on `host` (for a rendezvous started by this process: tests, benchmarks)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launcher_env(base: Mapping[str, str] | None = None) -> dict:
    """A copy of the environment without the variables that describe this process's own job, so that a launcher
    started from it (torchrun, mpirun) sets up a fresh one; one intra-op thread per rank, unbuffered output."""
    env = dict(os.environ if base is None else base, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in (*_TORCHRUN_VARS, "LOCAL_SIZE", "SLURM_PROCID"):
        env.pop(key, None)
    return env
