"""IterNCGP and multi-class EP against SVGP, subset-of-data Laplace and exact Laplace: test accuracy, NLL and ECE
against wall time.

    python -m benchmarks.suite                 # mixture (N = 10^4, both kernel settings) + digits, ~1 h here
    python -m benchmarks.suite --large         # also IterNCGP (R = 10) at N = 10^5: memory and time split
    python -m benchmarks.suite --smoke         # tiny sizes, a minute: checks that everything runs (--quick: the same)
    python -m benchmarks.suite --methods ep svgp --svgp-inducing 1000 --svgp-lr 0.01   # a subset of the methods

(``python benchmarks/suite.py`` runs it too.) Every run happens in a fresh process (one at a time), so its peak
resident memory is its own. All methods use the same fixed Matérn-3/2 kernel per setting; the softmax models share one
predictive rule (E[softmax] under independent latent marginals), EP (multinomial probit) uses its likelihood's own
predictive. The SVGP runs get the wall-clock budget of the slowest IterNCGP-CG or EP run of their setting.

Writes ``results/suite.json`` (and ``results/suite_large.json`` with ``--large``) with the machine they ran
on, one ``results/suite_<dataset>_<setting>.png`` per problem, and prints a table per problem.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import add_smoke_flag, machine
from benchmarks.data import Data

RESULTS = Path(__file__).resolve().parent / "results"

# Kernel settings (lengthscale, outputscale): the paper's, and one that suits the data better.
SETTINGS = {
    "mixture": {"paper": (0.05, 0.05), "sensible": (0.3, 5.0)},
    "digits": {"sensible": (8.0, 10.0)},
}


def load_problem(dataset: str, setting: str, num_train: int, num_test: int, seed: int, device: str = "cpu"):
    """The problem of a job, built inside its worker process (float32), its tensors on ``device``."""
    from gpytorch_iterncgp.datasets import gaussian_mixture

    lengthscale, outputscale = SETTINGS[dataset][setting]
    if dataset == "mixture":
        train_x, train_y, test_x, test_y = gaussian_mixture(
            num_train, num_test, num_classes=10, dim=3, mixture_seed=0, sample_seed=seed, dtype=torch.float32
        )
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        inputs = torch.as_tensor(digits.data, dtype=torch.float32)
        labels = torch.as_tensor(digits.target)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        num_test = min(num_test, len(labels) // 3)
        test, train = order[:num_test], order[num_test:][:num_train]
        center, scale = inputs[train].mean(0), inputs[train].std(0).clamp_min(1e-3)
        inputs = (inputs - center) / scale
        train_x, train_y, test_x, test_y = inputs[train], labels[train], inputs[test], labels[test]
    return Data(f"{dataset}/{setting}", train_x, train_y, test_x, test_y, 10, lengthscale, outputscale).to(device)


def run_job(job: dict) -> dict:
    """Run one method on one problem (in a worker process) and return its results with the job's description."""
    import warnings

    from benchmarks import methods

    torch.set_num_threads(job["threads"])
    warnings.filterwarnings("ignore", message=".*CUDA.*")
    problem = load_problem(
        job["dataset"], job["setting"], job["num_train"], job["num_test"], job["seed"], job.get("device", "cpu")
    )
    kind, options = job["method"], dict(job["options"])
    if kind == "iterncgp":
        result = methods.run_iterncgp(problem, **options)
    elif kind == "ep":
        result = methods.run_ep(problem, **options)
    elif kind == "svgp":
        result = methods.run_svgp(problem, budget_seconds=job["budget"], **options)
    else:
        result = methods.run_sod_laplace(problem, **options)
    return {**job, "num_train": problem.num_train, "num_test": len(problem.test_y), **result}


