"""The family of generated classification tasks synth-classification-<seed>: scikit-learn's make_classification
clusters (2 or 3 classes) as a table; its seed draws the size, separation, label noise, imbalance, features, the
metric (cycling over the four classification metrics) and the baseline.

Run: python tasks/synth-classification/prepare.py 3   (prints task 3 and its table; `python env.py prepare` makes them)
"""
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd

BUILTIN = runpy.run_path(str(Path(__file__).parents[1] / "builtin.py"))  # table_columns, table_data, starter
ROWS = 3000  # half of them test rows, half of those private


def _draw(seed: int) -> dict:
    rng = np.random.default_rng(7200 + seed)
    metric, classes = [("log_loss", 3), ("accuracy", 2), ("roc_auc", 2), ("f1_macro", 3), ("log_loss", 2),
                       ("accuracy", 3)][seed % 6]
    return dict(metric=metric, classes=classes, d=int(rng.integers(6, 13)), n_cat=int(rng.integers(0, 3)),
                missing=bool(seed % 2), flip=float(rng.uniform(0.01, 0.06)), sep=float(rng.uniform(0.6, 1.2)))


def task(seed: int) -> dict:
    """What the seed draws besides the rows (task.json's fields, the research problem and the starter)."""
    draw = _draw(seed)
    metric, classes, d, n_cat, missing = (draw[k] for k in ("metric", "classes", "d", "n_cat", "missing"))
    submit = "classes" if metric == "log_loss" and classes == 3 else \
        "probability" if metric in ("log_loss", "roc_auc") else "label"
    model, words = [("scaled-logreg", "logistic regression"), ("naive-bayes", "Gaussian naive Bayes"),
                    ("tree-classifier", "a depth-3 decision tree")][seed % 3]
    what = {"classes": "Submit one probability column per class: `class_0`, `class_1`, `class_2`.",
            "probability": "Predict the probability that `label` is 1.", "label": "Predict `label`."}[submit]
    about = (f"Tell {classes} classes (`label` 0 ... {classes - 1}) apart from {d} numeric features `f0` ... "
             f"`f{d - 1}`" + (f" and {n_cat} categorical column(s) `cat0` ..." if n_cat else "")
             + ". The table is generated; some labels are noise." + (" Some values are missing." if missing else "")
             + " " + what)
    name, baseline = f"synth-classification-{seed}", ("one-hot categories and " if n_cat else "") + words
    code = BUILTIN["starter"](name, baseline, metric, "label", "classification", model,
                              BUILTIN["table_data"]("label", n_cat, missing), submit)
    return {"name": name, "title": f"Generated classification {seed}", "metric": metric, "missing": missing,
            "baseline": baseline, "about": about, "starter": code, "submit": submit, "classes": classes}


def rows(seed: int) -> pd.DataFrame:
    """make_classification's clusters, with skewed features, categories and missing values (table_columns)."""
    from sklearn.datasets import make_classification  # here, not at the top: env.py reads this file at import
    draw = _draw(seed)
    classes, d, n_cat = draw["classes"], draw["d"], draw["n_cat"]
    x, y = make_classification(n_samples=ROWS, n_features=d + n_cat, n_informative=max(3, d // 2), n_redundant=1,
                               n_classes=classes, n_clusters_per_class=2,
                               weights=[0.6] + [0.4 / (classes - 1)] * (classes - 1) if seed % 3 else None,
                               flip_y=draw["flip"], class_sep=draw["sep"], random_state=17200 + seed)
    return BUILTIN["table_columns"](np.random.default_rng(17200 + seed), x, n_cat, draw["missing"]).assign(label=y)


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    print(task(seed)["about"], rows(seed), sep="\n")
