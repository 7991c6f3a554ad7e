"""Imported MLE-bench competitions are graded as MLE-bench grades them (issue 15).

Fixtures are competitions in MLE-bench's own layout, written here: a fake checkout
(`mlebench/competitions/<id>/config.yaml`, `grade.py`, `leaderboard.csv`, a stand-in `mlebench/grade_helpers.py`)
and a data folder (`<data>/<id>/prepared/{public,private}`). Reference numbers are computed by hand in the comments.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import log_loss, mean_absolute_error, roc_auc_score

import env

ROOT = Path(env.__file__).parent
CONFIG = """id: {id}
name: "A test competition"
competition_type: simple
awards_medals: true
prizes:
  - position: 1
    value: 2500
description: mlebench/competitions/{id}/description.md

dataset:
  answers: {id}/prepared/{answers}
  sample_submission: {id}/prepared/{sample}

grader:
  name: {grader}
  grade_fn: mlebench.competitions.{id}.grade:grade  # a comment

preparer: mlebench.competitions.{id}.prepare:prepare
"""
# ventilator-pressure-prediction/grade.py in short: MAE on the rows with u_out == 0, same length and ids required
VENTILATOR_GRADE = """
from sklearn.metrics import mean_absolute_error
from mlebench.grade_helpers import InvalidSubmissionError

def grade(submission, answers):
    assert "part" not in answers.columns and "u_out" in answers.columns  # the answers as MLE-bench keeps them
    if len(submission) != len(answers):
        raise InvalidSubmissionError("Submission and answers must have the same length")
    submission, answers = submission.sort_values("id"), answers.sort_values("id")
    if (submission["id"].values != answers["id"].values).any():
        raise InvalidSubmissionError("Submission and answers must be aligned in id order")
    keep = (answers["u_out"] == 0).values
    return mean_absolute_error(answers["pressure"].values[keep], submission["pressure"].values[keep])
"""


def _competition(root: Path, cid: str, answers: pd.DataFrame, sample: pd.DataFrame, grade_py=VENTILATOR_GRADE,
                 answers_file="private/test.csv", sample_file="public/sample_submission.csv", train_file="train.csv",
                 scores=(0.1, 0.2, 0.5), grader="mae") -> tuple[Path, Path]:
    """(prepared folder, checkout) of one competition in MLE-bench's layout."""
    prepared = root / "data" / cid / "prepared"
    for f, df in ((answers_file, answers), (sample_file, sample), (f"public/{train_file}", answers.head(3))):
        (prepared / f).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(prepared / f, index=False)
    comp = root / "mle-bench" / "mlebench" / "competitions" / cid
    comp.mkdir(parents=True)
    for pkg in (comp.parent.parent, comp.parent, comp):
        (pkg / "__init__.py").touch()
    (comp.parent.parent / "grade_helpers.py").write_text("class InvalidSubmissionError(Exception):\n    pass\n")
    (comp / "config.yaml").write_text(CONFIG.format(id=cid, answers=answers_file, sample=sample_file, grader=grader))
    (comp / "grade.py").write_text(grade_py)
    pd.DataFrame({"teamId": range(len(scores)), "score": scores}).to_csv(comp / "leaderboard.csv", index=False)
    return prepared, root / "mle-bench"


def _ventilator(root: Path, n=40, cid="tiny-ventilator"):
    rng = np.random.default_rng(0)
    answers = pd.DataFrame({"id": np.arange(1, n + 1), "u_out": np.arange(n) % 3 == 0,
                            "pressure": np.round(rng.normal(10, 3, n), 3)}).astype({"u_out": int})
    return _competition(root, cid, answers, answers[["id"]].assign(pressure=0.0))


def _parts(task) -> pd.DataFrame:
    return pd.read_csv(task.private_dir / "answers.csv")


def _write(df: pd.DataFrame, path: Path) -> Path:
    df.to_csv(path, index=False)
    return path


# ============================================================================================ with a checkout


