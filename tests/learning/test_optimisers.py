"""The learning phase's optimisers against the ones they stand in for."""

import pytest
import torch

from gpytorch_iterncgp.learning.optimisers import Adam


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_steps_as_torch_optim_adam_does(dtype):
    """``Adam`` (torch's functional update) moves the parameters exactly as ``torch.optim.Adam`` at the same learning
    rate, step for step, including a parameter that has no gradient at some steps (both leave it alone then)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(3,), (2, 2), (1,)]
    ours = [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]
    theirs = [parameter.detach().clone().requires_grad_() for parameter in ours]
    start = [parameter.detach().clone() for parameter in ours]
    optimiser, reference = Adam(ours, 0.1), torch.optim.Adam(theirs, lr=0.1)
    for step in range(30):
        for parameters in (ours, theirs):
            for parameter in parameters:
                parameter.grad = None
            loss = parameters[0].pow(4).sum() + parameters[1].sin().sum()
            if step % 3:  # the third parameter gets a gradient on two steps of three
                loss = loss + parameters[2].square().sum()
            loss.backward()
        optimiser.step()
        reference.step()
        for mine, expected in zip(ours, theirs, strict=True):
            assert torch.equal(mine, expected)
    assert all(not torch.equal(parameter, first) for parameter, first in zip(ours, start, strict=True))  # they moved
