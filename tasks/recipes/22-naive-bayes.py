# idea: Replace the model with complement naive Bayes.
# category: model
# tasks: TEXT
# block: model
# replace: model = .*

from sklearn.naive_bayes import ComplementNB

model = ComplementNB(alpha=0.5)
