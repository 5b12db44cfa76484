"""Which device and which thread, on a CPU machine: the CUDA calls are replaced by recording fakes.

- a reward's `device: auto` is the process's current CUDA device with its index (cuda:k on rank k), never a bare
  "cuda", which a worker thread would read as cuda:0;
- the background reward thread sets the trainer's device, scores on a stream of its own once the producer's
  event says the chunk is written, and hands back host scores after its stream is done;
- a node with more local ranks than visible GPUs is refused, naming LOCAL_RANK / LOCAL_WORLD_SIZE and the count.
(Failing together across ranks: test_rank_failures.py; FSDP2's bf16 inputs: test_engines.py, test_distributed.py.)
"""

import contextlib
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from jagg_scale.parallel import dist as dist_module
from jagg_scale.parallel.dist import init_distributed
from jagg_scale.parallel.ranks import RankInfo
from jagg_scale.rewards import Reward, RewardOutput, base, clip, imagenet
from jagg_scale.rewards.multi import ChunkScorer, RewardMix

ROOT = Path(__file__).resolve().parents[2]
# what the refusal names: the variables and the count (its type, TooManyLocalRanksError, is a RuntimeError)
REFUSED = r"LOCAL_RANK={} of LOCAL_WORLD_SIZE={}.*device_count\(\)=4"


@pytest.fixture
def gpus(monkeypatch):
    """A CPU machine that claims 4 GPUs, its current device cuda:3 (what init_distributed sets on local rank 3)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


# ------------------------------------------------------------------------------------------ "auto"


def test_auto_is_the_current_cuda_device_with_its_index(gpus):
    resolve = clip.resolve_device  # what every CLIP-family reward resolves its device option with
    assert resolve("auto") == torch.device("cuda", 3)
    assert resolve("cpu") == torch.device("cpu") and resolve("cuda:1") == torch.device("cuda", 1)
    assert resolve is getattr(base, "resolve_device", None)  # one rule for every reward


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert clip.resolve_device("auto") == torch.device("cpu")


def test_imagenet_auto_places_its_classifier_on_the_current_device(gpus, monkeypatch):
    placed = []

    class Spy(nn.Module):
        def to(self, *args, **kwargs):
            placed.append(args[0])
            return self

    monkeypatch.setattr(imagenet, "load_model", lambda path=None: Spy())
    reward = imagenet.ImagenetClass(device="auto")
    assert reward.device == torch.device("cuda", 3) and placed == [torch.device("cuda", 3)]


# ------------------------------------------------------------------------------------------ the reward thread


class _Brightness(Reward):
    name = "brightness"

    def __call__(self, images, prompts, metadata):
        return RewardOutput(images.mean(dim=(1, 2, 3)))


class _FakeCuda:
    """torch.cuda's device, stream and event calls, each logged as (what, thread name, ...)."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        self.current = threading.local()  # the stream a `with torch.cuda.stream(s)` made current, per thread
        fake = self

        class Event:
            def record(self, stream):
                fake.note("record", self, stream)

        class Stream:
            def __init__(self, device):
                fake.note("new_stream", device)

            def wait_event(self, event):
                fake.note("wait", self, event)

            def synchronize(self):
                fake.note("synchronize", self)

        @contextlib.contextmanager
        def stream(s):
            self.current.stream = s
            try:
                yield
            finally:
                self.current.stream = None

        for name, value in {"set_device": lambda i: self.note("set_device", i), "Event": Event, "Stream": Stream,
                            "current_stream": lambda i: f"default stream of cuda:{i}", "stream": stream}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def note(self, what, *args):
        self.log.append((what, threading.current_thread().name, *args))

    def decode(self, latents):
        self.note("decode", getattr(self.current, "stream", None), latents)
        return latents


