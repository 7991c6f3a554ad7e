"""The rows of the "digits" task: scikit-learn's copy of the UCI handwritten digits, 8x8 grey-level images.

Run: python tasks/digits/prepare.py   (prints the table; `python env.py prepare digits` makes the task folder)
"""
import pandas as pd
from sklearn.datasets import load_digits


def rows() -> pd.DataFrame:
    """One row per image: its 64 pixel intensities (0-16), row by row, and the digit in `label`."""
    data = load_digits()
    return pd.DataFrame(data.data.astype(int), columns=[f"pixel_{i}" for i in range(64)]).assign(label=data.target)


if __name__ == "__main__":
    print(rows())
