"""GP-ALPS on a noisy mixture of periodic signals (GP-ALPS §4.2): which of 9 candidate periods, duplicates included?

Data (GP-ALPS §4.2 and Figure 4): ``m* = 3`` sinusoids with periods 7, 17 and 23 (unit amplitude, random phases)
at the integer times ``t = 0, …, 399``, mixed by the fixed ``H* = [I₃ Z]ᵀ`` (``Z``: a standard-normal 3 × 6
matrix, the paper's 6 × 6 being a typo: ``H*`` is 9 × 3) into ``p = 9`` outputs, and corrupted by Gaussian noise of
standard deviation 1 (where: see below). Outputs 1–3 are the noisy signals themselves. The first 300 times train,
the last 100 test (the vertical line of the paper's Figure 4(b)).

Model: GP-ALPS (GP-ALPS eq. 2) with ``m = 9`` latent GPs whose single-sinusoid ("linear-periodic", as in §4.1)
kernels have the fixed periods 3, 7, 7, 11, 13, 17, 19, 23, 23 (GPyTorch's ``CosineKernel`` computes
``cos(π|t − t′|/p)``, so period ``T`` needs ``period_length = T/2``), outputscale 1, prior activation 0.5.

* **VI**: :class:`~gpytorch_iterncgp.alps.GPALPS` + :class:`~gpytorch_iterncgp.alps.GPALPSELBO` (12 shared
  inducing inputs over the training range, Adam), one noise variance per output, learnt. ``--family``: the
  variational family, GPALPS's default ``spike_and_slab`` if not given (a closed gate returns the latent and its
  mixing weights to the prior; exact ELBO), or the paper's ``concrete`` (relaxed gates, 8 samples of (H, b) per
  step), which left period 13 on for the data seed 1 (0.80; Gibbs 0.06) and period 3 near 0.5 for seed 0; spike-and-slab selected
  exactly the true periods for the data seeds 0–3.
* **Gibbs**: :func:`~gpytorch_iterncgp.alps.gibbs_sample_model` (GP-ALPS App. D) on the exact GP prior at the
  training times, with the noise variances that VI ended with: the exact posterior's activation probabilities.

Expected (GP-ALPS §4.2, Figure 2(c)): exactly one latent switched on (probability > 0.5) for each of the periods
7, 17 and 23, although the duplicates fit the data equally well, and the periods 3, 11, 13 and 19 off. The
activation probabilities go to the terminal and to ``alps_periodic_mixture.json``; the figure
``alps_periodic_mixture.png`` shows them, the posterior means of the mixing matrix, and the predictions of three
outputs on the last 100 training and the 100 test times.

Where the noise enters: with ``--noise-before-mixing`` it is added to the three signals before ``H*`` mixes them,
the paper's wording. That noise is shared by the outputs (its covariance ``σ² H* H*ᵀ`` has rank 3, which the
model's independent output noises cannot express), so its random projections on the candidate sinusoids are
coherent across the 9 outputs, the structure of a gated latent, and a spurious period is switched on more often.
By default the noise is added to each output independently, the model's own likelihood (GP-ALPS eq. 2). The
training window (300 times) is long enough to resolve the neighbouring frequencies 1/17 and 1/19 (they differ by
1/161).

    python examples/alps_periodic_mixture.py            # 1-3 minutes on one (shared) CPU core
    python examples/alps_periodic_mixture.py --smoke    # fewer points and steps: seconds
"""

from __future__ import annotations

import argparse
import json
import math

import _common
import gpytorch
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from gpytorch_iterncgp.alps import GPALPS, GPALPSELBO, VARIATIONAL_FAMILIES, gibbs_sample_model, noise_variances

NAME = "alps_periodic_mixture"
TRUE_PERIODS = (7.0, 17.0, 23.0)
CANDIDATE_PERIODS = (3.0, 7.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0, 23.0)
NUM_OUTPUTS = 9
NOISE_STD = 1.0
LEARNING_RATE = 0.1
NUM_INDUCING = 12


