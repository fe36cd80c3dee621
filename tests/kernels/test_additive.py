"""``FirstOrderAdditiveKernel`` (``gpytorch_iterncgp.kernels.additive``) against GPyTorch's ``AdditiveKernel`` of
copies of the base kernel with ``active_dims=(d,)`` (the same hyperparameters): values, diagonals, batches, gradients,
the bytes autograd saves, the Laplace evidence of a model and its gradients, ``state_dict`` and argument checks."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import LaplaceMarginalLogLikelihood, LogitBernoulliLikelihood
from gpytorch_iterncgp.kernels.additive import FirstOrderAdditiveKernel
from tests.common import IterNCGPModel, binary_data

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
#: test_kernel_choice's CG solver with tighter tolerances, so that a different number of CG iterations on the two
#: models (rounding of the same matrix) could not move their evidences apart by more than ~1e-8
SOLVER = dict(policy="cg", max_solver_iterations=None, abs_tol=1e-8, rel_tol=1e-8)


def _scaled_matern(batch: int | None = None) -> gpytorch.kernels.Kernel:
    """``ScaleKernel(MaternKernel(nu=2.5))``, a batch of ``batch`` of them where given."""
    batch_shape = torch.Size([batch] if batch else [])
    return gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.MaternKernel(nu=2.5, batch_shape=batch_shape), batch_shape=batch_shape
    )


BASES = {"scaled-matern": _scaled_matern, "rbf": lambda: gpytorch.kernels.RBFKernel()}


def _additive(base: gpytorch.kernels.Kernel, num_dims: int, dtype: torch.dtype, seed: int = 0):
    """The kernel and GPyTorch's reference, every raw hyperparameter of every feature drawn from a seeded generator
    (different lengthscales and weights per feature)."""
    kernel = FirstOrderAdditiveKernel(base, num_dims).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in kernel.parameters():
            parameter.copy_(0.7 * torch.randn(parameter.shape, generator=generator, dtype=dtype))
    terms = []
    for d, feature_kernel in enumerate(kernel.base_kernels):
        term = copy.deepcopy(feature_kernel)
        term.active_dims = torch.tensor([d])
        terms.append(term)
    return kernel, gpytorch.kernels.AdditiveKernel(*terms)


def _inputs(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# 1. Values
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("base", list(BASES))
def test_values_and_diagonal_equal_gpytorchs_additive_kernel(base, dtype):
    kernel, reference = _additive(BASES[base](), 4, dtype)
    assert len(list(kernel.parameters())) == 4 * len(list(BASES[base]().parameters()))  # a copy per feature
    lengthscales = torch.stack(
        [k.lengthscale if base == "rbf" else k.base_kernel.lengthscale for k in kernel.base_kernels]
    )
    assert lengthscales.unique().numel() == 4
    x1, x2 = _inputs(7, 4, dtype=dtype), _inputs(5, 4, dtype=dtype, seed=2)
    with torch.no_grad():
        matrix = kernel(x1, x2).to_dense()
        assert matrix.shape == (7, 5) and matrix.dtype == dtype
        torch.testing.assert_close(matrix, reference(x1, x2).to_dense(), **TOLERANCES[dtype])
        diagonal = kernel(x1, diag=True)
        assert diagonal.shape == (7,)
        torch.testing.assert_close(diagonal, reference(x1, diag=True), **TOLERANCES[dtype])
        torch.testing.assert_close(kernel(x1).to_dense().diagonal(), diagonal, **TOLERANCES[dtype])
    # with gradients recorded (the checkpointed terms) the same values
    torch.testing.assert_close(kernel(x1, x2).to_dense().detach(), matrix, rtol=0, atol=0)
    assert kernel.is_stationary
    assert not FirstOrderAdditiveKernel(gpytorch.kernels.LinearKernel(), 4).is_stationary


def test_a_batch_of_kernels_and_its_indexing():
    kernel, reference = _additive(_scaled_matern(3), 4, torch.float64)
    assert kernel.batch_shape == torch.Size([3])
    x1, x2 = _inputs(3, 7, 4), _inputs(3, 5, 4, seed=2)
    with torch.no_grad():
        matrix = kernel(x1, x2).to_dense()
        assert matrix.shape == (3, 7, 5)
        expected = reference(x1, x2).to_dense()
        torch.testing.assert_close(matrix, expected, **TOLERANCES[torch.float64])
        torch.testing.assert_close(kernel(x1, diag=True), reference(x1, diag=True), **TOLERANCES[torch.float64])
        assert not torch.allclose(matrix[0], matrix[1])  # the batches' hyperparameters differ
        assert kernel[1].batch_shape == torch.Size([])
        torch.testing.assert_close(kernel[1](x1[1], x2[1]).to_dense(), expected[1], **TOLERANCES[torch.float64])
        torch.testing.assert_close(kernel(x1, x2)[1].to_dense(), expected[1], **TOLERANCES[torch.float64])
        assert kernel.expand_batch(2, 3).batch_shape == torch.Size([2, 3])


def test_active_dims_of_the_additive_kernel_select_its_features():
    kernel, reference = _additive(_scaled_matern(), 2, torch.float64)
    kernel.active_dims = torch.tensor([0, 2])
    for d, term in zip((0, 2), reference.kernels, strict=True):
        term.active_dims = torch.tensor([d])
    x1, x2 = _inputs(7, 3), _inputs(5, 3, seed=2)
    with torch.no_grad():
        expected = reference(x1, x2).to_dense()
        torch.testing.assert_close(kernel(x1, x2).to_dense(), expected, **TOLERANCES[torch.float64])
        kernel.active_dims = None  # features 0 and 1: another matrix
        assert not torch.allclose(kernel(x1[:, :2], x2[:, :2]).to_dense(), expected)


# ---------------------------------------------------------------------------------------------------
# 2. Gradients
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("base", list(BASES))
def test_gradients_equal_gpytorchs_additive_kernel(base):
    kernel, reference = _additive(BASES[base](), 4, torch.float64)
    weights = torch.randn(7, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x1 = _inputs(7, 4)
    x2 = _inputs(5, 4, seed=2)
    gradients = []
    for module in (kernel, reference):
        inputs = x1.clone().requires_grad_(True)
        module.zero_grad()
        value = (module(inputs, x2).to_dense() * weights).sum()
        value.backward()
        gradients.append((value.detach(), inputs.grad, [p.grad.clone() for p in module.parameters()]))
    (value, x_grad, p_grads), (ref_value, ref_x_grad, ref_p_grads) = gradients
    assert len(p_grads) == len(ref_p_grads) == 4 * len(list(BASES[base]().parameters()))
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=0)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-10, atol=1e-10 * float(ref_x_grad.abs().max()))
    for grad, ref_grad in zip(p_grads, ref_p_grads, strict=True):
        assert float(ref_grad.abs().max()) > 1e-3
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------------------------------
# 3. Memory: the bytes of the tensors autograd saves for the backward pass
# ---------------------------------------------------------------------------------------------------
def _saved_bytes(module: gpytorch.kernels.Kernel, x: torch.Tensor) -> int:
    """The bytes of the distinct storages of the tensors saved for backward while evaluating ``module(x)``."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        matrix = module(x).to_dense()
    assert matrix.requires_grad
    return sum(storages.values())


