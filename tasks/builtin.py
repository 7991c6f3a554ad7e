"""What the built-in tasks share: reading the folders of tasks/ into task specs, a spec's task folder (its table split
into train and test rows, the answers, the starter, the leaderboard), the reference panel that makes each leaderboard,
and the starter script of a generated task. env.py loads this file (runpy) for BUILTIN_TASKS and prepare(); the
families' prepare.py load it for starter().

The panel stands in for a Kaggle leaderboard: a range of scikit-learn pipelines (dummies, linear models over a range
of regularisation, k-nearest neighbours, trees, ensembles, an SVM, an MLP), each fitted on train.csv and scored on
the private part of the test rows (`score`, the leaderboard, which HumanRank reads) and on the public part
(`public_score`, whose best is the m_best of the reward's scale: m_t, m_init and m_best on the same rows).
"""
import fcntl
import functools
import json
import os
import runpy
import string
import types
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

# ======================================================================================== the tasks of tasks/
# One folder per task or task family (tasks/README.md), in MLAgentBench's per-task layout (its benchmarks/<task>/:
# scripts/prepare.py makes the data, scripts/research_problem.txt states the problem, env/train.py is the starter,
# scripts/eval.py scores it): task.json says how the task is split and scored, prepare.py's rows() makes the whole
# table, research_problem.md and train.py are the problem and the starter. A family's task.json says how many seeds it
# has, and its prepare.py draws the rest with task(seed) and the table with rows(seed).
ORDER = ("digits", "breast-cancer", "reviews", "churn", "wine", "diabetes", "loans", "energy", "sales",
         "house-prices", "synth-regression", "synth-classification", "synth-timeseries", "synth-text")
# time_limit: seconds per run of train.py, far above what the starters and the offline recipes take alone, because under
# ppo.py's load (4 scripts and the generation on 2 cores) a script runs several times slower, and a tighter limit
# would make rewards depend on load (tests/RESULTS.md, "env.py: the per-run time limit").
SPEC_DEFAULTS = {"submit": "label", "test_fraction": 0.3, "missing": False, "classes": 3, "time_limit": 60.0}
VERSION = 6  # bump when a folder of tasks/ or make() changes a task: prepare() rebuilds the folders of older ones


def specs(root: Path) -> dict[str, types.SimpleNamespace]:
    """Every built-in task of the folders under `root` by name (ORDER first, then the others by name): task.json's
    fields with defaults, or, for a family, with each seed's draw; `rows()` makes the table, `starter` is train.py,
    `about` the research problem."""
    folders = sorted((p.parent for p in root.glob("*/task.json")),
                     key=lambda f: ((*ORDER, f.name).index(f.name), f.name))
    tasks = {}
    for folder in folders:
        info = json.loads((folder / "task.json").read_text())
        if "seeds" in info:
            code = runpy.run_path(str(folder / "prepare.py"))
            # the seeds past `seeds` are the family's held-out draws: evaluation only (never collected, SFT or PPO)
            held_out = range(info["seeds"], info["seeds"] + info.get("held_out_seeds", 0))
            draws = [({**info, **code["task"](s), **({"split": "held-out"} if s in held_out else {})},
                      functools.partial(code["rows"], s)) for s in range(held_out.stop)]
        else:  # prepare.py is read when the rows are made: its imports (scikit-learn's datasets) are slow
            draws = [({**info, "name": folder.name, "about": (folder / "research_problem.md").read_text().rstrip("\n"),
                       "starter": (folder / "train.py").read_text()}, functools.partial(rows_of, folder))]
        for fields, rows in draws:
            spec = types.SimpleNamespace(**{**SPEC_DEFAULTS, **fields}, rows=rows)
            # the submission's target columns: one probability column per class, or the target
            spec.target_columns = [f"class_{c}" for c in range(spec.classes)] if spec.submit == "classes" \
                else [spec.target]
            tasks[spec.name] = spec
    return tasks


def rows_of(folder: Path):
    """The table of a one-task folder: its prepare.py's rows()."""
    return runpy.run_path(str(folder / "prepare.py"))["rows"]()


