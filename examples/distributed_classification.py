"""Multi-class GP classification on several processes: IterNCGP with the kernel products split over the ranks.

The paper's 10-class Gaussian mixture in 3-D (Appendix C.3), a softmax likelihood over C = 10 latent GPs that share
one Matérn-3/2 kernel, CG actions (5 per Newton step) with recycling and compression (R = 10). Every process
(launched by torchrun) builds the same model on the same data, with its kernel wrapped in ``ShardedKernel``: each
product with K is computed by rows, N / P rows per process, and assembled by ``all_gather``; the rest of the fit is
replicated, so every rank holds the same posterior. Rank 0 prints the fit's table, checks that its ``state_dict()``
loads into a model without the wrapper with the same predictions, and saves a figure (test accuracy and NLL after
each Newton step, and where the time went).

    torchrun --nproc-per-node 2 examples/distributed_classification.py [--smoke] [--quiet] [--out DIR] [--timeout S]

On CPUs the processes talk through gloo; with one GPU per process (``torchrun --nproc-per-node <GPUs>``) through
NCCL, each on ``cuda:LOCAL_RANK`` (``docs/distributed.md``).
"""

from __future__ import annotations

import datetime
import os
import time

import _common
import gpytorch
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from gpytorch_iterncgp import IterNCGPStrategy
from gpytorch_iterncgp.datasets import gaussian_mixture
from gpytorch_iterncgp.distributed import ShardedKernel

NAME = "distributed_classification"
NUM_CLASSES = 10
MIN_CURVATURE = 1e-6  # as examples/multiclass.py: bounds the softmax probabilities' W^+


class Model(gpytorch.models.ApproximateGP):
    """Zero-mean GPs for the C class latents, one Matérn-3/2 kernel shared by the classes, its products sharded
    (``sharded=False``: the same model for one process)."""

    def __init__(self, train_x, train_y, likelihood, sharded: bool = True, **options):
        strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, **options)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 5.0
        self.covar_module = ShardedKernel(kernel) if sharded else kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def make_model(data, device, sharded: bool, steps: int, quiet: bool) -> Model:
    train_x, train_y, _, _ = data
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=NUM_CLASSES, mixing_weights=False)
    options = {"policy": "cg", "max_solver_iterations": 5, "compression_rank": 10, "max_newton_steps": steps}
    model = Model(train_x, train_y, likelihood, sharded, outer_tol=1e-3, min_curvature=MIN_CURVATURE, **options)
    model.variational_strategy.show_progress = not quiet
    return model.to(device)


def test_metrics(strategy, test_x, test_y) -> tuple[float, float]:
    probs = strategy.predictive_probabilities(test_x)
    accuracy = float((probs.argmax(-1) == test_y).double().mean())
    nll = float(-probs[torch.arange(len(test_y)), test_y].clamp_min(1e-300).log().mean())
    return accuracy, nll


def main():
    args = _common.parse_args(
        __doc__.splitlines()[0],
        lambda parser: parser.add_argument(
            "--timeout", type=float, default=120.0, help="seconds a rank waits for the others before failing"
        ),
    )
    _common.setup(seed=0)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun: torchrun --nproc-per-node 2 examples/distributed_classification.py")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # a rank that fails (an error, an OOM, Ctrl-C) makes the others fail after at most this long, not hang
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    num_train, num_test, steps = (1000, 500, 5) if args.smoke else (20000, 2000, 30)
    data = tuple(tensor.to(device) for tensor in gaussian_mixture(num_train, num_test, num_classes=NUM_CLASSES))
    _, _, test_x, test_y = data
    model = make_model(data, device, sharded=True, steps=steps, quiet=args.quiet or rank != 0)
    strategy, kernel = model.variational_strategy, model.covar_module
    history = []

    def callback(step, state):
        history.append({"step": step.step, "products": step.kernel_products, "seconds": time.perf_counter() - start})

    start = time.perf_counter()
    with torch.no_grad():
        report = strategy.fit(callback=callback)
        accuracy, nll = test_metrics(strategy, test_x, test_y)
        mean = strategy.marginal_latent(test_x)[0]  # sharded too: every rank takes part in predictions
    if rank == 0:
        print(
            f"{world_size} processes ({device.type}), N = {num_train}, C = {NUM_CLASSES}: {report.steps} Newton steps, "
            f"{report.kernel_products} products with K in {report.kernel_product_seconds:.3g} s of "
            f"{report.wall_time:.3g} s; {kernel.bytes_sent / 2**20:.3g} MiB sent by this rank in "
            f"{kernel.products} gathered products; test accuracy {accuracy:.4f}, NLL {nll:.4f}"
        )
        # the contract: the state_dict loads into the same model in one process, with the same posterior
        single = make_model(data, device, sharded=False, steps=steps, quiet=True)
        single.load_state_dict(model.state_dict())
        with torch.no_grad():
            difference = (single.variational_strategy.marginal_latent(test_x)[0] - mean).abs()
        print(
            f"state_dict loaded into a single-process model: max |difference of posterior means| {difference.max():.2g}"
        )
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.out / f"{NAME}.pt")
        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
        left.plot([record["step"] for record in history], [record["seconds"] for record in history], "o-")
        left.set(xlabel="Newton step", ylabel="wall time (s)", title=f"{world_size} processes, N = {num_train}")
        right.bar(
            ["products with K", "rest of the fit"],
            [report.kernel_product_seconds, report.wall_time - report.kernel_product_seconds],
        )
        right.set(ylabel="seconds", title=f"test accuracy {accuracy:.3f}, NLL {nll:.3f}")
        figure.tight_layout()
        _common.save_figure(figure, args, NAME)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
