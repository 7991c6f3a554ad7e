"""Tests for tests/bench_claims.py, the papers' claims in miniature (it checks the report's shape, never the outcomes):

- usage errors (an unknown flag, --lanes below one) exit 2 with one line and start nothing;
- independent steps run at once or in turn, each once, and a failure is raised after the others finished;
- the bootstrap interval brackets the mean and narrows with n; the power arithmetic; a claim is decided only by an
  interval clear of 0; bench_ppo.py pairs each variant against the first;
- bench_ppo.py's course loop: a finished ppo.py run as a variant only when it is comparable, a kept J_step seed only
  for the same reward.py and weights, and its jobs at most --lanes at a time;
- a claims run at the smallest size runs every step, writes every claim C1-C8, and a rerun finds everything done
  (the steps' commands at their least sizes; how steps run, once each, in lanes, is the test of the second item).
"""
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent / "bench_claims.py"
spec = importlib.util.spec_from_file_location("bench_claims", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
ROOT = PATH.parent.parent


def test_claims_usage_error_exits_2_with_one_line(tmp_path, cli):  # main(argv) here (conftest.cli)
    out = cli(bench.main, ["--fast", "--out", str(tmp_path)], cwd=ROOT)
    assert out.returncode == 2 and "unrecognized arguments: --fast" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "work").exists()


def test_claims_lanes_below_one_is_a_usage_error(tmp_path, cli):
    out = cli(bench.main, ["--lanes", "-1", "--out", str(tmp_path)], cwd=ROOT)
    assert out.returncode == 2 and "--lanes must be at least 1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "work").exists()


@pytest.mark.parametrize("lanes", [1, 2])
def test_claims_steps_run_every_job_once_and_a_failure_waits_for_the_others(tmp_path, lanes):
    """Independent steps at once (lanes 2) or in turn (1): each that succeeds is marked done, a failed one raises
    naming itself only after the others finished, and a rerun skips what is done."""
    R = bench.ClaimsRun({}, tmp_path, log=lambda *a: None, lanes=lanes)
    with pytest.raises(RuntimeError, match="claims step bad failed"):
        R.steps(("bad", "env.py", ["--no-such-flag"], []), ("help", "env.py", ["--help"], []))
    assert (tmp_path / "work" / "help.done").exists() and not (tmp_path / "work" / "bad.done").exists()
    assert "import-mlebench" in (tmp_path / "work" / "logs" / "help.log").read_text()
    (tmp_path / "work" / "logs" / "help.log").unlink()
    R.steps(("help", "env.py", ["--help"], []), ("help-again", "env.py", ["--help"], []))
    assert not (tmp_path / "work" / "logs" / "help.log").exists()  # done before: not run again
    assert set(R.seconds) == {"help", "help-again"} and (tmp_path / "work" / "help-again.done").exists()


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_n():
    small, large = bench.bootstrap([0.0, 1.0] * 5), bench.bootstrap([0.0, 1.0] * 500)
    assert small["mean"] == large["mean"] == 0.5 and small["n"] == 10
    assert small["lo"] < 0.5 < small["hi"] and (large["hi"] - large["lo"]) < (small["hi"] - small["lo"]) / 5
    assert bench.bootstrap([None])["mean"] is None


def test_power_is_the_detectable_effect_and_the_units_its_mean_needs():
    units = [1.0, -1.0] * 8 + [0.5] * 4  # sd 0.9403 (ddof 1), mean 0.1, 20 units
    got = bench.power(units)
    assert got["detectable"] == pytest.approx(2.80 * 0.9403 / 20 ** 0.5, rel=1e-3)
    assert got["units_needed"] == 694  # ceil((2.80 * 0.9403 / 0.1) ** 2)
    by_task = bench.power([[1.0, 3.0], [0.0], [2.0, 2.0, 2.0]])  # each task's runs averaged: 2, 0, 2
    assert by_task["detectable"] == pytest.approx(2.80 * 1.1547 / 3 ** 0.5, rel=1e-3)
    assert bench.power([1.0])["detectable"] is None and bench.power([2.0, 2.0])["detectable"] is None


def test_a_claim_is_decided_only_by_intervals_clear_of_zero():
    up, down, across = ({"mean": m, "lo": lo, "hi": hi} for m, lo, hi in ((0.2, 0.1, 0.3), (-0.2, -0.3, -0.1),
                                                                          (0.1, -0.1, 0.3)))
    assert bench._decided(up) is True and bench._decided(up, up) is True
    assert bench._decided(down) is False and bench._decided(up, down) is False
    assert bench._decided(across) is None and bench._decided(up, across) is None
    assert bench._decided({"mean": None, "lo": None, "hi": None}) is None


