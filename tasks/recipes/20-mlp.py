# idea: Replace the model with a one-hidden-layer neural network (MLP) on standardised features.
# category: model
# tasks: CLASSIFY
# block: model
# replace: model = .*

from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.neural_network import MLPClassifier

model = make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(128,), max_iter=500, early_stopping=True, random_state=0))
