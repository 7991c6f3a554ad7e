"""The papers' claims in miniature (not collected by pytest): one command that measures C1-C8.

It runs the pipeline's own commands (collect.py, sft.py, ppo.py, orchestrator.py, eval.py) as subprocesses under
--out/work, each step once: a finished step leaves <step>.done, a killed one is started again from an empty folder,
so a killed run resumes at the step it was in. Steps that do not depend on each other (the three collections; the
SFT runs and the Matryoshka runs; the eight PPO runs; the two evaluations) run at once, one per CPU core with one
torch thread each (--lanes). Then it measures each claim and writes claims.json, claims.md and (with matplotlib)
c3_reward_vs_time.png and c7_context.png under --out. Every number comes with its uncertainty (a bootstrap over
states, runs or seeds) and "holds" says whether the miniature shows the paper's effect; nothing here is tuned to make
a claim hold. `estimate_objective` measures J_step (ML-Agent, arXiv:2505.23723, the step-wise objective) of a
checkpoint on a fixed sample of states; tests/bench_ppo.py uses it too. tests/RESULTS.md has the numbers.

  C1 SFT keeps the action format        ML-Agent, exploration-enriched fine-tuning
  C2 PPO beats SFT                      ML-Agent Table 1, Figure 3
  C3 step-wise beats episode-wise       ML-Agent Figure 3
  C4 more RL tasks help                 ML-Agent Figure 5
  C5 exploration-enriched data helps    ML-Agent Figures 4 and 7
  C6 each reward term matters           ML-Agent Table 3
  C7 the Orchestrator's context grows slowly   Matryoshka Agent Figure 2
  C8 a trained Orchestrator is better   Matryoshka Agent Table 1

  python tests/bench_claims.py              # the full run, under runs/claims
  python tests/bench_claims.py --quick      # the same steps at a small size: the report's shape, not the outcomes
  python tests/bench_claims.py --lanes 1    # one step at a time, with torch's default threads
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import agent  # noqa: E402
import env  # noqa: E402
import model  # noqa: E402
import ppo  # noqa: E402
import sft  # noqa: E402
from agent import write_atomic  # noqa: E402
from eval import task_bootstrap  # noqa: E402
from reward import OUTCOMES, RewardConfig  # noqa: E402

ROOT = env.ROOT
HELD_IN = [n for n, s in env.BUILTIN_TASKS.items() if s.split == "held-in"]
CLAIM_PRESETS = {
    # the full run: every held-in task, two SFT seeds, PPO for 16 iterations of 16 states (ppo.py's tiny defaults:
    # 4 samples each, the group baseline), J_step over 8 x 64 states, K = 2 on the held-out tasks; C8 on all of them.
    # J_step is cheap beside training; over 3 x 64 states its paired intervals were as wide as the effects they
    # measured (tests/RESULTS.md, "The claims"); C3's two policies over 24 x 64: at the spread of its 8 x 64 of
    # 2026-12-03, finding that mean needed more pairs than 8 x 64 (`power`; the numbers: RESULTS). Three trajectories a
    # task, as collect.py's default: with one, 5 SFT epochs were too few steps, and seed 0's model took invalid
    # actions in most held-out steps, so no held-out run moved (tests/RESULTS.md, 2026-12-07, the claims' full run)
    "full": dict(tasks=HELD_IN, few_tasks=4, trajectories=3, sft_seeds=(0, 1), sft=[], unseen_states=150,
                 ppo=["--iterations", "16"], objective_states=64, objective_seeds=8, c3_seeds=24,
                 eval=["--k", "2", "--max-steps", "8"], eval_tasks=[], orch_task="breast-cancer",
                 orch=["--iterations", "1", "--depth", "2"], c7_rounds=6,
                 c8_tasks=[n for n, s in env.BUILTIN_TASKS.items() if s.split == "held-out"]),
    # --quick: the same steps at a small size that shows the report's shape quickly, not the claims' outcomes
    "quick": dict(tasks=["digits", "churn", "synth-regression-0", "synth-classification-0", "synth-timeseries-0",
                         "synth-text-0"], few_tasks=2, trajectories=1, sft_seeds=(0,), sft=["--epochs", "2"],
                  unseen_states=40, ppo=["--iterations", "2", "--batch-size", "8"], objective_states=16,
                  objective_seeds=1, eval=["--k", "1", "--max-steps", "4"], eval_tasks=["energy", "loans"],
                  orch_task="breast-cancer",
                  orch=["--iterations", "1", "--depth", "1", "--imitation-steps", "200", "--tree-tasks", "1"],
                  c7_rounds=3, c8_tasks=["loans"]),
}


def bootstrap(values, n=2000, seed=0) -> dict:
    """The mean of `values` with a 95% percentile-bootstrap interval (resampling the values; paired values: pass
    their differences)."""
    import numpy as np
    x = np.asarray([v for v in values if v is not None], dtype=float)
    if len(x) == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    means = x[np.random.default_rng(seed).integers(0, len(x), (n, len(x)))].mean(axis=1)
    return {"mean": float(x.mean()), "lo": float(np.percentile(means, 2.5)), "hi": float(np.percentile(means, 97.5)),
            "n": int(len(x))}


class ClaimsRun:
    """The steps of one claims run under `out`/work, each run once (a .done marker) and logged to work/logs."""

    def __init__(self, preset: dict, out: Path, log=print, lanes=None):
        self.p, self.out, self.work, self.log = preset, Path(out), Path(out) / "work", log
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.seconds: dict = {}
        self.lanes = lanes or os.cpu_count() or 1  # independent steps run at once, one per core (`steps`)

    def path(self, *parts) -> str:
        return str(self.work.joinpath(*parts))

    def steps(self, *jobs):
        """Independent steps (name, script, args, owns), `lanes` at a time; with more than one lane each process gets
        one torch thread, so that the lanes do not oversubscribe the cores. Every step runs to its end before the
        first failure is raised."""
        lanes = max(min(self.lanes, len(jobs)), 1)
        with ThreadPoolExecutor(lanes) as pool:
            errors = [r.exception() for r in [pool.submit(self.step, name, script, *args, owns=owns,
                                                           threads=1 if lanes > 1 else 0)
                                               for name, script, args, owns in jobs]]
        if any(errors):
            raise next(e for e in errors if e)

    def step(self, name: str, script: str, *args, owns=(), threads=0):
        """Run `python script args` once; `owns` are the folders it writes, emptied before a (re)start; threads > 0
        sets the process's torch threads (OMP_NUM_THREADS)."""
        marker = self.work / f"{name}.done"
        if marker.exists():
            self.seconds[name] = json.loads(marker.read_text())["seconds"]
            return
        for path in map(Path, owns):  # only what this run made under work/
            if path.exists() and self.work.resolve() in path.resolve().parents:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        start = time.time()
        self.log(f"claims: {name}: python {script} {' '.join(map(str, args))}")
        with open(self.work / "logs" / f"{name}.log", "w") as f:
            done = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, stdout=f,
                                  stderr=subprocess.STDOUT,
                                  env={**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})})
        if done.returncode != 0:
            raise RuntimeError(f"claims step {name} failed (exit {done.returncode}); see {f.name}")
        self.seconds[name] = time.time() - start
        write_atomic(marker, json.dumps({"seconds": self.seconds[name]}))

    def measure(self, name: str, fn):
        """fn() once, its JSON result kept in work/<name>.json."""
        path = self.work / f"{name}.json"
        if path.exists():
            return json.loads(path.read_text())
        self.log(f"claims: measuring {name}")
        result = fn()
        write_atomic(path, json.dumps(result))
        return result


