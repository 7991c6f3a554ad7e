"""What every task shares: task folders and their grading, the agent's actions (Env), the sandbox that runs agent code,
and MLE-bench import.

The actions follow MLAgentBench (arXiv:2310.03302; high_level_actions.py, low_level_actions.py), where ML-Agent
trains (arXiv:2505.23723, §Experiments). A task folder is an MLE-bench prepared competition (arXiv:2410.07095):
`public/` what the agent sees, `private/answers.csv` the answers with a `part` column (Kaggle's public/private split).

Departures from MLAgentBench:
1. No LLM answers `Understand File`: it shows a CSV's shape, columns, first rows, or a script's first lines.
2. The workspace is an in-memory dict of scripts: a state is snapshotted and restored exactly.
3. An edited script is run: reward.py pays the change of train.py's metric (another file's once it reaches train.py).
4. `Execute Script` shows the run's capped log, stdout and stderr as written (MLAB: stdout, or stderr on failure), then
   a note at a time or resource limit, for a train.py without a valid submission.csv, or the public score (as Kaggle
   shows; `show_score`) and, in words, whether it beats the score before train.py's last edit.
5. `Edit Script (AI)` takes any editor `(instruction, code) -> code`; offline, recipe_editor applies tasks/recipes/.
6. Built-in tasks' data ship with scikit-learn or are seeded; their leaderboard is a reference panel of scikit-learn
   pipelines (tasks/builtin.py), not human Kaggle entries.
7. An action that raises is "EnvError: Error executing {action}: {why}" (MLAB's has no why) and leaves no trace.

Run:  python env.py list | python env.py prepare [NAME ...] | python env.py run --task digits --script my_train.py
      python env.py import-mlebench --prepared <data>/ID/prepared --out runs/tasks-mle/ID --mlebench ../mle-bench
"""
from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import ctypes
import difflib
import fcntl
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import posixpath
import resource
import runpy
import secrets
import select
import shutil
import signal
import socket
import stat
import string
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

ROOT = Path(__file__).parent
TASKS_DIR = ROOT / "runs" / "tasks"
CACHE_DIR = ROOT / "runs" / "cache"
LOG_DIR = ROOT / "runs" / "logs"
DATA_DIR = ROOT / "tasks"  # the tasks' sources (runs/tasks: the prepared folders)


def _text(name: str) -> str:
    return (DATA_DIR / name).read_text()


def _fill(template: str, **values) -> str:
    """tasks/'s one templating (`$name`, `$$` a dollar); KeyError for an unfilled name."""
    return string.Template(template).substitute(values)

# ==== metrics


def _labels(values) -> np.ndarray:
    """Class labels as comparable strings: 3, 3.0 and "3" are the same label."""
    s = pd.Series(values)
    num = pd.to_numeric(s, errors="coerce")
    if num.notna().all() and np.all(num == np.round(num)):
        return num.astype(np.int64).astype(str).to_numpy()
    return s.astype(str).str.strip().to_numpy()


def _f1_macro(y, p) -> float:
    """sklearn's f1_score(average="macro"): mean over labels in y or p of 2 tp / (2 tp + fp + fn) = 2 tp / (#y + #p)."""
    return float(np.mean([2 * np.sum((y == c) & (p == c)) / (np.sum(y == c) + np.sum(p == c))
                          for c in np.union1d(y, p)]))


def _roc_auc(y, p) -> float:
    """Mann-Whitney form; several columns: their mean (as jigsaw-toxic-comment-classification-challenge/grade.py)."""
    y, p = np.asarray(y, dtype=float), np.asarray(p, dtype=float)
    if y.ndim == 2:
        return float(np.mean([_roc_auc(y[:, j], p[:, j]) for j in range(y.shape[1])]))
    ranks = pd.Series(p).rank().to_numpy()
    n1, n0 = y.sum(), len(y) - y.sum()
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def _log_loss(y, p) -> float:
    """As sklearn.metrics.log_loss (>= 1.5), which MLE-bench's graders call: clipped to float64 eps, rows unscaled."""
    y, p = np.asarray(y, dtype=float), np.asarray(p, dtype=float)
    if y.ndim == 1:  # one column: a binary task's positive class
        y, p = np.column_stack([1 - y, y]), np.column_stack([1 - p, p])
    eps = np.finfo(float).eps
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(np.sum(y * np.log(p), axis=1)))


@dataclass(frozen=True)
class Metric:
    fn: Callable  # (truth, prediction) -> score
    higher_is_better: bool
    kind: str  # "label" (class labels), "probability" (in [0, 1]) or "value" (any finite number)


METRICS = {  # scikit-learn's names (tasks/builtin.py, tasks/recipes/)
    "accuracy": Metric(lambda y, p: float(np.mean(y == p)), True, "label"),
    "f1_macro": Metric(_f1_macro, True, "label"), "roc_auc": Metric(_roc_auc, True, "probability"),
    "log_loss": Metric(_log_loss, False, "probability"),
    "mae": Metric(lambda y, p: float(np.mean(np.abs(y - p))), False, "value"),
    "rmse": Metric(lambda y, p: float(np.sqrt(np.mean((y - p) ** 2))), False, "value")}

# ==== the task folder


class TaskError(ValueError):
    """A task folder lacks something or holds something wrong (one-line message)."""


@dataclass
class Task:
    name: str
    dir: Path
    metric: str
    higher_is_better: bool
    id_column: str
    target_columns: list[str]
    best_score: float
    time_limit: float
    split: str  # "held-in" (to train on) or "held-out" (evaluation only)
    description: str
    info: dict = field(default_factory=dict, repr=False)  # task.json as read

    @property
    def public_dir(self) -> Path:
        return self.dir / "public"

    @property
    def private_dir(self) -> Path:
        return self.dir / "private"

    def leaderboard(self) -> list[tuple[str, float]]:
        path = self.private_dir / "leaderboard.csv"
        if not path.exists():
            return []
        board = pd.read_csv(path)
        return sorted(zip(board["entry"], board["score"].astype(float)), key=lambda e: e[1],
                      reverse=self.higher_is_better)


