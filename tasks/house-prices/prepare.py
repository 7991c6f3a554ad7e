"""The rows of the "house-prices" task: house sales generated from a multiplicative price model.

Run: python tasks/house-prices/prepare.py   (prints the table; `python env.py prepare house-prices` makes the task)
"""
import numpy as np
import pandas as pd


def rows(n=2000, seed=0) -> pd.DataFrame:
    """Prices from a multiplicative model: size x neighbourhood, a U-shaped age effect, condition, noise."""
    rng = np.random.default_rng(seed)
    hoods = {"riverside": 1.35, "old_town": 1.15, "hillcrest": 1.0, "lakeshore": 1.6, "industrial": 0.7}
    hood = rng.choice(list(hoods), size=n, p=[0.2, 0.25, 0.3, 0.1, 0.15])
    sqft = np.round(rng.lognormal(7.4, 0.35, n))
    bedrooms = np.clip(np.round(sqft / 600 + rng.normal(0, 0.7, n)), 1, 6)
    age = rng.integers(0, 100, n)
    condition = rng.integers(1, 6, n)
    garage = (rng.random(n) < 0.6).astype(int)
    lot = np.round(rng.lognormal(8.5, 0.5, n))
    price = (160 * sqft * np.vectorize(hoods.get)(hood) * (1 + 0.06 * (condition - 3))
             * (1 - 0.006 * age + 0.00007 * age ** 2) + 12 * np.sqrt(lot) * 100 + 15000 * garage)
    price = np.round(price * rng.lognormal(0, 0.08, n), -2)
    return pd.DataFrame({"sqft": sqft, "bedrooms": bedrooms, "age": age, "condition": condition, "garage": garage,
                         "lot_size": lot, "neighborhood": hood, "price": price})


if __name__ == "__main__":
    print(rows())
