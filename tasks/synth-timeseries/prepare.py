"""The family of generated forecasting tasks synth-timeseries-<seed>: daily sales of 3-5 stores from the generator
of the "sales" task (tasks/sales/prepare.py); its seed draws each store's level, the weekly shape, trend,
seasonality, promotion lift, noise and the metric. The starter is the sales starter's, with this task's metric.

Run: python tasks/synth-timeseries/prepare.py 3   (prints task 3 and its table; `python env.py prepare` makes them)
"""
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd

TASKS = Path(__file__).parents[1]
BUILTIN = runpy.run_path(str(TASKS / "builtin.py"))  # starter, data_block
SALES = runpy.run_path(str(TASKS / "sales" / "prepare.py"))  # rows, WEEK


def _draw(seed: int) -> dict:
    """The arguments of the sales generator."""
    rng = np.random.default_rng(7300 + seed)
    levels = tuple(np.round(rng.uniform(50, 250, int(rng.integers(3, 6))), 0))
    week = tuple(np.round(np.array(SALES["WEEK"])[rng.permutation(7)] * rng.uniform(0.9, 1.1, 7), 3))
    return dict(levels=levels, week=week, trend=float(rng.uniform(-0.0002, 0.0008)), season=float(rng.uniform(0, 0.3)),
                promo_lift=float(rng.uniform(0.05, 0.4)), noise_sd=float(rng.uniform(0.03, 0.1)),
                heat=float(rng.uniform(-1, 1.5)))


def task(seed: int) -> dict:
    """What the seed draws besides the rows (task.json's fields, the research problem and the starter)."""
    name, metric = f"synth-timeseries-{seed}", ("rmse", "mae")[seed % 2]
    baseline = "ridge regression on a trend, day-of-week and store indicators"
    about = (f"Forecast tomorrow's `sales` of {len(_draw(seed)['levels'])} stores from the `date`, `store`, a `promo` "
             "flag, the `temperature`, and the sales of the previous day (`sales_lag_1`) and week (`sales_lag_7`). "
             "The series are generated; train.csv covers 2021-01-08 to 2023-09-02, the test rows are the following "
             "120 days.")
    data = BUILTIN["data_block"]((TASKS / "sales" / "train.py").read_text(), "sales")
    code = BUILTIN["starter"](name, baseline, metric, "sales", "regression", "ridge", data, time_series=True)
    return {"name": name, "title": f"Generated daily sales {seed}", "metric": metric, "baseline": baseline,
            "about": about, "starter": code}


def rows(seed: int) -> pd.DataFrame:
    return SALES["rows"](7300 + seed, **_draw(seed))


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    print(task(seed)["about"], rows(seed), sep="\n")