REQUIRED_KEYS = ("name", "metric", "higher_is_better", "id_column", "target_columns")
_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
FIELD_CHECKS = {  # field -> (check, what it must be)
    "name": (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string"),
    "metric": (lambda v: isinstance(v, str), "a string"), "id_column": (lambda v: isinstance(v, str), "a string"),
    "higher_is_better": (lambda v: isinstance(v, bool), "true or false"),
    "target_columns": (lambda v: isinstance(v, list) and v != [] and all(isinstance(c, str) for c in v),
                       "a list of column names"),
    "best_score": (_number, "a finite number"), "time_limit": (lambda v: _number(v) and v > 0, "a number > 0"),
    "split": (lambda v: v in ("held-in", "held-out"), "held-in or held-out")}
REQUIRED_FILES = ("description.md", "public/train.csv", "public/test.csv", "public/sample_submission.csv",
                  "public/train.py", "private/answers.csv")


def load_task(name_or_path) -> Task:
    """A built-in task by name (prepared on first use) or a task folder by path, validated."""
    if isinstance(name_or_path, Task):
        return name_or_path
    if str(name_or_path) in BUILTIN_TASKS:
        folder = prepare([str(name_or_path)])[0]
    else:
        folder = Path(name_or_path)
        if not folder.is_dir():
            raise TaskError(unknown_task(name_or_path) + " (nor a folder)")
    meta = folder / "task.json"
    if not meta.is_file():
        raise TaskError(f"{folder}: task.json is missing")
    try:
        info = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise TaskError(f"{meta}: not valid JSON ({e})") from None
    if not isinstance(info, dict):
        raise TaskError(f"{meta}: not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in info]
    if missing:
        raise TaskError(f"{meta}: missing field(s) {', '.join(missing)}")
    wrong = [f"{k} must be {rule}, not {info[k]!r}" for k, (ok, rule) in FIELD_CHECKS.items()
             if k in info and info[k] is not None and not ok(info[k])]
    if wrong:
        raise TaskError(f"{meta}: {'; '.join(wrong)}")
    grade_py = info.get("mlebench", {}).get("grade_fn")
    if info["metric"] not in METRICS and not grade_py:
        raise TaskError(f"{meta}: unknown metric {info['metric']!r} (known: {', '.join(METRICS)})")
    optional = ("public/train.csv", "public/test.csv") if "mlebench" in info else ()
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file() and f not in optional]
    if missing:
        raise TaskError(f"{folder}: missing {', '.join(missing)}")
    with open(folder / "private" / "answers.csv") as f:
        header = f.readline().strip().split(",")
    rule = [info["score_rows"]["column"]] if info.get("score_rows") else []
    missing = [c for c in (info["id_column"], *([] if grade_py else info["target_columns"]), *rule, "part")
               if c not in header]
    if missing:
        raise TaskError(f"{folder / 'private/answers.csv'}: missing column(s) {', '.join(missing)}")
    task = Task(name=info["name"], dir=folder.resolve(), metric=info["metric"], id_column=info["id_column"],
                higher_is_better=bool(info["higher_is_better"]), target_columns=list(info["target_columns"]),
                best_score=info.get("best_score"), time_limit=float(info.get("time_limit", 600)),
                split=info.get("split", "held-out"), description=(folder / "description.md").read_text(), info=info)
    if task.best_score is None:  # e.g. MLE-bench: the leaderboard's top
        board = task.leaderboard()
        if not board:
            raise TaskError(f"{folder}: task.json has no best_score and private/leaderboard.csv is missing")
        task.best_score = board[0][1]
    return task


def load_tasks(names) -> list[Task]:
    """load_task of each, built-in ones prepared first in parallel (load_task builds one at a time)."""
    names = list(names)
    builtin = [str(n) for n in names if not isinstance(n, Task) and str(n) in BUILTIN_TASKS]
    if builtin:
        prepare(builtin)
    return [load_task(n) for n in names]


def list_tasks() -> list[Task]:
    return load_tasks(BUILTIN_TASKS)


def unknown_task(name, what="task") -> str:
    close = difflib.get_close_matches(str(name), BUILTIN_TASKS, n=3, cutoff=0.7)
    return f"unknown {what} {str(name)!r}: " + (f"did you mean {' or '.join(map(repr, close))}?" if close else
                                                 f"`python env.py list` names the {len(BUILTIN_TASKS)}")


@dataclass
class Grade:
    valid: bool
    public: float | None
    private: float | None
    error: str | None


def _check_submission(task: Task, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(truth, prediction, is_public) aligned by id; ValueError saying why a submission is rejected."""
    try:
        sub = pd.read_csv(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is the submission's fault
        raise ValueError(f"{path.name} cannot be read as CSV: {str(e).splitlines()[0]}") from None
    ans = pd.read_csv(task.private_dir / "answers.csv")
    want = [task.id_column, *task.target_columns]
    missing = [c for c in want if c not in sub.columns]  # others ignored, as MLE-bench's graders do
    if missing:  # (mlebench/competitions/utils.py, one_hot_dfs_to_log_loss_inputs)
        raise ValueError(f"wrong columns in {path.name}: missing {missing}; expected {want} (others are ignored)")
    if len(sub) != len(ans):
        raise ValueError(f"{path.name} has {len(sub)} rows, expected {len(ans)} (one per row of test.csv)")
    sub_ids, ans_ids = _labels(sub[task.id_column]), _labels(ans[task.id_column])
    if len(set(sub_ids)) != len(sub_ids):
        raise ValueError(f"duplicate ids in {path.name}")
    unknown = sorted(set(sub_ids) - set(ans_ids))
    if unknown:
        raise ValueError(f"ids do not match test.csv: {len(unknown)} unknown, e.g. {unknown[:3]}")
    sub = sub.set_index(sub_ids).loc[ans_ids]
    metric = METRICS[task.metric]
    if metric.kind == "label":
        if sub[task.target_columns].isna().any().any():
            raise ValueError(f"missing (NaN/empty) labels in {path.name}")
        truth, pred = _labels(ans[task.target_columns[0]]), _labels(sub[task.target_columns[0]])
    else:
        values = sub[task.target_columns].apply(pd.to_numeric, errors="coerce")
        bad = [c for c in task.target_columns if not np.isfinite(values[c]).all()]  # NaN is not finite either
        if bad:
            raise ValueError(f"NaN, empty, non-numeric or infinite values in column(s) {bad} of {path.name}")
        pred = values.to_numpy(dtype=float)
        if metric.kind == "probability" and ((pred < 0) | (pred > 1)).any():
            raise ValueError(f"probabilities outside [0, 1] in {path.name}")
        # atol=1e-6 as MLE-bench's dog-breed-identification/grade.py, leaf-classification/grade.py
        if task.metric == "log_loss" and pred.shape[1] > 1 and not np.isclose(pred.sum(axis=1), 1, atol=1e-6).all():
            raise ValueError(f"rows of probabilities that do not sum to 1 in {path.name}")
        truth = ans[task.target_columns].to_numpy(dtype=float)
        if len(task.target_columns) == 1:
            truth, pred = truth.ravel(), pred.ravel()
    rule = task.info.get("score_rows")  # e.g. ventilator scores only u_out == 0 (its grade.py)
    scored = _labels(ans[rule["column"]]) == _labels([rule["value"]])[0] if rule else np.ones(len(ans), bool)
    return truth[scored], pred[scored], (ans["part"] == "public").to_numpy()[scored]


def grade(task, submission_path) -> Grade:
    """A submission's score on the public and private test rows, or why it is rejected."""
    task, path = load_task(task), Path(submission_path)
    if path.is_symlink() or not path.is_file():  # the grader runs as root: a link could reach private/
        return Grade(False, None, None, f"no submission: {path.name} does not exist or is not a plain file (the "
                                        f"script must write submission.csv)")
    if task.info.get("mlebench", {}).get("grade_fn"):
        return _grade_mlebench(task, path)
    try:
        truth, pred, public = _check_submission(task, path)
    except ValueError as e:
        return Grade(False, None, None, str(e))
    fn = METRICS[task.metric].fn
    return Grade(True, fn(truth[public], pred[public]), fn(truth[~public], pred[~public]), None)

# ==== the agent's actions and Env


@dataclass(frozen=True)
class ActionSpec:
    name: str
    description: str
    args: dict[str, str]  # argument name -> what to give
    returns: str  # MLAB's return_value: what the observation holds

    def usage(self) -> str:
        return json.dumps({k: f"[{v}]" for k, v in self.args.items()}, indent=4)


ACTIONS = {a.name: a for a in [
    ActionSpec("List Files", "List the files and folders in a folder of the workspace.",
               {"dir_path": 'a relative folder path, e.g. "." for the workspace itself'},
               "the names in that folder (a folder's ends with /)"),
    ActionSpec("Understand File", "Look at a file: a CSV's shape, columns and first rows, a script's first lines.",
               {"file_name": "a relative file path", "things_to_look_for": "what you want to find out"},
               "that summary"),
    ActionSpec("Inspect Script Lines", "Show lines of a script (at most 100 at a time).",
               {"script_name": "a relative file path", "start_line_number": "first line, from 1",
                "end_line_number": "last line, included"}, "those lines and the number of the file's last line"),
    ActionSpec("Edit Script (AI)", "Have an editor change a script following your instruction; the result is saved "
               "under save_name and you get the diff. An edited Python script is run to measure it.",
               {"script_name": "the script to edit (an empty file if it does not exist)",
                "edit_instruction": "a precise description of the change", "save_name": "where to save the result"},
               "the diff, to check (Undo Edit Script of script_name reverts it)"),
    ActionSpec("Undo Edit Script", "Revert the most recent edit of a script.", {"script_name": "a relative file path"},
               "the script after the undo"),
    ActionSpec("Execute Script", "Run a Python script in the workspace and show its output.",
               {"script_name": "a relative file path"}, "what the script printed, or its error"),
    ActionSpec("Copy File", "Copy a script to another name; a script copied onto train.py is run to measure it.",
               {"source": "a relative file path", "destination": "a relative file path"}, "a success message"),
    ActionSpec("Final Answer", "End the task: train.py as it is now is your solution.",
               {"final_answer": "a short summary of what you did and found"}, "none: the task ends"),
]}


@dataclass
class StepResult:
    observation: str
    kind: str  # invalid | error | corner | neutral | edit | final: reward.py's outcomes
    metric_prev: float | None  # train.py's public score before the step
    metric_new: float | None  # ... and after it
    run: RunResult | None = None
    done: bool = False
    metric_high: float | None = None  # train.py's episode best before the step (binary reward)


class _Invalid(Exception):
    """An action input that breaks the action's contract: an "invalid" step."""


class Env:
    """One task's workspace and the agent's actions. The metric is train.py's public score (departure 3); Copy File
    onto train.py and Undo Edit Script of train.py report the score they bring."""

    def __init__(self, task, editor: Callable[[str, str], str] | None = None, show_score=True, timeout=None,
                 cache=True):
        self.task = load_task(task)
        self.editor = recipe_editor if editor is None else editor
        self.show_score, self.timeout, self.cache = show_score, timeout, cache
        self.files: dict[str, str] = {}  # the workspace's scripts; data files stay in public/
        self.history: list[dict] = []  # edits, newest last: {"script", "content" before, "metric"}
        self.step_count, self.done = 0, False
        self.metric = self.m_init = self.m_high = None
        self.m_best = self.task.info.get("best_public_score", self.task.best_score)  # on the rows m_t is measured on

    def reset(self) -> str:
        """A fresh workspace with the starter train.py, run once for m_init; returns the task description."""
        self.files = {"train.py": (self.task.public_dir / "train.py").read_text()}
        self.history, self.step_count, self.done = [], 0, False
        run = self._run("train.py")
        if run.status != "success":
            raise RuntimeError(f"the starter train.py of {self.task.name} does not score: {run.status} "
                               f"{run.error or run.output[-500:]}")
        self.m_init = self.metric = self.m_high = run.score
        return self.task.description

    def snapshot(self) -> dict:
        return {"task": self.task.name, "task_dir": str(self.task.dir), "step": self.step_count,
                "files": dict(self.files), "history": [dict(h) for h in self.history], "metric": self.metric,
                "m_init": self.m_init, "m_best": self.m_best, "m_high": self.m_high, "done": self.done}

    def restore(self, snapshot: dict):
        if Path(snapshot["task_dir"]).resolve() != self.task.dir:
            self.task = load_task(snapshot["task"] if snapshot["task"] in BUILTIN_TASKS else snapshot["task_dir"])
        self.files, self.history = dict(snapshot["files"]), [dict(h) for h in snapshot["history"]]
        self.step_count, self.metric, self.done = snapshot["step"], snapshot["metric"], snapshot.get("done", False)
        self.m_init, self.m_best = snapshot["m_init"], snapshot["m_best"]
        self.m_high = snapshot.get("m_high", self._better(self.metric, self.m_init))  # older snapshots lack it

    # --- one step

    def step(self, action: str, action_input: dict) -> StepResult:
        self.step_count += 1
        spec = ACTIONS.get(action) if isinstance(action, str) else None
        before = dict(self.files), list(self.history), self.metric, self.m_high, self.done
        try:
            if spec is None:
                raise _Invalid(f"EnvError: unknown action {action!r}; the actions are: {', '.join(ACTIONS)}")
            if not isinstance(action_input, dict):  # as MLAB's environment.py:306-336
                raise _Invalid(f"EnvError: the input of {action} must be a JSON object with the keys "
                               f"{', '.join(spec.args)}:\n{spec.usage()}")
            missing = [a for a in spec.args if a not in action_input]
            extra = [k for k in action_input if k not in spec.args]
            if missing or extra:
                raise _Invalid(f"EnvError: {action} takes the arguments {', '.join(spec.args)}; missing: "
                               f"{', '.join(missing) or 'none'}; unexpected: {', '.join(map(str, extra)) or 'none'}:"
                               f"\n{spec.usage()}")
            method = "_" + "_".join(action.lower().removesuffix(" (ai)").split())
            return getattr(self, method)(**action_input)
        except Exception as e:  # noqa: BLE001 - departure 7, as MLAB's environment.py
            self.files, self.history, self.metric, self.m_high, self.done = before
            if isinstance(e, _Invalid):
                return self._result(str(e), "invalid")
            return self._result(f"EnvError: Error executing {action}: {_short(f'{type(e).__name__}: {e}')}", "error")

    def _result(self, observation, kind, run=None, done=False) -> StepResult:
        return StepResult(observation, kind, self.metric, self.metric, run, done, self.m_high)

    def _better(self, a, b):
        if a is None or b is None:
            return b if a is None else a
        return max(a, b) if self.task.higher_is_better else min(a, b)

    def _submission(self, observation, score, run=None) -> StepResult:
        """A step that set train.py to a script scoring `score`: an "edit"."""
        prev, high = self.metric, self.m_high
        self.metric, self.m_high = score, self._better(high, score)
        return StepResult(observation, "edit", prev, score, run, metric_high=high)

    def _path(self, name, write=False) -> str:
        """A workspace path, else an "invalid" step; `write`: one a file can be saved under (no file, no folder)."""
        if not isinstance(name, str):
            raise _Invalid(f"EnvError: a path must be a string, got {_short(repr(name), 80)}")
        try:
            path = _workspace_path(name)
        except ValueError as e:
            raise _Invalid(f"EnvError: {e}; use a relative path such as train.py") from None
        if write and ((self.task.public_dir / path).is_dir() or any(
                path.startswith(f"{other}/") or other.startswith(f"{path}/") for other in self._every_file())):
            raise _Invalid(f"EnvError: cannot save to {_short(repr(name), 80)}: it would be both a file and a folder")
        return path

    def _every_file(self) -> set[str]:
        public = self.task.public_dir
        return {*self.files, *(str(p.relative_to(public)) for p in public.rglob("*") if p.is_file())}

    def _read(self, name) -> str | None:
        path = self._path(name)
        if path in self.files:
            return self.files[path]
        public = self.task.public_dir / path
        return public.read_text(errors="replace") if public.is_file() else None

    def _run(self, script: str) -> RunResult:
        others = {k: v for k, v in self.files.items() if k != script}
        return run_script(self.task, self.files[script], timeout=self.timeout, cache=self.cache, files=others,
                          script=script)

    def _outcome(self, run: RunResult, script: str) -> tuple[str, str]:
        if run.status == "success":
            higher = "higher" if self.task.higher_is_better else "lower"
            return "success", (f"\nPublic score ({self.task.metric}, {higher} is better): {run.score:.4f}"
                               if self.show_score else "")
        if run.status in ("timeout", "resource"):
            what = "the time limit" if run.status == "timeout" else "a resource limit (memory, CPU time or file size)"
            return "corner", f"\nEnvError: the script was stopped at {what}."
        if run.status == "invalid_submission":
            helper = script != "train.py" and run.error.startswith("no submission")  # e.g. a module of helpers
            return ("neutral" if helper else "error"), ("" if helper else f"\nEnvError: {run.error}")
        return "error", ""

    # --- the actions, each its name's method ("Edit Script (AI)": _edit_script); worded like MLAB's

    def _list_files(self, dir_path):
        prefix = "" if str(dir_path).strip() in ("", ".", "./") else self._path(dir_path) + "/"
        below = [path[len(prefix):] for path in self._every_file() if path.startswith(prefix)]
        entries = {rest.split("/")[0] + ("/" if "/" in rest else "") for rest in below}
        if not entries:
            return self._result(f"EnvError: Cannot list files in the {dir_path} directory", "error")
        return self._result("\n".join(sorted(entries)) + "\n", "neutral")

    def _understand_file(self, file_name, things_to_look_for):
        text = self._read(file_name)
        if text is None:
            return self._result(f"EnvError: cannot read {file_name}: no such file", "error")
        lines = text.splitlines()
        if file_name.endswith(".csv"):
            head = "\n".join(lines[:6])
            body = f"{len(lines) - 1} rows; columns: {lines[0] if lines else ''}\nFirst rows:\n{head}"
        else:
            body = "\n".join(lines[:100]) + (f"\n[... {len(lines) - 100} more lines]" if len(lines) > 100 else "")
        return self._result(f"Offline summary of {file_name} (no LLM reads it here; you asked about: "
                            f"{things_to_look_for}):\n{body}", "neutral")

    def _inspect_script_lines(self, script_name, start_line_number, end_line_number):
        try:
            start, end = int(start_line_number), int(end_line_number)
        except (TypeError, ValueError):
            raise _Invalid("EnvError: start_line_number and end_line_number must be integers") from None
        if end - start > 100:  # MLAB's limit, checked before the file is read (high_level_actions.py:164-174)
            return self._result("EnvError: the number of lines to display is limited to 100 lines", "error")
        text = self._read(script_name)
        if text is None:
            return self._result(f"EnvError: cannot find script {script_name}", "error")
        lines = text.split("\n")  # as MLAB counts: a final newline starts an empty last line
        shown = "\n".join(lines[max(start, 1) - 1:end])
        return self._result(f"Here are the lines (the file ends at line {len(lines)}):\n\n{shown}", "neutral")

    def _edit_script(self, script_name, edit_instruction, save_name):
        source = self._path(script_name)
        old = self._read(source)
        if old is None:  # MLAB creates an empty script_name (high_level_actions.py:80-84)
            old = self.files[self._path(script_name, write=True)] = ""
        save = self._path(save_name, write=True)
        try:
            new = self.editor(str(edit_instruction), old)
        except Exception as e:  # noqa: BLE001 - any editor failure is an edit that cannot be applied
            return self._result(f"EnvError: the edit could not be applied: {e}", "error")
        # MLAB backs up script_name, not save_name (high_level_actions.py:100-104): Undo of script_name reverts this
        self.history.append({"script": source, "content": old, "metric": self.metric})
        self.files[save] = new
        diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), source, save))
        observation = (f"The edited file is saved to {save}. Here is the diff, please check if the edit is correct "
                       f"and desirable:\n\n{diff}")
        return self._scored(observation, save) if save.endswith(".py") else self._result(observation, "neutral")

    def _scored(self, observation, script) -> StepResult:
        """Run a script just edited or copied: a new train.py is a new submission; a side file leaves the metric."""
        run = self._run(script)
        kind, note = self._outcome(run, script)
        if kind != "success":
            return self._result(observation + note, kind, run)
        if script != "train.py":
            return self._result(observation + note, "edit", run)
        return self._submission(observation + note, run.score, run)

    def _undo_edit_script(self, script_name):
        script = self._path(script_name)
        at = next((i for i in range(len(self.history) - 1, -1, -1) if self.history[i]["script"] == script), None)
        if at is None:
            return self._result(f"EnvError: there is no change to undo in {script}", "error")
        entry = self.history.pop(at)
        if entry["content"] is None:  # an older version's record of a new script
            self.files.pop(script, None)
        else:
            self.files[script] = entry["content"]
        observation = f"Content of {script} after undo the most recent edit:\n{entry['content'] or ''}"
        if script == "train.py" and entry["metric"] is not None:
            return self._submission(observation, entry["metric"])
        return self._result(observation, "neutral")

    def _execute_script(self, script_name):
        script = self._path(script_name)
        if script not in self.files:
            return self._result(f"EnvError: The file {script} does not exist.", "error")
        run = self._run(script)
        kind, note = self._outcome(run, script)
        if kind == "success" and script == "train.py":
            self.metric, self.m_high = run.score, self._better(self.m_high, run.score)
            note += self._verdict(run.score)
        return self._result(f"The script has been executed. Here is the output:\n{run.output}{note}",
                            "neutral" if kind == "success" else kind, run)

    def _verdict(self, score) -> str:
        """Departure 4: does the score beat the one before train.py's last edit (what Undo restores)?"""
        before = next((h["metric"] for h in reversed(self.history) if h["script"] == "train.py"), None)
        better = before is not None and self._better(score, before) == score != before
        return f", {'better' if better else 'not better'} than {before:.4f} before the last edit" \
            if self.show_score and before is not None else ""

    def _copy_file(self, source, destination):
        src, dst = self._path(source), self._path(destination, write=True)
        if src not in self.files:
            return self._result(f"EnvError: cannot copy {source}: only scripts of the workspace can be copied", "error")
        self.files[dst] = self.files[src]  # no backup, as MLAB's copy_file
        observation = f"File {src} copied to {dst}"
        if dst != "train.py" or src == dst:
            return self._result(observation, "neutral")
        return self._scored(observation, dst)

    def _final_answer(self, final_answer):
        self.done = True
        return self._result("end", "final", done=True)

