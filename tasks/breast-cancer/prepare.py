"""The rows of the "breast-cancer" task: scikit-learn's copy of the Wisconsin diagnostic breast cancer data.

Run: python tasks/breast-cancer/prepare.py   (prints the table; `python env.py prepare breast-cancer` makes the task)
"""
import re

import pandas as pd
from sklearn.datasets import load_breast_cancer


def rows() -> pd.DataFrame:
    """30 measurements of cell nuclei (names with `_` for spaces) and `malignant` = 1 (scikit-learn codes it 0)."""
    data = load_breast_cancer(as_frame=True)
    return data.data.rename(columns=lambda c: re.sub(r"\W+", "_", c).strip("_")).assign(malignant=1 - data.target)


if __name__ == "__main__":
    print(rows())
