# idea: Calibrate the predicted probabilities with 3-fold sigmoid (Platt) calibration.
# category: learning
# tasks: CLASSIFY
# block: model

from sklearn.calibration import CalibratedClassifierCV

# calibrate the probabilities: Platt's sigmoid fitted on 3 held-out folds
model = CalibratedClassifierCV(model, method="sigmoid", cv=3)