def estimate_objective(policy, states_path, n=64, seed=0, temperature=0.7, max_new_tokens=400, workers=2,
                       reward_config=RewardConfig(), device=None):
    """J_step of a policy checkpoint, estimated: one sampled action in each of n states of the pool (the same seeded
    states, in the same order, with the same sampling seed for every policy, so two policies compare state by state),
    executed and scored as in training. -> {mean_reward, frac_<kind>, rewards, kinds, edits, states}; edits: the
    edit instruction of each action that was an `Edit Script (AI)`, else None (the agent's action diversity,
    claim C5)."""
    states = ppo.load_states(states_path)
    picked = random.Random(f"objective:{seed}").sample(range(len(states)), min(n, len(states)))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lm, tokenizer = model.load(policy, device, torch.float32)
    cfg = ppo.Config(temperature=temperature, max_new_tokens=max_new_tokens, workers=workers, reward=reward_config)
    torch.manual_seed(seed)
    with ThreadPoolExecutor(workers) as pool:
        outcomes = ppo.step_rollout([states[i] for i in picked], lm, tokenizer, cfg, pool, env.recipe_editor,
                                    device, lambda name: None)[3]
    rewards, kinds = [o["reward"] for o in outcomes], [o["kind"] for o in outcomes]
    return {"mean_reward": sum(rewards) / len(rewards), "rewards": rewards, "kinds": kinds, "states": picked,
            "edits": [o["edit"] for o in outcomes],
            **{f"frac_{k}": kinds.count(k) / len(kinds) for k in OUTCOMES}}