def test_bench_ppo_pairs_each_variant_against_the_sft_start_and_the_first_variant():
    bench_ppo = load_bench_ppo()
    sft, first, second = ({"rewards": r, "kinds": k} for r, k in
                          (([0.0, 0.0, 0.0, 0.0], ["edit"] * 4),
                           ([0.5, -1.0, 0.5, 0.0], ["edit", "invalid", "edit", "edit"]),
                           ([0.0, 0.0, 1.0, -1.0], ["edit", "edit", "edit", "invalid"])))
    log = [{"clipfrac": 0.1, "kl": 0.2, "explained_variance": None, "time_total": 3.0}]
    a, b = bench_ppo.row("a", [], first, sft, None, log), bench_ppo.row("b", ["--x"], second, sft, first, log)
    assert a["minus_first"] is None and a["minus_sft"]["mean"] == 0.0
    assert b["minus_first"]["mean"] == pytest.approx((-0.5 + 1.0 + 0.5 - 1.0) / 4) and b["minus_first"]["n"] == 4
    table = bench_ppo.markdown({"model": "m", "objective_seeds": 1, "objective_states": 4, "date": "d",
                                "sft": {"j_step": 0.0, "invalid": 0.0}, "rows": [a, b]})
    assert b["minus_first"]["invalid"]["mean"] == 0.0 and a["minus_sft"]["invalid"]["mean"] == 0.25
    assert b["minus_first"]["detectable"] == pytest.approx(2.80 * 0.9129 / 2, rel=1e-3)  # sd of the 4 differences
    assert "- a [95%]" in table and "| b | `--x` |" in table and "b - a: " in table


def load_bench_ppo():
    spec = importlib.util.spec_from_file_location("bench_ppo", PATH.parent / "bench_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_ppo_takes_a_finished_run_only_when_its_pairs_compare(tmp_path):
    bench_ppo = load_bench_ppo()
    assert bench_ppo.parse_variant("mine: --no-format-term") == ("mine", ["--no-format-term"], None)
    assert bench_ppo.parse_variant("full=runs/ckpt/ppo") == ("full", [], "runs/ckpt/ppo")
    for bad in ("full=runs/ckpt/ppo: --lam 1", "=runs/ckpt/ppo", "a b: --lam 1"):
        with pytest.raises(ValueError, match="--variant"):
            bench_ppo.parse_variant(bad)
    run, log = tmp_path / "ppo", tmp_path / "log.jsonl"
    (run / "trainer_state").mkdir(parents=True)
    log.write_text(json.dumps({"iteration": 1, "clipfrac": 0.1}) + "\n")
    config = {"model": str(tmp_path / "sft"), "states": str(tmp_path / "states.jsonl"), "log_file": str(log),
              "reward": {"alpha": 1.0, "clip": 1.0, "binary_performance": False, "format_term": False,
                         "corner_term": True, "code": "0123456789ab"}}
    (run / "trainer_state" / "progress.json").write_text(json.dumps({"iteration": 15, "config": config}))
    got_log, got_reward = bench_ppo.finished_run("full", str(run), config["model"], config["states"], 15)
    assert got_log == [{"iteration": 1, "clipfrac": 0.1}]
    assert got_reward.code == "0123456789ab" and got_reward.format_term is False
    for args, said in (((config["model"], config["states"], 8), "ran 15 iterations, not --iterations 8"),
                       ((str(tmp_path / "other"), config["states"], 15), "trained from model"),
                       ((config["model"], str(tmp_path / "other.jsonl"), 15), "trained from states")):
        with pytest.raises(ValueError, match=said):
            bench_ppo.finished_run("full", str(run), *args)
    with pytest.raises(ValueError, match="no ppo.py checkpoint"):
        bench_ppo.finished_run("full", str(tmp_path), config["model"], config["states"], 15)


def test_bench_ppo_keeps_a_j_step_seed_only_for_the_same_reward_code_and_weights(tmp_path, monkeypatch):
    bench_ppo = load_bench_ppo()
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"1")
    calls = []
    monkeypatch.setattr(bench_ppo.bench_claims, "estimate_objective", lambda policy, states, n, seed: calls.append(
        seed) or {"rewards": [float(seed)] * n, "kinds": ["edit"] * n})
    bench_ppo.measure(tmp_path, "a", str(policy), "states.jsonl", 3, seed=2)
    assert bench_ppo.measured(tmp_path, "a", str(policy), 2)["rewards"] == [2.0, 2.0, 2.0] and calls == [2]
    assert bench_ppo.measured(tmp_path, "a", str(policy), 1) is None  # another seed: not kept
    monkeypatch.setattr(bench_ppo.reward, "CODE", "another")  # reward.py changed: measured again
    assert bench_ppo.measured(tmp_path, "a", str(policy), 2) is None
    monkeypatch.undo()
    assert bench_ppo.measured(tmp_path, "a", str(policy), 2) is not None
    os.utime(policy / "model.safetensors", ns=(1, 1))  # retrained (its weights rewritten): measured again
    assert bench_ppo.measured(tmp_path, "a", str(policy), 2) is None


