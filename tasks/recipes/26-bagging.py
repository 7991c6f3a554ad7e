# idea: Train a bagging ensemble of 10 copies of the model on bootstrap samples.
# category: learning
# tasks: NUMERIC + TEXT
# block: model

from sklearn.ensemble import Bagging$kind

# a bagging ensemble: 10 copies fitted on bootstrap samples, averaged
model = Bagging$kind(model, n_estimators=10, random_state=0)
