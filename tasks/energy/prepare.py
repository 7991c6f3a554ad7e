"""The rows of the "energy" task: the yearly heating energy of generated buildings, from a simple heat-loss model.

Run: python tasks/energy/prepare.py   (prints the table; `python env.py prepare energy` makes the task)
"""
import numpy as np
import pandas as pd


def rows(n=3000, seed=0) -> pd.DataFrame:
    """Yearly heating energy of buildings (kWh per m2): heat lost through walls (insulation, with diminishing
    returns), windows and air leaks (older buildings leak more), times the climate's degree-days, over the heating
    system's efficiency; smaller buildings lose more per m2; multiplicative noise."""
    rng = np.random.default_rng(seed)
    area = np.round(rng.lognormal(5.2, 0.6, n))
    floors = rng.integers(1, 7, n)
    year = rng.integers(1900, 2023, n)
    insulation = np.round(np.clip(rng.gamma(2.0, 6.0, n) * (0.4 + (year - 1900) / 122), 0, 40))
    windows = np.round(rng.uniform(0.1, 0.5, n), 2)
    climate = rng.choice(["mild", "temperate", "cold"], size=n, p=[0.3, 0.45, 0.25])
    heating = rng.choice(["gas", "oil", "heat_pump", "district"], size=n, p=[0.45, 0.15, 0.25, 0.15])
    degree_days = np.select([climate == "mild", climate == "temperate"], [1800.0, 2800.0], 4000.0)
    efficiency = np.select([heating == "gas", heating == "oil", heating == "heat_pump"], [0.92, 0.85, 3.0], 0.95)
    loss = (1 - windows) / (0.25 + insulation / 4) + 2.6 * windows + 0.6 * (2.2 - (year - 1900) / 80)
    compact = 1 + 4 / np.sqrt(area / floors)
    energy = 0.024 * degree_days * loss * compact / efficiency * 30
    return pd.DataFrame({"floor_area": area, "floors": floors, "year_built": year, "insulation_cm": insulation,
                         "window_share": windows, "climate": climate, "heating": heating,
                         "energy": np.round(energy * rng.lognormal(0, 0.1, n), 1)})


if __name__ == "__main__":
    print(rows())