def _parse_rate(ckpt: str, rows: list) -> dict:
    lm, tok = model.load(ckpt, "cpu")
    ok, same = sft.parse_rate(lm, tok, rows, 512)
    return {"parse_rate": ok, "same_action": same, "states": len(rows)}


def _distinct_ideas(data: str) -> dict:
    """Exploration in a data set (ML-Agent Figures 4, 7): distinct edit instructions per trajectory and in all."""
    trajs = agent.read_jsonl(Path(data) / "trajectories.jsonl", complete_only=True)
    edits = [[s["action_input"].get("edit_instruction") for s in t["steps"]
              if s["action"] == "Edit Script (AI)" and isinstance(s["action_input"], dict)] for t in trajs]
    return {"per_trajectory": [len(set(e)) for e in edits], "distinct": len({i for e in edits for i in e}),
            "trajectories": len(trajs)}


Z_POWER = 1.96 + 0.84  # a two-sided test at 5% finds an effect of Z_POWER standard errors 80% of the time


def power(units) -> dict:
    """What a paired comparison over these units (numbers, or each task's list of runs, averaged per task) can
    detect: the smallest effect found 80% of the time at 5%, and how many units the observed mean would need."""
    import numpy as np
    x = np.array([np.mean(u) if isinstance(u, list) else u for u in units if u is not None and u != []], dtype=float)
    if len(x) < 2 or x.std(ddof=1) == 0:
        return {"detectable": None, "units_needed": None}
    sd, mean = x.std(ddof=1), x.mean()
    return {"detectable": float(Z_POWER * sd / len(x) ** 0.5),
            "units_needed": int(np.ceil((Z_POWER * sd / mean) ** 2)) if mean else None}


def _group(report: dict, path: str) -> dict:
    return next(g for g in report["groups"] if g["policy_path"] == path)


def _gain(report: dict, path: str) -> dict:
    """eval.py's measure of a policy on the held-out tasks: the clipped gain, its interval resampling tasks."""
    o = _group(report, path)["overall"]
    return {"mean": o["gain_clipped"], "lo": o["gain_clipped_ci"][0], "hi": o["gain_clipped_ci"][1], "n": o["runs"]}


