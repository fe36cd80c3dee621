"""GP-ALPS: which variational family of the gates selects the right latents? Concrete, Bernoulli, spike-and-slab.

Each family of :class:`~gpytorch_iterncgp.alps.GPALPS` (``variational_family``: the paper's ``"concrete"``,
``"bernoulli"``, ``"spike_and_slab"``) is trained exactly as the examples train it, as a new user would: Adam
(learning rate 0.1) on every free parameter (gate logits and per-output noise variances included) of the ELBO of
:class:`~gpytorch_iterncgp.alps.GPALPSELBO` (8 draws of (H, b) per step under ``"concrete"``), prior activation 0.5,
initial activation 0.9, the model's other defaults; fixed kernels. Problems (``--problems``), each over the seeds
``--seeds`` (a seed draws the data and, through ``torch.manual_seed``, the initial mixing means and the Concrete
draws; every family starts from the same initial q):

* **square waves** (GP-ALPS §4.1; ``examples/alps_square_wave.py``): one output, a square wave of frequency ``f``
  (amplitude 1) at ``n`` equally spaced times on ``[0, span)`` plus Gaussian noise; ``m = 8`` candidate latents
  with single-sinusoid kernels at ``i f``, ``i = 1..8`` (``CosineKernel`` times an outputscale of 1). Present: the
  odd harmonics (amplitudes ``4/(pi i)``); absent: the even ones. 12 inducing inputs on a grid over the span.
  ``square_0.05``: the example's problem (phase 0); the others at frequencies and noise levels no example uses,
  with a phase drawn per seed. The *sampled* waves are not exactly odd-harmonic: with an odd number of samples per
  period (``square_0.1``: 25) the half-wave symmetry breaks, and the even harmonics have amplitudes of about 0.08
  in the data (``square_0.05``: 0.03, the sample at each jump; ``square_0.35_noisy``: below 0.001), small beside
  the residual of the harmonics above the 8th (standard deviation about 0.2), which the learnt noise takes up.
* **periodic mixtures** (GP-ALPS §4.2; ``examples/alps_periodic_mixture.py``): 3 unit sinusoids (phases drawn)
  mixed by ``H* = [I_3 Z]^T`` (``Z`` standard normal) into 9 outputs, independent noise of standard deviation 1 on
  each output; 9 candidate latents whose periods include duplicates of true ones. Present: for each true period,
  exactly one of its candidates; absent: the rest. 12 inducing inputs over the training range; the times after
  the training range test. ``mixture_7_17_23``: the example's problem; ``mixture_5_11_19``: other periods.

Scores per run: **selected** (the examples' criterion, ``q(b_j = 1) > 1/2``: every present latent on, one per true
component, every other latent off), **confident** (present gates > 0.8, every other gate < 0.2), the largest gate of
an absent latent, the smallest gate of a present one, the **RMSE** of the predictive mean (``GPALPS.predict``, 512
draws) to the noiseless signal (square waves: at the training times, the example's reconstruction RMSE;
mixtures: at the test times, the example's test RMSE), and the wall time of training. Pooled over problems and
seeds: the selection rates, and the RMSE relative to the best family on the same problem and seed (mean and
standard deviation). The winner: the highest rate of correct selections (both criteria summed), ties broken by the
mean relative RMSE.

Writes ``results/alps_family.json`` and ``.png`` (``--smoke``, or its alias ``--quick``: tiny settings,
``alps_family_smoke.*``).

    python -m benchmarks.alps_family            # about 20 minutes on one unloaded CPU thread
    python -m benchmarks.alps_family --smoke    # seconds: a functional check
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.common import add_smoke_flag, load_average, machine
from gpytorch_iterncgp.alps import GPALPS, GPALPSELBO, VARIATIONAL_FAMILIES

RESULTS = Path(__file__).resolve().parent / "results"
DTYPE = torch.float64
LEARNING_RATE = 0.1
NUM_SAMPLES = 8  # draws of (H, b) per step under "concrete", as in the examples
NUM_INDUCING = 12
CONFIDENT_ON, CONFIDENT_OFF = 0.8, 0.2
CHECKPOINT_EVERY = 100  # steps between the recordings of the selection criteria


@dataclass(frozen=True)
class SquareWave:
    """A square wave of ``frequency`` at ``num_points`` equally spaced times on ``[0, span)``, noise ``noise_std``;
    phase 0 or drawn per seed (``random_phase``)."""

    frequency: float
    span: float
    num_points: int
    noise_std: float
    random_phase: bool
    num_latents: int = 8
    kind: str = "square_wave"


@dataclass(frozen=True)
class PeriodicMixture:
    """Sinusoids of ``true_periods`` mixed into 9 outputs, noise ``noise_std`` on each output; candidate latents of
    ``candidate_periods``; the first ``num_train`` of the integer times train, the next ``num_test`` test."""

    true_periods: tuple[float, ...]
    candidate_periods: tuple[float, ...]
    num_train: int
    num_test: int
    noise_std: float = 1.0
    num_outputs: int = 9
    kind: str = "periodic_mixture"


PROBLEMS: dict[str, SquareWave | PeriodicMixture] = {
    "square_0.05": SquareWave(0.05, span=60.0, num_points=120, noise_std=0.1, random_phase=False),  # the example's
    "square_0.1": SquareWave(0.1, span=60.0, num_points=150, noise_std=0.1, random_phase=True),
    "square_0.35_noisy": SquareWave(0.35, span=20.0, num_points=150, noise_std=0.3, random_phase=True),
    "mixture_7_17_23": PeriodicMixture(  # the example's
        (7.0, 17.0, 23.0), (3.0, 7.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0, 23.0), num_train=300, num_test=100
    ),
    "mixture_5_11_19": PeriodicMixture(
        (5.0, 11.0, 19.0), (3.0, 5.0, 5.0, 8.0, 11.0, 13.0, 19.0, 19.0, 29.0), num_train=200, num_test=100
    ),
}


@dataclass
class Instance:
    """One problem at one seed: what a run trains on and how it is scored. ``groups``: for each true component, the
    candidate latents that can represent it (exactly one should be on); ``absent``: the latents that should be
    off."""

    train_t: torch.Tensor
    train_y: torch.Tensor
    score_t: torch.Tensor
    score_clean: torch.Tensor
    kernels: list[gpytorch.kernels.Kernel]
    inducing: torch.Tensor
    initial_noise: float
    groups: list[list[int]]
    absent: list[int]


def single_sinusoid_kernel(period: float) -> gpytorch.kernels.Kernel:
    """:math:`k(t, t') = \\cos(2\\pi (t - t') / P)`, outputscale 1, fixed (``CosineKernel`` computes
    :math:`\\cos(\\pi |t - t'| / p)`, so ``period_length = P / 2``)."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.CosineKernel()).to(DTYPE)
    kernel.base_kernel.period_length = period / 2
    kernel.outputscale = 1.0
    kernel.requires_grad_(False)
    return kernel


