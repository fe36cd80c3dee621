r"""The optimisers of :func:`~gpytorch_iterncgp.fit_mll`'s learning phase: SciPy's L-BFGS-B where the evidence is exact
(a deterministic value and gradient), Adam where it is estimated.

Neither builds a ``torch.optim`` optimiser: the first one a process builds imports ``torch._dynamo``
(``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``), seconds on a few cores, longer than the whole
learning of a small data set (``docs/design_notes.md``). L-BFGS is SciPy's, as scikit-learn's GP estimators and
BoTorch's ``fit_gpytorch_mll_scipy`` use it; Adam is torch's own update, its functional form
``torch.optim.adam.adam``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.optim.adam import adam

from .recipe import LearningRecipe, LearningStop

__all__ = ["Adam", "lbfgs", "optimise"]


def optimise(
    parameters: list[Tensor],
    evaluate: Callable[[], Tensor],
    backward: Callable[[Tensor], None],
    exact: bool,
    recipe: LearningRecipe,
) -> LearningStop:
    """Run L-BFGS (``exact``: :func:`lbfgs`) or ``recipe.optimizer_steps`` steps of :class:`Adam` at
    ``recipe.learning_rate`` on ``evaluate()``'s loss (``backward`` fills the parameters' gradients); return why it
    stopped."""
    if exact:
        return lbfgs(parameters, evaluate, backward, recipe)
    optimizer = Adam(parameters, float(recipe.learning_rate))
    for _ in range(recipe.optimizer_steps):
        for parameter in parameters:
            parameter.grad = None
        backward(evaluate())
        optimizer.step()
    return LearningStop.OPTIMIZER_STEPS


class Adam:
    r"""``torch.optim.Adam(parameters, lr=learning_rate)`` at its defaults (:math:`\beta_1 = 0.9`, :math:`\beta_2 =
    0.999`, :math:`\epsilon = 10^{-8}`, no weight decay, no AMSGrad; Kingma & Ba 2015, Algorithm 1), stepped by torch's
    functional ``torch.optim.adam.adam``: the same update, the same state (a float32 step count and the two moment
    estimates, made at a parameter's first step), without building a ``torch.optim`` optimiser (module docstring).
    A parameter whose gradient is ``None`` is left alone, as the optimiser leaves it.

    :param parameters: the tensors to optimise (leaves with ``requires_grad``).
    :param learning_rate: Adam's step size.
    """

    def __init__(self, parameters: list[Tensor], learning_rate: float):
        self.parameters, self.learning_rate = list(parameters), learning_rate
        self.state: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # id(parameter): step count, first, second moment

    def step(self) -> None:
        """One Adam step of every parameter that has a gradient."""
        stepped = [parameter for parameter in self.parameters if parameter.grad is not None]
        if not stepped:
            return
        for parameter in stepped:
            if id(parameter) not in self.state:
                moment = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                self.state[id(parameter)] = (torch.tensor(0.0), moment, moment.clone())
        steps, first, second = (list(part) for part in zip(*(self.state[id(p)] for p in stepped), strict=True))
        gradients = [parameter.grad for parameter in stepped]
        with torch.no_grad():
            adam(
                stepped,
                gradients,  # type: ignore[arg-type]  # (not None: filtered above)
                first,
                second,
                [],
                steps,
                amsgrad=False,
                beta1=0.9,
                beta2=0.999,
                lr=self.learning_rate,
                weight_decay=0.0,
                eps=1e-8,
                maximize=False,
            )


def lbfgs(
    parameters: list[Tensor], evaluate: Callable[[], Tensor], backward: Callable[[Tensor], None], recipe: LearningRecipe
) -> LearningStop:
    """SciPy's L-BFGS-B (no bounds; as BoTorch's ``fit_gpytorch_mll_scipy`` and scikit-learn's GP estimators) on
    ``evaluate()``'s loss over ``parameters``, flattened to one float64 vector: at most ``recipe.optimizer_steps``
    iterations and 1.25 evaluations per iteration (``torch.optim.LBFGS``'s default), stopping where an iteration
    changes the loss by at most ``recipe.loss_tol`` (``ftol``, relative to the loss where it exceeds 1) or the largest
    gradient entry falls below 1e-6 (``gtol``); not ``torch.optim.LBFGS`` (module docstring)."""
    from scipy.optimize import minimize

    sizes = [parameter.numel() for parameter in parameters]

    def loss_and_gradient(values: np.ndarray) -> tuple[float, np.ndarray]:
        with torch.no_grad():
            for parameter, chunk in zip(parameters, np.split(values, np.cumsum(sizes)[:-1]), strict=True):
                parameter.copy_(torch.from_numpy(chunk).reshape(parameter.shape))
                parameter.grad = None
        loss = evaluate()
        backward(loss)
        gradient = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
        return float(loss.detach()), torch.cat([g.reshape(-1) for g in gradient]).double().cpu().numpy()

    start = torch.cat([parameter.detach().reshape(-1) for parameter in parameters]).double().cpu().numpy()
    steps = recipe.optimizer_steps
    options = dict(maxiter=steps, maxfun=max(1, math.ceil(1.25 * steps)), ftol=float(recipe.loss_tol), gtol=1e-6)
    result = minimize(loss_and_gradient, start, jac=True, method="L-BFGS-B", options=options)
    return LearningStop.OPTIMIZER_STEPS if result.nit >= steps else LearningStop.CONVERGED
