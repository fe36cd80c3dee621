"""Budgets by convergence: a fit without a step limit runs until it converges (or stalls), and a limit that stops it
(steps or seconds) says so, naming it. The reference is the dense Laplace mode (``tests/reference.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from gpytorch_iterncgp import ConvergenceWarning, EPStrategy, LogitBernoulliLikelihood, NotConvergedWarning
from tests import reference
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood
from tests.test_exact_laplace import dense_prior


def _plain_cg_model(x, y, **options):
    """The paper's plain CG (no preconditioner), 5 iterations per Newton step, softmax over 5 classes at a
    learnt-scale outputscale of 20."""
    return IterNCGPModel(
        x, y, softmax_likelihood(5), lengthscale=0.5, outputscale=20.0, preconditioner_rank=0, **options
    )


@pytest.mark.slow  # about 19 s
def test_without_a_step_limit_plain_cg_runs_past_twenty_steps_to_the_exact_mode():
    """Plain CG at outputscale 20 (500 points of 5 classes in 3-D) needs more than 20 Newton steps (33 measured; 6
    with the default preconditioner): the default fit takes them without a warning and ends within outer_tol of the
    dense mode's Psi (measured 0.0023 nats below it); a limit of 20 stops it 0.29 nats below, with a
    ConvergenceWarning naming the limit."""
    x, y = multiclass_data(500, 5, dim=3, seed=11)
    model = _plain_cg_model(x, y)
    strategy = model.variational_strategy
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        warnings.simplefilter("error", NotConvergedWarning)
        report = strategy.fit()
    assert report.converged and report.steps > 20 and report.limit == "" and not report.stalled
    with torch.no_grad():
        kernel = dense_prior(model, x, x, 5)
    exact = reference.laplace_mode(kernel, torch.zeros(2500, dtype=x.dtype), y, "softmax", num_classes=5)
    # the stop rule: the full Newton step promises at most outer_tol = 1e-2 in Psi
    gap = exact.log_posteriors[-1] - report.log_posteriors[-1]
    assert 0 <= gap <= 1e-2
    limited = _plain_cg_model(x, y, max_newton_steps=20).variational_strategy
    with pytest.warns(ConvergenceWarning, match="Laplace stopped at max_newton_steps=20 before it converged"):
        stopped = limited.fit()
    assert stopped.steps == 20 and stopped.limit == "max_newton_steps" and not stopped.converged
    assert exact.log_posteriors[-1] - stopped.log_posteriors[-1] > 10 * gap


def test_a_time_limit_stops_after_a_step_and_is_named():
    x, y = binary_data(80, seed=2)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=EPStrategy, max_time=0.0)
    with pytest.warns(ConvergenceWarning, match=r"EP stopped at max_time=0 s before it converged.*Raise max_time"):
        report = model.variational_strategy.fit()
    assert report.steps == 1 and report.limit == "max_time"
    assert model.variational_strategy.fit(max_time=None).converged  # continued without the limit


@pytest.mark.parametrize("value", [-1.0, float("nan"), True, "60"])
def test_max_time_is_checked(value):
    x, y = binary_data(20, seed=2)
    with pytest.raises(ValueError, match="max_time"):
        IterNCGPModel(x, y, LogitBernoulliLikelihood(), max_time=value)