def test_grade_py_runs_in_a_subprocess_on_each_part(tmp_path):
    prepared, checkout = _ventilator(tmp_path)
    task = env.load_task(env.import_mlebench(prepared, tmp_path / "task", mlebench=checkout))
    m = task.info["mlebench"]  # the choice is recorded: every later grade() uses grade.py
    assert (m["grader"], m["grade_fn"], m["checkout"]) == \
        ("grade.py", "mlebench.competitions.tiny-ventilator.grade:grade", str(checkout.resolve()))
    assert (m["answers"], task.metric, task.higher_is_better, task.best_score) == ("private/test.csv", "mae", False, 0.1)
    ans = _parts(task)
    assert "u_out" in ans  # the answers keep every column grade.py may need
    sub = _write(ans[["id"]].assign(pressure=10.0), tmp_path / "submission.csv")
    g = env.grade(task, sub)
    for part, score in (("public", g.public), ("private", g.private)):
        rows = ans[(ans["part"] == part) & (ans["u_out"] == 0)]  # only u_out == 0 is scored, by grade.py itself
        assert score == pytest.approx(np.mean(np.abs(rows["pressure"] - 10.0)), abs=1e-12)
    assert g.valid and g.public != pytest.approx(np.mean(np.abs(ans["pressure"][ans["part"] == "public"] - 10)))


def test_grade_py_rejections_are_invalid_submissions(tmp_path):
    prepared, checkout = _ventilator(tmp_path)
    task = env.load_task(env.import_mlebench(prepared, tmp_path / "task", mlebench=checkout))
    ans = _parts(task)
    short = env.grade(task, _write(ans[["id"]][1:].assign(pressure=1.0), tmp_path / "short.csv"))
    assert not short.valid and short.error == "InvalidSubmissionError: Submission and answers must have the same length"
    # an extra row: each part alone would pass, the whole set does not (MLE-bench grades the whole set)
    extra = pd.concat([ans[["id"]], pd.DataFrame({"id": [999]})]).assign(pressure=1.0)
    assert not env.grade(task, _write(extra, tmp_path / "extra.csv")).valid
    assert not env.grade(task, tmp_path / "missing.csv").valid


def test_grade_py_that_cannot_run_is_a_one_line_error_naming_the_competition(tmp_path):
    prepared, checkout = _ventilator(tmp_path, cid="broken-comp")
    (checkout / "mlebench" / "competitions" / "broken-comp" / "grade.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(env.TaskError) as e:
        env.import_mlebench(prepared, tmp_path / "task", mlebench=checkout)
    assert "broken-comp" in str(e.value) and "no_such_module_xyz" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "task").exists()


def test_checkout_without_the_competition_is_refused(tmp_path):
    prepared, checkout = _ventilator(tmp_path)
    (prepared.parent.parent / "other").mkdir()
    prepared.parent.rename(prepared.parent.parent / "other" / "renamed")
    with pytest.raises(env.TaskError, match="renamed: no config.yaml"):
        env.import_mlebench(prepared.parent.parent / "other" / "renamed", tmp_path / "task", mlebench=checkout)


# ================================================================================ config.yaml, file names


def test_read_yaml_reads_an_mlebench_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(id="c", answers="private/answers.csv", sample="public/s.csv", grader="x y"))
    cfg = env._MLEBENCH["read_yaml"](path)
    assert cfg["dataset"] == {"answers": "c/prepared/private/answers.csv", "sample_submission": "c/prepared/public/s.csv"}
    assert cfg["grader"] == {"name": "x y", "grade_fn": "mlebench.competitions.c.grade:grade"}
    assert cfg["name"] == "A test competition" and cfg["preparer"] == "mlebench.competitions.c.prepare:prepare"


def _labels_csv_competition(root: Path):
    """dogs-vs-cats-like: answers private/answers.csv, sample public/sampleSubmission.csv, no train.csv/test.csv."""
    answers = pd.DataFrame({"id": np.arange(20), "label": np.arange(20) % 2})
    grade_py = "from sklearn.metrics import log_loss\ndef grade(s, a):\n" \
               "    return log_loss(a.sort_values('id')['label'], s.sort_values('id')['label'])\n"
    return _competition(root, "tiny-dogs", answers, answers[["id"]].assign(label=0.5), grade_py,
                        answers_file="private/answers.csv", sample_file="public/sampleSubmission.csv",
                        train_file="labels.csv", scores=(0.05, 0.3), grader="log-loss")


@pytest.mark.parametrize("with_checkout", [True, False])
def test_config_yaml_names_the_files(tmp_path, with_checkout):
    prepared, checkout = _labels_csv_competition(tmp_path)
    config = checkout / "mlebench" / "competitions" / "tiny-dogs" / "config.yaml"
    kw = dict(mlebench=checkout) if with_checkout else dict(metric="log_loss", config=config)
    task = env.load_task(env.import_mlebench(prepared, tmp_path / "task", **kw))
    assert task.info["mlebench"]["answers"] == "private/answers.csv"
    assert (task.public_dir / "labels.csv").is_file() and not (task.public_dir / "train.csv").exists()
    assert (task.public_dir / "sample_submission.csv").read_text() == (prepared / "public/sampleSubmission.csv").read_text()
    g = env.grade(task, task.public_dir / "sample_submission.csv")
    assert (g.public, g.private) == (pytest.approx(math.log(2)), pytest.approx(math.log(2)))  # 0.5 everywhere: ln 2