def periodic_kernel(period: float) -> gpytorch.kernels.Kernel:
    """A random sinusoid of period T: :math:`k(t, t') = \\cos(2\\pi (t - t') / T)`, outputscale 1, all fixed."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.CosineKernel())
    kernel.base_kernel.period_length = period / 2
    kernel.outputscale = 1.0
    kernel.requires_grad_(False)
    return kernel


def make_data(
    num_points: int, noise_before_mixing: bool, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Times ``(n, 1)``, noisy outputs ``(n, 9)``, noiseless outputs ``(n, 9)`` and :math:`H^*` ``(9, 3)``."""
    t = torch.arange(num_points, dtype=torch.float64)[:, None]
    phases = 2 * math.pi * torch.rand(len(TRUE_PERIODS), generator=generator)
    signals = torch.sin(2 * math.pi * t / torch.tensor(TRUE_PERIODS) + phases)  # shape: (n, 3)
    mixing = torch.cat([torch.eye(3), torch.randn(NUM_OUTPUTS - 3, 3, generator=generator)])  # H* = [I₃ Z]ᵀ
    clean = signals @ mixing.T
    if noise_before_mixing:
        noisy = (signals + NOISE_STD * torch.randn(signals.shape, generator=generator)) @ mixing.T
    else:
        noisy = clean + NOISE_STD * torch.randn(clean.shape, generator=generator)
    return t, noisy, clean, mixing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the data: phases, Z and noise (default 0)")
    parser.add_argument(
        "--noise-before-mixing",
        action="store_true",
        help="noise on the three signals, then mixed (the paper's wording)",
    )
    parser.add_argument(
        "--family",
        choices=VARIATIONAL_FAMILIES,
        default=None,
        help="variational family of the gates (default: GPALPS's, spike_and_slab; concrete is the paper's)",
    )