def _gain_diff(report: dict, a: str, b: str) -> dict:
    """b - a of the clipped gains on the held-out tasks, paired by (task, run) as eval.py's report pairs them, with
    the interval resampling tasks and the power over tasks."""
    diffs = [[y - x for x, y in zip(ta["gains_clipped"], tb["gains_clipped"])]
             for ta, tb in zip(_group(report, a)["tasks"], _group(report, b)["tasks"])]
    mean, lo, hi = task_bootstrap(diffs)
    return {"mean": mean, "lo": lo, "hi": hi, "n": sum(map(len, diffs)), **power(diffs)}


def _decided(*diffs) -> bool | None:
    """True when every interval is above 0, False when one is below, None (undecided) otherwise."""
    if any(d["mean"] is None or d["hi"] < 0 for d in diffs):
        return None if any(d["mean"] is None for d in diffs) else False
    return True if all(d["lo"] > 0 for d in diffs) else None


def _claim(name, mirrors, what, value, holds, **more) -> dict:
    return {"claim": name, "mirrors": mirrors, "measured": what, "value": value, "holds": holds, **more}


def _gt(a: dict, b: dict) -> bool | None:
    """a's mean above b's, with a's interval clear of b's mean (None when either is missing)."""
    if a["mean"] is None or b["mean"] is None:
        return None
    return a["mean"] > b["mean"] and a["lo"] > b["mean"]


def run_claims(preset: dict, out: Path, log=print, lanes=None) -> dict:
    """Every step and measurement of the claims run (resumable), then claims.json, claims.md and the plots; lanes:
    how many independent steps run at once (None: one per CPU core)."""
    with agent.claim_folder(out):  # one claims run per --out
        return _run_claims(preset, Path(out), log, lanes)


