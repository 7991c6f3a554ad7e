# idea: Fit the model to the logarithm of the target and transform predictions back.
# category: data
# tasks: REGRESS
# block: model

from sklearn.compose import TransformedTargetRegressor

# fit on log(1 + target), predict back on the original scale
model = TransformedTargetRegressor(model, func=np.log1p, inverse_func=np.expm1)
