# idea: Choose the model's main hyperparameters by 3-fold cross-validated grid search.
# category: learning
# tasks: NUMERIC + TEXT
# block: model

from sklearn.model_selection import GridSearchCV

# choose the main hyperparameters by 3-fold cross-validated grid search
values = {"C": [0.1, 1.0, 10.0], "alpha": [0.1, 1.0, 10.0], "max_depth": [None, 4, 8], "var_smoothing": [1e-9, 1e-3],
          "n_neighbors": [5, 15], "learning_rate": [0.05, 0.2]}
grid = {k: values[k.split("__")[-1]] for k in model.get_params() if k.split("__")[-1] in values}
model = GridSearchCV(model, grid, cv=3, scoring="$scoring") if grid else model