def make(spec, env) -> dict:
    """One built-in task's files, for env._write_task: the rows split, the answers with their public/private part, the
    starter, the leaderboard. `env` is env.py (its METRICS, _labels, _parts, _description, _columns)."""
    metric = env.METRICS[spec.metric]
    df = spec.rows()
    if spec.modality == "time series":  # the test rows are the last 120 days, kept in time order
        cut = sorted(df["date"].unique())[-120]
        df.insert(0, "id", np.arange(len(df)))
        train, test = df[df["date"] < cut], df[df["date"] >= cut]
    else:
        from sklearn.model_selection import train_test_split
        df = df.sample(frac=1.0, random_state=0).reset_index(drop=True)
        df.insert(0, "id", np.arange(len(df)))
        strat = df[spec.target] if spec.kind == "classification" else None
        train, test = train_test_split(df, test_size=spec.test_fraction, random_state=0, stratify=strat)
        train, test = train.sort_values("id"), test.sort_values("id")
    part = env._parts(len(test))
    if spec.submit == "classes":
        answers = pd.get_dummies(test[spec.target]).astype(int).set_axis(spec.target_columns, axis=1)
    else:
        answers = test[[spec.target]]
    answers = pd.concat([test[["id"]], answers], axis=1).assign(part=part)
    test_x = test.drop(columns=[spec.target])
    board = leaderboard(spec, metric, env._labels, train, test_x, answers)
    y = train[spec.target]
    if spec.submit == "classes":
        default = 1 / len(spec.target_columns)  # uniform class probabilities, unrounded: rows must sum to 1
    elif spec.submit == "probability":
        default = round(y.mean(), 4)  # the base rate
    else:
        default = y.mode()[0] if metric.kind == "label" else y.mean()
    info = {"name": spec.name, "title": spec.title, "metric": spec.metric, "higher_is_better": metric.higher_is_better,
            "id_column": "id", "target_columns": spec.target_columns, "best_score": float(board["score"].iloc[0]),
            "best_public_score": float(board["public_score"].max() if metric.higher_is_better
                                       else board["public_score"].min()),
            "time_limit": spec.time_limit, "split": spec.split, "kind": spec.kind, "modality": spec.modality,
            "public_fraction": round(float(np.mean(part == "public")), 4), "version": VERSION,
            "leaderboard": "reference panel of scikit-learn pipelines scored on the private part, "
                           "not human Kaggle entries"}
    description = env._description(
        "builtin", title=spec.title, about=spec.about, n_train=len(train), n_test=len(test),
        columns=env._columns(train.columns), submission=env._columns(["id", *spec.target_columns]),
        baseline=spec.baseline, time_limit=spec.time_limit, metric=spec.metric,
        direction="higher" if metric.higher_is_better else "lower")
    sample = pd.DataFrame({"id": test["id"], **dict.fromkeys(spec.target_columns, default)})
    return {"public/train.csv": train, "public/test.csv": test_x, "public/sample_submission.csv": sample,
            "public/train.py": spec.starter, "private/answers.csv": answers, "private/leaderboard.csv": board,
            "task.json": info, "description.md": description}

def prepare(env, names, root: Path, force: bool, workers) -> list[Path]:
    """env.prepare: the folders of the built-in tasks `names` (default: all) under root, built by make() where missing
    or of an older VERSION, `workers` at a time (default: one process per CPU core): fitting the reference panels is
    most of a first run's setup, and each task's panel fits in one thread."""
    root.mkdir(parents=True, exist_ok=True)
    names = list(names or env.BUILTIN_TASKS)
    unknown = [n for n in names if n not in env.BUILTIN_TASKS]
    if unknown:
        raise env.TaskError(env.unknown_task(unknown[0], "built-in task"))
    todo = list(dict.fromkeys(n for n in names if force or not current(root / n)))
    workers = min(len(todo), workers or os.cpu_count() or 1)
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        # spawned, not forked: a forked child can wait forever on a lock that a thread of its parent held (an OpenMP
        # pool of scikit-learn or numpy is the usual one); forked, the test suite once hung here with both workers idle.
        # The worker is env._build, which calls build(): a function of this file (run by runpy) cannot be pickled.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(tqdm(pool.map(env._build, todo, [root] * len(todo), [force] * len(todo)), "tasks", len(todo)))
    else:
        for name in tqdm(todo, "tasks", disable=len(todo) < 2):
            build(env, name, root, force)
    return [root / name for name in names]