def instance(problem: SquareWave | PeriodicMixture, seed: int) -> Instance:
    """The data of ``problem`` drawn with ``seed``, its candidate kernels and inducing inputs."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(problem, SquareWave):
        t = torch.arange(problem.num_points, dtype=DTYPE)[:, None] * (problem.span / problem.num_points)
        phase = 2 * math.pi * float(torch.rand((), generator=generator, dtype=DTYPE)) if problem.random_phase else 0.0
        clean = torch.where(torch.sin(2 * math.pi * problem.frequency * t + phase) >= 0, 1.0, -1.0).to(DTYPE)
        noisy = clean + problem.noise_std * torch.randn(clean.shape, generator=generator, dtype=DTYPE)
        harmonics = range(1, problem.num_latents + 1)
        return Instance(
            train_t=t,
            train_y=noisy,
            score_t=t,
            score_clean=clean,
            kernels=[single_sinusoid_kernel(1 / (i * problem.frequency)) for i in harmonics],
            inducing=torch.linspace(0, problem.span, NUM_INDUCING, dtype=DTYPE)[:, None],
            initial_noise=0.1,
            groups=[[i - 1] for i in harmonics if i % 2 == 1],
            absent=[i - 1 for i in harmonics if i % 2 == 0],
        )
    num_points = problem.num_train + problem.num_test
    t = torch.arange(num_points, dtype=DTYPE)[:, None]
    num_signals = len(problem.true_periods)
    phases = 2 * math.pi * torch.rand(num_signals, generator=generator, dtype=DTYPE)
    signals = torch.sin(2 * math.pi * t / torch.tensor(problem.true_periods, dtype=DTYPE) + phases)
    z = torch.randn(problem.num_outputs - num_signals, num_signals, generator=generator, dtype=DTYPE)
    clean = signals @ torch.cat([torch.eye(num_signals, dtype=DTYPE), z]).mT
    noisy = clean + problem.noise_std * torch.randn(clean.shape, generator=generator, dtype=DTYPE)
    train, test = slice(0, problem.num_train), slice(problem.num_train, num_points)
    candidates = problem.candidate_periods
    return Instance(
        train_t=t[train],
        train_y=noisy[train],
        score_t=t[test],
        score_clean=clean[test],
        kernels=[single_sinusoid_kernel(period) for period in candidates],
        inducing=torch.linspace(0, problem.num_train - 1, NUM_INDUCING, dtype=DTYPE)[:, None],
        initial_noise=1.0,
        groups=[[j for j, c in enumerate(candidates) if c == period] for period in problem.true_periods],
        absent=[j for j, c in enumerate(candidates) if c not in problem.true_periods],
    )


def selection_scores(probabilities: torch.Tensor, groups: list[list[int]], absent: list[int]) -> dict:
    """The selection criteria on the activation probabilities ``(m,)``.

    ``selected(on, off)``: in every group exactly one gate above ``on`` and the group's other gates below ``off``,
    and every absent gate below ``off``; ``selected`` is the examples' criterion (``on = off = 1/2``), ``confident``
    the strict one (0.8, 0.2). ``max_off_gate``: the largest gate that should be off (absent latents and, in each
    group, all but its largest); ``min_on_gate``: the smallest of the groups' largest gates.
    """
    values = probabilities.tolist()
    chosen = [max(group, key=lambda j: values[j]) for group in groups]
    should_be_off = absent + [j for group, best in zip(groups, chosen, strict=True) for j in group if j != best]
    max_off = max((values[j] for j in should_be_off), default=0.0)
    min_on = min((values[j] for j in chosen), default=1.0)

    def selected(on: float, off: float) -> bool:
        return min_on > on and max_off < off

    return {
        "selected": selected(0.5, 0.5),
        "confident": selected(CONFIDENT_ON, CONFIDENT_OFF),
        "max_off_gate": max_off,
        "min_on_gate": min_on,
    }


def train(family: str, data: Instance, steps: int, seed: int) -> dict:
    """Trains GP-ALPS in ``family`` on ``data`` as the examples do and scores it."""
    torch.manual_seed(seed)  # the initial mixing means (the same in every family) and the Concrete draws
    num_outputs = data.train_y.shape[-1]
    model = GPALPS(data.kernels, data.inducing, num_outputs=num_outputs, variational_family=family)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(
        num_tasks=num_outputs, rank=0, has_global_noise=False
    ).to(DTYPE)
    likelihood.task_noises = torch.full((num_outputs,), data.initial_noise, dtype=DTYPE)
    elbo = GPALPSELBO(likelihood, model, num_data=len(data.train_t), num_samples=NUM_SAMPLES)
    parameters = [p for p in (*model.parameters(), *likelihood.parameters()) if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE)
    checkpoints, seconds = [], 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = -elbo(model(data.train_t), data.train_y)
        loss.backward()
        optimizer.step()
        seconds += time.perf_counter() - start
        if step % CHECKPOINT_EVERY == 0 or step == steps:
            probabilities = model.activation_probabilities().detach()
            scores = selection_scores(probabilities, data.groups, data.absent)
            checkpoints.append({"step": step, "selected": scores["selected"], "confident": scores["confident"]})
    probabilities = model.activation_probabilities().detach()
    settled = [c["step"] for k, c in enumerate(checkpoints) if all(later["confident"] for later in checkpoints[k:])]
    mean, _ = model.predict(data.score_t, num_samples=512, generator=torch.Generator().manual_seed(1))
    return {
        "family": family,
        "seed": seed,
        "activation_probabilities": probabilities.tolist(),
        **selection_scores(probabilities, data.groups, data.absent),
        "rmse": float((mean - data.score_clean).square().mean().sqrt()),
        "final_loss": float(loss.detach()),
        "seconds": seconds,
        "ms_per_step": 1000 * seconds / max(steps, 1),
        "steps_to_confident": settled[0] if settled else None,
        "checkpoints": checkpoints,
    }


def _mean_std(values: list[float]) -> dict:
    tensor = torch.tensor(values, dtype=DTYPE)
    return {"mean": float(tensor.mean()), "std": float(tensor.std()) if len(values) > 1 else 0.0}


def _rate_by_step(runs: list[dict]) -> dict[int, float]:
    """The fraction of ``runs`` whose selection is confident at each checkpoint step that they all record."""
    steps = sorted(set.intersection(*({c["step"] for c in run["checkpoints"]} for run in runs)))
    return {
        step: sum(c["confident"] for run in runs for c in run["checkpoints"] if c["step"] == step) / len(runs)
        for step in steps
    }


def summarise(runs: list[dict], families: list[str], problems: list[str]) -> dict:
    """Per family and problem (over seeds), and per family pooled over problems and seeds; the winner."""
    best_rmse = {}
    for run in runs:
        key = (run["problem"], run["seed"])
        best_rmse[key] = min(best_rmse.get(key, math.inf), run["rmse"])
    per_problem, overall = {}, {}
    for family in families:
        mine = [run for run in runs if run["family"] == family]
        per_problem[family] = {}
        for name in problems:
            rows = [run for run in mine if run["problem"] == name]
            per_problem[family][name] = {
                "runs": len(rows),
                "selected": sum(run["selected"] for run in rows),
                "confident": sum(run["confident"] for run in rows),
                "rmse": _mean_std([run["rmse"] for run in rows]),
                "max_off_gate": _mean_std([run["max_off_gate"] for run in rows]),
                "min_on_gate": _mean_std([run["min_on_gate"] for run in rows]),
                "seconds": _mean_std([run["seconds"] for run in rows]),
                "steps_to_confident": [run["steps_to_confident"] for run in rows],
            }
        overall[family] = {
            "runs": len(mine),
            "selected_rate": sum(run["selected"] for run in mine) / len(mine),
            "confident_rate": sum(run["confident"] for run in mine) / len(mine),
            "rmse_relative_to_best": _mean_std(
                [run["rmse"] / best_rmse[(run["problem"], run["seed"])] for run in mine]
            ),
            "max_off_gate": _mean_std([run["max_off_gate"] for run in mine]),
            "min_on_gate": _mean_std([run["min_on_gate"] for run in mine]),
            "ms_per_step": _mean_std([run["ms_per_step"] for run in mine]),
            "confident_rate_by_step": {
                kind: _rate_by_step([run for run in mine if run["kind"] == kind])
                for kind in sorted({run["kind"] for run in mine})
            },
        }
    winner = max(
        families,
        key=lambda f: (
            overall[f]["selected_rate"] + overall[f]["confident_rate"],
            -overall[f]["rmse_relative_to_best"]["mean"],
        ),
    )
    return {"per_problem": per_problem, "overall": overall, "winner": winner}


def plot(output: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families, problems = output["settings"]["families"], output["settings"]["problems"]
    runs, summary = output["runs"], output["summary"]
    fig, (left, middle, right, curve) = plt.subplots(1, 4, figsize=(21, 4.8))
    width = 0.8 / len(families)
    for k, family in enumerate(families):
        x = torch.arange(len(problems)) - 0.4 + (k + 0.5) * width
        rows = [summary["per_problem"][family][name] for name in problems]
        left.bar(x, [r["selected"] / r["runs"] for r in rows], width=width, color=f"C{k}", alpha=0.35)
        left.bar(x, [r["confident"] / r["runs"] for r in rows], width=width, color=f"C{k}", label=family)
        for j, name in enumerate(problems):
            values = [run["rmse"] for run in runs if run["family"] == family and run["problem"] == name]
            middle.scatter([float(x[j])] * len(values), values, color=f"C{k}", s=14, label=family if j == 0 else None)
            middle.plot([float(x[j]) - width / 2, float(x[j]) + width / 2], [sum(values) / len(values)] * 2,
                        color=f"C{k}")  # fmt: skip
        offs = [run["max_off_gate"] for run in runs if run["family"] == family]
        ons = [run["min_on_gate"] for run in runs if run["family"] == family]
        right.scatter([k - 0.15] * len(offs), offs, color=f"C{k}", marker="v", s=14)
        right.scatter([k + 0.15] * len(ons), ons, color=f"C{k}", marker="^", s=14)
        for kind, rates in summary["overall"][family]["confident_rate_by_step"].items():
            style = "-" if kind == "square_wave" else "--"
            curve.plot([int(step) for step in rates], list(rates.values()), style, color=f"C{k}", marker="o", ms=3,
                       label=f"{family}, {kind.replace('_', ' ')}s")  # fmt: skip
    for axis in (left, middle):
        axis.set_xticks(range(len(problems)), problems, rotation=30, ha="right", fontsize=8)
    left.set_ylim(0, 1.05)
    left.set_ylabel("fraction of seeds")
    left.set_title("(a) selection: solid confident (0.8/0.2), pale q > 1/2", fontsize=10)
    left.legend(fontsize=8)
    middle.set_yscale("log")
    middle.set_ylabel("RMSE to the noiseless signal")
    middle.set_title("(b) RMSE, one dot per seed, bar: mean", fontsize=10)
    right.axhspan(CONFIDENT_OFF, CONFIDENT_ON, color="0.9", zorder=0)
    right.set_xticks(range(len(families)), families)
    right.set_ylim(-0.02, 1.02)
    right.set_ylabel("gate probability")
    right.set_title("(c) largest gate that should be off (v), smallest that should be on (^)", fontsize=10)
    curve.set_xlabel("Adam step")
    curve.set_ylabel("fraction of runs")
    curve.set_ylim(-0.02, 1.02)
    curve.set_title("(d) confident selection along training", fontsize=10)
    curve.legend(fontsize=7)
    settings = output["settings"]
    fig.suptitle(
        f"GP-ALPS variational families: {len(settings['seeds'])} seeds per problem, Adam lr {LEARNING_RATE}, "
        f"{settings['steps_square_wave']} / {settings['steps_mixture']} steps (square waves / mixtures)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_flag(parser, "tiny settings (a functional check, seconds)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--families", nargs="+", choices=VARIATIONAL_FAMILIES, default=list(VARIATIONAL_FAMILIES))
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps-square-wave", type=int, default=600, help="Adam steps (the example: 1500)")
    parser.add_argument("--steps-mixture", type=int, default=400, help="Adam steps (the example: 1500)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", help="file name of the results, without suffix (default alps_family)")
    parser.add_argument(
        "--merge", nargs="+", type=Path, help="JSON files of earlier invocations to combine into one result"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps_square_wave, args.steps_mixture, args.seeds = 20, 10, args.seeds[:1]
        args.problems = [name for name in args.problems if name in ("square_0.1", "mixture_5_11_19")] or args.problems
    return args


def _settings(args: argparse.Namespace) -> dict:
    return {
        "families": args.families,
        "problems": args.problems,
        "problem_definitions": {name: asdict(PROBLEMS[name]) for name in args.problems},
        "seeds": args.seeds,
        "steps_square_wave": args.steps_square_wave,
        "steps_mixture": args.steps_mixture,
        "learning_rate": LEARNING_RATE,
        "num_samples_concrete": NUM_SAMPLES,
        "num_inducing": NUM_INDUCING,
        "confident_thresholds": [CONFIDENT_ON, CONFIDENT_OFF],
    }


def merge(paths: list[Path]) -> dict:
    """One result from the JSON files of several invocations (e.g. the problems split over processes): their runs
    concatenated, the problems and seeds united; the families and the other settings must agree."""
    parts = [json.loads(path.read_text()) for path in paths]
    settings = dict(parts[0]["settings"])
    for part in parts[1:]:
        other = part["settings"]
        for key in ("families", "steps_square_wave", "steps_mixture", "learning_rate", "num_samples_concrete"):
            if other[key] != settings[key]:
                raise ValueError(f"{key} differs between the files to merge: {settings[key]} and {other[key]}.")
        settings["problems"] = settings["problems"] + [p for p in other["problems"] if p not in settings["problems"]]
        settings["seeds"] = sorted(set(settings["seeds"]) | set(other["seeds"]))
        settings["problem_definitions"] = {**settings["problem_definitions"], **other["problem_definitions"]}
    runs = [run for part in parts for run in part["runs"]]
    return {
        "machine": parts[0]["machine"],
        "settings": settings,
        "runs": runs,
        "summary": summarise(runs, settings["families"], settings["problems"]),
        "parts": [
            {
                "file": path.name,
                "problems": part["settings"]["problems"],
                "total_seconds": part["total_seconds"],
                "load_average_1min": part["load_average_1min"],
                "machine": part["machine"],
            }
            for path, part in zip(paths, parts, strict=True)
        ],  # fmt: skip
        "total_seconds": sum(part["total_seconds"] for part in parts),
    }


def save(output: dict, out: Path, name: str, figure: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(output, indent=1) + "\n")
    if figure:
        plot(output, out / f"{name}.png")


def report(output: dict, path: Path) -> None:
    for family, row in output["summary"]["overall"].items():
        relative = row["rmse_relative_to_best"]
        print(
            f"{family:14s} selected {row['selected_rate']:.2f} confident {row['confident_rate']:.2f} RMSE / best "
            f"{relative['mean']:.2f} ± {relative['std']:.2f}"
        )
    print(f"winner: {output['summary']['winner']}; {output['total_seconds']:.0f}s; saved {path}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    name = args.name or ("alps_family_smoke" if args.smoke else "alps_family")
    if args.merge:
        output = merge(args.merge)
        save(output, args.out, name)
        if not args.quiet:
            report(output, args.out / f"{name}.json")
        return output
    torch.set_num_threads(max(1, args.threads))
    load_before = load_average()
    start = time.perf_counter()
    runs: list[dict] = []
    output = {"machine": machine(), "settings": _settings(args), "runs": runs}
    for problem_name in args.problems:
        problem = PROBLEMS[problem_name]
        steps = args.steps_square_wave if isinstance(problem, SquareWave) else args.steps_mixture
        for seed in args.seeds:
            data = instance(problem, seed)
            for family in args.families:
                run = {"problem": problem_name, "kind": problem.kind, **train(family, data, steps, seed)}
                runs.append(run)
                save(output, args.out, name, figure=False)  # what is done survives an interruption
                if not args.quiet:
                    gates = " ".join(f"{q:.2f}" for q in run["activation_probabilities"])
                    print(
                        f"{problem_name:18s} seed {seed} {family:14s} selected {run['selected']!s:5s} confident "
                        f"{run['confident']!s:5s} RMSE {run['rmse']:.3f} {run['seconds']:5.1f}s  q(b=1) {gates}",
                        flush=True,
                    )
    output["summary"] = summarise(runs, args.families, args.problems)
    output["total_seconds"] = time.perf_counter() - start
    output["load_average_1min"] = {"before": load_before, "after": load_average()}
    save(output, args.out, name)
    if not args.quiet:
        report(output, args.out / f"{name}.json")
    return output


if __name__ == "__main__":
    main()
