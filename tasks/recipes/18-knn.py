# idea: Replace the model with k-nearest neighbours on standardised features.
# category: model
# tasks: NUMERIC
# block: model
# replace: model = .*

from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.neighbors import KNeighbors$kind

model = make_pipeline(StandardScaler(), KNeighbors$kind(n_neighbors=7, weights="distance"))
