submission = pd.DataFrame({"id": test["id"], "$target": model.predict_proba(X_test)[:, 1]})
