"""Starter script for the "breast-cancer" task: a depth-3 decision tree.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation ROC AUC,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.metrics import roc_auc_score
from sklearn.tree import DecisionTreeClassifier

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["malignant"]
X = train.drop(columns=["id", "malignant"])
X_test = test.drop(columns=["id"])

# --- model ---
model = DecisionTreeClassifier(max_depth=3, random_state=0)

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
model.fit(X_tr, y_tr)
print(f"Validation ROC AUC: {roc_auc_score(y_val, model.predict_proba(X_val)[:, 1]):.4f}")
model.fit(X, y)

# --- submission ---
submission = pd.DataFrame({"id": test["id"], "malignant": model.predict_proba(X_test)[:, 1]})
submission.to_csv("submission.csv", index=False)
