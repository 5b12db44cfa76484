"""Rank discovery from faked launcher environments (no processes spawned)."""

import dataclasses
import sys
import types

import pytest

from jagg_scale.parallel import RankInfo, default_backend, discover, expand_nodelist, export_env

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}


def slurm(**over):
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODEID": "0"}
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_torchrun():
    assert discover(TORCHRUN, use_mpi=False) == RankInfo(5, 8, 1, 4, "10.0.0.1", 29400, "torchrun")


def test_deepspeed_names_the_nodes_process_count_local_size():
    """DeepSpeed's launch.py sets torchrun's variables but LOCAL_SIZE for LOCAL_WORLD_SIZE (and CROSS_RANK /
    CROSS_SIZE for the node); a bad one is named by its own name."""
    env = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"} | {"LOCAL_SIZE": "4", "CROSS_RANK": "1",
                                                                         "CROSS_SIZE": "2"}
    assert discover(env, use_mpi=False) == RankInfo(5, 8, 1, 4, "10.0.0.1", 29400, "deepspeed")
    with pytest.raises(ValueError, match="LOCAL_RANK=1 must be < LOCAL_SIZE=1"):
        discover(env | {"LOCAL_SIZE": "1"}, use_mpi=False)
    with pytest.raises(ValueError, match="missing: LOCAL_WORLD_SIZE"):
        discover({k: v for k, v in env.items() if k != "LOCAL_SIZE"}, use_mpi=False)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu-a[1-2],gpu-b5", ["gpu-a1", "gpu-a2", "gpu-b5"]),
    ("host1,host2", ["host1", "host2"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("single", ["single"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]", "node[5-2]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def test_slurm_basic_and_job_id_port():
    info = discover(slurm(SLURM_JOB_ID="123456"), use_mpi=False)
    assert info == RankInfo(3, 8, 3, 4, "node07", 10000 + 123456 % 20000, "slurm")


@pytest.mark.parametrize("var, value, node_id, local_world", [
    ("SLURM_NTASKS_PER_NODE", "4", "0", 4),
    ("SLURM_TASKS_PER_NODE", "4(x2)", "1", 4),
    ("SLURM_TASKS_PER_NODE", "3,1", "0", 3),
    ("SLURM_TASKS_PER_NODE", "3,1", "1", 1),
    ("SLURM_TASKS_PER_NODE", "2(x2),4", "2", 4),
])
def test_slurm_tasks_per_node_forms(var, value, node_id, local_world):
    env = slurm(SLURM_TASKS_PER_NODE=None, SLURM_LOCALID="0", SLURM_NODEID=node_id, SLURM_NTASKS="8")
    env[var] = value
    assert discover(env, use_mpi=False).local_world_size == local_world


def test_slurm_nodelist_fallback_and_ports():
    env = slurm(SLURM_JOB_NODELIST=None, SLURM_NODELIST="gpu-a[1-2],gpu-b5")
    info = discover(env, use_mpi=False)
    assert (info.master_addr, info.master_port) == ("gpu-a1", 29500)
    assert discover({**env, "SLURM_JOB_ID": "7", "MASTER_PORT": "1234"}, use_mpi=False).master_port == 1234


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert discover(env, use_mpi=False) == RankInfo(2, 4, 0, 2, "127.0.0.1", 29500, "mpi")


def test_mpich():
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MASTER_ADDR": "head", "MASTER_PORT": "4000"}
    assert discover(env, use_mpi=False) == RankInfo(1, 3, 1, 3, "head", 4000, "mpi")
    env.update(MPI_LOCALRANKID="0", MPI_LOCALNRANKS="1")
    assert discover(env, use_mpi=False).local_world_size == 1


def test_mpi4py_probe_is_lazy_and_used(monkeypatch):
    class Comm:
        def __init__(self, rank, size):
            self.r, self.s = rank, size
        def Get_rank(self): return self.r
        def Get_size(self): return self.s
        def Split_type(self, _kind): return Comm(1, 2)

    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(COMM_WORLD=Comm(3, 4), COMM_TYPE_SHARED=0)
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    pmix = {"PMIX_RANK": "3"}  # srun --mpi=pmix sets no OMPI_ / PMI_RANK: only mpi4py knows the world
    assert discover(pmix) == RankInfo(3, 4, 1, 2, "127.0.0.1", 29500, "mpi")
    assert discover(pmix, use_mpi=False).source == "single"
    assert discover({}).source == "single"  # no launcher's variable: mpi4py is not asked (it would init MPI)
    fake.MPI.COMM_WORLD = Comm(0, 1)
    assert discover(pmix).source == "single"


def test_single():
    assert discover({}, use_mpi=False) == RankInfo(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_torchrun_wins_over_slurm():
    info = discover({**slurm(), **TORCHRUN}, use_mpi=False)
    assert info.source == "torchrun" and info.rank == 5


def test_slurm_wins_over_mpi():
    env = {**slurm(), "PMI_RANK": "0", "PMI_SIZE": "1"}
    assert discover(env, use_mpi=False).source == "slurm"


@pytest.mark.parametrize("env, var", [
    ({**TORCHRUN, "RANK": "8"}, "RANK"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK"),
    ({**TORCHRUN, "WORLD_SIZE": "eight"}, "WORLD_SIZE"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, "LOCAL_RANK"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
    (slurm(SLURM_PROCID="8"), "SLURM_PROCID"),
    (slurm(SLURM_NTASKS="x"), "SLURM_NTASKS"),
    (slurm(SLURM_TASKS_PER_NODE="4(y2)"), "SLURM_TASKS_PER_NODE"),
    (slurm(SLURM_LOCALID="4"), "SLURM_LOCALID"),
    (slurm(SLURM_JOB_NODELIST=None), "SLURM_JOB_NODELIST"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_RANK"),
    ({"PMI_RANK": "1.5", "PMI_SIZE": "4"}, "PMI_RANK"),
])
def test_errors_name_the_variable(env, var):
    with pytest.raises(ValueError, match=var):
        discover(env, use_mpi=False)


@pytest.mark.parametrize("env", [TORCHRUN, slurm(SLURM_JOB_ID="42")])
def test_export_env_round_trip(env):
    info = discover(env, use_mpi=False)
    out = export_env(info, {})
    assert set(out) == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    assert discover(out, use_mpi=False) == dataclasses.replace(info, source="torchrun")


def test_export_env_defaults_to_os_environ(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    export_env(RankInfo(0, 1, 0, 1, "localhost", 12345, "single"))
    import os
    assert os.environ["MASTER_PORT"] == "12345" and os.environ["WORLD_SIZE"] == "1"


def test_default_backend(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == "nccl"
