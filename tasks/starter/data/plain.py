X = train.drop(columns=["id", "$target"])
X_test = test.drop(columns=["id"])
