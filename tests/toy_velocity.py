"""Toy velocity models shared by the knot_backward tests (tests/jagg/test_backward.py, tests/jagg/test_plans.py).

Latents are [B, 3, 2, 2] (D = 12 flattened), sigma [B], conditioning [B, 4].
"""

import torch
from torch import nn

D = 12


class LinearVelocity(nn.Module):
    """v = A x + b s + C c: affine in (x, s), so J is affine in (x, s) and JAGG (any knot plan) must be exact on
    collinear inputs."""

    def __init__(self):
        super().__init__()
        self.A = nn.Linear(D, D)
        self.b = nn.Parameter(torch.randn(D))
        self.C = nn.Linear(4, D, bias=False)

    def forward(self, x, s, c):
        return (self.A(x.flatten(1)) + s[:, None] * self.b + self.C(c)).view_as(x)


class MLPVelocity(nn.Module):
    """Nonlinear in x, s and the conditioning."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D + 1 + 4, 32), nn.Tanh(), nn.Linear(32, D))

    def forward(self, x, s, c):
        return self.net(torch.cat([x.flatten(1), s[:, None], c], dim=1)).view_as(x)


class CountingModel(nn.Module):
    """Records (rows, grad enabled) of every forward and counts backward passes through the model."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.forwards = []
        self.backwards = 0

    @property
    def grad_rows(self) -> list[int]:
        """Rows of every forward with grad."""
        return [rows for rows, grad in self.forwards if grad]

    def forward(self, x, s, c):
        self.forwards.append((x.shape[0], torch.is_grad_enabled()))
        out = self.inner(x, s, c)
        if out.requires_grad:
            out.register_hook(self._count)
        return out

    def _count(self, grad):
        self.backwards += 1
        return grad
