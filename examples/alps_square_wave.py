"""GP-ALPS on a square wave (GP-ALPS §4.1): which of 8 harmonics does the signal need? VI against Gibbs.

One output (``p = 1``): a square wave of frequency 0.05 Hz (period 20 s, amplitude 1) sampled every 0.5 s on
[0, 60) s, plus Gaussian noise of standard deviation 0.1. Its Fourier series has only odd harmonics, with amplitudes
4/(πk): the candidates are ``m = 8`` latent GPs with single-sinusoid kernels at the frequencies ``i · 0.05`` Hz,
``i = 1..8`` (the paper's "linear-periodic" kernel: a linear kernel on (cos, sin) features, i.e. GPyTorch's
``CosineKernel`` times an outputscale; ``CosineKernel`` computes cos(π|t − t′|/p), so frequency f needs
``period_length = 1/(2f)``). Periods and outputscales (1) are fixed; the harmonics above the 8th (amplitude ≤ 0.14)
are left to the noise variance, which VI learns.

* **VI**: :class:`~gpytorch_iterncgp.alps.GPALPS` + :class:`~gpytorch_iterncgp.alps.GPALPSELBO` (12 shared
  inducing inputs on the grid, prior activation 0.5, Adam), in two variational families: the paper's
  ``"concrete"`` (relaxed gates, 8 samples of (H, b) per step, GP-ALPS App. C) and ``"spike_and_slab"``
  (Bernoulli gates, q(H | b = 0) the prior, the ELBO in closed form; GPALPS's default, chosen by
  ``benchmarks/alps_family.py``).
* **Gibbs**: :func:`~gpytorch_iterncgp.alps.gibbs_sample_model` on the exact GP prior at the data, with the
  kernels and the noise variance that each VI run ended with; two chains from different seeds, whose spread
  says how far the chains are from converged.

Expected (GP-ALPS Figure 1): harmonics 1, 3, 5, 7 on (probability > 0.5), 2, 4, 6, 8 off, VI and Gibbs close. The
figure ``alps_square_wave.png`` shows the reconstructions and the activation probabilities; the numbers go to the
terminal and to ``alps_square_wave.json``.

    python examples/alps_square_wave.py            # about 3 minutes on one (shared) CPU core
    python examples/alps_square_wave.py --smoke    # fewer points and steps: seconds
"""

from __future__ import annotations

import json
import math

import _common
import gpytorch
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from gpytorch_iterncgp.alps import GPALPS, GPALPSELBO, gibbs_sample_model, noise_variances

NAME = "alps_square_wave"
FREQUENCY = 0.05
NUM_LATENTS = 8
NOISE_STD = 0.1
LEARNING_RATE = 0.1
FAMILIES = ("concrete", "spike_and_slab")
NUM_CHAINS = 2


def square_wave(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.sin(2 * math.pi * FREQUENCY * t) >= 0, 1.0, -1.0)


