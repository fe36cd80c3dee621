"""The classifier of another checkout of the package (an older commit) on `benchmarks.tabular`'s splits, so that
today's fits can be timed side by side with an earlier default (benchmarks/README.md §32).

```bash
git worktree add /tmp/before_45 0c82094^          # the package as it was before issue 45's first change
python -m benchmarks.estimator_at_commit --package-root /tmp/before_45 --datasets spambase phoneme --seeds 0 --threads 1
```

The package is imported from ``--package-root`` (default: this checkout), the data from this checkout's loaders
(`real_data.py`); each split fits ``IterNCGPClassifier(random_state=seed)`` with that version's defaults and records
its seconds, test log-loss and accuracy, and the package's path and commit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_package(root: Path):
    """``gpytorch_iterncgp`` and its classifier class from ``root`` (it must not have been imported from elsewhere)."""
    sys.path.insert(0, str(root))
    import gpytorch_iterncgp

    if Path(gpytorch_iterncgp.__file__).resolve().parents[1] != root.resolve():
        raise RuntimeError(f"gpytorch_iterncgp was imported from {gpytorch_iterncgp.__file__}, not from {root}.")
    from gpytorch_iterncgp.integrations.sklearn import IterNCGPClassifier

    sys.path.remove(str(root))
    return gpytorch_iterncgp, IterNCGPClassifier


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package-root", type=Path, default=ROOT, help="the checkout whose package is fitted")
    parser.add_argument("--datasets", nargs="+", default=["spambase"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="300 training rows a set (seconds)")
    parser.add_argument(
        "--out", type=Path, default=None, help="results JSON (default: results/estimator_at_commit.json)"
    )
    args = parser.parse_args(argv)
    package, classifier = _import_package(args.package_root)
    import torch

    from benchmarks.common import write_results
    from benchmarks.real_data import load
    from benchmarks.scoring import log_loss

    torch.set_num_threads(args.threads)
    commit = subprocess.run(
        ["git", "-C", str(args.package_root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    rows = []
    for name in args.datasets:
        for seed in args.seeds:
            data = load(name, args.smoke, seed)
            if data.num_classes == 0:
                raise ValueError(f"{name} is a count data set; this script fits the classifier only.")
            estimator = classifier(random_state=seed)
            start = time.perf_counter()
            estimator.fit(data.train_x.numpy(), data.train_y.numpy())
            seconds = time.perf_counter() - start
            score = log_loss(torch.as_tensor(estimator.predict_proba(data.test_x.numpy())), data.test_y)
            rows.append({"dataset": name, "seed": seed, "seconds": seconds, **score})
            print(f"{name} split {seed}: {score['nll']:.4f} ({seconds:.0f} s)", flush=True)
    out = args.out or ROOT / "benchmarks" / "results" / "estimator_at_commit.json"
    fields = {"rows": rows, "package": str(Path(package.__file__).parent), "commit": commit}
    write_results(out, "estimator_at_commit", argv, **fields)
    return fields


if __name__ == "__main__":
    main()
