# idea: Replace the model with histogram gradient boosting.
# category: model
# tasks: NUMERIC
# block: model
# replace: model = .*

from sklearn.ensemble import HistGradientBoosting$kind

model = HistGradientBoosting$kind(max_iter=150, learning_rate=0.1, random_state=0)
