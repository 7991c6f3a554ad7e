"""Starter script for the "reviews" task: word counts and logistic regression.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation macro-F1,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["sentiment"]
vectorizer = CountVectorizer(min_df=2)
X = vectorizer.fit_transform(train["text"])
X_test = vectorizer.transform(test["text"])

# --- model ---
model = LogisticRegression(max_iter=1000)

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
model.fit(X_tr, y_tr)
print(f"Validation macro-F1: {f1_score(y_val, model.predict(X_val), average='macro'):.4f}")
model.fit(X, y)

# --- submission ---
submission = pd.DataFrame({"id": test["id"], "sentiment": model.predict(X_test)})
submission.to_csv("submission.csv", index=False)
