# idea: Add the logarithms of floor area and lot size as features.
# category: data
# tasks: house-prices
# block: data

# add log floor area and log lot size: prices grow multiplicatively
sizes = ["sqft", "lot_size"]
X, X_test = np.column_stack([X, np.log(train[sizes])]), np.column_stack([X_test, np.log(test[sizes])])
