"""GP-ALPS at scale: 10^4 inputs x 9 outputs, mini-batch training, CPU.

The noisy periodic mixture of GP-ALPS §4.2: three signals with periods 7, 17 and 23,
:math:`s_k(t) = \\sin(2\\pi t / P_k + \\phi_k)`, each corrupted by Gaussian noise (standard deviation 0.2) and
mixed by :math:`\\mathbf H^* = [\\mathbf I_3 \\; \\mathbf Z^\\top]^\\top` (:math:`\\mathbf Z` ``(6, 3)`` standard
normal, seed 0) into :math:`p = 9` outputs, plus observation noise (standard deviation 0.1); inputs uniform on
[0, 250]. 10% of the training entries are missing at random (``NaN``: the ELBO's mask). The model: :math:`m = 9`
linear-periodic latents (``CosineKernel`` times an outputscale of 1, fixed) with the paper's periods 3, 7, 7, 11, 13,
17, 19, 23, 23, 16 shared inducing inputs on a grid (learnt), per-output noise variances learnt.

Training: Adam on mini-batches (``--batch-size``, reshuffled every epoch) of the ELBO of
:class:`~gpytorch_iterncgp.alps.GPALPSELBO` (``--family``, default ``"spike_and_slab"``); with Bernoulli gates the
gate logits by :meth:`~gpytorch_iterncgp.alps.GPALPSELBO.update_gates` after each step (damped by the batch's share
of the data; ``--adam-gates``: by Adam instead). Records per epoch the
mean mini-batch ELBO (per data point) and the wall time; at the end the activation probabilities, the RMSE of the
predictive mean on 2000 held-out inputs (against the noisy targets and against the noiseless mixture
:math:`\\mathbf H^* \\mathbf s(t)`), total wall time, and the peak resident memory of the process above the memory
before training (Linux VmHWM). Writes ``results/alps_scale/alps_scale.json`` and ``.png`` (``--smoke``, or its
alias ``--quick``: tiny sizes, ``alps_scale_smoke.*``).

    python -m benchmarks.alps_scale            # about 2-5 minutes on one (shared) CPU core
    python -m benchmarks.alps_scale --smoke    # seconds: a functional check
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.alps_family import single_sinusoid_kernel
from benchmarks.common import add_smoke_flag, load_average, machine, peak_rss_bytes, reset_peak_rss, rss_bytes
from gpytorch_iterncgp.alps import GPALPS, GPALPSELBO, VARIATIONAL_FAMILIES

RESULTS = Path(__file__).resolve().parent / "results" / "alps_scale"
SIGNAL_PERIODS = (7.0, 17.0, 23.0)
LATENT_PERIODS = (3.0, 7.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0, 23.0)
SIGNAL_NOISE, OUTPUT_NOISE, SPAN = 0.2, 0.1, 250.0


def mixing_matrix() -> torch.Tensor:
    """:math:`\\mathbf H^* = [\\mathbf I_3; \\mathbf Z]`, ``(9, 3)``."""
    z = torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return torch.cat([torch.eye(3, dtype=torch.float64), z])


def signals(t: torch.Tensor) -> torch.Tensor:
    """The three noiseless periodic signals at ``t`` ``(n,)``: ``(n, 3)``."""
    phases = torch.tensor([0.3, 1.1, 2.0], dtype=torch.float64)
    periods = torch.tensor(SIGNAL_PERIODS, dtype=torch.float64)
    return torch.sin(2 * math.pi * t[:, None] / periods + phases)


def data(num: int, seed: int, missing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs ``(num, 1)``, noisy targets ``(num, 9)`` (``NaN`` where missing) and the noiseless mixture."""
    generator = torch.Generator().manual_seed(seed)
    t = SPAN * torch.rand(num, generator=generator, dtype=torch.float64)
    mixing = mixing_matrix()
    source = signals(t)
    noisy = source + SIGNAL_NOISE * torch.randn(source.shape, generator=generator, dtype=torch.float64)
    targets = noisy @ mixing.mT
    targets = targets + OUTPUT_NOISE * torch.randn(targets.shape, generator=generator, dtype=torch.float64)
    if missing:
        targets[torch.rand(targets.shape, generator=generator) < missing] = float("nan")
    return t[:, None], targets, source @ mixing.mT