def test_bench_ppo_lanes_run_at_most_n_jobs_at_once_and_name_a_failure(tmp_path):
    bench_ppo = load_bench_ppo()
    lanes = bench_ppo.Lanes(2, tmp_path)
    job = "import sys, time, os; open(sys.argv[1], 'a').write(f'{time.time()} +1\\n'); time.sleep(1); " \
          "open(sys.argv[1], 'a').write(f'{time.time()} -1\\n'); print(os.environ.get('OMP_NUM_THREADS'))"
    events = tmp_path / "events"
    with bench_ppo.ThreadPoolExecutor(5) as pool:
        list(pool.map(lambda i: lanes.run(f"j{i}", [bench_ppo.sys.executable, "-c", job, str(events)]), range(5)))
    running, most = 0, 0
    for _, delta in sorted((float(t), int(d)) for t, d in (line.split() for line in events.read_text().splitlines())):
        running += delta
        most = max(most, running)
    assert most == 2 and running == 0  # two at a time, all five ran
    assert (tmp_path / "j3.out").read_text().strip() == "1"  # one torch thread per lane
    with pytest.raises(RuntimeError, match="j9 failed \\(exit 3\\); its output: .*j9.out"):
        lanes.run("j9", [bench_ppo.sys.executable, "-c", "raise SystemExit(3)"])


# A claims run at the smallest size that still runs every step: it checks the report's shape, never the outcomes.
# The counts are small (one PPO state, two states and one seed of J_step, one MLAB step of at most 32 tokens, C7's
# two rounds for a slope), the SFT model is small (32 wide, 512 tokens, 1,024-token rows), the Orchestrator's
# training is test_orchestrator.py's end-to-end size (no other task's tree, one execution per Sub-Agent), and the
# evaluations run in their own process (--workers 1).
MICRO = dict(tasks=["digits", "synth-regression-0"], few_tasks=1, trajectories=1, sft_seeds=(0,),
             sft=["--epochs", "1", "--eval-parse", "0", "--max-len", "1024", "--scratch-hidden", "32",
                  "--scratch-vocab", "512"], unseen_states=2,
             ppo=["--iterations", "1", "--batch-size", "1", "--max-new-tokens", "32"], objective_states=2,
             objective_seeds=1,
             eval=["--k", "1", "--max-steps", "1", "--max-tokens", "32", "--workers", "1"], eval_tasks=["wine"],
             orch_task="breast-cancer",
             orch=["--iterations", "1", "--depth", "1", "--sub-iters", "1", "--imitation-steps", "20", "--tree-tasks",
                   "0"], c7_rounds=2, c8_tasks=["wine"])


# The Matryoshka evaluations' sizes are not the preset's (C7 and C8 take only its tasks and rounds): the test appends
# them to those two steps' commands (the last flag wins), the same least sizes as above.
SMALLER = {"eval-context": ["--sub-iters", "1", "--workers", "1"],
           "eval-orchestrator": ["--sub-iters", "1", "--max-tokens", "64", "--workers", "1"]}


@pytest.mark.slow
def test_claims_run_end_to_end_writes_every_claim_and_resumes(tmp_path, monkeypatch):
    step = bench.ClaimsRun.step
    monkeypatch.setattr(bench.ClaimsRun, "step", lambda self, name, script, *args, **kw: step(
        self, name, script, *args, *SMALLER.get(name, ()), **kw))
    result = bench.run_claims(MICRO, tmp_path, log=lambda *a: None)
    saved = json.loads((tmp_path / "claims.json").read_text())
    assert [c["claim"][:2] for c in saved["claims"]] == [f"C{i}" for i in range(1, 9)]
    for c in saved["claims"]:
        assert set(c) >= {"claim", "mirrors", "measured", "value", "holds"} and c["holds"] in (True, False, None)
        assert c["mirrors"] and c["measured"]
    table = (tmp_path / "claims.md").read_text()
    assert all(f"| C{i} " in table for i in range(1, 9))
    assert saved["claims"][0]["value"]["per_seed"]  # C1 measured a rate per seed
    assert set(saved["seconds"]) >= {"collect", "sft-0", "ppo-ppo", "ppo-episodic", "eval"}
    start = time.time()  # a second call finds every step done and every measurement kept
    again = bench.run_claims(MICRO, tmp_path, log=lambda *a: None)
    assert time.time() - start < 30 and again["claims"] == result["claims"]