def _run_claims(preset: dict, out: Path, log, lanes) -> dict:
    R, p = ClaimsRun(preset, out, log, lanes), preset
    data, data1, unseen = R.path("data"), R.path("data-k1"), R.path("unseen")
    tasks = ["--tasks", *p["tasks"], "--trajectories", p["trajectories"]]
    # the steps, each run once; those in one R.steps(...) are independent and run at once, a core each.
    # The data: exploration-enriched (the diversity filter keeps 10 ideas per category), one idea per category
    # (C5's "without exploration"), and trajectories of another seed whose states SFT never sees (C1)
    R.steps(("collect", "collect.py", [*tasks, "--out", data], [data]),
            ("collect-k1", "collect.py", [*tasks, "--k", 1, "--out", data1], [data1]),
            ("collect-unseen", "collect.py", [*tasks, "--seed", 1, "--out", unseen], [unseen]))
    sft_ckpt = {s: R.path(f"sft-{s}") for s in p["sft_seeds"]}
    sft0, sft1 = sft_ckpt[p["sft_seeds"][0]], R.path("sft-k1")
    # PPO from the same SFT model: step-wise (C2), episode-wise (C3: the same group baseline, over 4 episodes of a
    # task start instead of 4 actions in a state, and at most the same actions per update), few tasks (C4), the
    # reward ablations (C6), and from the SFT model of the less diverse data (C5)
    runs = {"ppo": [], "episodic": ["--episodic"], "few": ["--tasks", p["few_tasks"]],
            "binary": ["--binary-performance"], "no-format": ["--no-format-term"], "no-corner": ["--no-corner-term"]}
    ppo_ckpt = {name: R.path(f"ppo-{name}") for name in [*runs, "k1", "episodic-time"]}  # the actors (base names
    policies = {"sft": sft0, **ppo_ckpt, "sft-k1": sft1}                               # label eval's policies)
    orch, ev, ev7, ev8 = R.path("orch"), R.path("eval"), R.path("eval-context"), R.path("eval-orchestrator")
    R.steps(*[(f"sft-{s}", "sft.py", ["--data", f"{data}/sft.jsonl", "--out", c, "--seed", s, *p["sft"]], [c])
              for s, c in sft_ckpt.items()],
            ("sft-k1", "sft.py", ["--data", f"{data1}/sft.jsonl", "--out", sft1, *p["sft"]], [sft1]),
            # the Matryoshka runs (C7, C8) need none of the above
            ("orchestrator-train", "orchestrator.py", ["train", "--task", p["orch_task"], "--out", orch, *p["orch"]],
             [orch]),
            # C7 on energy: the context's growth does not depend on the task, and the monolithic chat's stacked
            # scripts run several times longer on loans (tests/RESULTS.md, "bench_claims.py: C7's task")
            ("eval-context", "eval.py", ["--scaffold", "matryoshka", "monolithic", "--policy", "scripted", "--tasks",
                                         p["eval_tasks"][0] if p["eval_tasks"] else "energy", "--k", "1", "--rounds",
                                         p["c7_rounds"], "--out", ev7, "--no-plots"], [ev7]))
    R.steps(*[(f"ppo-{name}", "ppo.py", ["--model", start, "--states", f"{states}/states.jsonl", "--out",
                                         ppo_ckpt[name], "--log-file", f"{ppo_ckpt[name]}.jsonl", *p["ppo"], *extra],
               [ppo_ckpt[name], f"{ppo_ckpt[name]}.jsonl"])
              for name, (start, states, extra) in {**{k: (sft0, data, v) for k, v in runs.items()},
                                                   "k1": (sft1, data1, [])}.items()])
    # C3 at equal time: episode-wise for as many iterations as fit in the step-wise run's training seconds
    secs = {k: [r["time_total"] for r in agent.read_jsonl(Path(f"{ppo_ckpt[k]}.jsonl"), complete_only=True)]
            for k in ("ppo", "episodic")}
    equal_time = max(1, round(sum(secs["ppo"]) / (sum(secs["episodic"]) / len(secs["episodic"]))))
    if equal_time == len(secs["episodic"]):  # the episode-wise run itself
        ppo_ckpt["episodic-time"] = policies["episodic-time"] = ppo_ckpt["episodic"]
    else:
        R.steps(("ppo-episodic-time", "ppo.py", ["--model", sft0, "--states", f"{data}/states.jsonl", "--out",
                                                 ppo_ckpt["episodic-time"], "--log-file",
                                                 f"{ppo_ckpt['episodic-time']}.jsonl", *p["ppo"], "--episodic",
                                                 "--iterations", equal_time],
                 [ppo_ckpt["episodic-time"], f"{ppo_ckpt['episodic-time']}.jsonl"]))
    # held-out evaluation of every policy (Δr avg@K), and of the Orchestrator before and after tree training
    R.steps(("eval", "eval.py", ["--policy", *[policies[k] for k in ("sft", "ppo", "few", "k1", "sft-k1")], "--out", ev,
                                 *(["--tasks", *p["eval_tasks"]] if p["eval_tasks"] else []), *p["eval"], "--no-plots"],
             [ev]),
            ("eval-orchestrator", "eval.py", ["--scaffold", "matryoshka", "--policy", f"{orch}/train/ckpt-0",
                                              f"{orch}/train/ckpt-1", "--sub-agent", "scripted", "--tasks",
                                              *p["c8_tasks"], "--k", "1", "--rounds", p["c7_rounds"], "--out", ev8,
                                              "--no-plots"], [ev8]))

    # measurements
    seen = {json.dumps(r["messages"]) for r in agent.read_jsonl(Path(data) / "sft.jsonl", complete_only=True)}
    unseen_rows = [r for r in agent.read_jsonl(Path(unseen) / "sft.jsonl", complete_only=True)
                   if json.dumps(r["messages"]) not in seen][: p["unseen_states"]]  # states SFT never trained on
    c1 = {s: R.measure(f"parse-sft-{s}", lambda c=c: _parse_rate(c, unseen_rows)) for s, c in sft_ckpt.items()}
    # J_step of each policy: objective_seeds fresh samples of objective_states states, the same for every policy
    # (C3's policies over more seeds: their first seeds are every policy's, so pairs with the others stay in order)
    c3 = {"step-wise": "ppo", "episode-wise": "episodic", "episode-wise, equal time": "episodic-time"}
    obj = {k: [R.measure(f"objective-{k}-{s}", lambda c=c, s=s: estimate_objective(
        c, f"{data}/states.jsonl", n=p["objective_states"], seed=s))
        for s in range(p.get("c3_seeds", p["objective_seeds"]) if k in c3.values() else p["objective_seeds"])]
        for k, c in policies.items() if k != "sft-k1"}
    # the agent's action diversity (ML-Agent Figure 7): distinct edit instructions among its actions in each seed's
    # states (runs before the "edits" key have none)
    acted = {k: {"per_seed": bootstrap([len({e for e in x.get("edits", []) if e}) for x in obj[k]]),
                 "edits": sum(1 for x in obj[k] for e in x.get("edits", []) if e)} for k in ("ppo", "k1")}
    obj = {k: {"rewards": [r for x in v for r in x["rewards"]]} for k, v in obj.items()}
    for v in obj.values():
        v["mean_reward"] = sum(v["rewards"]) / len(v["rewards"])
    report = json.loads((Path(ev) / "report.json").read_text())
    gain = {k: _gain(report, policies[k]) for k in ("sft", "ppo", "few", "k1")}
    div = {"with ideas": _distinct_ideas(data), "one idea per category": _distinct_ideas(data1)}
    logs = {k: agent.read_jsonl(Path(f"{ppo_ckpt[run]}.jsonl"), complete_only=True) for k, run in c3.items()}

    def diff(a, b):  # J_step a - b, paired by (seed, state), with its power over pairs
        d = [x - y for x, y in zip(obj[a]["rewards"], obj[b]["rewards"])]
        return {**bootstrap(d), **power(d)}
    corner = {k: bootstrap([r["frac_corner"] for r in agent.read_jsonl(f"{ppo_ckpt[k]}.jsonl", complete_only=True)])
              ["mean"] for k in ("ppo", "binary", "no-format", "no-corner")}  # corner cases' share of training actions
    terms = ["binary", "no-format"] + (["no-corner"] if corner["ppo"] else [])  # C6's reachable terms
    held_out = lambda a, b: _gain_diff(report, policies[a], policies[b])  # noqa: E731
    rep8 = json.loads((Path(ev8) / "report.json").read_text())
    ranks = {Path(g["policy_path"]).name: bootstrap([t["human_rank_avg"] for t in g["tasks"]])
             for g in rep8["groups"]}
    ctx: dict = {}  # scaffold -> the prompt tokens per round of each run (runs.jsonl keeps them; report.json not)
    for r in agent.read_jsonl(Path(ev7) / "runs.jsonl", complete_only=True):
        ctx.setdefault(r["scaffold"], []).append(r["context"])
    slope = lambda cs: bootstrap([(c[-1] - c[0]) / (len(c) - 1) for c in cs if len(c) > 1])  # noqa: E731

    rates = {s: r["parse_rate"] for s, r in c1.items()}
    claims = [
        _claim("C1 SFT keeps the action format", "ML-Agent §Exploration-enriched fine-tuning",
               f"valid-action rate of greedy SFT responses on {len(unseen_rows)} states of unseen trajectories, "
               "per seed", {"per_seed": rates, "seeds": bootstrap(list(rates.values()))},
               bool(unseen_rows) and min(rates.values()) >= 0.9, aim="at least 90% for every seed"),
        _claim("C2 PPO beats SFT", "ML-Agent Table 1, Figure 3",
               "clipped gain on the held-out tasks, PPO - SFT paired by (task, run) (eval.py's report; decides), and "
               f"the mean step reward on {p['objective_seeds']} x {p['objective_states']} held-in states (paired)",
               {"gain": {k: gain[k] for k in ("sft", "ppo")}, "gain_ppo_minus_sft": held_out("sft", "ppo"),
                "step_reward": {k: obj[k]["mean_reward"] for k in ("sft", "ppo")},
                "step_reward_ppo_minus_sft": diff("ppo", "sft")},
               _decided(held_out("sft", "ppo"))),
        _claim("C3 step-wise beats episode-wise", "ML-Agent Figure 3",
               "mean step reward on the held-in states (paired) after the same iterations with at most the same "
               "actions per update, and after the episode-wise run's iterations that fit the step-wise seconds; the "
               "training reward against wall time (plot); decided by the equal-iteration difference",
               {"step_reward": {k: obj[run]["mean_reward"] for k, run in c3.items()},
                "stepwise_minus_episodic": diff("ppo", "episodic"),
                "stepwise_minus_episodic_equal_time": diff("ppo", "episodic-time"),
                "seconds": {k: sum(r["time_total"] for r in v) for k, v in logs.items()},
                "iterations": {k: len(v) for k, v in logs.items()}},
               _decided(diff("ppo", "episodic"))),
        _claim("C4 more RL tasks help", "ML-Agent Figure 5",
               f"clipped gain on the held-out tasks after PPO on 0 (the SFT model), {p['few_tasks']} and "
               f"{len(p['tasks'])} held-in tasks, each step paired by (task, run); undecided where an interval holds "
               "0 (its detectable effect beside it)",
               {"0": gain["sft"], str(p["few_tasks"]): gain["few"], str(len(p["tasks"])): gain["ppo"],
                "few_minus_sft": held_out("sft", "few"), "all_minus_few": held_out("few", "ppo")},
               _decided(held_out("sft", "few"), held_out("few", "ppo"))),
        _claim("C5 exploration-enriched data helps", "ML-Agent Figures 4 and 7",
               f"distinct edit instructions among the RL agent's actions in each seed's {p['objective_states']} "
               "held-in states (the same states for both), and Δr avg@K after RL, from the data of the diverse idea "
               "pool and of one idea per category; the distinct ideas in the two data sets",
               {"agent_diversity": {"with ideas": acted["ppo"], "one idea per category": acted["k1"]},
                "gain": {"with ideas": gain["ppo"], "one idea per category": gain["k1"]},
                "data_diversity": {k: {"distinct": v["distinct"], "per_trajectory": bootstrap(v["per_trajectory"])}
                                   for k, v in div.items()}},
               bool(_gt(acted["ppo"]["per_seed"], acted["k1"]["per_seed"])) and bool(_gt(gain["ppo"], gain["k1"]))),
        _claim("C6 each reward term matters", "ML-Agent Table 3",
               "mean step reward (full reward) on the held-in states after PPO with the full reward and with each "
               "ablation (full - ablation, paired); the share of corner cases among each run's training actions: "
               "without any, the no-corner run is the full run and its term is not reachable here (left out)",
               {**{k: diff("ppo", k) for k in terms}, "corner_share": corner,
                **({} if "no-corner" in terms else {"no-corner": "not reachable: no corner case in training"})},
               _decided(*[diff("ppo", k) for k in terms])),
        _claim("C7 the Orchestrator's context grows slowly", "Matryoshka Figure 2",
               "prompt tokens added per round: the Orchestrator against the monolithic agent's chat",
               {k: slope(v) for k, v in ctx.items()},
               None if slope(ctx.get("matryoshka", []))["mean"] is None or slope(ctx.get("monolithic", []))["mean"] is None
               else slope(ctx["matryoshka"])["mean"] < slope(ctx["monolithic"])["mean"]),
        _claim("C8 a trained Orchestrator is better", "Matryoshka Table 1",
               "HumanRank on held-out tasks of the tree-trained Orchestrator (ckpt-1) against the same model before "
               "tree training (ckpt-0), scripted Sub-Agents", ranks,
               None if len(ranks) < 2 else bool(ranks.get("ckpt-1", {}).get("mean", 0) > ranks.get("ckpt-0", {}).get("mean", 0))),
    ]
    result = {"date": time.strftime("%Y-%m-%d"), "preset": p, "seconds": R.seconds, "claims": claims,
              "reward_config": "full reward unless the claim says otherwise (reward.py defaults)"}
    write_atomic(Path(out) / "claims.json", json.dumps(result, indent=1))
    write_atomic(Path(out) / "claims.md", claims_markdown(result))
    result["plots"] = claims_plots(Path(out), logs, ctx)
    return result


