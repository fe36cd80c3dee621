"""
GP-ALPS: a multi-output GP that selects its latent processes
============================================================

GP-ALPS (Berkovich, Perim & Bruinsma) mixes m candidate latent GPs into p outputs, f(t) = H (x(t) ∘ b), with a
Bernoulli gate b_j on every latent. Variational inference gives each gate's posterior probability: the latents the
data need are switched on, the others off. :mod:`gpytorch_iterncgp.alps` has the model, its ELBO with three
variational families for the gates, and an exact Gibbs sampler for small problems to check VI against.

This tutorial follows the paper's §4.2: three periodic signals (periods 7, 17 and 23) mixed into 9 noisy outputs,
and nine candidate latents with periods 3, 7, 7, 11, 13, 17, 19, 23 and 23 (two duplicates of true periods).
"""

# %%
# Data
# ----
import math
import os

import gpytorch
import matplotlib.pyplot as plt
import torch

from gpytorch_iterncgp.alps import GPALPS, GPALPSELBO, gibbs_sample_model

SMOKE = os.environ.get("GPYTORCH_ITERNCGP_SMOKE", "0") not in ("", "0")
NUM_POINTS, NUM_TRAIN, STEPS, SWEEPS, BURN_IN = (120, 90, 60, 40, 10) if SMOKE else (400, 300, 1500, 400, 100)
TRUE_PERIODS = (7.0, 17.0, 23.0)
CANDIDATE_PERIODS = (3.0, 7.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0, 23.0)
NUM_OUTPUTS = 9
DTYPE = torch.float64

generator = torch.Generator().manual_seed(0)
t = torch.arange(NUM_POINTS, dtype=DTYPE)[:, None]
phases = 2 * math.pi * torch.rand(3, generator=generator, dtype=DTYPE)
signals = torch.sin(2 * math.pi * t / torch.tensor(TRUE_PERIODS, dtype=DTYPE) + phases)  # (n, 3)
mixing = torch.cat([torch.eye(3, dtype=DTYPE), torch.randn(NUM_OUTPUTS - 3, 3, generator=generator, dtype=DTYPE)])
clean = signals @ mixing.T  # (n, 9): H* = [I₃ Z]ᵀ
y = clean + torch.randn(clean.shape, generator=generator, dtype=DTYPE)  # noise standard deviation 1
train = slice(0, NUM_TRAIN)

# %%
# The model
# ---------
# One single-sinusoid kernel per candidate latent with a fixed period (GPyTorch's ``CosineKernel`` computes
# cos(π|t − t′| / period_length), so a period T needs ``period_length = T / 2``), 12 inducing inputs shared by the
# latents, and the spike-and-slab family: a closed gate returns both H's column and the latent to their prior, so a
# latent that is not needed is switched off rather than shrunk.


def periodic_kernel(period):
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.CosineKernel())
    kernel.base_kernel.period_length = period / 2
    kernel.outputscale = 1.0
    return kernel.requires_grad_(False)


model = GPALPS(
    [periodic_kernel(period) for period in CANDIDATE_PERIODS],
    torch.linspace(0, NUM_TRAIN - 1, 12, dtype=DTYPE)[:, None],
    num_outputs=NUM_OUTPUTS,
    variational_family="spike_and_slab",
).double()
likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(
    num_tasks=NUM_OUTPUTS, rank=0, has_global_noise=False
).double()
likelihood.task_noises = torch.ones(NUM_OUTPUTS, dtype=DTYPE)

# %%
# Variational inference: Adam on the ELBO
# ---------------------------------------
elbo = GPALPSELBO(likelihood, model, num_data=NUM_TRAIN, num_samples=8)
parameters = [p for p in (*model.parameters(), *likelihood.parameters()) if p.requires_grad]
optimizer = torch.optim.Adam(parameters, lr=0.1)
trace = []
for _ in range(STEPS):
    optimizer.zero_grad()
    loss = -elbo(model(t[train]), y[train])
    loss.backward()
    optimizer.step()
    trace.append(loss.item())
probabilities = model.activation_probabilities().detach()
print("VI, q(b_j = 1):", [f"{p:.3f}" for p in probabilities.tolist()])
print("selected periods:", [CANDIDATE_PERIODS[j] for j in torch.nonzero(model.selected_latents()).flatten().tolist()])

# %%
# The exact Gibbs sampler over the gates (the latents marginalised when a gate is drawn), the reference for VI:
gibbs = gibbs_sample_model(
    model,
    likelihood,
    t[train],
    y[train],
    num_samples=SWEEPS,
    burn_in=BURN_IN,
    generator=torch.Generator().manual_seed(2),
)
print("Gibbs, p(b_j = 1):", [f"{p:.3f}" for p in gibbs.activation_probabilities.tolist()])

# %%
# Gates and predictions
# ---------------------
# Left: VI's and Gibbs' gate probabilities per candidate latent (true periods marked). At the full size VI switches
# on exactly one latent per true period (0.9998, 0.9999, 0.9997) and nothing else (≤ 0.033), as Gibbs does; the test
# RMSE to the noiseless outputs is 0.079. Right: the predictive mean of the first output beyond the training range.
with torch.no_grad():
    mean, variance = model.predict(t, num_samples=256, generator=torch.Generator().manual_seed(1))
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.6]})
positions = torch.arange(len(CANDIDATE_PERIODS))
left.bar(positions - 0.2, probabilities, width=0.4, label="VI (spike and slab)")
left.bar(positions + 0.2, gibbs.activation_probabilities, width=0.4, label="Gibbs")
left.set_xticks(positions, [f"{p:.0f}" + ("*" if p in TRUE_PERIODS else "") for p in CANDIDATE_PERIODS])
left.set_xlabel("period of the candidate latent (* true)")
left.set_ylabel("probability the latent is on")
left.legend(fontsize=8)
right.plot(t[:, 0], clean[:, 0], "k--", label="noiseless output 1")
right.scatter(t[train, 0], y[train, 0], s=4, color="gray", label="training data")
right.plot(t[:, 0], mean[:, 0], label="GP-ALPS predictive mean")
std = variance[:, 0].sqrt()
right.fill_between(t[:, 0], mean[:, 0] - 2 * std, mean[:, 0] + 2 * std, alpha=0.3)
right.axvline(NUM_TRAIN - 0.5, color="k", linewidth=0.8)
right.set_xlabel("t")
right.legend(fontsize=8, loc="upper left")
fig.tight_layout()
plt.show()