def test_without_config_the_default_file_names_are_refused_by_name(tmp_path):
    prepared, _ = _labels_csv_competition(tmp_path)
    with pytest.raises(env.TaskError, match="private/test.csv") as e:
        env.import_mlebench(prepared, tmp_path / "task", "log_loss")
    assert "\n" not in str(e.value)


# ================================================================ env.py's metrics, MLE-bench's conventions


def test_multi_column_roc_auc_is_macro_averaged():
    y = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    p = np.array([[0.9, 0.2], [0.8, 0.7], [0.3, 0.4], [0.1, 0.5]])
    # column 0: positives 0.9, 0.3 against negatives 0.8, 0.1: 3 of 4 pairs ordered -> 0.75
    # column 1: positives 0.7, 0.4 against negatives 0.2, 0.5: 3 of 4 -> 0.75; macro mean 0.75
    # pooled (the old ravel()): positives .9 .3 .7 .4 against .8 .1 .2 .5: 4 + 2 + 3 + 2 = 11 of 16 -> 0.6875
    assert env.METRICS["roc_auc"].fn(y, p) == 0.75 == roc_auc_score(y, p, average="macro")
    assert roc_auc_score(y.ravel(), p.ravel()) == 0.6875


def test_log_loss_is_sklearns_on_hard_predictions():
    y = np.eye(3)[np.arange(15) % 3]
    p = y.copy()
    p[0] = [0, 1, 0]  # 1 wrong hard prediction in 15 rows
    # sklearn clips to the float64 epsilon 2.220446e-16: -ln(2.220446e-16) / 15 = 36.0436534 / 15 = 2.40291
    # (Kaggle's clip to 1e-15 and rescaling gave -ln(1e-15) / 15 = 34.5387764 / 15 = 2.30259)
    assert env.METRICS["log_loss"].fn(y, p) == pytest.approx(2.40291, abs=5e-6)
    assert env.METRICS["log_loss"].fn(y, p) == pytest.approx(log_loss(y, p), rel=1e-12)
    yb, pb = np.array([1.0, 0, 1, 0]), np.array([0.8, 0.3, 1.0, 0.0])  # one column: P(class 1)
    assert env.METRICS["log_loss"].fn(yb, pb) == pytest.approx(log_loss(yb, pb), rel=1e-12)


def _log_loss_competition(root: Path, n=30):
    classes = ["a", "b", "c"]
    answers = pd.DataFrame(np.eye(3, dtype=int)[np.arange(n) % 3], columns=classes).assign(id=np.arange(n))
    answers = answers[["id", *classes]]
    prepared, _ = _competition(root, "tiny-leaf", answers, answers.assign(a=1 / 3, b=1 / 3, c=1 / 3), "",
                               grader="multi-class-log-loss", scores=(0.01, 0.5))
    return env.load_task(env.import_mlebench(prepared, root / "task", "log_loss")), answers


def test_log_loss_rows_must_sum_to_one(tmp_path):
    task, answers = _log_loss_competition(tmp_path)
    sub = answers.assign(a=0.7, b=0.1, c=0.1)  # rows sum to 0.9: MLE-bench's leaf/dog-breed graders reject them
    g = env.grade(task, _write(sub, tmp_path / "s.csv"))
    assert not g.valid and "sum to 1" in g.error
    near = answers.assign(a=0.8 + 4e-7, b=0.1, c=0.1)  # within np.isclose(..., 1, atol=1e-6): accepted
    assert env.grade(task, _write(near, tmp_path / "near.csv")).valid


def test_extra_submission_columns_are_ignored(tmp_path):
    task, answers = _log_loss_competition(tmp_path)
    sub = answers.assign(a=0.6, b=0.2, c=0.2)
    plain = env.grade(task, _write(sub, tmp_path / "plain.csv"))
    extra = env.grade(task, _write(sub.assign(Unnamed=1, note="x"), tmp_path / "extra.csv"))
    assert plain.valid and extra == plain
    ans = _parts(task)  # the reference: sklearn on each part
    for part, score in (("public", plain.public), ("private", plain.private)):
        rows = ans[ans["part"] == part]
        assert score == pytest.approx(log_loss(rows[["a", "b", "c"]], np.tile([0.6, 0.2, 0.2], (len(rows), 1))))


