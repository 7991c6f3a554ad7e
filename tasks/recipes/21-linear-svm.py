# idea: Replace the model with a linear support vector machine.
# category: model
# tasks: TEXT
# block: model
# replace: model = .*

from sklearn.svm import LinearSVC

model = LinearSVC(C=0.5)
