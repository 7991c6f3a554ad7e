"""Starter script for the "energy" task: one-hot categories and ridge regression.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation MAE,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.linear_model import Ridge
from sklearn.metrics import mean_absolute_error

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["energy"]
X = train.drop(columns=["id", "energy"])
X_test = test.drop(columns=["id"])
both = pd.get_dummies(pd.concat([X, X_test]), columns=["climate", "heating"], dtype=float)
X, X_test = both[: len(X)], both[len(X):]

# --- model ---
model = Ridge(alpha=1.0)

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, random_state=0)
model.fit(X_tr, y_tr)
print(f"Validation MAE: {mean_absolute_error(y_val, model.predict(X_val)):.4f}")
model.fit(X, y)

# --- submission ---
submission = pd.DataFrame({"id": test["id"], "energy": model.predict(X_test)})
submission.to_csv("submission.csv", index=False)
