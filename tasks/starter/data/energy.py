X = train.drop(columns=["id", "energy"])
X_test = test.drop(columns=["id"])
both = pd.get_dummies(pd.concat([X, X_test]), columns=["climate", "heating"], dtype=float)
X, X_test = both[: len(X)], both[len(X):]
