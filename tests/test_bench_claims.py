"""Tests for tests/bench_claims.py, the papers' claims in miniature (it checks the report's shape, never the outcomes):

- usage errors (an unknown flag, --lanes below one) exit 2 with one line and start nothing;
- independent steps run at once or in turn, each once, and a failure is raised after the others finished;
- the bootstrap interval brackets the mean and narrows with n; the power arithmetic; a claim is decided only by an
  interval clear of 0; bench_ppo.py pairs each variant against the first;
- a claims run at the smallest size runs every step, writes every claim C1-C8, and a rerun finds everything done
  (the steps' commands at their least sizes; how steps run, once each, in lanes, is the test of the second item).
"""
import importlib.util
import json
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
    spec = importlib.util.spec_from_file_location("bench_ppo", PATH.parent / "bench_ppo.py")
    bench_ppo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ppo)
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
