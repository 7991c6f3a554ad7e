# idea: Add a 0/1 indicator column for every feature that has missing values.
# category: data
# tasks: MISSING
# block: data

# add a 0/1 column per feature with missing values: was it missing?
missing = [c for c in test.columns if train[c].isna().any()]
X, X_test = np.column_stack([X, train[missing].isna()]), np.column_stack([X_test, test[missing].isna()])
