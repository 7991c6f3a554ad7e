"""The rows of the "wine" task: scikit-learn's copy of the UCI wine recognition data (three cultivars).

Run: python tasks/wine/prepare.py   (prints the table; `python env.py prepare wine` makes the task folder)
"""
import re

import pandas as pd
from sklearn.datasets import load_wine


def rows() -> pd.DataFrame:
    """13 chemical measurements (names with `_` for `/` and spaces) and the cultivar, 0, 1 or 2, in `label`."""
    data = load_wine(as_frame=True)
    return data.data.rename(columns=lambda c: re.sub(r"\W+", "_", c).strip("_")).assign(label=data.target)


if __name__ == "__main__":
    print(rows())
