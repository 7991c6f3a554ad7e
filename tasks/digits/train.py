"""Starter script for the "digits" task: standardised pixels and logistic regression.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation accuracy,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["label"]
X = train.drop(columns=["id", "label"])
X_test = test.drop(columns=["id"])

# --- model ---
model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
model.fit(X_tr, y_tr)
print(f"Validation accuracy: {accuracy_score(y_val, model.predict(X_val)):.4f}")
model.fit(X, y)

# --- submission ---
submission = pd.DataFrame({"id": test["id"], "label": model.predict(X_test)})
submission.to_csv("submission.csv", index=False)
