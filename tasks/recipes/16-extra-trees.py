# idea: Replace the model with extremely randomised trees (200 trees).
# category: model
# tasks: NUMERIC + TEXT
# block: model
# replace: model = .*

from sklearn.ensemble import ExtraTrees$kind

model = ExtraTrees$kind(n_estimators=200, random_state=0)
