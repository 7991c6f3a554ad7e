# idea: Average the model's predictions with a random forest and gradient boosting.
# category: learning
# tasks: NUMERIC
# block: model

from sklearn.ensemble import HistGradientBoosting$kind, RandomForest$kind, Voting$kind

# average the model with a random forest and gradient boosting
model = Voting$kind([("base", model), ("forest", RandomForest$kind(n_estimators=100, random_state=0)),
                     ("boosting", HistGradientBoosting$kind(max_iter=50, random_state=0))]$voting)
