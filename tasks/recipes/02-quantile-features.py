# idea: Map every feature to a normal distribution with a quantile transform.
# category: data
# tasks: NUMERIC
# block: data

from sklearn.preprocessing import QuantileTransformer

# map each feature through its quantiles onto a normal distribution
quantiles = QuantileTransformer(n_quantiles=200, output_distribution="normal").fit(X)
X, X_test = quantiles.transform(X), quantiles.transform(X_test)
