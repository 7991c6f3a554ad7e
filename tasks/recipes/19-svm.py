# idea: Replace the model with an RBF-kernel support vector machine on standardised features.
# category: model
# tasks: CLASSIFY
# block: model
# replace: model = .*

from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

model = make_pipeline(StandardScaler(), SVC(C=10, probability=True, random_state=0))
