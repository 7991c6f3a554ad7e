# idea: Add the previous day's and previous week's sales as lag features.
# category: data
# tasks: SERIES
# block: data

# add the lagged sales: yesterday and the same day last week
lags = ["sales_lag_1", "sales_lag_7"]
X, X_test = np.column_stack([X, train[lags]]), np.column_stack([X_test, test[lags]])