# ==== the sandbox
# `run_script` treats agent code as untrusted. It protects against:
# - altering the task: the code runs in a fresh temporary folder on *copies* of `public/`;
# - reading the answers: as root, the code runs as its own unprivileged uid; `private/`, the cache and the logs are
#   root-only (0700), so that uid can neither read them nor signal the parent;
# - leaking secrets: the environment is a short whitelist (no API keys or tokens);
# - runaway processes: a new session/process group, stdin closed, a wall-clock limit (TERM, grace, KILL), the group
#   killed after every run and, as root, every process of the run's uid (also daemons that left the group); rlimits
#   on CPU time, file size, open files, processes (per uid, as root), core dumps, address space (CPU-only runs);
# - floods: output goes to a log capped by RLIMIT_FSIZE; the caller gets its head and tail;
# - links planted for the root parent: the submission and kept outputs (`keep`) must be plain files in the work
#   folder, so neither the grader nor the copy follows a symlink to `private/`;
# - the network: a new, empty network namespace (`unshare(CLONE_NEWNET)`) where the kernel allows it, else it stays
#   reachable (RunResult.isolation says what applied).
# It does NOT protect against: kernel exploits (same kernel, no seccomp filter), reading world-readable files
# elsewhere, filling the disk with many files below the size limit, using the GPU it is given (set_script_gpu: a
# torchrun rank's own, or none; not isolated from the trainer's memory) or all CPU cores. Without root there is no
# separate uid: `private/` is readable and a setsid daemon escapes the group kill. An interpreter under a folder the
# sandbox uid cannot enter (e.g. /root/.pyenv) is bound back into an empty tmpfs over it, in a private mount namespace.