def build(env, name: str, root: Path, force: bool):
    """One task folder, under an flock of its own (root/.<name>.lock): a second builder of it waits, then finds it
    built; builders of other tasks go on."""
    lock = os.open(root / f".{name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not current(root / name):
            env._write_task(root / name, make(env.BUILTIN_TASKS[name], env))
    finally:
        os.close(lock)


def current(folder: Path) -> bool:
    try:
        return json.loads((folder / "task.json").read_text()).get("version") == VERSION
    except (OSError, json.JSONDecodeError):
        return False


# ================================================================================================ the reference panel


def features(train: pd.DataFrame, test: pd.DataFrame, target: str):
    """Numeric features for the reference panel: date parts, one-hot categories, median-filled numbers, or tf-idf."""
    if "text" in train:
        from sklearn.feature_extraction.text import TfidfVectorizer
        vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
        return vec.fit_transform(train["text"]), vec.transform(test["text"])
    both = pd.concat([train.drop(columns=[target]), test]).drop(columns=["id"])
    if "date" in both:
        date = pd.to_datetime(both.pop("date"))
        doy = 2 * np.pi * date.dt.day_of_year / 365.25
        both = both.assign(t=(date - date.min()).dt.days, dow=date.dt.day_of_week.astype(str), sin=np.sin(doy),
                           cos=np.cos(doy))
    both = pd.get_dummies(both, dtype=float)
    both = both.fillna(both[: len(train)].median()).to_numpy(dtype=float)
    return both[: len(train)], both[len(train):]


def panel(kind: str, sparse: bool, proba: bool = True) -> list[tuple[str, object]]:
    """The reference pipelines: dummies, linear models over a range of regularisation, kNN, trees, ensembles.
    proba=False (a metric on labels): the SVM skips the 5-fold Platt scaling that only predict_proba uses (its
    predict reads the decision function either way), a fifth of a task's build."""
    from sklearn import dummy, ensemble, linear_model as lm, naive_bayes, neighbors, neural_network, svm, tree
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def scaled(m):  # tf-idf rows are already on one scale
        return m if sparse else make_pipeline(StandardScaler(), m)
    if kind == "classification":
        panel = [("dummy: most frequent class", dummy.DummyClassifier()),
                 ("dummy: random, class frequencies", dummy.DummyClassifier(strategy="stratified", random_state=0))]
        panel += [(f"logistic regression C={c:g}", scaled(lm.LogisticRegression(C=c, max_iter=2000)))
                  for c in (0.001, 0.01, 0.1, 1, 10, 100)]
        panel += [(f"k-nearest neighbours k={k}", scaled(neighbors.KNeighborsClassifier(k))) for k in (1, 5, 25)]
        panel += [(f"decision tree depth={d}", tree.DecisionTreeClassifier(max_depth=d, random_state=0))
                  for d in (1, 3, 6, None)]
        panel += [("random forest 20 trees depth 4", ensemble.RandomForestClassifier(20, max_depth=4, random_state=0)),
                  ("random forest 100 trees", ensemble.RandomForestClassifier(100, random_state=0)),
                  ("extra trees 100", ensemble.ExtraTreesClassifier(100, random_state=0)),
                  ("RBF SVM", scaled(svm.SVC(C=10, probability=proba, random_state=0))),
                  ("MLP 64 hidden", scaled(neural_network.MLPClassifier((64,), max_iter=300, random_state=0)))]
        if sparse:
            return panel + [("multinomial naive Bayes", naive_bayes.MultinomialNB()),
                            ("linear SVM", svm.LinearSVC())]
        return panel + [("gaussian naive Bayes", naive_bayes.GaussianNB()),
                        ("histogram gradient boosting", ensemble.HistGradientBoostingClassifier(random_state=0))]
    panel = [("dummy: mean", dummy.DummyRegressor()), ("dummy: median", dummy.DummyRegressor(strategy="median")),
             ("linear regression", scaled(lm.LinearRegression()))]
    panel += [(f"ridge alpha={a:g}", scaled(lm.Ridge(a))) for a in (0.1, 10, 100, 1000)]
    panel += [(f"lasso alpha={a:g}", scaled(lm.Lasso(alpha=a, max_iter=5000))) for a in (0.1, 10)]
    panel += [(f"k-nearest neighbours k={k}", scaled(neighbors.KNeighborsRegressor(k))) for k in (1, 5, 20)]
    panel += [(f"decision tree depth={d}", tree.DecisionTreeRegressor(max_depth=d, random_state=0))
              for d in (2, 4, 8, None)]
    return panel + [("random forest 20 trees depth 4", ensemble.RandomForestRegressor(20, max_depth=4, random_state=0)),
                    ("random forest 100 trees", ensemble.RandomForestRegressor(100, random_state=0)),
                    ("extra trees 100", ensemble.ExtraTreesRegressor(100, random_state=0)),
                    ("gradient boosting 200", ensemble.GradientBoostingRegressor(n_estimators=200, random_state=0)),
                    ("histogram gradient boosting", ensemble.HistGradientBoostingRegressor(random_state=0))]


def leaderboard(spec, metric, labels, train, test, answers) -> pd.DataFrame:
    """Fit every pipeline of the panel on train.csv and score it with `metric` (env.METRICS's) on the private and the
    public part of the test rows; `labels` turns class labels into comparable strings (env.py's, as the grader)."""
    from threadpoolctl import threadpool_limits  # scikit-learn's own dependency
    xtr, xte = features(train, test, spec.target)
    private = (answers["part"] == "private").to_numpy()
    truth = answers[spec.target_columns].to_numpy()
    truth = labels(truth.ravel()) if metric.kind == "label" else truth.astype(float).squeeze()
    rows = []
    for entry, model in panel(spec.kind, sparse=not isinstance(xtr, np.ndarray), proba=metric.kind == "probability"):
        if metric.kind == "probability" and not hasattr(model, "predict_proba"):
            continue
        with warnings.catch_warnings(), threadpool_limits(1):  # one thread: deterministic, no oversubscription
            warnings.simplefilter("ignore")
            model.fit(xtr, train[spec.target])
        if metric.kind == "label":
            pred = labels(model.predict(xte))
        elif metric.kind == "probability":
            pred = model.predict_proba(xte)[:, 1] if len(spec.target_columns) == 1 else model.predict_proba(xte)
        else:
            pred = model.predict(xte)
        rows.append((entry, round(metric.fn(truth[private], pred[private]), 6),
                     round(metric.fn(truth[~private], pred[~private]), 6)))
    board = pd.DataFrame(rows, columns=["entry", "score", "public_score"])
    return board.sort_values("score", ascending=not metric.higher_is_better, kind="stable")


# ================================================================================== the starter of a generated task
# A hand-made task's starter is its own train.py; a family's differs with its seed, so its prepare.py makes it from
# these pieces. The `# --- name ---` lines mark the blocks that the offline recipes (tasks/recipes/) edit.

METRIC_CODE = {  # metric -> (its name in the script's output, the scikit-learn call that scores the validation rows)
    "accuracy": ("accuracy", "accuracy_score(y_val, model.predict(X_val))"),
    "f1_macro": ("macro-F1", "f1_score(y_val, model.predict(X_val), average='macro')"),
    "roc_auc": ("ROC AUC", "roc_auc_score(y_val, model.predict_proba(X_val)[:, 1])"),
    "log_loss": ("log-loss", "log_loss(y_val, model.predict_proba(X_val))"),
    "mae": ("MAE", "mean_absolute_error(y_val, model.predict(X_val))"),
    "rmse": ("RMSE", "root_mean_squared_error(y_val, model.predict(X_val))")}
MODELS = {  # the starter's model block: (the imports it needs, the line that makes `model`)
    "ridge": (["from sklearn.linear_model import Ridge"], "model = Ridge(alpha=1.0)"),
    "tree-regressor": (["from sklearn.tree import DecisionTreeRegressor"],
                       "model = DecisionTreeRegressor(max_depth=4, random_state=0)"),
    "scaled-logreg": (["from sklearn.linear_model import LogisticRegression", "from sklearn.pipeline import "
                       "make_pipeline", "from sklearn.preprocessing import StandardScaler"],
                      "model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))"),
    "naive-bayes": (["from sklearn.naive_bayes import GaussianNB"], "model = GaussianNB()"),
    "tree-classifier": (["from sklearn.tree import DecisionTreeClassifier"],
                        "model = DecisionTreeClassifier(max_depth=3, random_state=0)"),
    "text-logreg": (["from sklearn.feature_extraction.text import CountVectorizer",
                     "from sklearn.linear_model import LogisticRegression"],
                    "model = LogisticRegression(max_iter=1000)")}
SUBMIT = {  # what submission.csv holds -> the lines that make it
    "label": 'submission = pd.DataFrame({"id": test["id"], "$target": model.predict(X_test)})',
    "probability": 'submission = pd.DataFrame({"id": test["id"], "$target": model.predict_proba(X_test)[:, 1]})',
    "classes": 'submission = pd.DataFrame(model.predict_proba(X_test), columns=[f"class_{c}" for c in '
               'model.classes_])\nsubmission.insert(0, "id", test["id"])'}
STARTER = string.Template('''"""Starter script for the "$name" task: $baseline.

Reads train.csv and test.csv, holds out 20% of train.csv for validation and prints the validation $label,
then refits on all of train.csv and writes submission.csv in the format of sample_submission.csv.
"""
import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
$imports

# --- data ---
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y = train["$target"]
$data

# --- model ---
$model

# --- training ---
X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.2, $split)
model.fit(X_tr, y_tr)
print(f"Validation $label: {$score:.4f}")
model.fit(X, y)

# --- submission ---
$submit
submission.to_csv("submission.csv", index=False)
''')


def starter(name, baseline, metric, target, kind, model, data, submit="label", time_series=False) -> str:
    """A generated task's starter: `model` a key of MODELS, `data` the lines that build X and X_test from train and
    test, `submit` a key of SUBMIT. A time series validates on the latest rows of train.csv (no shuffle)."""
    label, score = METRIC_CODE[metric]
    imports, code = MODELS[model]
    split = "shuffle=False" if time_series else "random_state=0" + (", stratify=y" if kind == "classification" else "")
    return STARTER.substitute(
        name=name, baseline=baseline, label=label, target=target, data=data, model=code, split=split, score=score,
        imports="\n".join(sorted({f"from sklearn.metrics import {score.split('(')[0]}", *imports})),
        submit=string.Template(SUBMIT[submit]).substitute(target=target))


def data_block(script: str, target: str) -> str:
    """The lines of a starter that build X and X_test (after `y = ...`, up to the model block): a family drawn from a
    hand-made task's generator keeps that task's features."""
    return script.split(f'y = train["{target}"]\n', 1)[1].split("\n\n# --- model ---", 1)[0]

# ============================================================ generated tables (synth-regression, synth-classification)


def table_columns(rng, x: np.ndarray, n_cat: int, missing: bool) -> pd.DataFrame:
    """Numeric features (some skewed or rounded to counts), `n_cat` categories binned from further features,
    5% missing values in two numeric columns when `missing`."""
    n, d = x.shape[0], x.shape[1] - n_cat
    df = pd.DataFrame(index=range(n))
    for j in range(d):
        shape = rng.choice(["normal", "skewed", "count"])
        col = x[:, j] if shape == "normal" else np.exp(0.6 * x[:, j]) if shape == "skewed" \
            else np.clip(np.round(3 + 1.5 * x[:, j]), 0, None)
        df[f"f{j}"] = np.round(col, 4)
    for j in range(n_cat):
        levels = [f"{c}{j}" for c in "abcde"[: rng.integers(3, 6)]]
        df[f"cat{j}"] = np.array(levels)[np.digitize(x[:, d + j], np.sort(rng.normal(0, 1, len(levels) - 1)))]
    if missing:
        for col in rng.choice([f"f{j}" for j in range(d)], size=2, replace=False):
            df.loc[rng.random(n) < 0.05, col] = np.nan
    return df


def table_data(target: str, n_cat: int, missing: bool) -> str:
    """The starter's data block of a generated table: one-hot categories, training medians for missing numbers."""
    lines = [f'X = train.drop(columns=["id", "{target}"])', 'X_test = test.drop(columns=["id"])']
    if n_cat:
        cols = ", ".join(f'"cat{j}"' for j in range(n_cat))
        lines += ["# one-hot encode the categories", f"both = pd.get_dummies(pd.concat([X, X_test]), columns=[{cols}], "
                  "dtype=float)"]
    else:
        lines += ["both = pd.concat([X, X_test])"]
    if missing:
        lines += ["# fill missing numbers with the training medians", "both = both.fillna(both[: len(X)].median())"]
    return "\n".join(lines + ["X, X_test = both[: len(X)], both[len(X):]"])
