"""Starter script for the "sales" task: ridge regression on a trend, day-of-week and store indicators.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation RMSE,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.linear_model import Ridge
from sklearn.metrics import root_mean_squared_error

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["sales"]


def features(df):
    """A day counter for the trend, the promotion flag, temperature, day of the week and store."""
    date = pd.to_datetime(df["date"])
    return pd.DataFrame({"t": (date - pd.Timestamp("2021-01-01")).dt.days, "promo": df["promo"],
                         "temperature": df["temperature"], "dow": date.dt.day_of_week, "store": df["store"]})


both = pd.get_dummies(pd.concat([features(train), features(test)]), columns=["dow", "store"], dtype=float)
X, X_test = both[: len(train)], both[len(train):]
# train.csv is in time order, so the validation split below (shuffle=False) holds out its latest days

# --- model ---
model = Ridge(alpha=1.0)

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, shuffle=False)
model.fit(X_tr, y_tr)
print(f"Validation RMSE: {root_mean_squared_error(y_val, model.predict(X_val)):.4f}")
model.fit(X, y)

# --- submission ---
submission = pd.DataFrame({"id": test["id"], "sales": model.predict(X_test)})
submission.to_csv("submission.csv", index=False)