MEMORY_LIMIT = 4 << 30  # RLIMIT_AS of CPU-only runs: numpy/torch imports reserve GBs of virtual memory
GPU_MEMORY_LIMIT = 32 << 30  # RLIMIT_DATA of runs that see a GPU: CUDA cannot start under RLIMIT_AS
FILE_SIZE_LIMIT = 128 << 20  # RLIMIT_FSIZE, the output log included
OPEN_FILES_LIMIT = 1024
PROCESS_LIMIT = 256  # RLIMIT_NPROC is per uid: only with a dedicated uid
GRACE = 1.0  # seconds between TERM and KILL
OUTPUT_HEAD = OUTPUT_TAIL = 4096  # bytes of the log the caller gets
UID_BASE, UID_COUNT = 60000, 1000  # dedicated uids, one per concurrent run
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "CUDA_VISIBLE_DEVICES")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # one core per run
RESOURCE_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "File too large", "out of memory")
CACHE_SKIP = ("timeout", "resource")  # depend on machine load: not cached

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000  # <sched.h>
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000  # <sys/mount.h>


@dataclass
class RunResult:
    status: str  # success | error | timeout | resource | invalid_submission
    score: float | None  # on the public test rows
    test_score: float | None  # on the private ones
    seconds: float
    output: str  # head and tail of the log
    log_path: str
    returncode: int | None
    cached: bool = False
    error: str | None = None  # the grader's message for invalid_submission
    isolation: str = ""  # what the sandbox applied here
    kept: dict[str, str] = field(default_factory=dict)  # output name -> path of its copy (run_script's `keep`)