def iterncgp_jobs(args, path: str) -> list[tuple[str, dict]]:
    """(label, options) of the IterNCGP runs.

    CG with R in {inf, 10} matrix-free (KeOps or chunks), and on the package's default path at this size (K
    evaluated once and cached), where the same time buys many more Newton steps; unit-vector actions.
    """
    name = {"keops": "KeOps", "chunked": "chunked K"}[path]
    short = {"max_newton_steps": args.newton_steps, "max_solver_iterations": args.solver_iterations}
    long = {"max_newton_steps": args.dense_newton_steps, "max_solver_iterations": args.solver_iterations}
    short, long = _preconditioned(args, short), _preconditioned(args, long)
    dense = f"cached dense K, ≤{args.dense_newton_steps} steps"
    return [
        (f"IterNCGP-CG R=∞ ({name})", {**short, "policy": "cg", "compression_rank": None, "kernel_path": path}),
        (f"IterNCGP-CG R=10 ({name})", {**short, "policy": "cg", "compression_rank": 10, "kernel_path": path}),
        (f"IterNCGP-CG R=∞ ({dense})", {**long, "policy": "cg", "kernel_path": "dense"}),
        (f"IterNCGP-CG R=10 ({dense})", {**long, "policy": "cg", "compression_rank": 10, "kernel_path": "dense"}),
        (
            f"IterNCGP-unit R=∞ (cached dense K, j≤{args.unit_iterations})",
            {**short, "policy": "unit", "max_solver_iterations": args.unit_iterations, "kernel_path": "dense"},
        ),
    ]


def _preconditioned(args, options: dict) -> dict:
    """``options`` with ``--preconditioner-rank`` where given (otherwise the package's default preconditioner)."""
    if args.preconditioner_rank is None:
        return options
    return {**options, "preconditioner_rank": args.preconditioner_rank}


def _kernel_path(args) -> str:
    """KeOps if installed (and not switched off), else GPyTorch's kernel in row chunks."""
    if args.no_keops:
        return "chunked"
    try:
        import pykeops  # noqa: F401

        return "keops"
    except ImportError:
        return "chunked"


def run_problem(args, executor, dataset: str, setting: str) -> list[dict]:
    """All methods on one problem, IterNCGP first (its time is SVGP's budget)."""
    base = {
        "dataset": dataset,
        "setting": setting,
        "num_train": args.n_train,
        "num_test": args.n_test,
        "seed": args.seed,
        "threads": args.threads,
        "device": args.device,
    }
    jobs = []
    if "iterncgp" in args.methods:
        jobs += [
            {**base, "label": label, "method": "iterncgp", "options": options}
            for label, options in iterncgp_jobs(args, _kernel_path(args))
        ]
    if "ep" in args.methods:
        options = {"max_sweeps": args.ep_sweeps, "max_solver_iterations": args.solver_iterations}
        label = f"EP, multinomial probit, CG R=∞ (cached dense K, ≤{args.ep_sweeps} sweeps)"
        jobs.append({**base, "label": label, "method": "ep", "options": options})
    runs = []
    for job in jobs:
        runs.append(_submit(executor, job, args))
    timed = [run["fit_seconds"] for run in runs if run["method"] == "ep" or run["options"].get("policy") == "cg"]
    budget = args.svgp_budget or max(timed)
    for num_inducing in args.svgp_inducing if "svgp" in args.methods else []:
        for learning_rate in args.svgp_lr:
            job = {
                **base,
                "label": f"SVGP U={num_inducing} lr={learning_rate:g}",
                "method": "svgp",
                "budget": budget,
                "options": {"num_inducing": num_inducing, "learning_rate": learning_rate},
            }
            runs.append(_submit(executor, job, args))
    num_train = runs[0]["num_train"]
    sizes = sorted({size for size in args.sod_sizes if size < num_train}) if "sod" in args.methods else []
    if num_train <= args.exact_max and "sod" in args.methods:
        sizes.append(num_train)
    for size in sizes:
        label = "exact Laplace (Cholesky)" if size == num_train else f"SoD Laplace n={size}"
        job = {**base, "label": label, "method": "sod", "options": {"subset_size": size}}
        runs.append(_submit(executor, job, args))
    return runs


def _submit(executor, job: dict, args) -> dict:
    result = executor.submit(run_job, job).result()
    last = result["history"][-1]
    if not args.quiet:
        print(
            f"  {result['label']:<48} {result['fit_seconds']:8.1f}s  acc {last['accuracy']:.4f}  "
            f"NLL {last['nll']:.4f}  ECE {last['ece']:.4f}  peak RSS {result['peak_rss_bytes'] / 2**20:7.0f} MiB",
            flush=True,
        )
    return result


