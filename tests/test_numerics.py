"""The rounding model behind every tolerance (tests/numerics.py) holds for sums of random fp32
terms in different orders, and is far tighter than a single wrong term."""

import pytest
import torch

from tests.numerics import rounding


@pytest.mark.parametrize("n", [10, 1_000, 100_000])
def test_rounding_bounds_sums_in_other_orders(n):
    g = torch.Generator().manual_seed(n)
    for scale in (1e-3, 1.0, 7.0):
        x = scale * torch.randn(n, generator=g)
        exact = x.double().sum().item()
        orders = {
            "sequential": x.cumsum(0)[-1].item(),
            "reversed": x.flip(0).cumsum(0)[-1].item(),
            "pairwise": x.sum().item(),
            "blocked": x.view(-1, 10).sum(1).cumsum(0)[-1].item() if n % 10 == 0 else x.sum().item(),
        }
        tolerance = rounding(x.abs().max().item(), n)
        for name, value in orders.items():
            assert abs(value - exact) < tolerance, (name, n, scale)
            for other in orders.values():
                assert abs(value - other) < tolerance, (name, n, scale)
        # dropping one term of the sum would be seen
        assert tolerance < x.abs().min().item() or tolerance < x.abs().median().item()


def test_rounding_refuses_nonsense():
    with pytest.raises(ValueError, match="terms"):
        rounding(1.0, 0)
