"""Generic baseline of an imported MLE-bench task: it writes sample_submission.csv unchanged.

A placeholder that makes a valid submission, not a model: it is the starting point to replace.
"""
import pandas as pd

submission = pd.read_csv("sample_submission.csv")
print(f"{len(submission)} rows of sample_submission.csv written unchanged to submission.csv")
submission.to_csv("submission.csv", index=False)
