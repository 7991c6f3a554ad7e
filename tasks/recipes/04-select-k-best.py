# idea: Keep only the better half of the features by a univariate F-test.
# category: data
# tasks: NUMERIC
# block: data

from sklearn.feature_selection import SelectKBest, $selector

# keep the half of the features with the strongest univariate relation to the target
selector = SelectKBest($selector, k=max(1, X.shape[1] // 2)).fit(X, y)
X, X_test = selector.transform(X), selector.transform(X_test)
