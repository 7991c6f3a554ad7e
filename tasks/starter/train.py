"""Starter script for the "$name" task: $baseline.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation $label,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
$imports

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["$target"]
$data

# --- model ---
$model

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, $split)
model.fit(X_tr, y_tr)
print(f"Validation $label: {$score:.4f}")
model.fit(X, y)

# --- submission ---
$submit
submission.to_csv("submission.csv", index=False)
