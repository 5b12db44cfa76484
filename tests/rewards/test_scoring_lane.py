"""The reward's worker thread is the run's (rewards/multi.py ScoringLane), and a chunk past reward.deadline_s does not
run on into the update: queued ones are cancelled, the running one told to stop (base.cancelled, which remote and
vlm_judge read before each request) and awaited; one that will not stop is abandoned with its thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hang_guard import WAIT_S
from jagg_scale.rewards import Reward
from jagg_scale.rewards import multi
from jagg_scale.rewards.base import cancellable, cancelled
from jagg_scale.rewards.multi import ChunkScorer, RewardMix, ScoringLane
from jagg_scale.rewards.remote import RemoteReward, RemoteRewardError


class Recording(Reward):
    """Scores 1.0; notes the thread each call ran on, and, when told to, polls cancelled() for up to WAIT_S (as a
    reward waiting on a server between its requests) or blocks on `release` ignoring it (a reward with no timeout)."""

    def __init__(self, mode: str = "quick"):
        self.mode, self.threads, self.calls = mode, [], 0
        self.stopped, self.release = threading.Event(), threading.Event()

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        self.threads.append(threading.get_ident())
        if self.mode == "polls":
            end = time.monotonic() + WAIT_S
            while not cancelled() and time.monotonic() < end:
                time.sleep(0.01)
            self.stopped.set()
        elif self.mode == "blocks":
            self.release.wait(WAIT_S)
        return torch.ones(len(prompts))


def scorer(reward, lane):
    return ChunkScorer(RewardMix([("r", 1.0, reward)]), lambda x: x.clamp(0, 1), background=True, lane=lane)


def chunk(s, n=2):
    s.add(torch.rand(n, 3, 4, 4), ["p"] * n, [{}] * n)


def test_every_step_scores_on_the_runs_one_thread():
    lane, reward = ScoringLane(None), Recording()
    try:
        for _ in range(3):  # three steps
            s = scorer(reward, lane)
            chunk(s)
            chunk(s)
            assert s.finish(deadline_s=WAIT_S)["r"].valid.all()
        assert len(reward.threads) == 6 and len(set(reward.threads)) == 1
    finally:
        lane.close()


def test_a_late_chunk_is_told_to_stop_and_awaited_and_the_queued_ones_never_run():
    lane, reward = ScoringLane(None), Recording("polls")
    try:
        s = scorer(reward, lane)
        chunk(s)
        chunk(s)  # queued behind the first: cancelled, never run
        t0 = time.monotonic()
        parts = s.finish(deadline_s=0.2)
        assert reward.stopped.is_set() and time.monotonic() - t0 < WAIT_S / 2  # stopped, not run out
        assert s.late == 4 and not parts["r"].valid.any() and reward.calls == 1
        reward.mode = "quick"
        nxt = scorer(reward, lane)  # the next step: the same thread, free
        chunk(nxt)
        assert nxt.finish(deadline_s=WAIT_S)["r"].valid.all() and len(set(reward.threads)) == 1
    finally:
        lane.close()


def test_a_chunk_that_will_not_stop_is_abandoned_with_its_thread(monkeypatch):
    monkeypatch.setattr(multi, "GRACE_S", 0.3)
    lane, reward = ScoringLane(None), Recording("blocks")
    try:
        s = scorer(reward, lane)
        chunk(s)
        t0 = time.monotonic()
        s.finish(deadline_s=0.1)
        assert s.late == 2 and time.monotonic() - t0 < WAIT_S / 2
        reward.mode = "quick"
        nxt = scorer(reward, lane)
        chunk(nxt)
        assert nxt.finish(deadline_s=WAIT_S)["r"].valid.all()
        assert reward.threads[0] != reward.threads[-1]  # a new thread while the old one still waits
    finally:
        reward.release.set()
        lane.close()


def test_a_remote_reward_told_to_stop_sends_nothing_more():
    r = RemoteReward(url="http://127.0.0.1:9", reward="x", retries=5, backoff_s=0.0)
    stop = threading.Event()
    stop.set()
    with cancellable(stop), pytest.raises(RemoteRewardError, match="given up after 0 attempt"):
        r.poster.post(b"{}")
    assert not cancelled()  # only inside the scoring it was set for


def test_a_judges_rows_in_flight_stop_asking_once_their_chunk_is_told_to_stop():
    """vlm_judge sends rows from threads of its own: the chunk's cancel event reaches them, and no request is sent
    (a listening socket counts the connections: none with the event set, one a row without it)."""
    import socket

    from jagg_scale.rewards import build_reward

    srv, accepted = socket.create_server(("127.0.0.1", 0)), []

    def accept():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(conn)  # held open, never answered: the row times out

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/v1"
    judge = build_reward("vlm_judge", url=url, model="m", retries=0, timeout_s=0.3, concurrency=4, resize=None)
    try:
        stop = threading.Event()
        stop.set()
        with cancellable(stop):
            out = judge(torch.rand(4, 3, 8, 8), ["p"] * 4, [{}] * 4)
        assert out.info["judge_failed"] == 4 and accepted == []
        out = judge(torch.rand(4, 3, 8, 8), ["p"] * 4, [{}] * 4)  # not told to stop: each row asks, and times out
        assert out.info["judge_failed"] == 4 and len(accepted) == 4
    finally:
        srv.close()
        for conn in accepted:
            conn.close()


def test_this_ranks_preemption_signal_ends_the_reward_wait_and_stops_the_chunks():
    """finish(stop=): a reward that would run for WAIT_S (it polls cancelled()) under a deadline of WAIT_S; the
    rank's signal arrives 0.3 s in: the wait ends within a poll, every row is masked, the running chunk is told to
    stop and the queued one never runs. Without the signal the same wait would have lasted the reward's WAIT_S."""
    lane, reward = ScoringLane(None), Recording("polls")
    signalled = threading.Timer(0.3, lambda: None)
    try:
        s = scorer(reward, lane)
        chunk(s)
        chunk(s)
        signalled.start()
        t0 = time.monotonic()
        parts = s.finish(deadline_s=WAIT_S, stop=lambda: not signalled.is_alive())
        waited = time.monotonic() - t0
        assert 0.25 < waited < 0.3 + 5 * multi.STOP_POLL_S
        assert s.late == 4 and not parts["r"].valid.any()
        assert reward.stopped.wait(WAIT_S) and reward.calls == 1  # told to stop; the queued chunk cancelled
    finally:
        lane.close()
