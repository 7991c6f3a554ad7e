"""The preparation of an MLE-bench competition ("MLE-bench", arXiv:2410.07095): a task folder made from one.

MLE-bench (github.com/openai/mle-bench) prepares a Kaggle competition into <data>/<id>/prepared/ (public/: what the
agent sees; private/: the answers); mlebench/competitions/<id>/ in its checkout holds config.yaml (the answers and
sample submission files, the grade function), grade.py and Kaggle's leaderboard.csv (best first). Here the test rows
get a seeded public/private split, as Kaggle had, and the folder says how each part is graded: by the competition's own
grade.py (given a checkout) or by one of env.METRICS. env.py runs this file with runpy and passes itself as `env`
(env.import_mlebench, `python env.py import-mlebench`): nothing here is imported as a module.
"""
import shutil
import sys
from pathlib import Path

import pandas as pd


def read_yaml(path: Path) -> dict:
    """The YAML that an MLE-bench config.yaml needs here (mlebench/registry.py reads it with yaml.safe_load): nested
    `key: value` mappings by indentation, quotes stripped; list items (prizes) are skipped. PyYAML is no dependency."""
    root: dict = {}
    stack = [(-1, root)]
    for line in path.read_text().splitlines():
        body = line.split(" #")[0].rstrip()
        if not body.strip() or body.lstrip().startswith(("#", "-")):
            continue
        indent = len(body) - len(body.lstrip())
        key, _, value = (x.strip() for x in body.partition(":"))
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1][key] = value.strip("'\"") if value else {}
        if not value:
            stack.append((indent, stack[-1][1][key]))
    return root


def read_board(env, leaderboard, metric, higher) -> tuple[pd.DataFrame, bool]:
    """MLE-bench's leaderboard.csv as private/leaderboard.csv (`entry`, `score`), best first, and whether higher is
    better (`higher`, the metric's direction, or None: read off the leaderboard)."""
    board = pd.read_csv(leaderboard)
    if "score" not in board or board["score"].isna().all():
        raise env.TaskError(f"{leaderboard}: no `score` column with values")
    board = board.dropna(subset=["score"])
    first, last = board["score"].iloc[0], board["score"].iloc[-1]
    if higher is None:  # as MLE-bench reads it off the leaderboard, best first (mlebench/grade_helpers.py)
        higher = not first < last
    if (first - last) * (1 if higher else -1) < 0:
        raise env.TaskError(f"{leaderboard} ranks the other way round from {metric} ("
                            f"{'higher' if higher else 'lower'} is better): is {metric} the competition's metric?")
    teams = board["teamId"].tolist() if "teamId" in board else range(1, len(board) + 1)  # MLE-bench drops names
    board = pd.DataFrame({"entry": [f"team {t}" for t in teams], "score": board["score"].to_numpy(float)})
    return board.sort_values("score", ascending=not higher, kind="stable"), higher


