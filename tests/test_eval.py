"""Tests for eval.py: the two metrics, the failed-run accounting, the resumable run log, end to end.

- performance_gain and human_rank on hand-computed cases: higher and lower is better, ties, invalid submissions;
- the clipped gains (+-50% a run), their task bootstrap (seeded, holds the mean) and the paired differences;
- a (scaffold, policy, task) summary with a failed run: it stays among the K runs and scores m_init / HumanRank 0;
- runs that crash, and runs whose final train.py writes no submission, are recorded and counted, not dropped;
- seeding: a fresh process draws the same torch numbers for the same seed (the first run of a checkpoint repeats);
- runs.jsonl: a torn last line (a kill mid-write) is cut off and the complete lines are kept;
- `eval.py` end to end with the scripted agent on one task, K = 2 (subprocess): the report's fields agree with the
  runs and with a fresh sandbox run of the starter; a rerun skips both finished runs;
- the plots (only where matplotlib is installed); usage errors exit 2 with one line;
- tests/pool_eval.py: pooled over reports, the two-level interval holds the spread between reports that the tasks
  interval leaves out; counts are summed; a missing policy or a folder without a report is one line, exit 2.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import agent
import env
import eval as ev

ROOT = Path(ev.__file__).resolve().parent

# ----------------------------------------------------------------------------------------------- performance gain


def test_performance_gain_hand_computed():
    # higher is better: (0.9 - 0.8) / 0.8 = +0.125; a drop to 0.7 is -0.125
    assert ev.performance_gain(0.9, 0.8, True) == pytest.approx(0.125)
    assert ev.performance_gain(0.7, 0.8, True) == pytest.approx(-0.125)
    # lower is better (beta = -1): RMSE 50 -> 45 is -1 * (45 - 50) / 50 = +0.1; 50 -> 60 is -0.2
    assert ev.performance_gain(45.0, 50.0, False) == pytest.approx(0.1)
    assert ev.performance_gain(60.0, 50.0, False) == pytest.approx(-0.2)
    # no change is exactly zero in both directions (no -0.0)
    assert math.copysign(1.0, ev.performance_gain(0.5, 0.5, False)) == 1.0
    with pytest.raises(ValueError, match="undefined"):
        ev.performance_gain(0.1, 0.0, True)

# ---------------------------------------------------------------------------------------------------- HumanRank


@pytest.mark.parametrize("score, expected", [
    (0.95, 1.0),   # better than all 4: p = 0
    (0.85, 0.75),  # below 0.9 only: p = 1, 1 - 1/4
    (0.8, 0.75),   # tied with both 0.8 entries: ties are not strictly better, p = 1
    (0.75, 0.25),  # below 0.9, 0.8, 0.8: p = 3
    (0.5, 0.0),    # below all: p = 4
    (None, 0.0),   # invalid submission
    (float("nan"), 0.0),
])
def test_human_rank_higher_is_better(score, expected):
    assert ev.human_rank(score, [0.9, 0.8, 0.8, 0.7], True) == pytest.approx(expected)


@pytest.mark.parametrize("score, expected", [
    (5.0, 1.0),    # lower than every entry
    (20.0, 0.75),  # tie with both 20s, only 10 strictly better: p = 1
    (25.0, 0.25),  # 10, 20, 20 are better: p = 3
    (31.0, 0.0),
    (None, 0.0),
])
def test_human_rank_lower_is_better(score, expected):
    assert ev.human_rank(score, [30.0, 20.0, 10.0, 20.0], False) == pytest.approx(expected)


def test_human_rank_empty_leaderboard_is_an_error():
    with pytest.raises(ValueError):
        ev.human_rank(0.5, [], True)

# ------------------------------------------------------------------------------ clipped gains, paired, task bootstrap


def test_task_bootstrap_interval_holds_the_mean_and_is_seeded():
    per_task = [[0.1 * t + 0.03 * r for r in range(3)] for t in range(-4, 8)]  # 12 tasks of 3 runs
    mean, low, high = ev.task_bootstrap(per_task)
    assert mean == pytest.approx(sum(map(sum, per_task)) / 36) and low < mean < high
    assert ev.task_bootstrap(per_task) == (mean, low, high)  # the same draws for the same seed
    assert ev.task_bootstrap(per_task, seed=1) != (mean, low, high)
    assert ev.task_bootstrap([[], []]) == (None, None, None)  # no task with a gain


def test_task_summary_clips_each_run_gain_at_half():
    task = SimpleNamespace(name="t", metric="accuracy", higher_is_better=True, leaderboard=lambda: [])
    runs = [_row(0.9, True), _row(0.2, True), _row(0.44, True), _row(None, False, "failed")]  # +80%, -60%, -12%, m_init
    s = ev.task_summary(task, {"public": 0.5, "private": 0.5}, runs)
    assert s["gains_clipped"] == pytest.approx([0.5, -0.5, -0.12, 0.0])
    assert s["gain_avg"] == pytest.approx((0.9 + 0.2 + 0.44 + 0.5) / 4 / 0.5 - 1)  # avg@K's gain stays unclipped
    assert ev.overall([s])["gain_clipped"] == pytest.approx(-0.12 / 4)


def test_a_policy_a_constant_tenth_above_another_differs_by_exactly_that():
    def group(policy, shift):
        return {"scaffold": "mlab", "policy": policy,
                "tasks": [{"gains_clipped": [0.05 * t - 0.1 * r + shift for r in range(4)]} for t in range(6)]}
    (d,) = ev.paired([group("sft", 0.0), group("ppo", 0.1)])
    assert (d["a"], d["b"], d["tasks"], d["runs"]) == ("sft", "ppo", 6, 24)
    assert d["mean"] == pytest.approx(0.1) and d["low"] == pytest.approx(0.1) and d["high"] == pytest.approx(0.1)
    assert ev.paired([group("sft", 0.0), {**group("ppo", 0.1), "scaffold": "matryoshka"}]) == []  # other scaffolds

# ------------------------------------------------------------------------------------------- failed-run accounting


def _row(private, valid, status="ok", tokens=0):
    return {"private": private, "valid": valid, "status": status, "prompt_tokens": tokens, "completion_tokens": 0,
            "cost": 0.0, "seconds": 1.0, "steps": 3}


def test_task_summary_counts_a_failed_run_as_m_init_and_rank_zero():
    board = [("a", 30.0), ("b", 35.0), ("c", 45.0), ("d", 60.0)]  # lower is better
    task = SimpleNamespace(name="t", metric="rmse", higher_is_better=False, leaderboard=lambda: board)
    runs = [_row(40.0, True, tokens=100), _row(None, False, "failed"), _row(None, False)]  # crash + invalid
    s = ev.task_summary(task, {"public": 52.0, "private": 50.0}, runs)
    assert s["runs"] == 3 and s["failed"] == 1
    assert s["avg@K"] == pytest.approx((40.0 + 50.0 + 50.0) / 3)  # failed runs score m_init = 50
    assert s["best@K"] == pytest.approx(40.0)
    assert s["gain_avg"] == pytest.approx(-(46.6666667 - 50.0) / 50.0)
    assert s["gain_best"] == pytest.approx(0.2)
    assert s["human_rank_avg"] == pytest.approx((0.5 + 0.0 + 0.0) / 3)  # 40: p = 2 of 4; invalid: 0
    assert s["human_rank_best"] == pytest.approx(0.5)
    assert s["valid_rate"] == pytest.approx(1 / 3)
    assert s["tokens_per_traj"] == pytest.approx(100 / 3)  # the failed runs stay in the denominator
    assert s["invalid_step_rate"] is None and s["undone_gains_per_traj"] is None  # no run recorded its actions


def test_conditioning_counts_edits_from_the_prompt_and_keeps_or_undoes_that_match_the_score():
    """target 1 of issue 42: edits of train.py that are the run's ideas; after running an edit, undo exactly when
    the public score is not better than before the edit (higher is better here)."""
    def step(action, inp=None, kind="neutral", metric=None, history=()):
        return SimpleNamespace(action=action, action_input=inp, kind=kind,
                               snapshot={"metric": metric, "history": [{"script": "train.py", "metric": m}
                                                                       for m in history]})
    def edit(idea, metric=0.5, history=()):
        return step("Edit Script (AI)", {"script_name": "train.py", "edit_instruction": idea, "save_name": "train.py"},
                    "edit", metric, history)
    run = {"script_name": "train.py"}
    steps = [step("Execute Script", run, metric=0.5),  # the baseline: no edit to undo, no decision after it
             step("Inspect Script Lines", metric=0.5), edit(" Use a forest. "),  # an idea of the prompt
             step("Execute Script", run, metric=0.6, history=[0.5]),
             edit("Something else.", 0.6, [0.5]),  # better (0.6 > 0.5) and kept: right; not an idea of the prompt
             step("Execute Script", run, metric=0.4, history=[0.5, 0.6]),
             step("Final Answer", {"final_answer": "x"}, "final", 0.4, history=[0.5, 0.6]),  # worse, kept: wrong
             edit("use a forest.", 0.4, [0.5, 0.6, 0.4]),
             step("Execute Script", run, metric=0.3, history=[0.5, 0.6, 0.4]),
             step(None, None, "invalid", 0.3, history=[0.5, 0.6, 0.4])]  # invalid: no decision
    traj = SimpleNamespace(steps=steps, higher_is_better=True)
    got = ev.conditioning(traj, [("model", "Use a forest.")])
    assert got == {"followed": [True, False, True], "agreed": [True, False]}
    traj.higher_is_better = False  # now 0.6 after 0.5 is worse and kept (wrong), 0.4 after 0.6 better and kept
    assert ev.conditioning(traj, [("model", "Use a forest.")])["agreed"] == [False, True]


def test_task_summary_counts_invalid_steps_and_undone_gains():
    task = SimpleNamespace(name="t", metric="accuracy", higher_is_better=True, leaderboard=lambda: [])
    edit, undo = "Edit Script (AI)", "Undo Edit Script"
    runs = [{**_row(0.9, True), "actions": [[edit, "edit", 0.4], ["Execute Script", "neutral", 0.0],
                                            [undo, "edit", -0.4], [None, "invalid", -1.0]]},  # a gain given back
            {**_row(0.8, True), "actions": [[edit, "edit", -0.2], [undo, "edit", 0.2],  # a loss undone: not counted
                                            [None, "invalid", -1.0], [undo, "error", -1.0]]},  # nothing to undo
            _row(None, False, "failed")]  # a failed run recorded no actions: left out of both
    s = ev.task_summary(task, {"public": 0.8, "private": 0.8}, runs)
    assert s["invalid_step_rate"] == pytest.approx(2 / 8) and s["undone_gains_per_traj"] == pytest.approx(1 / 2)
    assert "| invalid steps | undone gains/traj |" in ev.markdown(
        {"config": {"scaffolds": ["mlab"], "k": 3, "max_steps": 4, "ideas": "sampled", "temperature": 0.7, "seed": 0},
         "tasks": {"t": {}}, "groups": [{"scaffold": "mlab", "policy": "p", "overall": ev.overall([s]), "tasks": [s]}],
         "paired": []})


class _NoSubmission:
    """A policy whose one edit rewrites train.py into a script without a submission, then gives its final answer."""

    def __init__(self):
        self.usage = agent.Usage()

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None):
        text = messages[-1]["content"]
        if "Change it as this instruction says" in text:  # the LLM editor's request
            out = "```python\nprint('trained, but no submission.csv')\n```"
        elif "Observation:" in text:  # after the edit
            out = ("Reflection: r\nResearch Plan and Status: 1. edit [done]\nFact Check: none\nThought: t\n"
                   'Action: Final Answer\nAction Input: {"final_answer": "done"}')
        else:
            out = ("Reflection: r\nResearch Plan and Status: 1. edit [in progress]\nFact Check: none\nThought: t\n"
                   'Action: Edit Script (AI)\nAction Input: {"script_name": "train.py", "edit_instruction": "drop '
                   'the submission", "save_name": "train.py"}')
        c = agent.Completion([out] * n, prompt_tokens=10, completion_tokens=5)
        self.usage.add(c, 0.0)
        return c


class _Crash:
    usage = agent.Usage()

    def chat(self, *a, **k):
        raise RuntimeError("the policy fell over")


def test_failing_runs_are_recorded_and_counted(tmp_path, monkeypatch):
    backends = {"nosub": _NoSubmission(), "crash": _Crash()}
    monkeypatch.setattr(ev, "get_backend", lambda name, role, cfg: backends[name])
    cfg = ev.Config(policies=["nosub", "crash"], tasks=["wine"], k=2, max_steps=4, editor="policy",
                    out=str(tmp_path), plots=False, workers=1)  # the patched backends live in this process
    report = ev.evaluate(cfg, log=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # 2 policies x K = 2: nothing dropped
    nosub = [r for r in rows if r["policy"] == "nosub"]
    assert all(r["status"] == "ok" and r["submission"] == "invalid_submission" and not r["valid"] for r in nosub)
    assert all(r["prompt_tokens"] > 0 for r in nosub)  # agent + editor calls are counted per trajectory
    crash = [r for r in rows if r["policy"] == "crash"]
    assert all(r["status"] == "failed" and "fell over" in r["error"] for r in crash)
    m_init = report["tasks"]["wine"]["m_init"]["private"]
    for g in report["groups"]:
        t = g["tasks"][0]
        assert t["runs"] == 2 and t["valid_rate"] == 0.0
        assert t["avg@K"] == pytest.approx(m_init) and t["gain_avg"] == 0.0 and t["human_rank_avg"] == 0.0
    assert [g["tasks"][0]["failed"] for g in report["groups"]] == [0, 2]

def test_matryoshka_and_monolithic_runs_record_scores_and_context(tmp_path):
    cfg = ev.Config(scaffolds=["matryoshka", "monolithic"], policies=["scripted"], tasks=["wine"], k=1, rounds=2,
                    calls=1, sub_iters=2, out=str(tmp_path), plots=False)
    report = ev.evaluate(cfg, log=lambda *a: None)
    rows = {r["scaffold"]: r for r in report["runs"]}
    full = {r["scaffold"]: r for r in ev.read_runs(tmp_path / "runs.jsonl").values()}  # with the context lists
    assert set(rows) == {"matryoshka", "monolithic"} and all(r["status"] == "ok" for r in rows.values())
    assert len(full["matryoshka"]["context"]) == rows["matryoshka"]["steps"] == 2  # one Orchestrator prompt a round
    mono = full["monolithic"]["context"]
    assert len(mono) >= 2 and all(b > a for a, b in zip(mono, mono[1:]))  # the monolithic chat only grows
    assert all(r["valid_attempts"] <= r["steps"] and r["private"] is not None for r in rows.values())



def test_runs_in_worker_processes_equal_runs_in_this_process(tmp_path):
    # the scripted expert (sandbox runs) and the scripted Orchestrator (its own generator): each run's outcome is its
    # own, whether it runs here or in one of two workers that each take several runs
    cfg = dict(scaffolds=["mlab", "matryoshka"], policies=["scripted"], tasks=["wine"], k=3, max_steps=4, rounds=2,
               calls=1, sub_iters=2, plots=False)
    rows = {}
    for workers in (1, 2):
        ev.evaluate(ev.Config(**cfg, out=str(tmp_path / str(workers)), workers=workers), log=lambda *a: None)
        rows[workers] = {k: {f: r[f] for f in ("private", "public", "steps", "ideas", "seed", "valid")}
                         for k, r in ev.read_runs(tmp_path / str(workers) / "runs.jsonl").items()}
    assert len(rows[1]) == 6 and rows[1] == rows[2]
    assert len({r["private"] for r in rows[1].values()}) > 1  # the runs differ from each other


def test_seeding_fixes_torch_in_a_fresh_process():
    # a fresh process has not imported torch yet when the first run is seeded (the first checkpoint loads after);
    # torch's own start seed differs per process, so an unseeded first run would not repeat
    code = "import eval; eval.seed_everything(7); import torch; print(torch.rand(3).tolist())"
    outs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           check=True).stdout for _ in range(2)]
    assert outs[0] == outs[1] != ""

# -------------------------------------------------------------------------------------------------- the run log


def test_read_runs_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "runs.jsonl"
    ev.agent.append_jsonl(path, {"key": "a", "x": 1})
    ev.agent.append_jsonl(path, {"key": "b", "x": 2})
    with open(path, "a") as f:
        f.write('{"key": "c", "x"')  # killed mid-write
    assert set(ev.read_runs(path)) == {"a", "b"}
    assert path.read_text().endswith("\n")  # the next append starts on a fresh line
    ev.agent.append_jsonl(path, {"key": "c", "x": 3})
    assert ev.read_runs(path)["c"]["x"] == 3

# ----------------------------------------------------------------------------------------------------- end to end


def _eval(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_end_to_end_scripted_k2_and_resume(tmp_path):
    args = ["--policy", "scripted", "--tasks", "wine", "--k", "2", "--max-steps", "6", "--out", str(tmp_path),
            "--no-plots"]
    first = _eval(*args)
    assert first.returncode == 0, first.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().count("| mlab | scripted | wine |") == 1
    runs = sorted((json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()),
                  key=lambda r: r["run"])  # in the order they finished (two worker processes)
    assert [r["run"] for r in runs] == [0, 1] and len({r["seed"] for r in runs}) == 2
    task = env.load_task("wine")
    starter = env.run_script(task, (task.public_dir / "train.py").read_text())
    assert report["tasks"]["wine"]["m_init"]["private"] == pytest.approx(starter.test_score)
    (g,) = report["groups"]
    t = g["tasks"][0]
    for key in ("m_init", "avg@K", "best@K", "gain_avg", "gain_best", "human_rank_avg", "human_rank_best",
                "valid_rate", "tokens_per_traj", "cost_per_traj"):
        assert t[key] is not None, key
    scores = [r["private"] if r["valid"] else starter.test_score for r in runs]
    assert t["runs"] == 2 and t["avg@K"] == pytest.approx(sum(scores) / 2) and t["best@K"] == pytest.approx(min(scores))
    assert t["gain_avg"] == pytest.approx(ev.performance_gain(t["avg@K"], starter.test_score, False))
    board = [s for _, s in task.leaderboard()]
    assert t["human_rank_best"] == pytest.approx(ev.human_rank(t["best@K"], board, False))
    assert g["overall"]["gain_avg"] == pytest.approx(t["gain_avg"])
    # each run's final train.py was graded on the private rows; the scripted expert's runs are valid
    assert all(r["valid"] and r["steps"] >= 1 and len(r["context"]) == r["steps"] == len(r["actions"]) for r in runs)
    assert t["invalid_step_rate"] == 0.0  # the scripted expert writes valid actions only

    second = _eval(*args)
    assert second.returncode == 0, second.stderr
    assert "2 already in" in second.stdout and "[1/" not in second.stdout
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 2
    again = json.loads((tmp_path / "report.json").read_text())
    assert again["groups"] == report["groups"]


def test_plots_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"iteration": i, "reward": -1 + i / 10}) + "\n" for i in range(1, 6)))
    cfg = ev.Config(out=str(tmp_path), ppo_log=str(log))
    group = lambda s: {"scaffold": s, "policy": "p", "overall": {"gain_avg": 0.1, "cost_per_traj": 0.0,  # noqa: E731
                                                                "tokens_per_traj": 100.0}}
    runs = [{"scaffold": "matryoshka", "policy": "p", "context": [10, 12, 14]},
            {"scaffold": "monolithic", "policy": "p", "context": [10, 30, 60, 100]}]
    made = ev.plots({"groups": [group("matryoshka"), group("monolithic")]}, runs, cfg)
    assert made == ["gain_vs_cost.png", "ppo_reward.png", "context_growth.png"]
    assert all((tmp_path / m).stat().st_size > 1000 for m in made)


@pytest.mark.parametrize("args, words", [
    (["--k", "0"], "--k: must be at least 1"),
    (["--tasks", "no-such-task"], "unknown task"),
    (["--policy", "runs/no-such-ckpt"], "no checkpoint folder"),
    (["--scaffold", "swarm"], "invalid choice"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args, words, cli):  # main(argv) here, not a python + torch
    out = cli(ev.main, [*args, "--out", str(tmp_path)], cwd=ROOT)
    assert out.returncode == 2
    assert words in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs.jsonl").exists()


def test_the_default_policies_say_which_checkpoints_are_missing(tmp_path, monkeypatch):
    """Without runs/ckpt/sft and runs/ckpt/ppo the default evaluation is the scripted expert alone, and says so."""
    monkeypatch.setattr(ev, "ROOT", tmp_path)
    (tmp_path / "runs/ckpt/ppo").mkdir(parents=True)  # found: not named as missing
    said = []
    assert ev.default_policies(said.append) == ["scripted", str(tmp_path / "runs/ckpt/ppo")]
    assert said == ["eval.py: no runs/ckpt/sft (sft.py / ppo.py make them): evaluating without"]
    said.clear()
    (tmp_path / "runs/ckpt/ppo").rmdir()
    ev.evaluate(ev.Config(tasks=["wine"], k=1, max_steps=1, workers=1, plots=False, out=str(tmp_path / "o")),
                log=said.append)
    assert said[0] == "eval.py: no runs/ckpt/sft or runs/ckpt/ppo (sft.py / ppo.py make them): evaluating without"
    said.clear()
    ev.evaluate(ev.Config(policies=["scripted"], tasks=["wine"], k=1, max_steps=1, workers=1, plots=False,
                          out=str(tmp_path / "o")), log=said.append)
    assert not any("evaluating without" in s for s in said)  # policies named: nothing is missing


@pytest.mark.parametrize("flag", ["--policy", "--sub-agent", "--editor"])
def test_a_bad_model_name_is_one_line_exit_2_before_any_run(flag, tmp_path, no_endpoint):
    """Issue 43: no endpoint configured, a missing folder, a file, a hub id not in the cache (hub offline) or an
    endpoint's name is one line, exit 2, at once: no request, no --out made (no .lock), no run."""
    from conftest import assert_bad_models_refused
    assert_bad_models_refused(ev.main, ["--tasks", "wine", "--k", "1", "--no-plots", flag, "{m}", "--out", "{d}/o"],
                              tmp_path, no_endpoint)