def test_multi_column_auc_competition_grades_each_part_macro(tmp_path):
    rng = np.random.default_rng(1)
    cols = ["toxic", "obscene", "insult"]
    answers = pd.DataFrame(rng.integers(0, 2, (40, 3)), columns=cols).assign(id=[f"x{i}" for i in range(40)])
    answers = answers[["id", *cols]]
    prepared, _ = _competition(tmp_path, "tiny-jigsaw", answers, answers.assign(toxic=0.5, obscene=0.5, insult=0.5),
                               "", scores=(0.99, 0.9))
    task = env.load_task(env.import_mlebench(prepared, tmp_path / "task", "roc_auc"))
    sub = answers.assign(**{c: rng.random(40) for c in cols})
    g = env.grade(task, _write(sub, tmp_path / "s.csv"))
    ans = _parts(task).merge(sub, on="id", suffixes=("", "_p"))
    for part, score in (("public", g.public), ("private", g.private)):
        rows = ans[ans["part"] == part]
        assert score == pytest.approx(roc_auc_score(rows[cols], rows[[c + "_p" for c in cols]], average="macro"))


def test_jigsaw_minus_one_rows_are_refused_without_a_checkout(tmp_path):
    answers = pd.DataFrame({"id": range(10), "toxic": [1, 0] * 4 + [-1, -1]})
    prepared, _ = _competition(tmp_path, "tiny-jig", answers, answers.assign(toxic=0.5), "", scores=(0.99, 0.9))
    with pytest.raises(env.TaskError, match="--mlebench") as e:
        env.import_mlebench(prepared, tmp_path / "task", "roc_auc")
    assert "0/1" in str(e.value) and "\n" not in str(e.value)


def test_a_subset_scored_competition_with_score_rows(tmp_path):
    prepared, _ = _ventilator(tmp_path)
    task = env.load_task(env.import_mlebench(prepared, tmp_path / "task", "mae", score_rows="u_out=0"))
    assert task.info["score_rows"] == {"column": "u_out", "value": "0"}
    ans = _parts(task)
    g = env.grade(task, _write(ans[["id"]].assign(pressure=9.0), tmp_path / "s.csv"))
    for part, score in (("public", g.public), ("private", g.private)):
        rows = ans[(ans["part"] == part) & (ans["u_out"] == 0)]
        assert score == pytest.approx(mean_absolute_error(rows["pressure"], np.full(len(rows), 9.0)))
    # the same submission graded by the checkout's grade.py gives the same numbers
    by_grade_py = env.load_task(env.import_mlebench(prepared, tmp_path / "task2", mlebench=prepared.parents[2] /
                                                    "mle-bench"))
    again = env.grade(by_grade_py, tmp_path / "s.csv")
    assert (again.public, again.private) == (pytest.approx(g.public, rel=1e-12), pytest.approx(g.private, rel=1e-12))


@pytest.mark.parametrize("rule, words", [("u_out<1", "COLUMN=VALUE"), ("nope=0", "COLUMN=VALUE"),
                                         ("pressure=0", "COLUMN=VALUE")])
def test_a_subset_rule_that_cannot_be_expressed_is_refused(tmp_path, rule, words):
    prepared, _ = _ventilator(tmp_path)
    with pytest.raises(env.TaskError, match=words) as e:
        env.import_mlebench(prepared, tmp_path / "task", "mae", score_rows=rule)
    assert "--mlebench" in str(e.value) and "\n" not in str(e.value)


def test_score_rows_with_a_checkout_is_refused(tmp_path):
    prepared, checkout = _ventilator(tmp_path)
    with pytest.raises(env.TaskError, match="grade.py"):
        env.import_mlebench(prepared, tmp_path / "task", mlebench=checkout, score_rows="u_out=0")


# =============================================================================================== command line


def _cli(*args):
    return subprocess.run([sys.executable, "env.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_import_with_a_checkout(tmp_path):
    prepared, checkout = _ventilator(tmp_path)
    out = _cli("import-mlebench", "--prepared", str(prepared), "--out", str(tmp_path / "task"),
               "--mlebench", str(checkout))
    assert out.returncode == 0, out.stderr
    info = json.loads((tmp_path / "task" / "task.json").read_text())
    assert info["mlebench"]["grader"] == "grade.py"


def test_cli_import_needs_a_metric_or_a_checkout(tmp_path):
    prepared, _ = _ventilator(tmp_path)
    out = _cli("import-mlebench", "--prepared", str(prepared), "--out", str(tmp_path / "task"))
    assert out.returncode == 2 and "--metric" in out.stderr and len(out.stderr.strip().splitlines()) == 1