def test_the_reward_thread_scores_on_the_trainers_device_and_its_own_stream(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    scorer = ChunkScorer(RewardMix([("b", 1.0, _Brightness())]), cuda.decode, background=True,
                         device=torch.device("cuda", 3))
    chunks = [torch.full((2, 3, 4, 4), v) for v in (0.25, 0.75)]
    for chunk in chunks:
        scorer.add(chunk, ["p", "q"], [{}, {}])
    parts = scorer.finish()
    assert parts["b"].scores.tolist() == [0.25, 0.25, 0.75, 0.75] and parts["b"].scores.device.type == "cpu"

    main = threading.current_thread().name
    worker = {entry[1] for entry in cuda.log} - {main}
    assert len(worker) == 1 and worker.pop().startswith("reward")
    by_thread = lambda who: [e for e in cuda.log if (e[1] == main) == (who == "main")]
    # the producer: one event per chunk, on its current stream of the trainer's device
    records = by_thread("main")
    assert [(e[0], e[3]) for e in records] == [("record", "default stream of cuda:3")] * 2
    # the worker: the trainer's device first, then its own stream; per chunk, wait for that chunk's event, decode
    # and score on the worker stream, synchronize before the scores go back
    work = by_thread("worker")
    assert [e[:3] for e in work[:2]] == [("set_device", work[0][1], 3), ("new_stream", work[0][1], 3)]
    stream = next(e[2] for e in work if e[0] == "wait")
    for i, chunk in enumerate(chunks):
        wait, decode, sync = work[2 + 3 * i: 5 + 3 * i]
        assert wait[0] == "wait" and wait[2] is stream and wait[3] is records[i][2]
        assert decode[0] == "decode" and decode[2] is stream and decode[3] is chunk
        assert sync[0] == "synchronize" and sync[2] is stream


def test_on_the_cpu_or_inline_no_cuda_call_is_made(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    for device, background in ((torch.device("cpu"), True), (None, True), (torch.device("cuda", 3), False)):
        scorer = ChunkScorer(RewardMix([("b", 1.0, _Brightness())]), cuda.decode, background=background,
                             device=device)
        scorer.add(torch.ones(2, 3, 4, 4), ["p", "q"], [{}, {}])
        assert scorer.finish()["b"].scores.tolist() == [1.0, 1.0]
    assert [e[0] for e in cuda.log] == ["decode"] * 3 and all(e[2] is None for e in cuda.log)


# ------------------------------------------------------------------------------------------ local ranks


def test_a_local_rank_takes_its_own_gpu(gpus):
    from jagg_scale.parallel.dist import local_device_index

    assert [local_device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert local_device_index(1, 2) == 1


@pytest.mark.parametrize("local_rank, local_world_size", [(4, 8), (1, 8), (4, 4)])
def test_more_local_ranks_than_gpus_is_refused(gpus, local_rank, local_world_size):
    from jagg_scale.parallel.dist import TooManyLocalRanksError, local_device_index

    with pytest.raises(TooManyLocalRanksError, match=REFUSED.format(local_rank, local_world_size)):
        local_device_index(local_rank, local_world_size)


def test_init_distributed_refuses_before_taking_a_gpu(gpus, monkeypatch):
    taken = []
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    monkeypatch.setattr(dist_module, "discover", lambda: RankInfo(5, 8, 5, 8, "127.0.0.1", 29500, "torchrun"))
    with pytest.raises(RuntimeError, match=REFUSED.format(5, 8)):
        init_distributed("cuda")
    assert taken == []  # rank 5 would have been wrapped onto GPU 1, beside rank 1


def test_jagg_eval_builds_its_reward_on_the_ranks_device(monkeypatch):
    """jagg-eval under torchrun: a reward's "auto" device, resolved when the reward is built, is the rank's GPU
    (cuda:2 on local rank 2), not the process's first one (built before init_distributed set the rank's device,
    every rank's reward model landed on cuda:0)."""
    from jagg_scale.parallel.dist import DistContext
    from jagg_scale.rewards import multi
    from jagg_scale.train import evaluate, load_config

    current = [0]  # a 4-GPU machine whose current device is what torch.cuda.set_device last set
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: current.__setitem__(0, int(index)))
    seen = []

    class Stop(Exception):
        pass

    def build(reward_cfg):  # what a reward with device "auto" gets when it is built
        seen.append(base.resolve_device("auto"))
        raise Stop

    def init(device, **kw):  # the rank's device, as init_distributed sets it on local rank 2
        torch.cuda.set_device(2)
        return DistContext()

    monkeypatch.setattr(dist_module, "init_distributed", init)
    monkeypatch.setattr(multi, "build_reward_mix", build)
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), ["eval.prompts=[a cat]"])
    with pytest.raises(Stop):
        evaluate.evaluate_checkpoint(cfg, None, None)
    assert seen == [torch.device("cuda", 2)]


def test_a_gpu_bound_per_task_is_each_ranks_own_and_a_shared_one_is_refused(monkeypatch):
    """Direct srun with a GPU per task (--gpus-per-task=1): every process sees one GPU as cuda:0, whatever its local
    rank; once the group is up the ranks of a host compare their GPUs' UUIDs, and two on the same physical GPU (one
    CUDA_VISIBLE_DEVICES for all, not a binding) are refused on every rank, naming them."""
    import types

    from jagg_scale.parallel.dist import TooManyLocalRanksError, _check_one_gpu_each, local_device_index

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [local_device_index(r, 4) for r in range(4)] == [0, 0, 0, 0]
    info = RankInfo(1, 4, 1, 2, "127.0.0.1", 29500, "slurm")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(uuid="GPU-b"))

    def gathered(rows):
        def all_gather_object(out, obj):
            assert obj[1] == "GPU-b"  # this rank's own GPU goes in
            out[:] = rows
        return all_gather_object

    own = [("n1", "GPU-a", "0"), ("n1", "GPU-b", "1"), ("n2", "GPU-a", "0"), ("n2", "GPU-b", "1")]
    monkeypatch.setattr(dist_module.dist, "all_gather_object", gathered(own))
    _check_one_gpu_each(info, torch.device("cuda", 0))  # two hosts, two GPUs each, one per rank: fine
    shared = [("n1", "GPU-a", "0"), ("n1", "GPU-a", "0"), ("n2", "GPU-a", "0"), ("n2", "GPU-b", "1")]
    monkeypatch.setattr(dist_module.dist, "all_gather_object", gathered(shared))
    with pytest.raises(TooManyLocalRanksError, match=r"ranks \[0, 1\] on n1 all see one GPU, the same one"):
        _check_one_gpu_each(info, torch.device("cuda", 0))
