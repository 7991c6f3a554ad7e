X = train.drop(columns=["id", "outcome"])
X_test = test.drop(columns=["id"])
# one-hot encode the categories and fill missing numbers with the training medians
both = pd.get_dummies(pd.concat([X, X_test]), columns=["employment", "purpose"], dtype=float)
both = both.fillna(both[: len(X)].median())
X, X_test = both[: len(X)], both[len(X):]
