submission = pd.DataFrame({"id": test["id"], "$target": model.predict(X_test)})