def harmonic_kernel(i: int) -> gpytorch.kernels.Kernel:
    """A single sinusoid at frequency i·f: cos(2π i f (t − t′)), outputscale 1, all fixed."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.CosineKernel())
    kernel.base_kernel.period_length = 1 / (2 * i * FREQUENCY)
    kernel.outputscale = 1.0
    kernel.requires_grad_(False)
    return kernel


def fit(family: str, t: torch.Tensor, y: torch.Tensor, steps: int, quiet: bool) -> dict:
    """VI in one variational family, then Gibbs chains at the hyperparameters it ended with."""
    torch.manual_seed(0)  # the same initial q in both families
    num_points = len(t)
    inducing = torch.linspace(0, 60, 12)[:, None]
    kernels = [harmonic_kernel(i) for i in range(1, NUM_LATENTS + 1)]
    model = GPALPS(kernels, inducing, num_outputs=1, variational_family=family)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=1, rank=0, has_global_noise=False)
    likelihood.task_noises = torch.tensor([0.1])
    elbo = GPALPSELBO(likelihood, model, num_data=num_points, num_samples=8)
    parameters = [p for p in (*model.parameters(), *likelihood.parameters()) if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE)
    trace = []
    with _common.Timer() as vi_timer:
        for _ in tqdm(range(steps), desc=f"VI ({family})", disable=quiet):
            optimizer.zero_grad()
            loss = -elbo(model(t), y)
            loss.backward()
            optimizer.step()
            trace.append(float(loss.detach()))
    with torch.no_grad():
        mean, variance = model.predict(t, num_samples=512, generator=torch.Generator().manual_seed(1))
    return {
        "model": model,
        "likelihood": likelihood,
        "vi": model.activation_probabilities().detach(),
        "mean": mean[:, 0],
        "std": variance[:, 0].sqrt(),
        "seconds": vi_timer.seconds,
        "final_loss": trace[-1],
        "noise_std": float(noise_variances(likelihood).detach().sqrt()),
    }


def gibbs(run: dict, t: torch.Tensor, y: torch.Tensor, sweeps: int, burn_in: int) -> dict:
    """``NUM_CHAINS`` Gibbs chains at the run's kernels and noise; their pooled Rao-Blackwellised probabilities,
    the largest difference between chains, and the pooled posterior mean and sd of the signal."""
    chains = []
    with _common.Timer() as timer:
        for seed in range(NUM_CHAINS):
            chains.append(
                gibbs_sample_model(
                    run["model"],
                    run["likelihood"],
                    t,
                    y,
                    num_samples=sweeps,
                    burn_in=burn_in,
                    generator=torch.Generator().manual_seed(2 + seed),
                )
            )
    per_chain = torch.stack([chain.activation_probabilities for chain in chains])  # shape: (chains, m)
    signal = torch.cat(
        [torch.einsum("spm,snm->snp", c.mixing * c.gates[:, None].to(torch.float64), c.latents)[..., 0] for c in chains]
    )
    return {
        "probabilities": per_chain.mean(0),
        "frequencies": torch.stack([chain.activation_frequencies for chain in chains]).mean(0),
        "chain_spread": float((per_chain.max(0).values - per_chain.min(0).values).max()),
        "mean": signal.mean(0),
        "std": signal.std(0),
        "seconds": timer.seconds,
    }


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(seed=0)
    num_points, steps, sweeps, burn_in = (40, 60, 100, 25) if args.smoke else (120, 1500, 2000, 500)
    t = torch.arange(num_points, dtype=torch.float64)[:, None] * (60.0 / num_points)
    clean = square_wave(t[:, 0])
    y = (clean + NOISE_STD * torch.randn(num_points)).unsqueeze(-1)

    runs, samplers = {}, {}
    for family in FAMILIES:
        runs[family] = fit(family, t, y, steps, args.quiet)
        if not args.quiet:
            print(f"Gibbs at the {family} run's noise: {NUM_CHAINS} chains of {burn_in} + {sweeps} sweeps", flush=True)
        samplers[family] = gibbs(runs[family], t, y, sweeps, burn_in)

    odd = torch.arange(1, NUM_LATENTS + 1) % 2 == 1
    rows = []
    for i in range(NUM_LATENTS):
        row = [i + 1, f"{(i + 1) * FREQUENCY:.2f}", 4 / (math.pi * (i + 1)) if odd[i] else 0.0]
        for family in FAMILIES:
            row += [float(runs[family]["vi"][i]), float(samplers[family]["probabilities"][i])]
        rows.append(row)
    header = ["harmonic", "Hz", "amplitude"]
    for family in FAMILIES:
        header += [f"VI {family}", "Gibbs"]
    _common.print_table(
        header,
        rows,
        title="Square wave: activation probabilities (VI: sigmoid of the gate logits; Gibbs: Rao-Blackwellised, "
        f"pooled over {NUM_CHAINS} chains, at the hyperparameters of the VI run to its left)",
    )
    summary_families = {}
    for family in FAMILIES:
        run, sampler = runs[family], samplers[family]
        vi = run["vi"]
        selected_odd = bool((vi[odd] > 0.5).all() and (vi[~odd] < 0.5).all())
        gap = float((vi - sampler["probabilities"]).abs().max())
        vi_rmse = float((run["mean"] - clean).square().mean().sqrt())
        gibbs_rmse = float((sampler["mean"] - clean).square().mean().sqrt())
        print(
            f"{family}: selects exactly the odd harmonics: {selected_odd}; max |VI - Gibbs| = {gap:.3f} "
            f"(Gibbs chains differ by at most {sampler['chain_spread']:.3f}); RMSE to the square wave: VI "
            f"{vi_rmse:.3f}, Gibbs {gibbs_rmse:.3f}; learnt noise std {run['noise_std']:.3f}; VI {run['seconds']:.1f}s "
            f"({steps} steps), Gibbs {sampler['seconds']:.1f}s"
        )
        summary_families[family] = {
            "vi": {"adam_steps": steps, "learning_rate": LEARNING_RATE, "seconds": run["seconds"],
                   "final_loss": run["final_loss"]},
            "gibbs": {"chains": NUM_CHAINS, "burn_in": burn_in, "sweeps": sweeps, "seconds": sampler["seconds"],
                      "max_difference_between_chains": sampler["chain_spread"]},
            "noise_std_learnt": run["noise_std"],
            "vi_probabilities": vi.tolist(),
            "gibbs_probabilities": sampler["probabilities"].tolist(),
            "gibbs_frequencies": sampler["frequencies"].tolist(),
            "vi_selects_odd_harmonics": selected_odd,
            "max_abs_vi_minus_gibbs": gap,
            "rmse_to_square_wave": {"vi": vi_rmse, "gibbs": gibbs_rmse},
        }  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "description": __doc__.splitlines()[0],
        "smoke": args.smoke,
        "num_points": num_points,
        "noise_std_true": NOISE_STD,
        "families": summary_families,
        "threads": torch.get_num_threads(),
    }
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {json_path}")

    best = FAMILIES[-1]
    run, sampler = runs[best], samplers[best]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), constrained_layout=True)
    top.plot(t[:, 0], clean, color="0.6", lw=1, label="square wave")
    top.scatter(t[:, 0], y[:, 0], s=8, color="k", label="data")
    top.plot(t[:, 0], run["mean"], color="C0", label=f"GP-ALPS (VI, {best}) mean ± 2 sd")
    top.fill_between(t[:, 0], run["mean"] - 2 * run["std"], run["mean"] + 2 * run["std"], color="C0", alpha=0.2)
    top.plot(t[:, 0], sampler["mean"], color="C3", ls="--", label="Gibbs mean ± 2 sd")
    lower, upper = sampler["mean"] - 2 * sampler["std"], sampler["mean"] + 2 * sampler["std"]
    top.fill_between(t[:, 0], lower, upper, color="C3", alpha=0.15)
    top.set_xlabel("t (s)")
    rmse = summary_families[best]["rmse_to_square_wave"]
    top.set_title(f"(a) reconstruction; RMSE to the square wave: VI {rmse['vi']:.3f}, Gibbs {rmse['gibbs']:.3f}")
    top.legend(fontsize=8, ncol=4, loc="lower left")
    index = torch.arange(1, NUM_LATENTS + 1)
    width = 0.8 / (len(FAMILIES) + 1)
    for k, family in enumerate(FAMILIES):
        gap = summary_families[family]["max_abs_vi_minus_gibbs"]
        bars = index - 0.4 + (k + 0.5) * width
        bottom.bar(bars, runs[family]["vi"], width=width, color=f"C{k}", label=f"VI {family} (max gap {gap:.3f})")
    bottom.bar(index + 0.4 - 0.5 * width, sampler["probabilities"], width=width, color="C3", label="Gibbs")
    bottom.axhline(0.5, color="0.5", lw=0.8, ls=":")
    bottom.set_xticks(index, [f"{i}·f\n{i * FREQUENCY:.2f} Hz" for i in index.tolist()])
    bottom.set_ylim(0, 1.05)
    bottom.set_ylabel("activation probability")
    bottom.set_title(f"(b) gate posteriors; Gibbs at the {best} run's noise")
    bottom.legend(fontsize=8)
    fig.suptitle("GP-ALPS (GP-ALPS §4.1): a 0.05 Hz square wave, 8 candidate harmonics", fontsize=12)
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
