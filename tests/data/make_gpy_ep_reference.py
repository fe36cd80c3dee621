r"""Writes ``tests/data/gpy_ep_probit.json``: GPy's expectation propagation (EP) on two binary probit problems.

The numbers are a cross-check from outside the project for ``tests/reference_ep.py`` (and, later, the package's own
EP); ``tests/ep/test_gpy_reference.py`` reads them without importing GPy. GPy is not a project dependency. To regenerate
the JSON, from the repository root::

    python3.11 -m venv /tmp/gpyenv && /tmp/gpyenv/bin/pip install GPy
    /tmp/gpyenv/bin/python tests/data/make_gpy_ep_reference.py

Written with GPy 1.15.0, paramz 0.10.0, numpy 2.4.6, scipy 1.17.1 on CPython 3.11.7; the newest GPy from the index
installed and imported with numpy 2, nothing pinned. The output is deterministic: the data come from
``numpy.random.RandomState`` and every EP run seeds numpy's global generator first (GPy's sequential EP visits the
sites in ``np.random.permutation`` order).

GPy settings. ``GPy.core.GP`` with ``GPy.likelihoods.Bernoulli()`` (probit link, labels in {0, 1}), zero mean
function, ``GPy.kern.RBF`` (:math:`k = \sigma^2 \exp(-r^2 / (2\ell^2))`, one lengthscale) at the fixed
hyperparameters below (never optimised), and
``GPy.inference.latent_function_inference.expectation_propagation.EP`` with

* ``parallel_updates=False``: sequential EP, rank-one updates of :math:`\Sigma` site by site (R&W Alg. 3.5) and a
  fresh Cholesky recomputation after each sweep, sites visited in a random permutation each sweep;
* ``eta=1.0`` (no fractional/power EP), ``delta=1.0`` (no damping);
* ``epsilon=1e-28``: GPy stops when both mean-squared changes of the site parameters over a sweep,
  ``mean((tau - tau_old)**2)`` and ``mean((v - v_old)**2)``, are below ``epsilon`` (root-mean-square change
  ~1e-14), ``max_iters=1000`` sweeps; the sweeps used and the final mean-squared changes are recorded;
* ``ep_mode="nested"``: EP is rerun at every parameter change (the default ``"alternated"`` keeps the old sites when
  the hyperparameters change, which would make the finite differences below sites-fixed ones).

Besides, for each problem, a run with ``parallel_updates=True, delta=0.5`` (every site from the same posterior, damped
by one half) records its log marginal likelihood and sites (same fixed point, a second GPy code path).

Recorded (all in GPy's own notation mapped to R&W's):

* ``log_marginal_likelihood``: ``model.log_likelihood()``, the EP approximation :math:`\log Z_{EP}` (R&W eq. 3.65);
* ``site_precision`` / ``site_natural_mean``: GPy's ``ga_approx.tau`` / ``ga_approx.v``, R&W's
  :math:`\tilde\tau` / :math:`\tilde\nu` (site :math:`\propto \exp(\tilde\nu f - \tilde\tau f^2 / 2)`);
* ``cavity_precision`` / ``cavity_natural_mean``: GPy's ``cav_params.tau`` / ``cav_params.v`` as left by the last
  sweep (each computed mid-sweep, before its own site update; equal to the end-of-run cavities only up to the
  convergence tolerance);
* ``train_latent_mean`` / ``train_latent_variance`` and ``test_latent_mean`` / ``test_latent_variance``:
  ``model._raw_predict`` (the posterior of the latent f, no likelihood);
* ``test_probability``: ``model.predict(X_test)[0]`` = :math:`\Phi(\bar f_* / \sqrt{1 + \mathbb V[f_*]})`;
* gradients: ``"d log Z_EP / d variance"`` and ``"d log Z_EP / d lengthscale"`` in natural parameters, from
  ``model.gradient`` (paramz keeps there the gradient of the log likelihood, not of the objective, wrt the natural
  parameters; ``objective_function_gradients()`` is its negative; the optimiser's gradient ``model._grads(x)`` is wrt
  the Logexp (softplus) coordinates, :math:`\theta = \log(1 + e^x)`, so it is
  :math:`-\partial\log Z/\partial\theta \cdot (1 - e^{-\theta})`, neither natural nor log parameters). All three are
  recorded, and a five-point central finite difference of ``log_likelihood()`` with EP re-converged from scratch at
  every shifted hyperparameter (step ``1e-3 * theta``; also at ``2e-3 * theta``, to show the finite-difference error).
"""

from __future__ import annotations

import json
import pathlib
import platform

import GPy
import numpy as np
import paramz
import scipy
from GPy.inference.latent_function_inference.expectation_propagation import EP

EPSILON = 1e-28
MAX_ITERS = 1000
EP_SEED = 1234
OUT = pathlib.Path(__file__).with_name("gpy_ep_probit.json")


