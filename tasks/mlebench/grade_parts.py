import importlib, json, sys
import numpy as np, pandas as pd
$labels
fn, submission, answers, id_column = sys.argv[1:]
module, name = fn.split(":")  # as mlebench/utils.py import_fn
try:
    grade = getattr(importlib.import_module(module), name)
except Exception as e:
    sys.exit(f"cannot import {fn}: {type(e).__name__}: {e}")
read = lambda path: pd.read_csv(path, float_precision="round_trip")  # as mlebench/utils.py read_csv
ans = read(answers)
try:  # any exception of grade() makes the submission invalid, as in mlebench/grade_helpers.py Grader.__call__
    sub = read(submission)
    grade(sub, ans.drop(columns="part"))  # valid as a whole, as MLE-bench grades it; then each part alone
    ids = _labels(sub[id_column]) if id_column in sub else None
    out = {}
    for part in ("public", "private"):
        a = ans[ans["part"] == part].drop(columns="part").reset_index(drop=True)
        s = sub if ids is None else sub[np.isin(ids, _labels(a[id_column]))].reset_index(drop=True)
        out[part] = float(grade(s, a))
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
print(json.dumps(out))