def summary_rows(runs: list[dict]) -> list[dict]:
    """One row per run: final metrics, time split and memory."""
    rows = []
    for run in runs:
        last = run["history"][-1]
        row = {
            "method": run["label"],
            "fit_seconds": run["fit_seconds"],
            "accuracy": last["accuracy"],
            "nll": last["nll"],
            "ece": last["ece"],
            "plug_in_nll": last.get("plug_in_nll", float("nan")),
            "plug_in_ece": last.get("plug_in_ece", float("nan")),
            "peak_rss_MiB": run["peak_rss_bytes"] / 2**20,
            "fit_memory_MiB": (run["peak_rss_bytes"] - run["baseline_rss_bytes"]) / 2**20,
            "state_MiB": run.get("state_bytes", 0) / 2**20,
        }
        if run["method"] in ("iterncgp", "ep"):
            row.update(
                products=run["products"],
                product_seconds=run["product_seconds"],
                other_fraction=run["other_seconds"] / run["fit_seconds"],
                buffer_MiB=run["buffer_bytes"] / 2**20,
                buffer_columns=run["buffer_columns"],
            )
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    header = f"{'method':<50} {'time s':>8} {'acc':>7} {'NLL':>7} {'ECE':>7} {'RSS MiB':>8} {'+fit MiB':>8}"
    header += f" {'state MiB':>9}"
    print(header + f" {'products':>8} {'in K':>6}")
    for row in rows:
        line = (
            f"{row['method']:<50} {row['fit_seconds']:8.1f} {row['accuracy']:7.4f} {row['nll']:7.4f} "
            f"{row['ece']:7.4f} {row['peak_rss_MiB']:8.0f} {row['fit_memory_MiB']:8.0f} {row['state_MiB']:9.1f}"
        )
        if "products" in row:
            line += f" {row['products']:8d} {1 - row['other_fraction']:6.1%}"
        print(line)


