from sklearn.linear_model import Ridge

model = Ridge(alpha=1.0)
