# idea: Add pairwise products and squares of the features (degree-2 polynomial).
# category: data
# tasks: NUMERIC - digits
# block: data

from sklearn.preprocessing import PolynomialFeatures

# add all pairwise products and squares
poly = PolynomialFeatures(degree=2, include_bias=False).fit(X)
X, X_test = poly.transform(X), poly.transform(X_test)
