# idea: Replace the model with a linear classifier trained by stochastic gradient descent (modified Huber loss).
# category: model
# tasks: TEXT
# block: model
# replace: model = .*

from sklearn.linear_model import SGDClassifier

model = SGDClassifier(loss="modified_huber", alpha=1e-4, random_state=0)