def _os_call(ret: int, what: str):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass(frozen=True)
class _Isolation:
    """What this machine allows, probed once per process (_isolation)."""
    uid: bool  # a dedicated unprivileged uid (needs root)
    net: bool  # a new, empty network namespace
    reveal: tuple  # ((folder the uid cannot enter, (interpreter paths to bind back)), ...)

    def describe(self, uid) -> str:
        parts = [f"uid {uid}" if self.uid else "same uid as the parent",
                 "no network" if self.net else "network NOT isolated (unshare failed)"]
        parts += [f"{blocked} covered by tmpfs except the interpreter" for blocked, _ in self.reveal]
        return "; ".join(parts + ["rlimits cpu/fsize/nofile/core" + ("/nproc" if self.uid else "")])


def _reveal_plan() -> tuple:
    """Interpreter folders the sandbox uid cannot reach, by the first folder on the way without o+x."""
    plan: dict[str, list[str]] = {}
    for path in {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}:
        blocked = next((p for p in reversed(path.parents) if not p.stat().st_mode & stat.S_IXOTH), None)
        if blocked is not None:
            plan.setdefault(str(blocked), []).append(str(path))
    return tuple((blocked, tuple(sorted(paths))) for blocked, paths in sorted(plan.items()))


def _preexec(iso: _Isolation, uid: int | None, limits: list, stage: str):
    """Runs in the child between fork and exec; the parent-death signal last, as a change of uid clears it."""
    parent = os.getpid()

    def child():
        flags = (CLONE_NEWNET if iso.net else 0) | (CLONE_NEWNS if iso.reveal else 0)
        if flags:
            _os_call(_libc.unshare(flags | (0 if os.geteuid() == 0 else CLONE_NEWUSER)), "unshare")
        if iso.reveal:  # private mounts first, or the tmpfs would reach the host
            _os_call(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            for i, (blocked, paths) in enumerate(iso.reveal):
                kept = [f"{stage}/{i}-{j}".encode() for j in range(len(paths))]
                for path, keep in zip(paths, kept):
                    _os_call(_libc.mount(path.encode(), keep, None, MS_BIND | MS_REC, None), f"bind {path}")
                _os_call(_libc.mount(b"tmpfs", blocked.encode(), b"tmpfs", 0, b"mode=0755"), f"tmpfs on {blocked}")
                for path, keep in zip(paths, kept):
                    os.makedirs(path, exist_ok=True)
                    _os_call(_libc.mount(keep, path.encode(), None, MS_BIND | MS_REC, None), f"bind back {path}")
        for res, soft_hard in limits:
            resource.setrlimit(res, soft_hard)
        if uid is not None:  # each needs the privilege the next drops
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
    return child


def _sweep_stale(where=None, pattern="mlenv-*-p*-*"):
    """Remove the folders of dead processes (the name holds the pid after "-p"; mkdtemp's part has no "-")."""
    for path in Path(where or tempfile.gettempdir()).glob(pattern):
        pid = path.name.rsplit("-", 1)[0].rsplit("-p", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


@functools.cache
def _isolation() -> tuple[_Isolation, str]:
    """The strongest isolation that starts the interpreter here, falling back step by step."""
    root = os.geteuid() == 0
    reveal = _reveal_plan() if root else ()
    _sweep_stale()
    stage = tempfile.mkdtemp(prefix=f"mlenv-stage-p{os.getpid()}-")  # empty mount points
    atexit.register(shutil.rmtree, stage, True)
    for i, (_, paths) in enumerate(reveal):
        for j in range(len(paths)):
            os.mkdir(f"{stage}/{i}-{j}")
    for iso in (_Isolation(root, True, reveal), _Isolation(root, False, reveal), _Isolation(False, True, ())):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run([sys.executable, "-c", "import encodings, site"], cwd="/", env={},
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                              preexec_fn=_preexec(iso, UID_BASE + UID_COUNT if iso.uid else None, [], stage)
                              ).returncode == 0:
                return iso, stage
    return _Isolation(False, False, ()), stage  # the last step needs nothing: not probed


def _claim_uid() -> tuple[int, int]:
    """A uid no other run holds, by an flock held until its file is closed."""
    locks = Path(tempfile.gettempdir()) / "mlenv-uids"
    locks.mkdir(mode=0o700, exist_ok=True)
    start = secrets.randbelow(UID_COUNT)
    for i in range(UID_COUNT):
        uid = UID_BASE + (start + i) % UID_COUNT
        fd = os.open(locks / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError("all sandbox uids are in use")


def _kill_group(pgid: int, sig: int):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_uid(uid: int):
    """Found by /proc, so also daemons that left the group with setsid."""
    for _ in range(100):
        found = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if f"\nUid:\t{uid}\t" in status and "\nState:\tZ" not in status:
                found = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.005)


# ---- the fork server
# Importing numpy, pandas and scikit-learn is most of a short run (tests/RESULTS.md, "env.py: the fork server"), so a
# run forks an interpreter that imported them once. Unlike `python -u`, the modules are imported and one server's
# runs share Python's hash seed. Where it cannot start, or FORK_SERVER is False: a new interpreter.

FORK_SERVER = True
PRELOAD = ("numpy", "pandas", "scipy.sparse", *(f"sklearn.{m}" for m in (  # what the starters and recipes import
    "base calibration compose decomposition ensemble feature_extraction.text feature_selection impute linear_model "
    "metrics model_selection naive_bayes neighbors neural_network pipeline preprocessing svm tree").split()))
_SERVER: list = []  # [_ForkServer], or [None]: it could not start
_SERVER_LOCK = threading.Lock()
SCRIPT_GPU: str | None = None  # CUDA_VISIBLE_DEVICES of every sandboxed run; None: the parent's (set_script_gpu)


def set_script_gpu(index: int | None):
    """The GPU this process's scripts may use (else all land on GPU 0): a rank's local index; None: none."""
    global SCRIPT_GPU
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    SCRIPT_GPU = "" if index is None else (visible[index] if index < len(visible) else str(index))


def _sandbox_env(work) -> dict:
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    env.update({"HOME": str(work), "TMPDIR": str(work), "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"},
               **dict.fromkeys(THREAD_VARS, "1"))
    if SCRIPT_GPU is not None:
        env["CUDA_VISIBLE_DEVICES"] = SCRIPT_GPU
    return env


class _ForkServer:
    def __init__(self, stage: str):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:  # `-u` as every run has it
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-c", f"import sys; sys.path[0] = {str(ROOT)!r}; import env  # mlenv fork "
                 f"server\nenv._serve({theirs.fileno()})"], cwd="/", env=_sandbox_env(stage),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()])
        ready = select.select([self.sock], [], [], 120)[0]  # the imports done, or the server died
        if not ready or self.sock.recv(16) != b"ready":
            self.proc.kill()
            raise OSError("the sandbox's fork server did not start")


