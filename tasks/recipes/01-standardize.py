# idea: Standardise every feature to zero mean and unit variance before fitting the model.
# category: data
# tasks: NUMERIC
# block: data

from sklearn.preprocessing import StandardScaler

# standardise every feature with the training mean and standard deviation
scaler = StandardScaler().fit(X)
X, X_test = scaler.transform(X), scaler.transform(X_test)