class RecordingEP(EP):
    """GPy's EP, unchanged, but remembering how many sweeps the last run took and its final mean-squared changes."""

    def expectation_propagation(self, *args, **kwargs):
        self.sweeps, self.last_change = 0, None
        return super().expectation_propagation(*args, **kwargs)

    def _local_updates(self, *args, **kwargs):
        self.sweeps += 1
        return super()._local_updates(*args, **kwargs)

    def _stop_criteria(self, ga_approx):
        self.last_change = (
            float(np.mean(np.square(ga_approx.tau - self.ga_approx_old.tau))),
            float(np.mean(np.square(ga_approx.v - self.ga_approx_old.v))),
        )
        return super()._stop_criteria(ga_approx)


def build(X, y, variance, lengthscale, parallel=False):
    """A GPy probit-EP model; constructing it runs EP (seeded)."""
    np.random.seed(EP_SEED)
    kern = GPy.kern.RBF(X.shape[1], variance=variance, lengthscale=lengthscale)
    ep = RecordingEP(
        epsilon=EPSILON,
        eta=1.0,
        delta=0.5 if parallel else 1.0,
        max_iters=MAX_ITERS,
        ep_mode="nested",
        parallel_updates=parallel,
    )
    model = GPy.core.GP(
        X, y[:, None].astype(float), kernel=kern, likelihood=GPy.likelihoods.Bernoulli(), inference_method=ep
    )
    return model


def lml(X, y, variance, lengthscale):
    return float(build(X, y, variance, lengthscale).log_likelihood())


def five_point(fun, theta, step):
    return (fun(theta - 2 * step) - 8 * fun(theta - step) + 8 * fun(theta + step) - fun(theta + 2 * step)) / (12 * step)


def record(name, X, y, X_test, variance, lengthscale, description):
    model = build(X, y, variance, lengthscale)
    ep = model.inference_method
    assert ep.last_change is not None and max(ep.last_change) < EPSILON, (name, ep.sweeps, ep.last_change)
    post_params, ga_approx, cav_params, _ = ep._ep_approximation
    train_mean, train_var = model._raw_predict(X)
    test_mean, test_var = model._raw_predict(X_test)
    probability = model.predict(X_test)[0]

    names = [p.name for p in model.flattened_parameters]
    assert names == ["variance", "lengthscale"], names
    gradient = np.array(model.gradient, dtype=float)
    objective_gradient = np.array(model.objective_function_gradients(), dtype=float)
    optimizer_gradient = np.array(model._grads(model.optimizer_array.copy()), dtype=float)

    fd = {}
    for step_factor in (1e-3, 2e-3):
        fd[str(step_factor)] = [
            five_point(lambda v: lml(X, y, v, lengthscale), variance, step_factor * variance),
            five_point(lambda ell: lml(X, y, variance, ell), lengthscale, step_factor * lengthscale),
        ]

    parallel = build(X, y, variance, lengthscale, parallel=True)
    pep = parallel.inference_method
    assert pep.last_change is not None and max(pep.last_change) < EPSILON, (name, pep.sweeps, pep.last_change)
    _, pga, _, _ = pep._ep_approximation

    problem = {
        "description": description,
        "kernel": {
            "name": "RBF",
            "formula": "variance * exp(-|x - x'|^2 / (2 * lengthscale^2))",
            "variance": variance,
            "lengthscale": lengthscale,
        },
        "X": X.tolist(),
        "y": y.astype(int).tolist(),
        "X_test": X_test.tolist(),
        "ep_sweeps": ep.sweeps,
        "ep_final_mean_squared_change": {"tau": ep.last_change[0], "v": ep.last_change[1]},
        "log_marginal_likelihood": float(model.log_likelihood()),
        "site_precision": ga_approx.tau.tolist(),
        "site_natural_mean": ga_approx.v.tolist(),
        "cavity_precision": cav_params.tau.tolist(),
        "cavity_natural_mean": cav_params.v.tolist(),
        "train_latent_mean": train_mean[:, 0].tolist(),
        "train_latent_variance": train_var[:, 0].tolist(),
        "ep_internal_train_latent_mean": np.asarray(post_params.mu).tolist(),
        "ep_internal_train_latent_variance": np.diag(post_params.Sigma).tolist(),
        "test_latent_mean": test_mean[:, 0].tolist(),
        "test_latent_variance": test_var[:, 0].tolist(),
        "test_probability": probability[:, 0].tolist(),
        "gradient": {
            "d log Z_EP / d variance": float(gradient[0]),
            "d log Z_EP / d lengthscale": float(gradient[1]),
            "source": "model.gradient (natural parameters, gradient of the log marginal likelihood, sites fixed at "
            "the EP fixed point: 0.5 tr((alpha alpha^T - (K + S~^-1)^-1) dK/dtheta))",
        },
        "gpy_objective_function_gradients": {
            "value": objective_gradient.tolist(),
            "meaning": "model.objective_function_gradients(): -(d log Z_EP / d (variance, lengthscale)), natural",
        },
        "gpy_optimizer_gradients": {
            "value": optimizer_gradient.tolist(),
            "meaning": "model._grads(optimizer_array): -(d log Z_EP / d theta) * (1 - exp(-theta)), the gradient of "
            "the objective wrt x with theta = softplus(x) (paramz Logexp), for (variance, lengthscale)",
        },
        "finite_difference_gradient": {
            "d log Z_EP / d variance": fd["0.001"][0],
            "d log Z_EP / d lengthscale": fd["0.001"][1],
            "method": "five-point central difference of model.log_likelihood() with EP re-converged from scratch at "
            "each shifted hyperparameter (same settings), step 1e-3 * theta",
            "with_step_2e-3_theta": fd["0.002"],
        },
        "parallel_run": {
            "settings": {"parallel_updates": True, "delta": 0.5, "eta": 1.0, "epsilon": EPSILON},
            "ep_sweeps": pep.sweeps,
            "log_marginal_likelihood": float(parallel.log_likelihood()),
            "site_precision": pga.tau.tolist(),
            "site_natural_mean": pga.v.tolist(),
        },
    }
    report = (
        f"{name}: sweeps {ep.sweeps} (parallel {pep.sweeps}), final msq change {ep.last_change}, "
        f"lml {problem['log_marginal_likelihood']:.15g}, parallel lml diff "
        f"{abs(problem['log_marginal_likelihood'] - problem['parallel_run']['log_marginal_likelihood']):.2e}\n"
        f"  gradient {gradient}, objective {objective_gradient}, optimizer {optimizer_gradient}\n"
        f"  fd(1e-3) {fd['0.001']}, fd(2e-3) {fd['0.002']}, |grad - fd| {np.abs(gradient - fd['0.001'])}"
    )
    print(report)
    return problem