# ----------------------------------------------------------------------------------------------- tests/pool_eval.py


def _report(folder: Path, gains: dict, followed=(1, 4)) -> Path:
    """A report.json with eval.py's fields that pool_eval reads: {policy: [clipped gains of task a, of task b]}."""
    folder.mkdir(parents=True)
    groups = [{"scaffold": "mlab", "policy": name,
               "tasks": [{"task": t, "gains_clipped": runs, "followed": followed[0], "followed_n": followed[1],
                          "agreed": 1, "agreed_n": 1} for t, runs in zip("ab", per_task)]}
              for name, per_task in gains.items()]
    (folder / "report.json").write_text(json.dumps({"groups": groups}))
    return folder


def test_pool_eval_two_level_interval_holds_the_spread_between_reports(tmp_path, cli, capsys):
    """Report 1's ppo leads sft by 0.01 in every run, report 2's by 0.03: the pooled lead is 0.02; tasks resampled
    every draw is 0.02 (each task holds both reports' runs), reports resampled the draws are 0.01, 0.02 or 0.03."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pool_eval", ROOT / "tests/pool_eval.py")
    pool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool)
    one = _report(tmp_path / "s0", {"scripted": [[0.2, 0.2], [0.1, 0.1]], "sft": [[0.0, 0.0]] * 2,
                                    "ppo": [[0.01, 0.01]] * 2})
    two = _report(tmp_path / "s1", {"scripted": [[0.2, 0.2], [0.1, 0.1]], "sft": [[0.1, 0.1]] * 2,
                                    "ppo": [[0.13, 0.13]] * 2}, followed=(3, 4))
    pool.main([str(one), str(two / "report.json"), "--json", str(tmp_path / "pooled.json")])
    out = json.loads((tmp_path / "pooled.json").read_text())
    d = out["difference"]
    assert d["mean"] == pytest.approx(0.02) and d["runs"] == 8 and d["reports"] == 2
    assert d["tasks"] == pytest.approx([0.02, 0.02])
    assert d["two_level"] == pytest.approx([0.01, 0.03])
    assert out["policies"]["scripted"]["mean"] == pytest.approx(0.15)
    assert out["policies"]["sft"]["followed"] == [1 * 2 + 3 * 2, 4 * 4]  # summed over tasks and reports
    assert "ppo - sft: +2.00% [+2.00%, +2.00%] tasks, [+1.00%, +3.00%] two-level; 8 pairs" in capsys.readouterr().out
    # usage errors: one line, exit 2, naming the input
    for argv, words in [([str(one), "--b", "ppo-7"], f"{one}: no mlab policy 'ppo-7' (it has: scripted, sft, ppo)"),
                        ([str(tmp_path)], f"{tmp_path / 'report.json'}: not an eval.py report.json")]:
        res = cli(pool.main, argv, cwd=ROOT)
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1