class _ForkedRun:
    """A fork server's run as Popen to _run; the server writes two 4-byte numbers to the pipe: pid, exit status."""

    def __init__(self, server: _ForkServer, request: dict):
        self.r, w = os.pipe()
        try:
            socket.send_fds(server.sock, [json.dumps(request).encode()], [w])
        finally:
            os.close(w)
        self.returncode = None
        try:
            self.pid = self._number(60)
        except subprocess.TimeoutExpired:
            os.close(self.r)
            raise OSError("the sandbox's fork server did not answer") from None

    def _number(self, timeout) -> int:
        if not select.select([self.r], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("fork server run", timeout)
        data = os.read(self.r, 4)
        if len(data) < 4:
            os.close(self.r)
            raise OSError("the sandbox's fork server died during a run")
        return int.from_bytes(data, "little", signed=True)

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._number(timeout)
            os.close(self.r)
        return self.returncode


def _fork_server(stage: str) -> "_ForkServer | None":
    with _SERVER_LOCK:
        if _SERVER and _SERVER[0] is not None and _SERVER[0].proc.poll() is not None:
            _SERVER.clear()
        if not _SERVER:
            try:
                _SERVER.append(_ForkServer(stage))
            except OSError:
                _SERVER.append(None)
        return _SERVER[0]


def _serve(fd: int):
    """The fork server's loop. End of file: the caller died; so do its runs."""
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    sock.sendall(b"ready")
    runs: dict[int, tuple] = {}  # child pid -> (the pipe its caller reads, the run's uid)
    while True:
        readable = select.select([sock], [], [], 0.01 if runs else None)[0]
        while runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            w, _ = runs.pop(pid, (None, None))
            if w is not None:
                os.write(w, os.waitstatus_to_exitcode(status).to_bytes(4, "little", signed=True))
                os.close(w)
        if not readable:
            continue
        msg, fds = b"", []
        with contextlib.suppress(OSError):
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        if not msg:
            for pid, (_, uid) in runs.items():
                _kill_group(pid, signal.SIGKILL)
                if uid is not None:
                    _kill_uid(uid)
            os._exit(0)
        req = json.loads(msg)
        setup = _preexec(_Isolation(*req["iso"]), req["uid"], req["limits"], req["stage"])
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        pid = os.fork()
        if pid == 0:
            sock.detach()  # closed with the others
            _child(req, log, setup)  # never returns
        os.close(log)
        runs[pid] = (fds[0], req["uid"])
        os.write(fds[0], pid.to_bytes(4, "little", signed=True))


def _child(req: dict, log: int, setup: Callable):
    """One run in a fork server's child: what Popen(start_new_session=True, preexec_fn=setup), `python -u` would do."""
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.chdir(req["cwd"])
        os.setsid()
        setup()
    except BaseException:
        os._exit(255)  # as a failed exec
    atexit._clear()  # the server's exit handlers are not the script's
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # read again from TMPDIR
    np.random.seed()  # `random` reseeds itself after a fork (random.py's register_at_fork)
    sys.modules.pop("env", None)  # a workspace's own env.py imports
    path = os.path.join(req["cwd"], req["script"])
    sys.argv, sys.path[0] = [req["script"]], os.path.dirname(path)
    main = types.ModuleType("__main__")  # what `python script` runs the file in
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"] = main
    try:
        exec(compile(Path(path).read_bytes(), path, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # the traceback from the script's first frame
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        raise SystemExit(1)
    raise SystemExit(0)


def _neutral_paths(text: str) -> str:
    """Output with the interpreter's folders as placeholders: the same on every install."""
    paths = sysconfig.get_paths()
    names = {paths["purelib"]: "<site-packages>", paths["platlib"]: "<site-packages>", paths["stdlib"]: "<stdlib>",
             sys.prefix: "<python>", sys.base_prefix: "<python>"}
    for folder in sorted(names, key=len, reverse=True):  # site-packages lies inside the prefix
        text = text.replace(folder.rstrip("/") + "/", names[folder] + "/")
    return text


def _head_tail(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(OUTPUT_HEAD + OUTPUT_TAIL + 1)
        if size > OUTPUT_HEAD + OUTPUT_TAIL:
            f.seek(size - OUTPUT_TAIL)
            data = data[:OUTPUT_HEAD] + f"\n[... {size - OUTPUT_HEAD - OUTPUT_TAIL} bytes omitted ...]\n".encode() \
                + f.read()
    return data.decode("utf-8", errors="replace")


def _short(text: str, limit=300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else f"{line[:limit - 30]}... [{len(line)} characters]"


def _workspace_path(name: str) -> str:
    """A relative path inside the workspace, normalised; ValueError if it leaves it or no file can have it."""
    norm = posixpath.normpath(str(name).strip()) if str(name).strip() else ""
    shown = _short(repr(name), 80)
    if not norm or norm.startswith(("/", "..")) or "\\" in norm or "\0" in norm:
        raise ValueError(f"{shown} is outside the workspace")
    if norm == ".":
        raise ValueError(f"{shown} is the workspace folder itself, not a file")
    try:
        sizes = [len(part.encode()) for part in norm.split("/")]
    except UnicodeEncodeError:  # a lone surrogate, e.g. "\ud800" in JSON
        raise ValueError(f"{shown} is not valid UTF-8") from None
    if max(sizes) > 255 or len(norm.encode()) > 1024:  # Linux's NAME_MAX; well below PATH_MAX
        raise ValueError(f"{shown} is too long (at most 255 bytes a name, 1024 a path)")
    return norm


_TASK_HASHES: dict = {}


def _task_hash(task: Task) -> str:
    files = sorted(p for p in task.dir.rglob("*") if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stamp not in _TASK_HASHES:
        h = hashlib.sha256()
        for p in files:
            h.update(str(p.relative_to(task.dir)).encode() + b"\0" + p.read_bytes())
        _TASK_HASHES[stamp] = h.hexdigest()
    return _TASK_HASHES[stamp]


def run_script(task, code: str, timeout=None, cache=True, files: dict[str, str] | None = None, *,
               script="train.py", keep=()) -> RunResult:
    """Run `code` as `script` in a fresh sandbox with a copy of public/ and `files`; `keep`: outputs to copy out."""
    task = load_task(task)
    timeout = float(timeout or task.time_limit)
    files = {_workspace_path(k): v for k, v in {**(files or {}), script: code}.items()}
    keep = sorted({_workspace_path(k) for k in keep})
    limit = [GPU_MEMORY_LIMIT, "gpu"] if SCRIPT_GPU else MEMORY_LIMIT  # runs that see a GPU apart
    key = hashlib.sha256(json.dumps([task.name, _task_hash(task), _workspace_path(script), sorted(files.items()),
                                     timeout, limit, FILE_SIZE_LIMIT, *([keep] if keep else [])]).encode()
                         ).hexdigest()  # `keep` joins the key only when given: old entries stay valid
    cached = CACHE_DIR / f"{key}.json"
    if cache and cached.exists():
        entry = json.loads(cached.read_text())  # older entries hold this install's paths
        return RunResult(**{**entry, "output": _neutral_paths(entry["output"]), "cached": True})
    result = _run(task, files, _workspace_path(script), timeout, keep)
    if cache and result.status not in CACHE_SKIP:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(CACHE_DIR, 0o700)  # results hold private scores: root-only, like private/
        if result.kept:  # renamed whole: a reader sees all kept files or none
            folder = CACHE_DIR / f"{key}.{Path(result.log_path).stem}.kept"
            shutil.move(Path(result.log_path).with_suffix(".kept"), folder)
            result.kept = {name: str(folder / name) for name in result.kept}
        tmp = CACHE_DIR / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(asdict(result)))
        os.replace(tmp, cached)
    return result


def _run(task: Task, files: dict[str, str], script: str, timeout: float, keep: list[str]) -> RunResult:
    iso, stage = _isolation()
    uid, lock = _claim_uid() if iso.uid else (None, None)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(LOG_DIR, 0o700)
    work = Path(tempfile.mkdtemp(prefix=f"mlenv-{task.name}-p{os.getpid()}-"))
    log_path = LOG_DIR / f"{work.name}.log"
    try:
        shutil.copytree(task.public_dir, work, dirs_exist_ok=True)
        for name, text in files.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(text)
        if uid is not None:
            _kill_uid(uid)  # a crashed parent's leftovers
            for p in [work, *work.rglob("*")]:
                os.chown(p, uid, uid)
        env = _sandbox_env(work)
        cpu = int(timeout * (os.cpu_count() or 1)) + 1  # a backstop to the wall clock
        limits = [(resource.RLIMIT_CPU, (cpu, cpu + 5)), (resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT,) * 2),
                  (resource.RLIMIT_NOFILE, (OPEN_FILES_LIMIT,) * 2), (resource.RLIMIT_CORE, (0, 0))]
        limits.append((resource.RLIMIT_DATA, (GPU_MEMORY_LIMIT,) * 2) if SCRIPT_GPU else
                      (resource.RLIMIT_AS, (MEMORY_LIMIT,) * 2))
        limits += [(resource.RLIMIT_NPROC, (PROCESS_LIMIT,) * 2)] if uid is not None else []
        server = _fork_server(stage) if FORK_SERVER else None
        start, proc = time.monotonic(), None
        if server is not None:
            with contextlib.suppress(OSError):  # it died: a new interpreter now, a new server next time
                proc = _ForkedRun(server, {"cwd": str(work), "script": script, "log": str(log_path), "env": env,
                                           "uid": uid, "limits": limits, "stage": stage,
                                           "iso": [iso.uid, iso.net, iso.reveal]})
        if proc is None:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen([sys.executable, "-u", script], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_preexec(iso, uid, limits, stage))
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(GRACE)
        _kill_group(proc.pid, signal.SIGKILL)  # no grandchild survives
        proc.wait()
        seconds = time.monotonic() - start
        if uid is not None:
            _kill_uid(uid)
        rc, output = proc.returncode, _neutral_paths(_head_tail(log_path))
        result = RunResult("error", None, None, seconds, output, str(log_path), rc, isolation=iso.describe(uid))
        if timed_out:
            result.status = "timeout"
        elif rc in (-signal.SIGKILL, -signal.SIGXCPU, -signal.SIGXFSZ) or (rc != 0 and (
                any(m in output for m in RESOURCE_MARKERS) or log_path.stat().st_size >= FILE_SIZE_LIMIT)):
            result.status = "resource"
        elif rc == 0:
            g = grade(task, work / "submission.csv")
            result.status = "success" if g.valid else "invalid_submission"
            result.score, result.test_score, result.error = g.public, g.private, g.error
        for name in keep:  # the copy runs as root
            path = work / name
            if not path.is_symlink() and path.is_file() and path.resolve().is_relative_to(work.resolve()):
                copy = log_path.with_suffix(".kept") / name
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, copy)
                result.kept[name] = str(copy)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if lock is not None:
            os.close(lock)

# ==== writing a task folder (built-in or MLE-bench)


def _description(template: str, time_limit: float, **values) -> str:
    return _fill(_text(f"description/{template}.md") + _text("description/evaluation.md"),
                 time_limit=format(time_limit, "g"), **values)


def _columns(columns) -> str:
    cols = [f"`{c}`" for c in columns]
    return ", ".join(cols) if len(cols) <= 12 else f"{', '.join(cols[:4])}, ..., {', '.join(cols[-3:])}"


def _parts(n: int, public_fraction=0.5, seed=0) -> np.ndarray:
    return np.where(np.random.default_rng(seed).permutation(n) < int(n * public_fraction), "public", "private")


def _write_task(folder: Path, files: dict):
    """Write a task folder from {path: DataFrame | dict (JSON) | text | folder}; swapped in whole by two renames."""
    _sweep_stale(folder.parent, f".{folder.name}-p*-*")  # a killed writer's (answers included)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-p{os.getpid()}-", dir=folder.parent))
    try:
        (tmp / "task" / "private").mkdir(parents=True, mode=0o700)
        for name, content in files.items():
            path = tmp / "task" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, pd.DataFrame):
                content.to_csv(path, index=False)
            elif isinstance(content, dict):
                path.write_text(json.dumps(content, indent=2) + "\n")
            elif isinstance(content, Path):
                shutil.copytree(content, path, dirs_exist_ok=True)
            else:
                path.write_text(content)
        if folder.exists():
            os.replace(folder, tmp / "old")
        os.replace(tmp / "task", folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

# ==== built-in tasks: tasks/builtin.py reads tasks/ (tasks/README.md) into BUILTIN_TASKS, prepare() their folders
_BUILTIN = runpy.run_path(str(DATA_DIR / "builtin.py"))
BUILTIN_ORDER = _BUILTIN["ORDER"]  # the hand-made tasks, built first; then the others by name
BUILTIN_TASKS = _BUILTIN["specs"](DATA_DIR)


def prepare(names=None, root=TASKS_DIR, force=False, workers=None) -> list[Path]:
    """Make the built-in task folders under root (up-to-date ones kept), `workers` at a time (default: one a core)."""
    return _BUILTIN["prepare"](sys.modules[__name__], names, Path(root), force, workers)


def _build(name: str, root: Path, force: bool):  # prepare's worker
    _BUILTIN["build"](sys.modules[__name__], name, root, force)

# ==== offline recipes for Edit Script (AI)
# tasks/recipes/: one real code change each, in one of ML-Agent's idea categories, for the built-in starters.


class EditError(Exception):
    """The editor could not apply the instruction."""


_EDITOR = runpy.run_path(str(DATA_DIR / "recipes" / "editor.py"))
RECIPES = _EDITOR["read_recipes"](BUILTIN_TASKS)


def recipes_for(task_name: str) -> list:
    return [r for r in RECIPES if task_name in r.tasks]


def recipe_editor(instruction: str, code: str) -> str:
    """Offline stand-in for the LLM editor: the recipe the instruction names, applied; EditError when none fits."""
    try:
        return _EDITOR["edit"](instruction, code, BUILTIN_TASKS, RECIPES)
    except ValueError as e:
        raise EditError(str(e)) from None

# ==== MLE-bench competitions (tasks/mlebench/prepare.py)
GRADE_TIMEOUT = 600.0  # seconds for one run of a competition's grade.py
_MLEBENCH = runpy.run_path(str(DATA_DIR / "mlebench" / "prepare.py"))


def _grade_mlebench(task: Task, path: Path) -> Grade:
    """Grade with the competition's grade.py; TaskError if it fails."""
    m = task.info["mlebench"]
    script = _fill(_text("mlebench/grade_parts.py"), labels=inspect.getsource(_labels))
    env_ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [m["checkout"], os.environ.get("PYTHONPATH")]))}
    try:
        r = subprocess.run([m["python"], "-c", script, m["grade_fn"], str(path), str(task.private_dir / "answers.csv"),
                            task.id_column], cwd=m["checkout"], env=env_, capture_output=True, text=True,
                           timeout=GRADE_TIMEOUT)
        out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        raise TaskError(f"{m['competition']}: grading with {m['grade_fn']} failed: {str(e).splitlines()[0]}") from None
    if out is None:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise TaskError(f"{m['competition']}: grading with {m['grade_fn']} failed: {tail}")
    return Grade(False, None, None, out["error"]) if "error" in out else Grade(True, out["public"], out["private"], None)


