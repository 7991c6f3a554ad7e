"""The family of generated regression tasks synth-regression-<seed>: a positive target from a noisy non-linear
function of numeric and categorical features; its seed draws the size, the features, the metric and the baseline.

Run: python tasks/synth-regression/prepare.py 3   (prints task 3 and its table; `python env.py prepare` makes them)
"""
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd

BUILTIN = runpy.run_path(str(Path(__file__).parents[1] / "builtin.py"))  # table_columns, table_data, starter
ROWS = 3000  # half of them test rows, half of those private


def _draw(seed: int) -> tuple[int, int, bool]:
    """The number of numeric features, of categorical ones, and whether values are missing."""
    rng = np.random.default_rng(7100 + seed)
    return int(rng.integers(5, 11)), int(rng.integers(0, 3)), bool(seed % 3 == 1)


def task(seed: int) -> dict:
    """What the seed draws besides the rows (task.json's fields, the research problem and the starter)."""
    d, n_cat, missing = _draw(seed)
    name, metric, tree = f"synth-regression-{seed}", ("rmse", "mae")[seed % 2 == 0], seed % 3 == 2
    baseline = ("one-hot categories and ridge regression", "a depth-4 regression tree")[tree]
    about = (f"Predict `target` (a positive number) from {d} numeric features `f0` ... `f{d - 1}`"
             + (f" and {n_cat} categorical column(s) `cat0` ..." if n_cat else "")
             + ". The table is generated: the target is a noisy non-linear function of the features."
             + (" Some values are missing." if missing else ""))
    data = BUILTIN["table_data"]("target", n_cat, missing)
    code = BUILTIN["starter"](name, baseline, metric, "target", "regression", ("ridge", "tree-regressor")[tree], data)
    return {"name": name, "title": f"Generated regression {seed}", "metric": metric, "missing": missing,
            "baseline": baseline, "about": about, "starter": code}


def rows(seed: int) -> pd.DataFrame:
    """A sum of per-feature shapes (linear, square, sine, threshold), one interaction, offsets per category and
    Gaussian noise; multiplicative for odd seeds (a skewed target, where the log recipe helps)."""
    d, n_cat, missing = _draw(seed)
    rng = np.random.default_rng(17100 + seed)
    x = rng.normal(size=(ROWS, d + n_cat))
    shapes = rng.choice(["linear", "square", "sine", "step"], size=d)
    parts = {"linear": lambda v: v, "square": lambda v: v ** 2 - 1, "sine": lambda v: np.sin(2 * v),
             "step": lambda v: (v > 0.3) - 0.4}
    f = sum(rng.uniform(0.3, 1.5) * parts[s](x[:, j]) for j, s in enumerate(shapes)) + 0.8 * x[:, 0] * x[:, 1]
    for j in range(n_cat):
        f = f + rng.normal(0, 0.8, 5)[np.digitize(x[:, d + j], [-1, 0, 1, 2])]
    f = (f - f.mean()) / f.std() + rng.normal(0, rng.uniform(0.2, 0.7), ROWS)
    y = np.round(np.exp(0.5 * f) * 100, 2) if seed % 2 else np.round(np.clip(50 + 10 * f, 1, None), 3)
    return BUILTIN["table_columns"](rng, x, n_cat, missing).assign(target=y)


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    print(task(seed)["about"], rows(seed), sep="\n")
