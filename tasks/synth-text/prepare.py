"""The family of generated sentiment tasks synth-text-<seed>: reviews from the generator of the "reviews" task
(tasks/reviews/prepare.py); its seed draws the class balance, the share of noisy labels and the metric. The starter
is the reviews starter's, with this task's metric.

Run: python tasks/synth-text/prepare.py 3   (prints task 3 and its table; `python env.py prepare` makes them)
"""
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd

TASKS = Path(__file__).parents[1]
BUILTIN = runpy.run_path(str(TASKS / "builtin.py"))  # starter, data_block
REVIEWS = runpy.run_path(str(TASKS / "reviews" / "prepare.py"))  # rows
ROWS = 3000  # half of them test rows, half of those private


def task(seed: int) -> dict:
    """What the seed draws besides the rows (task.json's fields, the research problem and the starter)."""
    name, metric = f"synth-text-{seed}", ("f1_macro", "accuracy")[seed % 2]
    baseline = "word counts and logistic regression"
    about = ("Classify generated product reviews as `negative`, `neutral` or `positive` (column `sentiment`) from "
             "their `text`. Reviews mix praise and complaints, and some are negated (\"not great\").")
    data = BUILTIN["data_block"]((TASKS / "reviews" / "train.py").read_text(), "sentiment")
    code = BUILTIN["starter"](name, baseline, metric, "sentiment", "classification", "text-logreg", data)
    return {"name": name, "title": f"Generated review sentiment {seed}", "metric": metric, "baseline": baseline,
            "about": about, "starter": code}


def rows(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(7400 + seed)
    balance = rng.dirichlet([4, 4, 4])
    return REVIEWS["rows"](ROWS, 7400 + seed, balance, float(rng.uniform(0.02, 0.1)))


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    print(task(seed)["about"], rows(seed), sep="\n")