def import_mlebench(prepared, out, metric=None, leaderboard=None, id_column=None, higher_is_better=None,
                    starter=None, name=None, split="held-out", time_limit=600.0, public_fraction=0.5,
                    seed=0, mlebench=None, config=None, score_rows=None) -> Path:
    """A task folder at `out` from an MLE-bench prepared competition, graded by its grade.py or by `metric`."""
    return _MLEBENCH["import_mlebench"](sys.modules[__name__], prepared, out, metric, leaderboard, id_column,
                                        higher_is_better, starter, name, split, time_limit, public_fraction, seed,
                                        mlebench, config, score_rows)

# ==== command line


class Help(argparse.ArgumentDefaultsHelpFormatter):  # " (default: X)" unless the help says it, or a switch's (off)
    def _get_help_string(self, a):
        says = any(w in (a.help or "").lower() for w in ("default:", "none:", "[]:")) or a.required
        return a.help if says or a.nargs == 0 and not isinstance(a, argparse.BooleanOptionalAction) else \
            super()._get_help_string(a)


class Parser(argparse.ArgumentParser):  # agent.Parser too: a usage error is one line, exit status 2
    __init__ = functools.partialmethod(argparse.ArgumentParser.__init__, formatter_class=Help)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _seconds(text: str) -> float:
    with contextlib.suppress(ValueError):
        if math.isfinite(value := float(text)) and value > 0:
            return value
    raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, not {text}")