def _v(x) -> str:
    if isinstance(x, dict) and "mean" in x:
        return "-" if x["mean"] is None else (f"{x['mean']:+.4f} [{x['lo']:+.4f}, {x['hi']:+.4f}] (n={x['n']}"
                                              + (f"; detectable {x['detectable']:.4f}, needs n={x['units_needed']}"
                                                 if x.get("detectable") is not None else "") + ")")
    if isinstance(x, dict):
        return "; ".join(f"{k}: {_v(v)}" for k, v in x.items())
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def claims_markdown(result: dict) -> str:
    lines = [f"# The papers' claims in miniature ({result['date']})", "",
             "Means with 95% bootstrap intervals [lo, hi]; n = states, runs or seeds resampled.", "",
             "| claim | mirrors | measured | value | holds |", "|---|---|---|---|---|"]
    for c in result["claims"]:
        holds = {True: "yes", False: "no", None: "undecided"}[c["holds"]]
        lines.append(f"| {c['claim']} | {c['mirrors']} | {c['measured']} | {_v(c['value'])} | {holds} |")
    lines += ["", "Step seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result["seconds"].items())]
    return "\n".join(lines) + "\n"


def claims_plots(out: Path, logs: dict, ctx: dict) -> list[str]:
    """c3_reward_vs_time.png (training reward against wall time), c7_context.png; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, log in logs.items():
        t = [sum(r["time_total"] for r in log[: i + 1]) for i in range(len(log))]
        ax.plot(t, [r["reward"] for r in log], marker="o", ms=3, label=name)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("mean training step reward")
    ax.set_title("Step-wise against episode-wise PPO (ML-Agent Fig. 3)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "c3_reward_vs_time.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, cs in ctx.items():
        for c in cs:
            ax.plot(range(1, len(c) + 1), c, marker="o", ms=3, label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("prompt tokens")
    ax.set_title("Context growth (Matryoshka Fig. 2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "c7_context.png", dpi=120)
    plt.close(fig)
    return ["c3_reward_vs_time.png", "c7_context.png"]


def main(argv=None) -> None:
    p = agent.Parser(prog="bench_claims.py", description="Measure the papers' claims in miniature (runs/claims).")
    p.add_argument("--quick", action="store_true", help="a small run that shows the report's shape, not the claims")
    p.add_argument("--out", default=str(ROOT / "runs/claims"), help="claims.json, claims.md and the plots")
    p.add_argument("--lanes", type=int, default=0, help="independent steps run at once, each with one torch thread "
                   "(default: one per CPU core; 1: one step at a time with torch's default threads)")
    args = p.parse_args(argv)
    if args.lanes < 0:
        p.error(f"--lanes must be at least 1, not {args.lanes}")
    try:
        result = run_claims(CLAIM_PRESETS["quick" if args.quick else "full"], Path(args.out), lanes=args.lanes or None)
    except RuntimeError as e:
        sys.exit(f"bench_claims.py: {e}")
    except ValueError as e:  # --out a file or in use
        p.error(str(e))
    print(claims_markdown(result))
    print(f"wrote {Path(args.out) / 'claims.json'}, {Path(args.out) / 'claims.md'}"
          + "".join(f", {Path(args.out) / n}" for n in result["plots"]))


if __name__ == "__main__":
    main()
