# idea: Choose the model's main hyperparameters by 3-fold cross-validated search over 4 random settings of a grid.
# category: learning
# tasks: NUMERIC + TEXT
# block: model

import math
from sklearn.model_selection import RandomizedSearchCV

# choose the main hyperparameters by 3-fold cross-validation of 4 settings drawn from the grid (the whole grid of an
# ensemble's members can run to 18 settings: 54 fits of the ensemble, minutes)
values = {"C": [0.1, 1.0, 10.0], "alpha": [0.1, 1.0, 10.0], "max_depth": [None, 4, 8], "var_smoothing": [1e-9, 1e-3],
          "n_neighbors": [5, 15], "learning_rate": [0.05, 0.2]}
grid = {k: values[k.split("__")[-1]] for k in model.get_params() if k.split("__")[-1] in values}
settings = math.prod(len(v) for v in grid.values())
model = RandomizedSearchCV(model, grid, n_iter=min(4, settings), cv=3, scoring="$scoring",
                           random_state=0) if grid else model
