"""GP-ALPS on a square wave (GP-ALPS §4.1): which of 8 harmonics does the signal need? VI against Gibbs.

One output (``p = 1``): a square wave of frequency 0.05 Hz (period 20 s, amplitude 1) sampled every 0.5 s on
[0, 60) s, plus Gaussian noise of standard deviation 0.1. Its Fourier series has only odd harmonics, with amplitudes
4/(πk): the candidates are ``m = 8`` latent GPs with single-sinusoid kernels at the frequencies ``i · 0.05`` Hz,
``i = 1..8`` (the seed's "linear-periodic" kernel: a linear kernel on (cos, sin) features, i.e. GPyTorch's
``CosineKernel`` times an outputscale; ``CosineKernel`` computes cos(π|t − t′|/p), so frequency f needs
``period_length = 1/(2f)``). Periods and outputscales (1) are fixed; the harmonics above the 8th (amplitude ≤ 0.14)
are left to the noise variance, which VI learns.

* **VI**: :class:`~gpytorch_iterncgp.alps.GPALPS` + :class:`~gpytorch_iterncgp.alps.GPALPSELBO` (12 shared
  inducing inputs on the grid, prior activation 0.5, Adam, 8 samples of (H, b) per step).
* **Gibbs**: :func:`~gpytorch_iterncgp.alps_gibbs.gibbs_sample_model` on the exact GP prior at the data, with the
  kernels and the noise variance that VI ended with.

Expected (GP-ALPS Figure 1): harmonics 1, 3, 5, 7 on (probability > 0.5), 2, 4, 6, 8 off, VI and Gibbs close. The
figure ``alps_square_wave.png`` shows the reconstructions and both methods' activation probabilities; the numbers
go to the terminal and to ``alps_square_wave.json``.

    python examples/alps_square_wave.py            # about 1 minute on one (shared) CPU core
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

from gpytorch_iterncgp.alps import GPALPS, GPALPSELBO, noise_variances
from gpytorch_iterncgp.alps_gibbs import gibbs_sample_model

NAME = "alps_square_wave"
FREQUENCY = 0.05
NUM_LATENTS = 8
NOISE_STD = 0.1
LEARNING_RATE = 0.1


def square_wave(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.sin(2 * math.pi * FREQUENCY * t) >= 0, 1.0, -1.0)


def harmonic_kernel(i: int) -> gpytorch.kernels.Kernel:
    """A single sinusoid at frequency i·f: cos(2π i f (t − t′)), outputscale 1, all fixed."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.CosineKernel())
    kernel.base_kernel.period_length = 1 / (2 * i * FREQUENCY)
    kernel.outputscale = 1.0
    kernel.requires_grad_(False)
    return kernel


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(seed=0)
    num_points, steps, sweeps, burn_in = (40, 150, 200, 50) if args.smoke else (120, 1500, 2000, 500)
    t = torch.arange(num_points, dtype=torch.float64)[:, None] * (60.0 / num_points)
    clean = square_wave(t[:, 0])
    y = (clean + NOISE_STD * torch.randn(num_points)).unsqueeze(-1)

    inducing = torch.linspace(0, 60, 12)[:, None]
    model = GPALPS([harmonic_kernel(i) for i in range(1, NUM_LATENTS + 1)], inducing, num_outputs=1)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=1, rank=0, has_global_noise=False)
    likelihood.task_noises = torch.tensor([0.1])
    elbo = GPALPSELBO(likelihood, model, num_data=num_points, num_samples=8)
    parameters = [p for p in (*model.parameters(), *likelihood.parameters()) if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE)
    trace = []
    with _common.Timer() as vi_timer:
        for _ in tqdm(range(steps), desc="VI: Adam on the ELBO", disable=args.quiet):
            optimizer.zero_grad()
            loss = -elbo(model(t), y)
            loss.backward()
            optimizer.step()
            trace.append(float(loss.detach()))
    vi = model.activation_probabilities().detach()
    with torch.no_grad():
        vi_mean, vi_variance = model.predict(t, num_samples=512, generator=torch.Generator().manual_seed(1))

    if not args.quiet:
        print(f"Gibbs: {burn_in} + {sweeps} sweeps", flush=True)
    with _common.Timer() as gibbs_timer:
        gibbs = gibbs_sample_model(
            model, likelihood, t, y, num_samples=sweeps, burn_in=burn_in, generator=torch.Generator().manual_seed(2)
        )
    signal = torch.einsum("spm,snm->snp", gibbs.mixing * gibbs.gates[:, None].to(torch.float64), gibbs.latents)
    gibbs_mean, gibbs_std = signal.mean(0)[:, 0], signal.std(0)[:, 0]

    odd = torch.arange(1, NUM_LATENTS + 1) % 2 == 1
    rows = [
        [i + 1, f"{(i + 1) * FREQUENCY:.2f}", 4 / (math.pi * (i + 1)) if odd[i] else 0.0, float(vi[i]),
         float(gibbs.activation_probabilities[i]), float(gibbs.activation_frequencies[i])]
        for i in range(NUM_LATENTS)
    ]  # fmt: skip
    _common.print_table(
        ["harmonic", "Hz", "amplitude", "VI q(b=1)", "Gibbs p(b=1)", "Gibbs freq."],
        rows,
        title="Square wave: activation probabilities (VI: sigmoid of the gate logits; Gibbs: Rao-Blackwellised, "
        "and the raw frequency of b=1)",
    )
    selected_odd = bool((vi[odd] > 0.5).all() and (vi[~odd] < 0.5).all())
    agreement = float((vi - gibbs.activation_probabilities).abs().max())
    vi_rmse = float((vi_mean[:, 0] - clean).square().mean().sqrt())
    gibbs_rmse = float((gibbs_mean - clean).square().mean().sqrt())
    noise = float(noise_variances(likelihood).detach().sqrt())
    print(f"VI selects exactly the odd harmonics: {selected_odd}; max |VI - Gibbs| = {agreement:.3f}")
    print(f"RMSE to the noiseless square wave: VI {vi_rmse:.3f}, Gibbs {gibbs_rmse:.3f}; learnt noise std {noise:.3f}")
    print(f"VI {vi_timer.seconds:.1f}s ({steps} steps), Gibbs {gibbs_timer.seconds:.1f}s ({burn_in + sweeps} sweeps)")

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "description": __doc__.splitlines()[0],
        "smoke": args.smoke,
        "num_points": num_points,
        "noise_std_true": NOISE_STD,
        "noise_std_learnt": noise,
        "vi": {"adam_steps": steps, "learning_rate": LEARNING_RATE, "seconds": vi_timer.seconds, "final_loss": trace[-1]},
        "gibbs": {"burn_in": burn_in, "sweeps": sweeps, "seconds": gibbs_timer.seconds},
        "harmonics": [dict(zip(["harmonic", "hz", "amplitude", "vi", "gibbs", "gibbs_frequency"], r, strict=True)) for r in rows],
        "vi_selects_odd_harmonics": selected_odd,
        "max_abs_vi_minus_gibbs": agreement,
        "rmse_to_square_wave": {"vi": vi_rmse, "gibbs": gibbs_rmse},
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {json_path}")

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), constrained_layout=True)
    top.plot(t[:, 0], clean, color="0.6", lw=1, label="square wave")
    top.scatter(t[:, 0], y[:, 0], s=8, color="k", label="data")
    std = vi_variance[:, 0].sqrt()
    top.plot(t[:, 0], vi_mean[:, 0], color="C0", label="GP-ALPS (VI) mean ± 2 sd")
    top.fill_between(t[:, 0], vi_mean[:, 0] - 2 * std, vi_mean[:, 0] + 2 * std, color="C0", alpha=0.2)
    top.plot(t[:, 0], gibbs_mean, color="C3", ls="--", label="Gibbs mean ± 2 sd")
    top.fill_between(t[:, 0], gibbs_mean - 2 * gibbs_std, gibbs_mean + 2 * gibbs_std, color="C3", alpha=0.15)
    top.set_xlabel("t (s)")
    top.set_title(f"(a) reconstruction; RMSE to the square wave: VI {vi_rmse:.3f}, Gibbs {gibbs_rmse:.3f}")
    top.legend(fontsize=8, ncol=4, loc="lower left")
    index = torch.arange(1, NUM_LATENTS + 1)
    bottom.bar(index - 0.2, vi, width=0.4, color="C0", label="VI: σ(ρ)")
    bottom.bar(index + 0.2, gibbs.activation_probabilities, width=0.4, color="C3", label="Gibbs")
    bottom.axhline(0.5, color="0.5", lw=0.8, ls=":")
    bottom.set_xticks(index, [f"{i}·f\n{i * FREQUENCY:.2f} Hz" for i in index.tolist()])
    bottom.set_ylim(0, 1.05)
    bottom.set_ylabel("activation probability")
    bottom.set_title(f"(b) gate posteriors, max |VI − Gibbs| = {agreement:.3f}")
    bottom.legend(fontsize=8)
    fig.suptitle("GP-ALPS (GP-ALPS §4.1): a 0.05 Hz square wave, 8 candidate harmonics", fontsize=12)
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