def test_autograd_saves_one_matrix_at_most_where_the_reference_saves_one_per_feature():
    num_data, num_dims = 200, 16
    kernel, reference = _additive(_scaled_matern(), num_dims, torch.float64)
    x = _inputs(num_data, num_dims)
    matrix_bytes = num_data**2 * x.element_size()
    saved, reference_saved = _saved_bytes(kernel, x), _saved_bytes(reference, x)
    message = f"saved {saved} B, GPyTorch's AdditiveKernel {reference_saved} B; n^2 * itemsize = {matrix_bytes} B"
    assert saved < 2 * matrix_bytes, message
    assert reference_saved > num_dims / 2 * matrix_bytes, message
    # and the checkpointed terms still give the reference's gradients
    (kernel(x).to_dense().sum() + reference(x).to_dense().sum()).backward()
    for parameter, ref_parameter in zip(kernel.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, ref_parameter.grad, rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------------------------------
# 4. In a model: the Laplace evidence and its gradients
# ---------------------------------------------------------------------------------------------------
def test_laplace_evidence_and_its_gradients_equal_those_with_gpytorchs_additive_kernel():
    x, y = binary_data(60, dim=3, seed=5)
    additive, reference = _additive(_scaled_matern(), 3, torch.float64, seed=4)
    results = []
    for kernel in (additive, reference):
        likelihood = LogitBernoulliLikelihood()
        model = IterNCGPModel(x, y, likelihood, **SOLVER)
        model.covar_module = gpytorch.kernels.ScaleKernel(kernel).double()
        model.covar_module.outputscale = 1.5
        mll = LaplaceMarginalLogLikelihood(likelihood, model)
        model.train()
        loss = -mll(model(x), y)
        loss.backward()
        gradients = {
            name.replace(".base_kernels.", ".kernels."): parameter.grad
            for name, parameter in model.covar_module.named_parameters()
        }
        results.append((loss.detach(), gradients))
    (loss, gradients), (ref_loss, ref_gradients) = results
    assert gradients.keys() == ref_gradients.keys() and len(gradients) == 1 + 2 * 3
    torch.testing.assert_close(loss, ref_loss, rtol=1e-8, atol=0)
    for name, gradient in gradients.items():
        assert gradient is not None and float(ref_gradients[name].abs()) > 1e-4, name
        torch.testing.assert_close(gradient, ref_gradients[name], rtol=1e-7, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------------
# 5. state_dict
# ---------------------------------------------------------------------------------------------------
def test_state_dict_round_trip():
    kernel, _ = _additive(_scaled_matern(), 4, torch.float64, seed=6)
    other = FirstOrderAdditiveKernel(_scaled_matern(), 4).double()
    x = _inputs(6, 4)
    with torch.no_grad():
        assert not torch.allclose(other(x).to_dense(), kernel(x).to_dense())
        state = kernel.state_dict()
        assert len([key for key in state if key.endswith("raw_lengthscale")]) == 4
        other.load_state_dict(state)
        torch.testing.assert_close(other(x).to_dense(), kernel(x).to_dense(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# 6. Bad input
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, num_dims, match",
    [
        (lambda: gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=2), 2, "ard_num_dims=2"),
        (lambda: gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(active_dims=(0,))), 2, "active_dims"),
        (lambda: gpytorch.kernels.RBFKernel(), 0, "num_dims must be a positive int"),
        (lambda: gpytorch.kernels.RBFKernel(), 2.0, "num_dims must be a positive int"),
    ],
)
def test_bad_arguments_name_the_problem(make, num_dims, match):
    with pytest.raises(ValueError, match=match):
        FirstOrderAdditiveKernel(make(), num_dims)


def test_inputs_with_another_number_of_features_are_refused():
    kernel = FirstOrderAdditiveKernel(gpytorch.kernels.RBFKernel(), 3)
    with pytest.raises(ValueError, match="num_dims=3 features got inputs of 4"):
        kernel(torch.rand(5, 4)).to_dense()
    with pytest.raises(ValueError, match="num_dims=3 features got inputs of 2"):
        kernel(torch.rand(5, 2), diag=True)
