"""The rows of the "churn" task: scikit-learn's make_classification clusters dressed as
a telecom customer table.

Run: python tasks/churn/prepare.py   (prints the table; `python env.py prepare churn` makes the task folder)
"""
import numpy as np
import pandas as pd
from sklearn.datasets import make_classification


def rows(n=3000, seed=0) -> pd.DataFrame:
    """make_classification's clusters dressed as a telecom customer table, with categories and missing values."""
    x, y = make_classification(n_samples=n, n_features=8, n_informative=5, n_redundant=1, n_clusters_per_class=2,
                               weights=[0.73], flip_y=0.03, class_sep=0.9, random_state=seed)
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({
        "tenure_months": np.clip(np.round(24 + 12 * x[:, 0]), 0, 72),
        "monthly_charges": np.round(70 + 20 * x[:, 1], 2),
        "support_calls": np.clip(np.round(2 + 1.5 * x[:, 2]), 0, None),
        "data_usage_gb": np.round(np.exp(2 + 0.5 * x[:, 3]), 2),
        "late_payments": np.clip(np.round(1 + x[:, 4]), 0, None),
        "age": np.clip(np.round(45 + 12 * x[:, 5]), 18, 90),
        "plan": pd.cut(x[:, 6], [-np.inf, -0.5, 0.7, np.inf], labels=["basic", "standard", "premium"]).astype(str),
        "payment_method": pd.cut(x[:, 7], [-np.inf, -0.4, 0.4, np.inf],
                                 labels=["card", "bank_transfer", "electronic_check"]).astype(str),
        "region": rng.choice(["north", "south", "east", "west"], size=n),
    })
    for col in ("monthly_charges", "data_usage_gb", "age"):
        df.loc[rng.random(n) < 0.06, col] = np.nan
    df["churn"] = y
    return df


if __name__ == "__main__":
    print(rows())