def import_mlebench(env, prepared, out, metric, leaderboard, id_column, higher_is_better, starter, name, split,
                    time_limit, public_fraction, seed, mlebench, config, score_rows) -> Path:
    """env.import_mlebench: the task folder `out`, its sample submission graded before it is kept."""
    prepared, out = Path(prepared), Path(out)
    prepared = prepared / "prepared" if (prepared / "prepared").is_dir() else prepared
    competition = prepared.parent.name if prepared.name == "prepared" else prepared.name
    checkout = Path(mlebench).resolve() if mlebench else None
    if checkout and not config:
        config = checkout / "mlebench" / "competitions" / competition / "config.yaml"
    if config and not Path(config).is_file():
        raise env.TaskError(f"{competition}: no config.yaml at {config}")
    cfg = read_yaml(Path(config)) if config else {}
    if checkout and leaderboard is None:
        leaderboard = Path(config).parent / "leaderboard.csv"
    competition = cfg.get("id", competition)
    # config.yaml names the files relative to the data folder, <id>/prepared/... (mlebench/registry.py)
    answers_file, sample_file = (cfg.get("dataset", {}).get(k, d).split("prepared/", 1)[-1] for k, d in
                                 (("answers", "private/test.csv"), ("sample_submission", "public/sample_submission.csv")))
    missing = [f for f in (answers_file, sample_file) if not (prepared / f).is_file()]
    if missing or not answers_file.endswith(".csv") or not sample_file.startswith("public/"):
        raise env.TaskError(f"{prepared}: not an MLE-bench prepared competition with CSV answers and a public sample "
                            f"submission (answers {answers_file}, sample {sample_file}; missing {missing or 'none'})")
    if leaderboard is not None and not Path(leaderboard).is_file():
        raise env.TaskError(f"no such leaderboard: {leaderboard}")
    if not checkout and metric not in env.METRICS:
        raise env.TaskError(f"unknown metric {metric!r}: env.py grades with {', '.join(env.METRICS)} (another metric "
                            f"needs --mlebench, the competition's own grade.py)")
    if checkout and score_rows:
        raise env.TaskError("--score-rows is for env.py's metrics: with --mlebench the competition's grade.py picks "
                            "its rows")
    m = env.METRICS.get(metric)
    board, higher = (None, m.higher_is_better) if leaderboard is None else \
        read_board(env, leaderboard, metric, m.higher_is_better if m else None)
    direction = "higher" if higher else "lower"
    if higher_is_better not in (None, higher):
        raise env.TaskError(f"{metric or competition}: {direction} is better, not the direction given")
    if out.exists() and not (out / "task.json").is_file():
        raise env.TaskError(f"{out} exists and is not a task folder: choose a new --out")
    sample = pd.read_csv(prepared / sample_file)
    id_column = id_column or sample.columns[0]
    targets = [c for c in sample.columns if c != id_column]
    truth = pd.read_csv(prepared / answers_file)
    need = [id_column] if checkout else [id_column, *targets]
    missing = [c for c in need if c not in truth.columns or c not in sample.columns]
    if missing or not targets or (not checkout and len(truth) != len(sample)):
        raise env.TaskError(f"{prepared}: {answers_file} ({len(truth)} rows) must hold the id column and the target "
                            f"column(s) of {sample_file} ({len(sample)} rows); missing: {missing or 'none'}")
    rule = None
    if score_rows:  # the one subset rule expressed here: COLUMN == VALUE (ventilator-pressure-prediction's u_out=0)
        column, eq, value = score_rows.partition("=")
        if not eq or column not in truth.columns or column in need:
            raise env.TaskError(f"--score-rows {score_rows!r}: not COLUMN=VALUE with COLUMN a non-target column of "
                                f"{answers_file} (another subset rule needs --mlebench, the competition's own "
                                f"grade.py)")
        rule = {"column": column, "value": value}
    if m and m.kind == "probability" and not checkout and not truth[targets].isin([0, 1]).all().all():
        raise env.TaskError(f"{answers_file}: {metric} needs 0/1 answers, these hold other values (e.g. jigsaw's -1 "
                            f"rows, which its grade.py skips): import with --mlebench")
    keep = list(truth.columns) if checkout else [*need, *([rule["column"]] if rule else [])]
    answers = truth[keep].assign(part=env._parts(len(truth), public_fraction, seed))
    if board is not None:
        best = float(board["score"].iloc[0])
    else:  # no leaderboard: the best score is the perfect one, the answers graded against themselves
        values = answers[targets].to_numpy()
        try:
            values = env._labels(values[:, 0]) if m.kind == "label" else values.astype(float).squeeze()
        except ValueError:
            raise env.TaskError(f"{prepared}: the answers are not numbers, as {metric} needs") from None
        best = m.fn(values, values)
    name = name or competition
    about = prepared / "public" / "description.md"
    grader = {"grader": "env.py metric"} if not checkout else \
        {"grader": "grade.py", "grade_fn": cfg.get("grader", {}).get("grade_fn"), "checkout": str(checkout),
         "python": sys.executable}
    if checkout and not grader["grade_fn"]:
        raise env.TaskError(f"{competition}: {config} has no grader: grade_fn")
    metric = metric or cfg.get("grader", {}).get("name") or "grade.py"
    info = {"name": name, "title": name, "metric": metric, "higher_is_better": higher,
            "id_column": id_column, "target_columns": targets, "best_score": best, "time_limit": float(time_limit),
            "split": split, "source": f"MLE-bench prepared competition {prepared.resolve()}",
            "public_fraction": public_fraction, "split_seed": seed,
            "mlebench": {"competition": competition, "config": str(config) if config else None,
                         "answers": answers_file, "sample_submission": sample_file, **grader},
            **({"score_rows": rule} if rule else {}),
            "leaderboard": "MLE-bench's copy of the Kaggle leaderboard: scored by the competition's own metric on "
                           "Kaggle's test rows, not on these" if leaderboard is not None else
                           "none: best_score is the perfect score"}
    baseline = "the starter script given at import" if starter else \
        "a generic baseline that writes sample_submission.csv unchanged (a placeholder, not a model: replace it)"
    description = env._description(
        "mlebench", title=name, about=about.read_text().strip() if about.is_file() else f"MLE-bench competition {name}.",
        files=env._columns(sorted(p.name for p in (prepared / "public").iterdir())), baseline=baseline,
        submission=env._columns(sample.columns), metric=metric, direction=direction, time_limit=time_limit)
    files = {"public": prepared / "public", "public/sample_submission.csv": (prepared / sample_file).read_text(),
             "public/train.py": Path(starter).read_text() if starter else env._text("mlebench/baseline.py"),
             "private/answers.csv": answers, "task.json": info, "description.md": description}
    if board is not None:
        files["private/leaderboard.csv"] = board
    out.parent.mkdir(parents=True, exist_ok=True)
    env._write_task(out, files)
    try:  # a folder whose sample submission does not grade is removed again
        check = env.grade(out, out / "public" / "sample_submission.csv")
        if not check.valid:
            raise env.TaskError(f"{competition}: sample_submission.csv does not grade under {metric}: {check.error}")
    except env.TaskError:
        shutil.rmtree(out)
        raise
    return out