def _script(path: str) -> Path:
    try:
        Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = "not a UTF-8 text file" if isinstance(e, UnicodeDecodeError) else "no such script"
        raise argparse.ArgumentTypeError(f"{why}: {path}") from None
    return Path(path)


def main(argv=None):
    parser = Parser(prog="env.py", description="ML tasks, grading and the sandbox of the project.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the built-in tasks: name, split, metric, direction, best score")
    prep = sub.add_parser("prepare", help="make the built-in task folders under runs/tasks")
    prep.add_argument("names", nargs="*", help="tasks to prepare (default: all)")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    run = sub.add_parser("run", help="run a script as train.py of a task in the sandbox; prints one JSON object")
    run.add_argument("--task", required=True, help="a built-in task name or a task folder")
    run.add_argument("--script", required=True, type=_script, help="the Python file to run")
    run.add_argument("--timeout", type=_seconds, help="wall-clock limit in seconds (default: the task's)")
    run.add_argument("--no-cache", action="store_true", help="run even when an identical run is cached")
    imp = sub.add_parser("import-mlebench", help="make a task folder from an MLE-bench prepared competition")
    imp.add_argument("--prepared", required=True, help="<data>/<competition id>/prepared")
    imp.add_argument("--out", required=True, help="the task folder to write")
    imp.add_argument("--metric", help=f"one of: {', '.join(METRICS)}; with --mlebench any name (None: only there)")
    imp.add_argument("--mlebench", metavar="PATH", help="an MLE-bench checkout, its grade.py grades (None: --metric)")
    imp.add_argument("--config", help="the competition's config.yaml, for its file names (default: the checkout's)")
    imp.add_argument("--score-rows", metavar="COLUMN=VALUE", help="score only rows with COLUMN == VALUE (None: all)")
    imp.add_argument("--leaderboard", help="leaderboard.csv (default: the checkout's; None: the perfect score is best)")
    imp.add_argument("--id-column", help="default: the first column of sample_submission.csv")
    for way in ("higher", "lower"):
        imp.add_argument(f"--{way}-is-better", dest="higher", action="store_const", const=way == "higher",
                         help="a check: must agree with the metric")
    imp.add_argument("--starter", type=_script, help="the starting train.py (default: copy sample_submission.csv)")
    imp.add_argument("--name", help="the task name (default: the competition id)")
    imp.add_argument("--split", choices=("held-in", "held-out"), default="held-out", help="the task's split")
    imp.add_argument("--time-limit", type=_seconds, default=600.0, help="seconds per run of the agent's script")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(f"{'task':<24}{'split':<10}{'metric':<10}{'better':<8}{'best':>12}  title")
            for name, s in BUILTIN_TASKS.items():  # from the definitions: the best score once prepared
                built = _BUILTIN["current"](TASKS_DIR / name)
                best = f"{load_task(TASKS_DIR / name).best_score:.6g}" if built else "-"
                better = "higher" if METRICS[s.metric].higher_is_better else "lower"
                print(f"{name:<24}{s.split:<10}{s.metric:<10}{better:<8}{best:>12}  {s.title}")
            print("best: the reference panel's top, once `python env.py prepare` built the task", file=sys.stderr)
        elif args.command == "prepare":
            start = time.time()
            print(*prepare(args.names or None, force=args.force), sep="\n")
            print(f"prepared in {time.time() - start:.1f}s", file=sys.stderr)
        elif args.command == "import-mlebench":
            if not (args.metric or args.mlebench):
                parser.error("--metric is required without --mlebench")
            print(import_mlebench(args.prepared, args.out, args.metric, args.leaderboard, args.id_column, args.higher,
                                  args.starter, args.name, args.split, args.time_limit, mlebench=args.mlebench,
                                  config=args.config, score_rows=args.score_rows))
        else:
            result = run_script(load_task(args.task), args.script.read_text(encoding="utf-8"), timeout=args.timeout,
                                cache=not args.no_cache)
            print(json.dumps(asdict(result)))
    except TaskError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
