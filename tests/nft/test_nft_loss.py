"""DiffusionNFT's loss (jagg_scale/nft/loss.py) against the official code's arithmetic on fixed tensors: value and
gradient, several beta and optimality values, with the KL term."""

import pytest
import torch

from jagg_scale.nft import NFTBatch, NFTStepLoss, optimality


def _official(x0, xt, t, forward_prediction, old_prediction, ref_forward_prediction, advantages, beta, kl_beta,
              adv_clip_max):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py, one timestep's loss, its arithmetic transcribed (adv_mode
    "all"): the advantage clip and its map to r, the implicit positive and negative predictions, the adaptive
    weighting, the policy loss times adv_clip_max, and config.train.beta times the velocity KL."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (torch.abs(x0_prediction.double() - x0.double())
                         .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (torch.abs(negative_x0_prediction.double() - x0.double())
                                  .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=tuple(range(1, x0.ndim)))
    return policy_loss + kl_beta * torch.mean(kl_div_loss)


@pytest.mark.parametrize("beta,kl_beta", [(1.0, 1e-4), (0.1, 1e-4), (1.0, 0.0), (0.5, 0.3)])
def test_the_loss_and_its_gradient_are_diffusion_nfts(beta, kl_beta):
    g = torch.Generator().manual_seed(0)
    B, shape = 6, (6, 4, 8, 8)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.rand(B, generator=g) * 0.9 + 0.05
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    old = (noise - x0) + 0.1 * torch.randn(shape, generator=g)
    ref = (noise - x0) + 0.1 * torch.randn(shape, generator=g)
    adv = torch.tensor([-7.0, -2.0, -0.3, 0.0, 1.5, 9.0])  # beyond the clip on both sides
    v_official = (old + 0.05 * torch.randn(shape, generator=g)).requires_grad_(True)
    want = _official(x0, xt, t, v_official, old, ref, adv, beta, kl_beta, 5.0)
    (want_grad,) = torch.autograd.grad(want, v_official)

    batch = NFTBatch(clean=x0, t=t[None], noised=xt[None], old=old[None], optimality=optimality(adv, 5.0),
                     mask=torch.ones(B, dtype=torch.bool), ref=ref[None] if kl_beta > 0 else None)
    v = v_official.detach().clone().requires_grad_(True)
    got = NFTStepLoss(beta=beta, kl_beta=kl_beta, adv_clip_max=5.0)(batch, 0, v)
    (got_grad,) = torch.autograd.grad(got, v)
    # the official weights are float64 and promote its loss to float64; ours stays float32 (the stack's losses are)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-9)
    assert got_grad.abs().max() > 0


def test_optimality_maps_the_clipped_advantage_onto_0_1():
    r = optimality(torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 10.0]), 5.0)
    assert r.tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]


def test_masked_rows_count_for_nothing_and_the_denominator_is_the_minibatchs():
    g = torch.Generator().manual_seed(1)
    x0, e = torch.randn(4, 2, 4, 4, generator=g), torch.randn(4, 2, 4, 4, generator=g)
    t = torch.full((1, 4), 0.5)
    batch = NFTBatch(clean=x0, t=t, noised=(0.5 * x0 + 0.5 * e)[None], old=(e - x0)[None],
                     optimality=torch.tensor([1.0, 0.0, 0.5, 0.2]), mask=torch.tensor([True, True, False, False]))
    v = (e - x0) + 0.1 * torch.randn(4, 2, 4, 4, generator=g)
    loss = NFTStepLoss(kl_beta=0.0)
    full = loss(batch, 0, v)
    first_two = NFTStepLoss(kl_beta=0.0)(batch.rows(slice(0, 2)), 0, v[:2])
    torch.testing.assert_close(full, first_two)  # the masked rows neither add nor count
    half = NFTStepLoss(kl_beta=0.0, denominator=4.0)(batch, 0, v)  # 2 valid rows here, 4 over all ranks
    torch.testing.assert_close(half, full / 2)


def _official_r(advantages, adv_clip_max, adv_mode):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py:910-929 transcribed: the clip, the adv_mode chain, the map to r."""
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        advantages_clip = torch.clamp(advantages_clip, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        advantages_clip = torch.clamp(advantages_clip, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        advantages_clip = torch.where(advantages_clip > 0, torch.ones_like(advantages_clip),
                                      torch.zeros_like(advantages_clip))
    elif adv_mode == "binary":
        advantages_clip = torch.sign(advantages_clip)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    return torch.clamp(normalized_advantages_clip, 0, 1)


@pytest.mark.parametrize("adv_mode", ["all", "positive_only", "negative_only", "one_only", "binary"])
@pytest.mark.parametrize("adv_clip_max", [5.0, 1.5])
def test_each_adv_mode_is_diffusion_nfts(adv_mode, adv_clip_max):
    """nft.adv_mode's optimality r equals DiffusionNFT's on random advantages (beyond the clip on both sides, exact
    zeros), and each mode but all changes r somewhere."""
    adv = torch.cat([torch.randn(200, generator=torch.Generator().manual_seed(2)) * 3.0, torch.zeros(3)])
    got = optimality(adv, adv_clip_max, adv_mode)
    assert torch.equal(got, _official_r(adv, adv_clip_max, adv_mode))
    assert (adv_mode == "all") == torch.equal(got, optimality(adv, adv_clip_max))
    assert got.min() >= 0 and got.max() <= 1
