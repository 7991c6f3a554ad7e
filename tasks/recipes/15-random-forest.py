# idea: Replace the model with a random forest of 200 trees.
# category: model
# tasks: NUMERIC + TEXT
# block: model
# replace: model = .*

from sklearn.ensemble import RandomForest$kind

model = RandomForest$kind(n_estimators=200, random_state=0)
