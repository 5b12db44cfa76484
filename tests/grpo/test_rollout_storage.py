"""What the rollout stores (grpo/rollout.py): the minibatch handed to the loss is a view of the trajectory where the
rows are a contiguous range (no copy)."""

import torch

from jagg_scale.grpo import sample_sde
from jagg_scale.grpo.rollout import row_index


def _trajectory(n=6, steps=3, guidance=1.0):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g) * 0.3

    def model(x, s, cond):
        return torch.tanh(x @ w) * (1 + s.view(-1, 1, 1, 1))

    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    cond = (None, None) if guidance != 1.0 else None
    noise = torch.randn(n, 2, 4, 4, generator=g)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return sample_sde(model, cond, noise, sigmas, noise_level=0.7, generator=gens, guidance=guidance,
                      ref_velocity_fn=lambda x, s, c: model(x, s, c) + 0.1)


def test_a_contiguous_minibatch_is_a_view_of_the_trajectory_and_a_permuted_one_a_copy():
    traj = _trajectory()
    adv, mask = torch.linspace(-1, 1, 6), torch.ones(6, dtype=torch.bool)
    whole = traj.step_batch(torch.arange(6), adv, mask)
    second = traj.step_batch(torch.arange(3, 6), adv, mask)
    for batch, first in ((whole, 0), (second, 3)):
        for name in ("latents", "velocities", "log_probs", "ref_velocities"):
            t, stored = getattr(batch, name), getattr(traj, name)
            assert t.data_ptr() == stored[:, first].data_ptr(), name  # the same memory: no copy
            assert torch.equal(t, stored[:, first:first + t.shape[1]])
    permuted = traj.step_batch(torch.tensor([4, 1, 2]), adv, mask)
    assert permuted.latents.data_ptr() != traj.latents.data_ptr()
    assert torch.equal(permuted.velocities, traj.velocities[:, [4, 1, 2]])
    assert torch.equal(permuted.advantages, adv[[4, 1, 2]])


def test_row_index_is_a_slice_only_for_an_ascending_contiguous_host_range():
    assert row_index(torch.arange(2, 5), torch.device("cpu")) == slice(2, 5)
    for index in (torch.tensor([0, 2]), torch.tensor([1, 0]), torch.tensor([], dtype=torch.long)):
        assert torch.equal(row_index(index, torch.device("cpu")), index)
