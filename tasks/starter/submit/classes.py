submission = pd.DataFrame(model.predict_proba(X_test), columns=[f"class_{c}" for c in model.classes_])
submission.insert(0, "id", test["id"])
