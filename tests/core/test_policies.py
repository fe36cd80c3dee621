"""IterGP's policies (``gpytorch_iterncgp.core.policies``): the actions each one takes, against the sequence written
out by hand (the method of conjugate gradients: the residual; unit vectors: a seeded permutation of the data points,
each point's latent coordinates in turn), their state, and ``make_policy``. The argument checks of
``UnitVectorPolicy`` are in ``tests/test_validation.py``."""

from __future__ import annotations

import pytest
import torch

from gpytorch_iterncgp import ConjugateGradientPolicy, Policy, UnitVectorPolicy
from gpytorch_iterncgp.core.policies import make_policy


def _coordinates(policy: Policy, size: int, steps: int) -> list[int]:
    """The index of the one non-zero entry (equal to 1) of each of ``steps`` actions on residuals of ``size``."""
    taken = []
    for _ in range(steps):
        action = policy(torch.randn(size, dtype=torch.float64))
        (index,) = action.nonzero()[:, 0].tolist()
        assert action[index] == 1 and action.shape == (size,)
        taken.append(index)
    return taken


def test_conjugate_gradient_action_is_the_residual():
    policy = ConjugateGradientPolicy()
    policy.prepare(5, 1, False)
    residual = torch.randn(5, dtype=torch.float64)
    assert policy(residual) is residual
    assert policy.state() == {}


@pytest.mark.parametrize(("num_latents", "zero_sum"), [(1, False), (3, False), (3, True)])
def test_unit_vectors_visit_a_seeded_permutation_point_by_point(num_latents, zero_sum):
    """Point ``n`` of ``torch.randperm(N)`` (CPU generator seeded by ``seed``) gives the coordinates ``n C + c``,
    ``c < C`` (``c < C - 1`` for zero-sum actions, whose last class is redundant); after all of them it starts over."""
    num_data, seed = 7, 4
    order = torch.randperm(num_data, generator=torch.Generator().manual_seed(seed)).tolist()
    used = num_latents - 1 if zero_sum else num_latents
    expected = [n * num_latents + c for n in order for c in range(used)]
    policy = UnitVectorPolicy(seed=seed)
    policy.prepare(num_data, num_latents, zero_sum)
    assert _coordinates(policy, num_data * num_latents, 2 * len(expected)) == expected + expected
    assert sorted(expected) == sorted(set(expected))  # distinct: a basis of the coordinates it visits


def test_unit_vectors_follow_a_given_order_and_skip_missing_outputs():
    policy = UnitVectorPolicy(order=[4, 0, 2])
    observed = torch.ones(10, dtype=torch.bool)
    observed[[1, 8]] = False  # point 0's second output and point 4's first are missing
    policy.prepare(5, 2, False, observed=observed)
    assert _coordinates(policy, 10, 5) == [9, 0, 4, 5, 9]


def test_unit_vector_state_resumes_the_sequence_and_reset_restarts_it():
    first = UnitVectorPolicy(seed=2)
    first.prepare(6, 1, False)
    whole = _coordinates(first, 6, 9)
    resumed, restarted = UnitVectorPolicy(seed=2), UnitVectorPolicy(seed=2)
    resumed.prepare(6, 1, False)
    restarted.prepare(6, 1, False)
    _coordinates(restarted, 6, 4)
    assert _coordinates(resumed, 6, 4) == whole[:4]
    saved = resumed.state()
    assert saved == {"position": 4}
    loaded = UnitVectorPolicy(seed=2)
    loaded.prepare(6, 1, False)
    loaded.load_state({"position": torch.tensor(saved["position"])})  # as a saved state_dict holds it
    assert _coordinates(loaded, 6, 5) == whole[4:]
    restarted.reset()
    assert _coordinates(restarted, 6, 3) == whole[:3]


def test_unit_vector_policy_must_be_prepared():
    with pytest.raises(RuntimeError, match="prepare"):
        UnitVectorPolicy()(torch.zeros(3))


def test_make_policy():
    assert isinstance(make_policy("CG"), ConjugateGradientPolicy)
    unit = make_policy("unit", seed=3)
    assert isinstance(unit, UnitVectorPolicy) and unit.seed == 3
    mine = ConjugateGradientPolicy()
    assert make_policy(mine) is mine
    with pytest.raises(ValueError, match="Unknown policy 'lanczos'"):
        make_policy("lanczos")
    with pytest.raises(TypeError, match="policy must be"):
        make_policy(3)  # type: ignore[arg-type]
