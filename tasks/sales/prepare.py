"""The rows of the "sales" task: daily sales of three generated stores, 2021-2023.

Run: python tasks/sales/prepare.py   (prints the table; `python env.py prepare sales` makes the task)
"""
import numpy as np
import pandas as pd

WEEK = (0.9, 0.92, 0.95, 1.0, 1.12, 1.35, 1.2)  # Monday ... Sunday


def rows(seed=0, levels=(200.0, 120.0, 80.0), week=WEEK, trend=0.0004, season=0.15, promo_lift=0.25, noise_sd=0.06,
         heat=0.8) -> pd.DataFrame:
    """Stores A, B, ... (one per level), 2021-2023: trend x weekly x yearly seasonality x promotions, temperature,
    AR(1) noise. Each row also holds yesterday's and last week's sales: the task is one-step-ahead forecasting."""
    rng = np.random.default_rng(seed)
    dates = pd.date_range("2021-01-01", "2023-12-31", freq="D")
    t = np.arange(len(dates))
    doy = 2 * np.pi * dates.day_of_year.to_numpy() / 365.25
    weekly = np.array(week)[dates.day_of_week]
    frames = []
    for store, level in zip("ABCDEFGH", levels):
        temperature = np.round(14 - 9 * np.cos(doy) + rng.normal(0, 3, len(t)), 1)
        promo = (rng.random(len(t)) < 0.15).astype(int)
        noise = np.zeros(len(t))
        for i in range(1, len(t)):
            noise[i] = 0.75 * noise[i - 1] + rng.normal(0, noise_sd)
        sales = (level * (1 + trend * t) * weekly * (1 + season * np.sin(doy - 1.0)) * (1 + promo_lift * promo)
                 * np.exp(noise) + heat * (temperature - 14))
        frames.append(pd.DataFrame({"date": dates.strftime("%Y-%m-%d"), "store": store, "promo": promo,
                                    "temperature": temperature, "sales_lag_1": np.r_[np.nan, sales[:-1]].round(1),
                                    "sales_lag_7": np.r_[[np.nan] * 7, sales[:-7]].round(1),
                                    "sales": sales.round(1)}).iloc[7:])
    return pd.concat(frames).sort_values(["date", "store"], kind="stable").reset_index(drop=True)


if __name__ == "__main__":
    print(rows())