def build(args: argparse.Namespace, num_outputs: int):
    """GP-ALPS with the latents of :data:`LATENT_PERIODS` and a grid of inducing inputs, its multitask Gaussian
    likelihood (noises learnt, starting at 0.1) and the ELBO."""
    inducing = torch.linspace(0, SPAN, args.num_inducing, dtype=torch.float64)[:, None]
    model = GPALPS(
        [single_sinusoid_kernel(period) for period in LATENT_PERIODS],
        inducing,
        num_outputs=num_outputs,
        variational_family=args.family,
    )
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(
        num_tasks=num_outputs, rank=0, has_global_noise=False
    ).double()
    likelihood.task_noises = torch.full((num_outputs,), 0.1, dtype=torch.float64)
    return model, likelihood, GPALPSELBO(likelihood, model, num_data=args.num_train)


def train(args: argparse.Namespace, model, likelihood, elbo, train_t, train_y, gate_updates: bool, gate_step: float):
    """Adam on minibatches of the ELBO for ``args.epochs`` epochs; with ``gate_updates`` the gates by coordinate ascent
    after each step past the warm-up. The history per epoch, the seconds of training and the peak memory above the
    memory before it."""
    parameters = [
        p
        for p in (*model.parameters(), *likelihood.parameters())
        if p.requires_grad and not (gate_updates and p is model.gate_logits)
    ]
    optimizer = torch.optim.Adam(parameters, lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + 3)
    before = rss_bytes()
    reset_peak_rss()
    history = []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        order = torch.randperm(args.num_train, generator=generator)
        total, steps = 0.0, 0
        for batch in order.split(args.batch_size):
            optimizer.zero_grad()
            value = elbo(model(train_t[batch]), train_y[batch])
            (-value).backward()
            optimizer.step()
            if gate_updates and epoch >= args.gate_warmup:
                elbo.update_gates(model(train_t[batch]), train_y[batch], step_size=gate_step)
            total += float(value.detach())
            steps += 1
        history.append(
            {
                "epoch": epoch + 1,
                "elbo_per_point": total / steps,
                "seconds": time.perf_counter() - epoch_start,
                "activation_probabilities": model.activation_probabilities().detach().tolist(),
            }
        )
        if not args.quiet:
            print(
                f"epoch {epoch + 1:3d}  ELBO/n {total / steps:9.4f}  {history[-1]['seconds']:6.2f}s  q(b=1) "
                + " ".join(f"{p:.2f}" for p in history[-1]["activation_probabilities"]),
                flush=True,
            )
    return history, time.perf_counter() - start, peak_rss_bytes() - before


