"""Starter script for the "loans" task: one-hot categories and logistic regression.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation log-loss,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["outcome"]
X = train.drop(columns=["id", "outcome"])
X_test = test.drop(columns=["id"])
# one-hot encode the categories and fill missing numbers with the training medians
both = pd.get_dummies(pd.concat([X, X_test]), columns=["employment", "purpose"], dtype=float)
both = both.fillna(both[: len(X)].median())
X, X_test = both[: len(X)], both[len(X):]

# --- model ---
model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
model.fit(X_tr, y_tr)
print(f"Validation log-loss: {log_loss(y_val, model.predict_proba(X_val)):.4f}")
model.fit(X, y)

# --- submission ---
submission = pd.DataFrame(model.predict_proba(X_test), columns=[f"class_{c}" for c in model.classes_])
submission.insert(0, "id", test["id"])
submission.to_csv("submission.csv", index=False)