def problem_2d():
    rng = np.random.RandomState(0)
    X = rng.uniform(-2.0, 2.0, size=(60, 2))
    latent = np.sin(2.0 * X[:, 0]) + 0.5 * X[:, 1] ** 2 - 0.6
    flip = rng.uniform(size=60) < 0.1
    y = ((latent > 0) ^ flip).astype(int)
    X_test = rng.uniform(-2.5, 2.5, size=(15, 2))
    description = (
        "N = 60, X ~ U(-2, 2)^2 from np.random.RandomState(0); y = [sin(2 x1) + x2^2/2 - 0.6 > 0] XOR flip, "
        "flip = U(0, 1) < 0.1 (same generator); 15 test inputs ~ U(-2.5, 2.5)^2 (same generator)"
    )
    return X, y, X_test, description


def problem_1d():
    rng = np.random.RandomState(1)
    X = np.sort(rng.uniform(-1.5, 1.5, size=40))[:, None]
    flip = rng.uniform(size=40) < 0.1
    y = ((np.sin(4.0 * X[:, 0]) > 0) ^ flip).astype(int)
    X_test = np.linspace(-1.8, 1.8, 15)[:, None]
    description = (
        "N = 40, x ~ U(-1.5, 1.5) sorted, from np.random.RandomState(1); y = [sin(4 x) > 0] XOR flip, "
        "flip = U(0, 1) < 0.1 (same generator); 15 test inputs linspace(-1.8, 1.8)"
    )
    return X, y, X_test, description


def main():
    X, y, X_test, d2 = problem_2d()
    X1, y1, X1_test, d1 = problem_1d()
    data = {
        "generator": "tests/data/make_gpy_ep_reference.py, run with /tmp/gpyenv/bin/python",
        "versions": {
            "GPy": GPy.__version__,
            "paramz": paramz.__version__,
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "python": platform.python_version(),
        },
        "settings": {
            "model": "GPy.core.GP, GPy.likelihoods.Bernoulli() (probit link, y in {0, 1}), zero mean function, "
            "GPy.kern.RBF(input_dim, variance, lengthscale) with fixed hyperparameters",
            "inference": "GPy.inference.latent_function_inference.expectation_propagation.EP",
            "epsilon": EPSILON,
            "epsilon_meaning": "stop when mean((tau - tau_old)^2) < epsilon and mean((v - v_old)^2) < epsilon "
            "over one sweep",
            "max_iters": MAX_ITERS,
            "eta": 1.0,
            "delta": 1.0,
            "ep_mode": "nested",
            "parallel_updates": False,
            "site_order": f"np.random.permutation each sweep, np.random.seed({EP_SEED}) before each EP run",
            "initialisation": "GPy starts from tau = v = 0 with Sigma = K + 1e-7 I (the jitter only in the first "
            "sweep; Sigma is recomputed from K without it after each sweep)",
        },
        "problems": {
            "probit_2d": record("probit_2d", X, y, X_test, 2.0, 0.8, d2),
            "probit_1d": record("probit_1d", X1, y1, X1_test, 5.0, 0.3, d1),
        },
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