def markdown_table(rows: list[dict]) -> str:
    """The summary as a Markdown table (for the READMEs)."""
    lines = [
        "| method | time [s] | test acc | test NLL | test ECE | NLL / ECE of softmax(mean) | peak RSS [MiB] (fit adds) "
        "| products (time in K) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        products = f"{row['products']} ({1 - row['other_fraction']:.0%})" if "products" in row else "–"
        lines.append(
            f"| {row['method']} | {row['fit_seconds']:.1f} | {row['accuracy']:.3f} | {row['nll']:.3f} | "
            f"{row['ece']:.3f} | {row['plug_in_nll']:.3f} / {row['plug_in_ece']:.3f} | "
            f"{row['peak_rss_MiB']:.0f} ({row['fit_memory_MiB']:.0f}) | {products} |"
        )
    return "\n".join(lines)


SVGP_SHOWN = 3  # the figures show the best SVGP settings (all are in the JSON and the table), as the paper does


def plot_problem(title: str, runs: list[dict], path: Path) -> None:
    """Accuracy, NLL and ECE against wall time (log scale), one line per method, and peak memory per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 5), gridspec_kw={"width_ratios": [1, 1, 1, 1.1]})
    styles = {"iterncgp": ("-", "o"), "svgp": ("--", None), "sod": (":", "s")}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sod = [run for run in runs if run["method"] == "sod"]
    svgp = sorted((run for run in runs if run["method"] == "svgp"), key=lambda run: run["history"][-1]["nll"])
    lines = [run for run in runs if run["method"] == "iterncgp"] + svgp[:SVGP_SHOWN]
    for index, run in enumerate(lines):
        linestyle, marker = styles[run["method"]]
        times = [max(entry["time"], 1e-3) for entry in run["history"]]
        for axis, metric in zip(axes[:3], ("accuracy", "nll", "ece"), strict=True):
            axis.plot(
                times,
                [entry[metric] for entry in run["history"]],
                linestyle=linestyle,
                marker=marker,
                markersize=3,
                color=colors[index % len(colors)],
                linewidth=2.2 if run["method"] == "iterncgp" else 1.2,
                label=run["label"],
            )
    if sod:
        times = [max(run["fit_seconds"], 1e-3) for run in sod]
        for axis, metric in zip(axes[:3], ("accuracy", "nll", "ece"), strict=True):
            axis.plot(times, [run["history"][-1][metric] for run in sod], "k:s", label="SoD / exact Laplace (n ↑)")
    for axis, name in zip(axes[:3], ("test accuracy", "test NLL", "test ECE (15 bins)"), strict=True):
        axis.set_xscale("log")
        axis.set_xlabel("wall time of the method [s]")
        axis.set_title(name)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right", title=f"SVGP: best {SVGP_SHOWN} by final test NLL", title_fontsize=7)
    labels = [run["label"] for run in runs]
    baseline = [run["baseline_rss_bytes"] / 2**20 for run in runs]
    increase = [(run["peak_rss_bytes"] - run["baseline_rss_bytes"]) / 2**20 for run in runs]
    axes[3].barh(range(len(runs)), baseline, color="lightgray", label="before the fit (Python, libraries, data)")
    axes[3].barh(range(len(runs)), increase, left=baseline, color="tab:gray", label="added by the fit")
    axes[3].legend(fontsize=7, loc="lower right")
    axes[3].set_yticks(range(len(runs)), labels, fontsize=7)
    axes[3].invert_yaxis()
    axes[3].set_xlabel("peak resident memory of the run [MiB]")
    axes[3].set_title("memory")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_large(args, executor) -> dict:
    """IterNCGP-CG (R = 10, KeOps or chunked K) at N = 10^5: peak memory, buffers, time split, final metrics."""
    path = _kernel_path(args)
    job = {
        "dataset": "mixture",
        "setting": "sensible",
        "num_train": args.large_n,
        "num_test": args.n_test,
        "seed": args.seed,
        "threads": args.threads,
        "device": args.device,
        "label": f"IterNCGP-CG R=10 ({path}), N={args.large_n}",
        "method": "iterncgp",
        "options": _preconditioned(
            args,
            {
                "policy": "cg",
                "compression_rank": 10,
                "kernel_path": path,
                "max_newton_steps": args.large_steps,
                "max_solver_iterations": args.solver_iterations,
                "evaluate": False,
            },
        ),
    }
    result = executor.submit(run_job, job).result()
    size = result["num_train"] * 10
    result["dense_khat_bytes"] = size**2 * 8
    print(
        f"\nN={result['num_train']}, C=10: {result['newton_steps']} Newton steps, {result['products']} products "
        f"({result['product_seconds']:.0f}s of {result['fit_seconds']:.0f}s in products with K), peak RSS "
        f"{result['peak_rss_bytes'] / 2**30:.2f} GiB ({result['baseline_rss_bytes'] / 2**30:.2f} GiB before the fit), "
        f"buffer S, KS {result['buffer_bytes'] / 2**20:.0f} MiB "
        f"({result['buffer_columns']} columns), solver state {result['state_bytes'] / 2**20:.0f} MiB; a dense K̂ "
        f"would need {result['dense_khat_bytes'] / 1e12:.0f} TB"
    )
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=10_000, help="mixture training points (default 10^4)")
    parser.add_argument("--n-test", type=int, default=10_000)
    parser.add_argument("--datasets", nargs="+", default=["mixture", "digits"], choices=sorted(SETTINGS))
    parser.add_argument(
        "--settings",
        nargs="+",
        default=None,
        choices=sorted({setting for settings in SETTINGS.values() for setting in settings}),
        help="kernel settings to run (default: every setting of each dataset)",
    )
    parser.add_argument("--newton-steps", type=int, default=20, help="Newton steps of the matrix-free runs")
    parser.add_argument(
        "--dense-newton-steps", type=int, default=60, help="Newton steps of the runs with K cached (much cheaper)"
    )
    parser.add_argument("--solver-iterations", type=int, default=5, help="j: IterGP iterations per Newton step")
    parser.add_argument("--unit-iterations", type=int, default=10, help="iterations per step for unit vectors")
    parser.add_argument(
        "--preconditioner-rank",
        type=int,
        default=None,
        help="IterNCGP's preconditioner_rank (default: the package's; 0: unpreconditioned CG, as the paper and §1)",
    )
    parser.add_argument(
        "--methods", nargs="+", default=["iterncgp", "ep", "svgp", "sod"], choices=["iterncgp", "ep", "svgp", "sod"]
    )
    parser.add_argument("--ep-sweeps", type=int, default=40, help="sweeps of the multi-class EP run")
    parser.add_argument("--svgp-inducing", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--svgp-lr", type=float, nargs="+", default=[0.001, 0.01, 0.05])
    parser.add_argument("--svgp-budget", type=float, default=None, help="seconds (default: IterNCGP-CG's time)")
    parser.add_argument("--sod-sizes", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000])
    parser.add_argument("--exact-max", type=int, default=4000, help="exact Laplace on all data up to this N")
    parser.add_argument("--large", action="store_true", help="also run IterNCGP at N = --large-n (memory)")
    parser.add_argument("--large-only", action="store_true", help="only the --large run")
    parser.add_argument("--large-n", type=int, default=100_000)
    parser.add_argument("--large-steps", type=int, default=2, help="Newton steps of the large run")
    parser.add_argument("--no-keops", action="store_true", help="chunked torch products instead of KeOps")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device of every method's tensors (e.g. cuda)")
    add_smoke_flag(parser, "tiny sizes: a functional check in about a minute")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--replot", type=Path, default=None, help="redraw the figures and tables of a suite.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n_train, args.n_test, args.newton_steps, args.unit_iterations = 300, 300, 3, 10
        args.dense_newton_steps, args.ep_sweeps = 4, 3
        args.svgp_inducing, args.svgp_lr, args.sod_sizes, args.exact_max = [20], [0.01], [100], 300
        args.large_n, args.large_steps = 1000, 1
    return args


def write_tables(output: dict, out: Path) -> None:
    """suite.json and suite.md (a Markdown table per problem)."""
    (out / "suite.json").write_text(json.dumps(output, indent=1, default=str))
    tables = [
        f"### {problem['title']}\n\n{markdown_table(problem['summary'])}\n" for problem in output["problems"].values()
    ]
    (out / "suite.md").write_text("\n".join(tables))


def write_outputs(output: dict, out: Path) -> None:
    """suite.json, suite.md (tables) and one figure per problem."""
    out.mkdir(parents=True, exist_ok=True)
    for name, problem in output["problems"].items():
        plot_problem(problem["title"], problem["runs"], out / f"suite_{name}.png")
    write_tables(output, out)
    print(f"saved {out / 'suite.json'}, suite.md and the figures")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot is not None:
        output = json.loads(args.replot.read_text())
        for problem in output["problems"].values():
            problem["summary"] = summary_rows(problem["runs"])
        write_outputs(output, args.out)
        return output
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    output = {"machine": machine(), "arguments": {k: str(v) for k, v in vars(args).items()}, "problems": {}}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1) as executor:
        if not args.large_only:
            for dataset in args.datasets:
                for setting in SETTINGS[dataset]:
                    if args.settings is not None and setting not in args.settings:
                        continue
                    name = f"{dataset}_{setting}"
                    print(f"\n== {name} ==", flush=True)
                    runs = run_problem(args, executor, dataset, setting)
                    rows = summary_rows(runs)
                    lengthscale, outputscale = SETTINGS[dataset][setting]
                    title = (
                        f"{dataset}, N={runs[0]['num_train']}, N*={runs[0]['num_test']}, C=10, Matérn-3/2 "
                        f"ℓ={lengthscale:g}, s²={outputscale:g}"
                    )
                    print_table(title, rows)
                    plot_problem(title, runs, args.out / f"suite_{name}.png")
                    output["problems"][name] = {"title": title, "summary": rows, "runs": runs}
            write_tables(output, args.out)
            print(f"saved {args.out / 'suite.json'} and suite.md")
        if args.large or args.large_only:
            large = {"machine": output["machine"], "run": run_large(args, executor)}
            (args.out / "suite_large.json").write_text(json.dumps(large, indent=1, default=str))
            print(f"saved {args.out / 'suite_large.json'}")
    return output


if __name__ == "__main__":
    main()
