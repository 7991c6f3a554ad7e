"""The rows of the "loans" task: loan applications generated from a latent repayment risk.

Run: python tasks/loans/prepare.py   (prints the table; `python env.py prepare loans` makes the task)
"""
import numpy as np
import pandas as pd


def rows(n=4000, seed=0) -> pd.DataFrame:
    """Loan applications and how they were repaid (`outcome` 0 on time, 1 late, 2 default): a latent risk from the
    debt ratio (steeper for the self-employed), log income, the loan's size against income, credit history,
    delinquencies (past two, much worse), purpose and age (U-shaped), with logistic noise, cut at its 60% and 85%
    quantiles. Some values missing."""
    rng = np.random.default_rng(seed)
    income = np.round(rng.lognormal(10.8, 0.45, n), -2)
    debt_ratio = np.round(np.clip(rng.beta(2, 5, n) + rng.normal(0, 0.03, n), 0.0, 1.0), 3)
    employment = rng.choice(["salaried", "self_employed", "unemployed", "retired"], size=n, p=[0.6, 0.2, 0.08, 0.12])
    history = np.clip(np.round(rng.gamma(3.0, 3.0, n)), 0, 40)
    delinquencies = rng.poisson(0.5, n)
    amount = np.round(income * rng.uniform(0.05, 0.9, n), -2)
    age = np.clip(np.round(rng.normal(41, 12, n)), 21, 80)
    purpose = rng.choice(["car", "home", "education", "business", "other"], size=n, p=[0.3, 0.25, 0.15, 0.1, 0.2])
    risk = (3.0 * debt_ratio * np.where(employment == "self_employed", 2.0, 1.0) - 1.2 * np.log(income / 50000)
            + 2.5 * amount / income - 0.07 * history + 0.5 * np.minimum(delinquencies, 2)
            + 1.5 * (delinquencies > 2) + np.select([purpose == "business", purpose == "education"], [0.6, 0.3], 0.0)
            + np.select([employment == "unemployed", employment == "retired"], [1.0, -0.2], 0.0)
            + 0.002 * (age - 45) ** 2 + rng.logistic(0.0, 0.3, n))
    df = pd.DataFrame({"income": income, "debt_ratio": debt_ratio, "employment": employment,
                       "credit_history_years": history, "delinquencies": delinquencies, "loan_amount": amount,
                       "age": age, "purpose": purpose})
    for col in ("income", "credit_history_years"):
        df.loc[rng.random(n) < 0.05, col] = np.nan
    df["outcome"] = np.digitize(risk, np.quantile(risk, [0.6, 0.85]))
    return df


if __name__ == "__main__":
    print(rows())