def main():
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    _common.setup(seed=0)
    num_points, num_train, steps, sweeps, burn_in = (120, 90, 60, 40, 10) if args.smoke else (400, 300, 1500, 400, 100)
    t, y, clean, true_mixing = make_data(num_points, args.noise_before_mixing, torch.Generator().manual_seed(args.seed))
    train = slice(0, num_train)

    inducing = torch.linspace(0, num_train - 1, NUM_INDUCING)[:, None]
    family = {} if args.family is None else {"variational_family": args.family}
    model = GPALPS([periodic_kernel(period) for period in CANDIDATE_PERIODS], inducing, NUM_OUTPUTS, **family)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=NUM_OUTPUTS, rank=0, has_global_noise=False)
    likelihood.task_noises = torch.ones(NUM_OUTPUTS)
    elbo = GPALPSELBO(likelihood, model, num_data=num_train, num_samples=8)
    parameters = [p for p in (*model.parameters(), *likelihood.parameters()) if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE)
    trace = []
    with _common.Timer() as vi_timer:
        for _ in tqdm(range(steps), desc="VI: Adam on the ELBO", disable=args.quiet):
            optimizer.zero_grad()
            loss = -elbo(model(t[train]), y[train])
            loss.backward()
            optimizer.step()
            trace.append(float(loss.detach()))
    probabilities = model.activation_probabilities().detach()
    with torch.no_grad():
        mean, variance = model.predict(t, num_samples=512, generator=torch.Generator().manual_seed(1))

    if not args.quiet:
        print(f"Gibbs: {burn_in} + {sweeps} sweeps", flush=True)
    with _common.Timer() as gibbs_timer:
        gibbs = gibbs_sample_model(
            model, likelihood, t[train], y[train], num_samples=sweeps, burn_in=burn_in,
            generator=torch.Generator().manual_seed(2),
        )  # fmt: skip
    gibbs_probabilities = gibbs.activation_probabilities

    on = probabilities > 0.5
    periods = torch.tensor(CANDIDATE_PERIODS)
    on_per_true_period = {int(period): int(on[periods == period].sum()) for period in TRUE_PERIODS}
    spurious = [int(periods[j]) for j in range(len(periods)) if on[j] and float(periods[j]) not in TRUE_PERIODS]
    success = all(count == 1 for count in on_per_true_period.values()) and not spurious
    test = slice(num_train, num_points)
    test_rmse = float((mean[test] - clean[test]).square().mean().sqrt())
    noise_std = noise_variances(likelihood).detach().sqrt()

    rows = [
        [j + 1, int(period), period in TRUE_PERIODS, float(probabilities[j]), bool(on[j]), float(gibbs_probabilities[j])]
        for j, period in enumerate(CANDIDATE_PERIODS)
    ]  # fmt: skip
    _common.print_table(
        ["latent", "period", "true period", "VI q(b=1)", "VI on", "Gibbs p(b=1)"],
        rows,
        title="Periodic mixture: activation probabilities (VI: sigmoid of the gate logits; Gibbs: Rao-Blackwellised)",
    )
    gibbs_on = gibbs_probabilities > 0.5
    gibbs_success = all(int(gibbs_on[periods == period].sum()) == 1 for period in TRUE_PERIODS) and int(
        gibbs_on.sum()
    ) == len(TRUE_PERIODS)
    print(f"latents on per true period: {on_per_true_period}; spurious periods on: {spurious or 'none'}")
    print(f"exactly one latent per true period and no other: VI {success}, Gibbs {gibbs_success}")
    print(f"test RMSE to the noiseless outputs (t >= {num_train}): {test_rmse:.3f}; learnt noise std "
          f"{', '.join(f'{s:.2f}' for s in noise_std.tolist())}")  # fmt: skip
    print(f"VI {vi_timer.seconds:.1f}s ({steps} steps), Gibbs {gibbs_timer.seconds:.1f}s ({burn_in + sweeps} sweeps)")

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "description": __doc__.splitlines()[0],
        "smoke": args.smoke,
        "data_seed": args.seed,
        "variational_family": model.variational_family,
        "noise_before_mixing": args.noise_before_mixing,
        "num_train": num_train,
        "num_test": num_points - num_train,
        "noise_std_true": NOISE_STD,
        "noise_std_learnt": noise_std.tolist(),
        "true_mixing": true_mixing.tolist(),
        "latents": [dict(zip(["latent", "period", "true_period", "q_b", "on", "gibbs"], r, strict=True)) for r in rows],
        "on_per_true_period": on_per_true_period,
        "spurious_periods_on": spurious,
        "exactly_one_per_true_period": success,
        "gibbs_exactly_one_per_true_period": gibbs_success,
        "test_rmse_to_noiseless": test_rmse,
        "vi": {"adam_steps": steps, "learning_rate": LEARNING_RATE, "seconds": vi_timer.seconds, "final_loss": trace[-1]},
        "gibbs": {"burn_in": burn_in, "sweeps": sweeps, "seconds": gibbs_timer.seconds},
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {json_path}")

    fig = plt.figure(figsize=(12, 9), constrained_layout=True)
    grid = fig.add_gridspec(3, 2, width_ratios=[1, 1.6])
    bars, heat = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1:, 0])
    index = torch.arange(len(CANDIDATE_PERIODS))
    bars.bar(index - 0.2, probabilities, width=0.4, color="C0", label="VI: σ(ρ)")
    bars.bar(index + 0.2, gibbs_probabilities, width=0.4, color="C3", label="Gibbs")
    bars.axhline(0.5, color="0.5", lw=0.8, ls=":")
    bars.set_xticks(index, [f"T={int(period)}" for period in CANDIDATE_PERIODS], fontsize=8)
    bars.set_ylim(0, 1.05)
    bars.set_ylabel("q(b = 1)")
    bars.set_title("(a) activation probabilities (true periods: 7, 17, 23)")
    bars.legend(fontsize=8)
    mixing_mean = model.mixing_posterior()[0].detach()
    limit = float(mixing_mean.abs().max())
    image = heat.imshow(mixing_mean, cmap="RdBu_r", vmin=-limit, vmax=limit)
    heat.set_xticks(index, [f"T={int(period)}" for period in CANDIDATE_PERIODS], fontsize=8, rotation=90)
    heat.set_yticks(range(NUM_OUTPUTS), [f"output {i + 1}" for i in range(NUM_OUTPUTS)], fontsize=8)
    heat.set_title("(b) posterior means of the mixing matrix H")
    fig.colorbar(image, ax=heat, shrink=0.8)
    shown = slice(max(0, 2 * num_train - num_points), num_points)  # as many training times as test times
    times = t[shown, 0]
    for row, output in enumerate((0, 3, 8)):
        axis = fig.add_subplot(grid[row, 1])
        axis.scatter(times, y[shown, output], s=5, color="C0", label="data")
        axis.plot(times, clean[shown, output], color="k", lw=0.8, label="noiseless")
        centre, spread = mean[shown, output], 2 * variance[shown, output].sqrt()
        axis.plot(times, centre, color="C2", label="GP-ALPS mean ± 2 sd")
        axis.fill_between(times, centre - spread, centre + spread, color="C2", alpha=0.25)
        axis.axvline(num_train - 0.5, color="0.3", ls="--", lw=1)
        axis.set_title(f"({chr(ord('c') + row)}) output {output + 1}", fontsize=10)
        if row == 0:
            axis.legend(fontsize=8, ncol=3, loc="upper left")
    axis.set_xlabel("t (train left of the dashed line, test right)")
    where = "on the signals before mixing" if args.noise_before_mixing else "on each output"
    fig.suptitle(f"GP-ALPS (GP-ALPS §4.2): periods 7, 17, 23 mixed into 9 outputs, noise {where}", fontsize=12)
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
