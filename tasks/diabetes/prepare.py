"""The rows of the "diabetes" task: scikit-learn's copy of Efron et al.'s diabetes data, unscaled.

Run: python tasks/diabetes/prepare.py   (prints the table; `python env.py prepare diabetes` makes the task folder)
"""
import pandas as pd
from sklearn.datasets import load_diabetes


def rows() -> pd.DataFrame:
    """Age, sex, body mass index, blood pressure, six serum measurements and `progression` a year later."""
    data = load_diabetes(as_frame=True, scaled=False)
    return data.data.assign(progression=data.target)


if __name__ == "__main__":
    print(rows())
