# idea: Weight each class inversely to its frequency in the training loss.
# category: learning
# tasks: CLASSIFY + TEXT
# block: model

# weight each class inversely to its frequency
model.set_params(**{k: "balanced" for k in model.get_params() if k.split("__")[-1] == "class_weight"})