def run(args: argparse.Namespace) -> dict:
    """Train on the mixture and score the predictive mean on held-out inputs (the module docstring)."""
    torch.manual_seed(args.seed)
    train_t, train_y, _ = data(args.num_train, seed=args.seed + 1, missing=args.missing)
    test_t, test_y, test_clean = data(args.num_test, seed=args.seed + 2, missing=0.0)
    num_outputs = train_y.shape[1]
    model, likelihood, elbo = build(args, num_outputs)
    # Bernoulli gates: held on for --gate-warmup epochs (random initial slabs make every latent look harmful: a gate
    # closed at once freezes its q(X^z_j)), then coordinate ascent (GPALPSELBO.update_gates) after each Adam step,
    # damped by the batch's share of the data (the estimate averaged over about one epoch); Adam for the rest
    gate_updates = args.family != "concrete" and not args.adam_gates
    gate_step = min(1.0, args.batch_size / args.num_train)
    history, train_seconds, peak = train(args, model, likelihood, elbo, train_t, train_y, gate_updates, gate_step)
    mean, _ = model.predict(test_t, num_samples=256, generator=torch.Generator().manual_seed(args.seed + 4))
    rmse_noisy = float((mean - test_y).square().mean().sqrt())
    rmse_clean = float((mean - test_clean).square().mean().sqrt())
    probabilities = model.activation_probabilities().detach()
    return {
        "num_train": args.num_train,
        "num_outputs": num_outputs,
        "num_latents": len(LATENT_PERIODS),
        "latent_periods": list(LATENT_PERIODS),
        "signal_periods": list(SIGNAL_PERIODS),
        "missing_fraction_observed": float(torch.isnan(train_y).double().mean()),
        "num_inducing": args.num_inducing,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "adam_steps": args.epochs * math.ceil(args.num_train / args.batch_size),
        "learning_rate": args.lr,
        "family": args.family,
        "gates": f"held {args.gate_warmup} epochs, then coordinate ascent, step {gate_step:g}"
        if gate_updates
        else "Adam",
        "history": history,
        "train_seconds": train_seconds,
        "seconds_per_epoch": train_seconds / args.epochs,
        "peak_memory_above_start_bytes": peak,
        "activation_probabilities": probabilities.tolist(),
        "selected_periods": [p for p, on in zip(LATENT_PERIODS, (probabilities > 0.5).tolist(), strict=True) if on],
        "noise_std_learnt": likelihood.task_noises.detach().sqrt().tolist(),
        "test_rmse_to_noisy_targets": rmse_noisy,
        "test_rmse_to_noiseless_mixture": rmse_clean,
        "num_test": args.num_test,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = result["history"]
    epochs = [h["epoch"] for h in history]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.6))
    left.plot(epochs, [h["elbo_per_point"] for h in history], "o-", ms=3)
    left.set_xlabel("epoch")
    left.set_ylabel("mean mini-batch ELBO / n")
    left.set_title(f"{result['train_seconds']:.0f} s, {result['seconds_per_epoch']:.1f} s/epoch")
    probabilities = torch.tensor([h["activation_probabilities"] for h in history])
    for j, period in enumerate(result["latent_periods"]):
        middle.plot(epochs, probabilities[:, j], label=f"P = {period:g}")
    middle.set_xlabel("epoch")
    middle.set_ylabel("activation probability")
    middle.legend(fontsize=6, ncol=3)
    index = range(len(result["latent_periods"]))
    right.bar(index, result["activation_probabilities"], color="C0")
    right.set_xticks(list(index), [f"{p:g}" for p in result["latent_periods"]])
    right.set_xlabel("latent period (signals: 7, 17, 23)")
    right.set_ylim(0, 1.05)
    right.set_title(f"test RMSE {result['test_rmse_to_noisy_targets']:.3f} (noiseless mixture "
                    f"{result['test_rmse_to_noiseless_mixture']:.3f})", fontsize=9)  # fmt: skip
    fig.suptitle(
        f"GP-ALPS ({result['family']}), n = {result['num_train']}, p = {result['num_outputs']}, "
        f"m = {result['num_latents']}, batch {result['batch_size']}, CPU float64"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_flag(parser)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--family", choices=VARIATIONAL_FAMILIES, default="spike_and_slab")
    parser.add_argument("--num-train", type=int, default=10_000)
    parser.add_argument("--num-test", type=int, default=2000)
    parser.add_argument("--num-inducing", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--adam-gates", action="store_true", help="train the gate logits with Adam, not GPALPSELBO.update_gates"
    )
    parser.add_argument(
        "--gate-warmup", type=int, default=5, help="epochs with the gates held at their initial value (0.9)"
    )
    parser.add_argument("--missing", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_train, args.num_test, args.batch_size, args.epochs = 400, 100, 100, 3
        args.gate_warmup = min(args.gate_warmup, 1)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    load_before = load_average()
    start = time.perf_counter()
    result = run(args)
    result["total_seconds"] = time.perf_counter() - start
    result["load_average_1min"] = {"before": load_before, "after": load_average()}
    output = {"machine": machine(), "arguments": {k: str(v) for k, v in vars(args).items()}, "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "alps_scale_smoke" if args.smoke else "alps_scale"
    (args.out / f"{name}.json").write_text(json.dumps(output, indent=1) + "\n")
    plot(result, args.out / f"{name}.png")
    if not args.quiet:
        print(
            f"{result['total_seconds']:.1f}s total, {result['epochs']} epochs; selected periods "
            f"{result['selected_periods']}; test RMSE {result['test_rmse_to_noisy_targets']:.4f} (noiseless "
            f"{result['test_rmse_to_noiseless_mixture']:.4f}); peak memory +"
            f"{result['peak_memory_above_start_bytes'] / 2**20:.0f} MiB; saved {args.out / name}.json"
        )
    return output


if __name__ == "__main__":
    main()
