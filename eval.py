"""Evaluation as the papers report it: a scaffold with a policy, K seeded runs on each held-out task, and per task
m_init, avg@K and best@K of the private score, the performance gain, HumanRank, the valid-submission rate, tokens and
cost per trajectory; a JSON report, a Markdown table and (with matplotlib) the plots.

Reading order: config -> the two metrics (`performance_gain`, `human_rank`) -> policies and backends -> one run per
scaffold (MLAB research agent, Matryoshka, monolithic) -> the resumable run log -> aggregation -> report and plots ->
command line.

What comes from where:
- Performance gain (ML-Agent, arXiv:2505.23723, §Experiments "Testing"): Delta_r = beta * (m_avg@K - m_init) / m_init, beta = -1 when lower
  is better, K = 8, m_init the starter script's score. We divide by |m_init| so the sign stays right for a negative
  m_init (identical for the positive metrics of the built-in tasks). All scores here are PRIVATE-part scores: the
  final train.py of every run is re-run in the sandbox (env.run_script, cached) and graded on the hidden rows.
- HumanRank (Matryoshka Agent, arXiv:2607.25090, App. A Eq. 5): s = 1 - p / N, p the leaderboard entries strictly better than the
  submission, N the leaderboard size (the agent not counted); an invalid submission scores 0. The paper's review asks
  for the tie rule: a tie is not "strictly better", so a submission tied with entry k ranks with it. The built-in
  tasks' leaderboards are reference panels of scikit-learn pipelines (env.py), not human Kaggle entries.
- Failed runs count (a run that fails is not dropped from avg@K). A run that crashes, or whose final train.py has no valid submission, keeps its place
  among the K runs: it is invalid (valid rate; HumanRank 0, as MLE-bench gives an invalid submission no medal) and
  scores FAILED_RUN_SCORE = m_init in avg@K and best@K, i.e. no improvement. The papers are silent here; our reason:
  the MLAB workspace starts from a working starter, so "no improvement" is the neutral outcome of an attempt that
  fails, as in MLAgentBench's success rate (Huang et al. 2023), which credits a run only when its final submission
  beats the baseline. Dropping the run would reward failures; scoring it as the leaderboard's worst entry would
  punish them by the spread of the leaderboard rather than by the task's baseline.
- Where ML-Agent's test prompt has no injected ideas, the offline scripted expert needs an idea plan to do anything:
  `--ideas sampled` (default) draws 1-3 ideas from the task's offline recipe pool per run, seeded by (seed, task, run)
  and so the same for every policy; `--ideas none` is the paper's test prompt.
- Sampling temperature 0.7 (the papers give none for testing; summarize_from_feedback_details samples at 0.7), so that
  the K runs differ; each run seeds `random` and torch with its own seed, so runs go several at once (--workers, one
  process each; default one per CPU core) and give what they give one at a time (tests/test_eval.py).

Matryoshka and the monolithic baseline run through orchestrator.py (run_matryoshka, run_monolithic) with its budgets
(rounds x tool calls x Sub-Agent iterations); their submission is the best attempt by public score, which may be the
starter, so their runs also record `valid_attempts`. Context growth is the Orchestrator's prompt per round against the
monolithic chat's prompt per execution (Matryoshka Agent, arXiv:2607.25090, App. F). Besides agent, orchestrator and
env, this file imports collect.py, a lower file, for the offline idea pools and its append-only JSONL helpers.

Offline stand-ins (labelled in agent.py / orchestrator.py): the scripted expert, the scripted Orchestrator and the
recipe Sub-Agent; `Edit Script (AI)` uses env.py's recipe editor for scripted and local-checkpoint policies (as
ppo.py trains them) and the policy itself for endpoint models (MLAB).

Run:  python eval.py      (offline, after collect/sft/ppo: scripted expert + runs/ckpt/sft + runs/ckpt/ppo if present,
                           MLAB scaffold, held-out built-in tasks, K=2, 8 steps: minutes on a CPU)
      python eval.py --k 8 --max-steps 15                            (the paper's K and step budget)
      python eval.py --scaffold matryoshka monolithic --tasks wine   (Matryoshka against its monolithic baseline)
      OPENAI_API_KEY=... python eval.py --policy gpt-4o-mini --price-in 0.15 --price-out 0.6 --split held-in
      python eval.py claims [--quick] [--lanes N]   (the papers' claims C1-C8 in miniature, under runs/claims;
                                         the section "the claims" below says how each is measured)
Outputs under --out (default runs/eval): runs.jsonl (one finished run per line; a restart skips them), report.json,
report.md, and gain_vs_cost.png, ppo_reward.png, context_growth.png when matplotlib is installed.
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import agent
import collect
import env
import orchestrator

ROOT = env.ROOT
SCAFFOLDS = ("mlab", "matryoshka", "monolithic")
FAILED_RUN_SCORE = "m_init"  # what a run without a valid submission scores in avg@K / best@K (module docstring)


@dataclass
class Config:
    scaffolds: list = field(default_factory=lambda: ["mlab"])  # mlab | matryoshka | monolithic
    policies: list = field(default_factory=list)  # "scripted", checkpoint folders, endpoint models; [] = what exists
    sub_agent: str | None = None  # Matryoshka's Sub-Agent backend; None: the policy itself
    tasks: list = field(default_factory=list)  # built-in names or task folders; [] = the built-in tasks of `split`
    split: str = "held-out"  # held-out | held-in | all
    k: int = 2  # runs per task (paper: 8)
    max_steps: int = 8  # MLAB steps per trajectory (paper: 15)
    time_limit: float = 1800.0  # seconds per trajectory (paper: 30 minutes)
    temperature: float = 0.7  # sampling temperature of the policy (papers silent; N-details: 0.7)
    max_tokens: int | None = None  # tokens per response; None: MLAB 1024, Matryoshka 4096, <= 1/4 of a local context
    ideas: str = "sampled"  # sampled: 1-3 recipe ideas in the first prompt (offline); none: the paper's test prompt
    editor: str = "auto"  # auto | recipes | policy | an endpoint model: who executes Edit Script (AI)
    base_url: str | None = None  # OpenAI-compatible endpoint (default $OPENAI_BASE_URL)
    price_in: float = 0.0  # dollars per million prompt tokens (cost per trajectory)
    price_out: float = 0.0  # dollars per million completion tokens
    rounds: int = orchestrator.Config.rounds  # Matryoshka: Orchestrator rounds (monolithic: rounds x calls x iters)
    calls: int = orchestrator.Config.calls  # Matryoshka: tool calls per round
    sub_iters: int = orchestrator.Config.sub_iters  # Matryoshka: executions per Sub-Agent (the paper: 10)
    seed: int = 0  # base seed; run r of a task uses seed * 100003 + r
    out: str = str(ROOT / "runs/eval")  # runs.jsonl, report.json, report.md, plots
    ppo_log: str = str(ROOT / "runs/ppo/log.jsonl")  # ppo.py's log, one line per iteration (its "reward" field)
    plots: bool = True  # write PNG plots when matplotlib is installed
    threads: int = 1  # torch CPU threads of a local checkpoint (tiny-model decoding: fastest single-threaded when busy)
    workers: int = 0  # runs at once, each in its own process; 0: one per CPU core (at most 4), 1 on CUDA with a
                      # local checkpoint (each worker loads its own copy); 1: every run in this process

# ============================================================================================== the two metrics


def performance_gain(m_avg, m_init, higher_is_better) -> float:
    """ML-Agent's Delta_r = beta * (m_avg - m_init) / |m_init|, beta = +1 if higher is better else -1."""
    if m_init == 0:
        raise ValueError("m_init is 0: the relative gain is undefined")
    beta = 1.0 if higher_is_better else -1.0
    return beta * (m_avg - m_init) / abs(m_init) + 0.0  # + 0.0: no "-0.00%" when nothing changed


def human_rank(score, leaderboard_scores, higher_is_better) -> float:
    """Matryoshka's HumanRank s = 1 - p / N: p entries strictly better than `score`, N entries; None (invalid) -> 0."""
    board = [float(s) for s in leaderboard_scores]
    if not board:
        raise ValueError("an empty leaderboard has no HumanRank")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return 0.0
    p = sum(s > score if higher_is_better else s < score for s in board)
    return 1.0 - p / len(board)

# ================================================================================================ policies


def policy_label(name: str) -> str:
    return Path(name).name if os.path.isdir(name) else name


def policy_id(name: str) -> str:
    """The policy as it is now: a checkpoint folder includes its files' sizes and times, so retraining invalidates."""
    if not os.path.isdir(name):
        return name
    stamp = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(name).iterdir() if p.is_file())
    return f"{Path(name).resolve()}@{hashlib.sha256(repr(stamp).encode()).hexdigest()[:12]}"


def default_policies() -> list[str]:
    """The scripted expert, and the quick pipeline's checkpoints where they exist."""
    return ["scripted"] + [str(p) for p in (ROOT / "runs/ckpt/sft", ROOT / "runs/ckpt/ppo") if p.is_dir()]


_BACKENDS: dict = {}  # built once: a local checkpoint loads once for all its runs and roles


def get_backend(name: str, role: str, cfg: Config):
    """role: "agent" (MLAB), "orchestrator" or "sub-agent" (Matryoshka; the monolithic coder is a sub-agent). Only
    the offline stand-ins differ by role; a model serves every role from one backend."""
    key = (name, role if name == "scripted" else "model")
    if key not in _BACKENDS:
        if os.path.isdir(name) and cfg.threads > 0:
            import torch
            torch.set_num_threads(cfg.threads)
        if role == "agent":
            b = agent.make_backend(name, cfg.base_url, cfg.price_in, cfg.price_out)
        else:
            b = orchestrator.make_backend(name, cfg.base_url, role, cfg.seed)
            b.usage.price_in, b.usage.price_out = cfg.price_in, cfg.price_out
        _BACKENDS[key] = b
    return _BACKENDS[key]


def make_editor(cfg: Config, policy: str, backend):
    """Who executes Edit Script (AI): see Config.editor and the module docstring."""
    if cfg.editor == "recipes" or (cfg.editor == "auto" and (policy == "scripted" or os.path.isdir(policy))):
        return env.recipe_editor
    return agent.LLMEditor(backend if cfg.editor in ("auto", "policy") else get_backend(cfg.editor, "agent", cfg))


def usage_of(backends) -> dict:
    """Summed usage counters of distinct backends (a snapshot; runs take differences)."""
    seen = {id(b): b for b in backends}.values()
    return {k: sum(getattr(b.usage, k) for b in seen) for k in ("calls", "prompt_tokens", "completion_tokens")} | \
        {"cost": sum(b.usage.cost for b in seen)}


def seed_everything(seed: int):
    """Python's and torch's global generators (a local checkpoint samples with torch's). torch is imported here even
    before the first checkpoint loads: its generator starts from a different seed in every process (torch 2.13), so
    an unseeded first run differed between two evaluations of the same checkpoint."""
    import torch
    random.seed(seed)
    torch.manual_seed(seed)

# ================================================================================================ one run


def starter_scores(task) -> dict:
    """m_init: the starter train.py run once in the sandbox, its public and private scores."""
    run = env.run_script(task, (task.public_dir / "train.py").read_text())
    return {"status": run.status, "public": run.score, "private": run.test_score}


def response_tokens(cfg: Config, scaffold: str, backend) -> int:
    """The scaffold's own default (agent.run_episode: 1024; orchestrator.Config: 4096, whole scripts), at most a
    quarter of a local model's context so that the prompt keeps the rest (the tiny models have 2048 positions)."""
    n = cfg.max_tokens or (1024 if scaffold == "mlab" else orchestrator.Config.max_tokens)
    lm = getattr(backend, "lm", None)
    return min(n, lm.config.max_position_embeddings // 4) if lm is not None and not cfg.max_tokens else n


def run_mlab(cfg: Config, policy: str, task, ideas) -> dict:
    """ML-Agent's scaffold: agent.run_episode, then the final train.py graded on the private rows."""
    backend = get_backend(policy, "agent", cfg)
    editor = make_editor(cfg, policy, backend)
    e = env.Env(task, editor=editor)
    before = usage_of([backend, getattr(editor, "backend", backend)])
    traj = agent.run_episode(e, backend, ideas, max_steps=cfg.max_steps, time_limit=cfg.time_limit,
                             temperature=cfg.temperature, max_tokens=response_tokens(cfg, "mlab", backend))
    after = usage_of([backend, getattr(editor, "backend", backend)])
    others = {k: v for k, v in e.files.items() if k != "train.py"}
    final = env.run_script(task, e.files["train.py"], files=others)  # cached when the agent ran it already
    tok = getattr(backend, "tokenizer", None)
    return {"submission": final.status, "public": final.score, "private": final.test_score,
            "steps": len(traj.steps), "stopped": traj.stopped, **{k: after[k] - before[k] for k in after},
            "context": [orchestrator.prompt_tokens(s.messages, tok) for s in traj.steps],
            "actions": [[s.action, s.kind, s.reward] for s in traj.steps]}  # what the agent did, step by step


def run_hierarchical(cfg: Config, scaffold: str, policy: str, task, seed: int) -> dict:
    """Matryoshka (the policy orchestrates, cfg.sub_agent or the policy codes) or its monolithic baseline (the policy
    codes alone). The submission is the best attempt by public score, as orchestrator.py picks it; that may be the
    starter (attempt 0), so `valid_attempts` counts the agent's own attempts with a valid submission."""
    if scaffold == "matryoshka":
        backends = [get_backend(policy, "orchestrator", cfg), get_backend(cfg.sub_agent or policy, "sub-agent", cfg)]
        if hasattr(backends[0], "rng"):  # the scripted Orchestrator samples with its own generator: seed it per run
            backends[0].rng.seed(seed)
    else:
        backends = [get_backend(policy, "sub-agent", cfg)]
    ocfg = orchestrator.Config(task=str(task.dir), rounds=cfg.rounds, calls=cfg.calls, sub_iters=cfg.sub_iters,
                               time_limit=cfg.time_limit, temperature=cfg.temperature, seed=seed,
                               max_tokens=min(response_tokens(cfg, scaffold, b) for b in backends))
    quiet = lambda *a, **k: None  # noqa: E731 - orchestrator.py logs each round; the eval prints one line per run
    before = usage_of(backends)
    if scaffold == "matryoshka":
        res, role = orchestrator.run_matryoshka(ocfg, *backends, out=None, log=quiet), "orchestrator"
    else:
        res, role = orchestrator.run_monolithic(ocfg, *backends, out=None, log=quiet), "monolithic"
    after = usage_of(backends)
    context: dict = {}  # round -> the largest prompt of that role in it (re-asks make longer prompts)
    for r in res["records"]:
        if r["role"] == role:
            context[r["round"]] = max(context.get(r["round"], 0), r["tokens"])
    best = res["best"]
    return {"submission": "success" if best["private"] is not None else "invalid_submission",
            "public": best["public"], "private": best["private"], "steps": len(res["attempts"]) - 1,
            "valid_attempts": sum(a["score"] is not None for a in res["attempts"][1:]),
            "stopped": "finish" if res["finished"] else "budget", **{k: after[k] - before[k] for k in after},
            "context": [context[k] for k in sorted(context)], "token_counter": res["token_counter"]}


def run_one(cfg: Config, scaffold: str, policy: str, task, r: int) -> dict:
    """One seeded run; an exception inside it is a failed run (recorded and counted), except an endpoint that
    cannot serve us at all (agent.BackendError), which stops the evaluation so that a restart retries the run."""
    seed = cfg.seed * 100003 + r
    ideas = []
    if scaffold == "mlab" and cfg.ideas == "sampled":  # the same draw for every policy: seeded by (seed, task, run)
        ideas = collect.sample_ideas(collect.recipe_ideas(task.name), random.Random(f"{cfg.seed}:{task.name}:{r}"))
    seed_everything(seed)
    start = time.time()
    row = {"scaffold": scaffold, "policy": policy_label(policy), "task": task.name, "run": r, "seed": seed,
           "ideas": [list(i) for i in ideas]}
    try:
        out = run_mlab(cfg, policy, task, ideas) if scaffold == "mlab" else \
            run_hierarchical(cfg, scaffold, policy, task, seed)
        row.update(status="ok", error=None, **out)
    except agent.BackendError:
        raise
    except Exception as e:  # noqa: BLE001 - the run failed; it counts as a failure, not dropped
        row.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0][:500], submission="failed",
                   public=None, private=None, steps=0, stopped="error", calls=0, prompt_tokens=0,
                   completion_tokens=0, cost=0.0, context=[])
    row["valid"] = row["submission"] == "success" and row["private"] is not None
    row["seconds"] = time.time() - start
    return row

# ========================================================================================= the resumable run log


def run_key(cfg: Config, scaffold: str, policy: str, task, r: int) -> str:
    """Everything that changes a run's outcome; a finished run with this key is skipped on restart."""
    what = {"scaffold": scaffold, "policy": policy_id(policy), "task": str(task.dir), "run": r, "seed": cfg.seed,
            "max_steps": cfg.max_steps, "time_limit": cfg.time_limit, "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens, "ideas": cfg.ideas, "editor": cfg.editor}
    if scaffold != "mlab":
        what.update(sub_agent=policy_id(cfg.sub_agent or policy), rounds=cfg.rounds, calls=cfg.calls,
                    sub_iters=cfg.sub_iters)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def read_runs(path: Path) -> dict:
    """key -> the record of each finished run; collect.py's reader cuts a torn last line (a kill mid-write)."""
    return {r["key"]: r for r in collect.read_jsonl(path, repair=True) if "key" in r}


def write_atomic(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

# ================================================================================================ aggregation


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def task_summary(task, m_init: dict, runs: list[dict]) -> dict:
    """avg@K, best@K, gains and HumanRank of one (scaffold, policy, task) from its K runs (failed ones included)."""
    higher, board = task.higher_is_better, [s for _, s in task.leaderboard()]
    init = m_init["private"]
    scores = [r["private"] if r["valid"] else init for r in runs]  # FAILED_RUN_SCORE: a failed run scores m_init
    avg = _mean(scores)
    best = (max if higher else min)(scores) if scores and None not in scores else None

    def gain(m):
        try:
            return performance_gain(m, init, higher) if m is not None and init is not None else None
        except ValueError:
            return None
    ranks = [human_rank(r["private"] if r["valid"] else None, board, higher) for r in runs] if board else []
    k = max(len(runs), 1)
    # what the MLAB agent did (runs.jsonl's "actions": [action, kind, reward] a step; other scaffolds have none):
    # the share of its steps that were invalid, and how often an Undo gave back an improvement it had made
    acted = [r["actions"] for r in runs if r.get("actions") is not None]
    steps = [a for actions in acted for a in actions]
    return {"task": task.name, "metric": task.metric, "higher_is_better": higher, "runs": len(runs),
            "m_init_public": m_init["public"], "m_init": init, "avg@K": avg, "best@K": best,
            "gain_avg": gain(avg), "gain_best": gain(best), "human_rank_avg": _mean(ranks),
            "human_rank_best": human_rank(best, board, higher) if board and best is not None else None,
            "valid_rate": sum(r["valid"] for r in runs) / k, "failed": sum(r["status"] == "failed" for r in runs),
            "tokens_per_traj": sum(r["prompt_tokens"] + r["completion_tokens"] for r in runs) / k,
            "cost_per_traj": sum(r["cost"] for r in runs) / k, "seconds_per_traj": sum(r["seconds"] for r in runs) / k,
            "steps_per_traj": sum(r["steps"] for r in runs) / k,
            "invalid_step_rate": sum(kind == "invalid" for _, kind, _ in steps) / len(steps) if steps else None,
            "undone_gains_per_traj": sum(a == "Undo Edit Script" and kind == "edit" and rew < 0
                                         for a, kind, rew in steps) / len(acted) if acted else None}


def overall(rows: list[dict]) -> dict:
    """The mean over tasks of each per-task number (the papers average per task, then over tasks)."""
    keys = ("gain_avg", "gain_best", "human_rank_avg", "human_rank_best", "valid_rate", "tokens_per_traj",
            "cost_per_traj", "seconds_per_traj", "steps_per_traj", "invalid_step_rate", "undone_gains_per_traj")
    return {"tasks": len(rows), "runs": sum(r["runs"] for r in rows), "failed": sum(r["failed"] for r in rows),
            **{k: _mean([r[k] for r in rows]) for k in keys}}

# ============================================================================================= report and plots


def _f(x, pct=False, digits=4):
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:+.2f}%"
    return f"{x:.0f}" if abs(x) >= 1e4 else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# Evaluation: {', '.join(c['scaffolds'])} on {len(report['tasks'])} task(s), K = {c['k']}", "",
             f"Private-part scores. Gain = beta (m - m_init) / |m_init| (ML-Agent); HumanRank = 1 - p/N against "
             f"private/leaderboard.csv (Matryoshka); a failed run scores m_init in avg@K/best@K and HumanRank 0. "
             f"MLAB steps {c['max_steps']}, ideas {c['ideas']}, temperature {c['temperature']}, seed {c['seed']}. "
             "Invalid steps: the share of the MLAB agent's steps that were not a valid action; undone gains: its Undo "
             "Edit Script steps that gave back an improvement, per run.", "",
             "## Overall (mean over tasks)", "",
             "| scaffold | policy | tasks | runs | failed | gain avg@K | gain best@K | HumanRank | valid | tokens/traj "
             "| $/traj | s/traj | invalid steps | undone gains/traj |", "|" + "---|" * 14]
    for g in report["groups"]:
        o = g["overall"]
        lines.append(f"| {g['scaffold']} | {g['policy']} | {o['tasks']} | {o['runs']} | {o['failed']} | "
                     f"{_f(o['gain_avg'], True)} | {_f(o['gain_best'], True)} | {_f(o['human_rank_avg'], digits=3)} | "
                     f"{_f(o['valid_rate'], digits=2)} | {_f(o['tokens_per_traj'], digits=0)} | "
                     f"{_f(o['cost_per_traj'])} | {_f(o['seconds_per_traj'], digits=1)} | "
                     f"{_f(o['invalid_step_rate'], digits=2)} | {_f(o['undone_gains_per_traj'], digits=2)} |")
    lines += ["", "## Per task", "", "| scaffold | policy | task | metric | m_init | avg@K | best@K | gain avg@K | "
              "gain best@K | HumanRank avg | HumanRank best | valid | runs |", "|" + "---|" * 13]
    for g in report["groups"]:
        for t in g["tasks"]:
            lines.append(f"| {g['scaffold']} | {g['policy']} | {t['task']} | {t['metric']} "
                         f"({'higher' if t['higher_is_better'] else 'lower'}) | {_f(t['m_init'])} | {_f(t['avg@K'])} | "
                         f"{_f(t['best@K'])} | {_f(t['gain_avg'], True)} | {_f(t['gain_best'], True)} | "
                         f"{_f(t['human_rank_avg'], digits=3)} | {_f(t['human_rank_best'], digits=3)} | "
                         f"{_f(t['valid_rate'], digits=2)} | {t['runs']} |")
    return "\n".join(lines) + "\n"


def plots(report: dict, runs: list[dict], cfg: Config) -> list[str]:
    """gain_vs_cost.png (ML-Agent Figure 2), ppo_reward.png, context_growth.png; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out, made = Path(cfg.out), []
    groups = [g for g in report["groups"] if g["overall"]["gain_avg"] is not None]
    if groups:  # cost per trajectory; offline every cost is 0, so tokens per trajectory stand in
        by_cost = any(g["overall"]["cost_per_traj"] for g in groups)
        fig, ax = plt.subplots(figsize=(6, 4))
        for g in groups:
            x = g["overall"]["cost_per_traj" if by_cost else "tokens_per_traj"]
            ax.scatter(x, 100 * g["overall"]["gain_avg"], s=60)
            ax.annotate(f"{g['policy']} ({g['scaffold']})", (x, 100 * g["overall"]["gain_avg"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("cost per trajectory ($)" if by_cost else "tokens per trajectory (all costs are 0)")
        ax.set_ylabel("performance gain avg@K (%)")
        ax.set_title("Performance gain against cost (ML-Agent Fig. 2)")
        fig.tight_layout()
        fig.savefig(out / "gain_vs_cost.png", dpi=120)
        plt.close(fig)
        made.append("gain_vs_cost.png")
    log = [r for r in collect.read_jsonl(Path(cfg.ppo_log)) if "reward" in r and "iteration" in r]
    if log:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["iteration"] for r in log], [r["reward"] for r in log], marker="o", ms=3)
        ax.set_xlabel("PPO iteration")
        ax.set_ylabel("mean step reward")
        ax.set_title(f"Step-wise PPO ({cfg.ppo_log})")
        fig.tight_layout()
        fig.savefig(out / "ppo_reward.png", dpi=120)
        plt.close(fig)
        made.append("ppo_reward.png")
    curves: dict = {}  # (scaffold, policy) -> [tokens per round of each run]
    for r in runs:
        if r["context"]:
            curves.setdefault((r["scaffold"], r["policy"]), []).append(r["context"])
    if any(s != "mlab" for s, _ in curves):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (scaffold, policy), cs in sorted(curves.items()):
            n = max(map(len, cs))
            mean = [_mean([c[i] for c in cs if i < len(c)]) for i in range(n)]
            ax.plot(range(1, n + 1), mean, marker="o", ms=3, label=f"{scaffold} ({policy})")
        ax.set_xlabel("round (Matryoshka: Orchestrator round; monolithic: execution; MLAB: step)")
        ax.set_ylabel("prompt tokens")
        ax.set_title("Context growth: Orchestrator vs monolithic")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "context_growth.png", dpi=120)
        plt.close(fig)
        made.append("context_growth.png")
    return made

# ================================================================================================ evaluate


def resolve_tasks(cfg: Config) -> list:
    if cfg.tasks:
        return env.load_tasks(cfg.tasks)
    return [t for t in env.list_tasks() if cfg.split == "all" or t.split == cfg.split]


def workers_for(cfg: Config, policies, runs: int) -> int:
    """How many runs go at once (Config.workers)."""
    if cfg.workers:
        return max(min(cfg.workers, runs), 1)
    if any(os.path.isdir(p) for p in [*policies, cfg.sub_agent or ""]) and not cfg.base_url:
        import torch
        if torch.cuda.is_available():  # one copy of the checkpoint per worker on the GPU: one worker unless asked
            return 1
    return max(min(os.cpu_count() or 1, 4, runs), 1)


_WORKER: dict = {}  # in a worker process: its Config and tasks


def _worker_start(cfg: Config):
    _WORKER.update(cfg=cfg, tasks=resolve_tasks(cfg))


def _worker_run(scaffold: str, policy: str, i: int, r: int) -> dict:
    return run_one(_WORKER["cfg"], scaffold, policy, _WORKER["tasks"][i], r)


def run_all(cfg: Config, todo, tasks, policies):
    """Yield (job, row) for every job (scaffold, policy, task index, run) as it finishes. Several workers: each a
    new process (spawn: no inherited sandbox server or torch threads) with its own backends, so a checkpoint loads
    once per worker. A run's outcome does not depend on where it runs: run_one seeds every generator it draws from
    with the run's own seed, and run_key holds everything else that changes it. An endpoint that cannot serve us
    (agent.BackendError) stops the rest: the runs under way still finish and are yielded, then it is raised."""
    workers = workers_for(cfg, policies, len(todo))
    if workers == 1:
        for job in todo:
            yield job, run_one(cfg, job[0], job[1], tasks[job[2]], job[3])
        return
    error = None
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                             initargs=(cfg,)) as pool:
        futures = {pool.submit(_worker_run, *job): job for job in todo}
        try:
            for f in as_completed(futures):
                if f.cancelled():
                    continue
                try:
                    yield futures[f], f.result()
                except agent.BackendError as e:
                    error = error or e
                    for g in futures:
                        g.cancel()
        except BrokenProcessPool as e:  # a worker was killed (out of memory, a signal): the finished runs are kept
            raise RuntimeError(f"a worker process died ({e}); run eval.py again to resume") from None
        finally:
            for g in futures:  # a kill or an error here: runs not started are not started
                g.cancel()
    if error:
        raise error


def evaluate(cfg: Config, log=print) -> dict:
    """Run what runs.jsonl does not hold yet, then write report.json, report.md and the plots; returns the report."""
    with agent.claim_folder(cfg.out):  # one evaluation per --out: a second one would run and append every run again
        return _evaluate(cfg, log)


def _evaluate(cfg: Config, log) -> dict:
    out = Path(cfg.out)
    tasks, policies = resolve_tasks(cfg), cfg.policies or default_policies()
    path = out / "runs.jsonl"
    done = read_runs(path)
    m_init = {}
    for task in tasks:
        m_init[task.name] = starter_scores(task)
        if m_init[task.name]["status"] != "success":
            log(f"eval.py: the starter of {task.name} does not score ({m_init[task.name]['status']}); its gains are -")
    keys = {(s, p, i, r): run_key(cfg, s, p, t, r) for s in cfg.scaffolds for p in policies
            for i, t in enumerate(tasks) for r in range(cfg.k)}
    todo = [job for job, key in keys.items() if key not in done]
    log(f"eval.py: {len(keys)} runs ({len(keys) - len(todo)} already in {path}); policies "
        f"{', '.join(map(policy_label, policies))}; tasks {', '.join(t.name for t in tasks)}")
    for n, ((scaffold, policy, i, r), row) in enumerate(run_all(cfg, todo, tasks, policies), 1):
        row = {"key": keys[scaffold, policy, i, r], **row}
        collect.append_line(path, row)  # one whole line, flushed: a kill loses at most the runs under way
        done[row["key"]] = row
        log(f"[{n}/{len(todo)}] {scaffold} {row['policy']} {tasks[i].name} run {r}: "
            + (f"private {_f(row['private'])}" if row["valid"] else f"INVALID ({row['error'] or row['submission']})")
            + f", {row['steps']} steps, {row['prompt_tokens'] + row['completion_tokens']} tokens, "
              f"{row['seconds']:.1f}s")
    runs = [done[key] for key in keys.values()]
    groups = []
    for scaffold in cfg.scaffolds:
        for policy in policies:
            rows = [task_summary(t, m_init[t.name], [done[keys[scaffold, policy, i, r]] for r in range(cfg.k)])
                    for i, t in enumerate(tasks)]
            groups.append({"scaffold": scaffold, "policy": policy_label(policy), "policy_path": policy,
                           "overall": overall(rows), "tasks": rows})
    report = {"config": asdict(cfg) | {"policies": policies}, "failed_run_score": FAILED_RUN_SCORE,
              "tasks": {t.name: {"split": t.split, "metric": t.metric, "higher_is_better": t.higher_is_better,
                                 "m_init": m_init[t.name], "leaderboard_size": len(t.leaderboard())} for t in tasks},
              "groups": groups, "runs": [{k: v for k, v in x.items() if k != "context"} for x in runs]}
    write_atomic(out / "report.json", json.dumps(report, indent=1))
    write_atomic(out / "report.md", markdown(report))
    report["plots"] = plots(report, runs, cfg) if cfg.plots else []
    return report

# ================================================================================================ the claims
# One command that measures the papers' claims in miniature: it runs the pipeline's own commands as
# subprocesses under runs/claims/work (each step once: a finished step leaves <step>.done, a killed one is started
# again from an empty folder), measures each claim, and writes claims.json, claims.md and plots under runs/claims.
# Every number comes with its uncertainty (a bootstrap over states, runs or seeds) and "holds" says whether the
# miniature shows the paper's effect; nothing here is tuned to make a claim hold. The README, "The claims", has the
# numbers of a full run.

HELD_IN = [n for n, s in env.BUILTIN_TASKS.items() if s.split == "held-in"]
CLAIM_PRESETS = {
    # the full run: every held-in task, two SFT seeds, PPO for 16 iterations of 16 states (ppo.py's tiny defaults:
    # 4 samples each, the group baseline), J_step over 8 x 64 states, K = 2 on the held-out tasks; C8 on all of them.
    # J_step is cheap beside training; over 3 x 64 states its paired intervals were as wide as the effects they
    # measured (README, "The claims")
    "full": dict(tasks=HELD_IN, few_tasks=4, trajectories=1, sft_seeds=(0, 1), sft=[], unseen_states=150,
                 ppo=["--iterations", "16"], objective_states=64, objective_seeds=8,
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


def _parse_rate(ckpt: str, rows: list) -> dict:
    import model
    import sft
    lm, tok = model.load(ckpt, "cpu")
    ok, same = sft.parse_rate(lm, tok, rows, 512)
    return {"parse_rate": ok, "same_action": same, "states": len(rows)}


def _distinct_ideas(data: str) -> dict:
    """Exploration in a data set (ML-Agent Figures 4, 7): distinct edit instructions per trajectory and in all."""
    trajs = collect.read_jsonl(Path(data) / "trajectories.jsonl")
    edits = [[s["action_input"].get("edit_instruction") for s in t["steps"]
              if s["action"] == "Edit Script (AI)" and isinstance(s["action_input"], dict)] for t in trajs]
    return {"per_trajectory": [len(set(e)) for e in edits], "distinct": len({i for e in edits for i in e}),
            "trajectories": len(trajs)}


def _gains(report: dict) -> dict:
    """policy -> the performance gain of each held-out run (a failed run scores m_init, as in task_summary)."""
    out: dict = {}
    for r in report["runs"]:
        t = report["tasks"][r["task"]]
        init = t["m_init"]["private"]
        m = r["private"] if r["valid"] else init
        out.setdefault(r["policy"], []).append(performance_gain(m, init, t["higher_is_better"]) if init else None)
    return out


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
    import ppo
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
    ppo_ckpt = {name: R.path(f"ppo-{name}") for name in [*runs, "k1"]}  # the actors' folders (their base names
    policies = {"sft": sft0, **ppo_ckpt, "sft-k1": sft1}                 # label the policies in eval's report)
    orch, ev, ev7, ev8 = R.path("orch"), R.path("eval"), R.path("eval-context"), R.path("eval-orchestrator")
    R.steps(*[(f"sft-{s}", "sft.py", ["--data", f"{data}/sft.jsonl", "--out", c, "--seed", s, *p["sft"]], [c])
              for s, c in sft_ckpt.items()],
            ("sft-k1", "sft.py", ["--data", f"{data1}/sft.jsonl", "--out", sft1, *p["sft"]], [sft1]),
            # the Matryoshka runs (C7, C8) need none of the above
            ("orchestrator-train", "orchestrator.py", ["train", "--task", p["orch_task"], "--out", orch, *p["orch"]],
             [orch]),
            # C7 on energy: the context's growth does not depend on the task, and the monolithic chat's stacked
            # scripts took 341 s on loans against 82 s on energy (2026-12-02)
            ("eval-context", "eval.py", ["--scaffold", "matryoshka", "monolithic", "--policy", "scripted", "--tasks",
                                         p["eval_tasks"][0] if p["eval_tasks"] else "energy", "--k", "1", "--rounds",
                                         p["c7_rounds"], "--out", ev7, "--no-plots"], [ev7]))
    R.steps(*[(f"ppo-{name}", "ppo.py", ["--model", start, "--states", f"{states}/states.jsonl", "--out",
                                         ppo_ckpt[name], "--log-file", f"{ppo_ckpt[name]}.jsonl", *p["ppo"], *extra],
               [ppo_ckpt[name], f"{ppo_ckpt[name]}.jsonl"])
              for name, (start, states, extra) in {**{k: (sft0, data, v) for k, v in runs.items()},
                                                   "k1": (sft1, data1, [])}.items()])
    # held-out evaluation of every policy (Δr avg@K), and of the Orchestrator before and after tree training
    R.steps(("eval", "eval.py", ["--policy", *[policies[k] for k in ("sft", "ppo", "few", "k1", "sft-k1")], "--out", ev,
                                 *(["--tasks", *p["eval_tasks"]] if p["eval_tasks"] else []), *p["eval"], "--no-plots"],
             [ev]),
            ("eval-orchestrator", "eval.py", ["--scaffold", "matryoshka", "--policy", f"{orch}/train/ckpt-0",
                                              f"{orch}/train/ckpt-1", "--sub-agent", "scripted", "--tasks",
                                              *p["c8_tasks"], "--k", "1", "--rounds", p["c7_rounds"], "--out", ev8,
                                              "--no-plots"], [ev8]))

    # measurements
    seen = {json.dumps(r["messages"]) for r in collect.read_jsonl(Path(data) / "sft.jsonl")}
    unseen_rows = [r for r in collect.read_jsonl(Path(unseen) / "sft.jsonl")
                   if json.dumps(r["messages"]) not in seen][: p["unseen_states"]]  # states SFT never trained on
    c1 = {s: R.measure(f"parse-sft-{s}", lambda c=c: _parse_rate(c, unseen_rows)) for s, c in sft_ckpt.items()}
    # J_step of each policy: objective_seeds fresh samples of objective_states states, the same for every policy
    obj = {k: [R.measure(f"objective-{k}-{s}", lambda c=c, s=s: ppo.estimate_objective(
        c, f"{data}/states.jsonl", n=p["objective_states"], seed=s)) for s in range(p["objective_seeds"])]
        for k, c in policies.items() if k != "sft-k1"}
    # the agent's action diversity (ML-Agent Figure 7): distinct edit instructions among its actions in each seed's
    # states (runs before the "edits" key have none)
    acted = {k: {"per_seed": bootstrap([len({e for e in x.get("edits", []) if e}) for x in obj[k]]),
                 "edits": sum(1 for x in obj[k] for e in x.get("edits", []) if e)} for k in ("ppo", "k1")}
    obj = {k: {"rewards": [r for x in v for r in x["rewards"]]} for k, v in obj.items()}
    for v in obj.values():
        v["mean_reward"] = sum(v["rewards"]) / len(v["rewards"])
    report = json.loads((Path(ev) / "report.json").read_text())
    gains = {k: _gains(report).get(policy_label(c), []) for k, c in policies.items()}
    gain = {k: bootstrap(v) for k, v in gains.items()}
    div = {"with ideas": _distinct_ideas(data), "one idea per category": _distinct_ideas(data1)}
    c3 = {"step-wise": "ppo", "episode-wise": "episodic"}
    logs = {k: collect.read_jsonl(Path(f"{ppo_ckpt[run]}.jsonl")) for k, run in c3.items()}
    diff = lambda a, b: bootstrap([x - y for x, y in zip(obj[a]["rewards"], obj[b]["rewards"])])  # noqa: E731
    corner = {k: bootstrap([r["frac_corner"] for r in collect.read_jsonl(Path(f"{ppo_ckpt[k]}.jsonl"))])["mean"]
              for k in ("ppo", "binary", "no-format", "no-corner")}  # corner cases' share of the training actions
    rep8 = json.loads((Path(ev8) / "report.json").read_text())
    ranks = {Path(g["policy_path"]).name: bootstrap([t["human_rank_avg"] for t in g["tasks"]])
             for g in rep8["groups"]}
    ctx: dict = {}  # scaffold -> the prompt tokens per round of each run (runs.jsonl keeps them; report.json not)
    for r in collect.read_jsonl(Path(ev7) / "runs.jsonl"):
        ctx.setdefault(r["scaffold"], []).append(r["context"])
    slope = lambda cs: bootstrap([(c[-1] - c[0]) / (len(c) - 1) for c in cs if len(c) > 1])  # noqa: E731

    rates = {s: r["parse_rate"] for s, r in c1.items()}
    claims = [
        _claim("C1 SFT keeps the action format", "ML-Agent §Exploration-enriched fine-tuning",
               f"valid-action rate of greedy SFT responses on {len(unseen_rows)} states of unseen trajectories, "
               "per seed", {"per_seed": rates, "seeds": bootstrap(list(rates.values()))},
               bool(unseen_rows) and min(rates.values()) >= 0.9, aim="at least 90% for every seed"),
        _claim("C2 PPO beats SFT", "ML-Agent Table 1, Figure 3",
               f"mean step reward on {p['objective_seeds']} x {p['objective_states']} held-in states (PPO - SFT, "
               "paired) and Δr avg@K on the held-out tasks",
               {"step_reward": {k: obj[k]["mean_reward"] for k in ("sft", "ppo")},
                "step_reward_ppo_minus_sft": diff("ppo", "sft"), "gain": {k: gain[k] for k in ("sft", "ppo")}},
               diff("ppo", "sft")["lo"] is not None and diff("ppo", "sft")["lo"] > 0 and _gt(gain["ppo"], gain["sft"])),
        _claim("C3 step-wise beats episode-wise", "ML-Agent Figure 3",
               "mean step reward on the held-in states after at most the same number of actions per update (paired), "
               "and the training reward against wall time (plot)",
               {"step_reward": {k: obj[run]["mean_reward"] for k, run in c3.items()},
                "stepwise_minus_episodic": diff("ppo", "episodic"),
                "seconds": {k: sum(r["time_total"] for r in v) for k, v in logs.items()}},
               diff("ppo", "episodic")["lo"] is not None and diff("ppo", "episodic")["lo"] > 0),
        _claim("C4 more RL tasks help", "ML-Agent Figure 5",
               f"Δr avg@K on the held-out tasks after PPO on 0 (the SFT model), {p['few_tasks']} and "
               f"{len(p['tasks'])} held-in tasks", {"0": gain["sft"], str(p["few_tasks"]): gain["few"],
                                                    str(len(p["tasks"])): gain["ppo"]},
               None if gain["ppo"]["mean"] is None else bool(gain["ppo"]["mean"] > gain["few"]["mean"] > gain["sft"]["mean"])),
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
               "ablation (full - ablation, paired); the share of corner cases among each run's training actions "
               "(without any, the no-corner run is the full run)",
               {**{k: diff("ppo", k) for k in ("binary", "no-format", "no-corner")}, "corner_share": corner},
               all(diff("ppo", k)["mean"] is not None and diff("ppo", k)["mean"] > 0
                   for k in ("binary", "no-format", "no-corner"))),
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
        return "-" if x["mean"] is None else f"{x['mean']:+.4f} [{x['lo']:+.4f}, {x['hi']:+.4f}] (n={x['n']})"
    if isinstance(x, dict):
        return "; ".join(f"{k}: {_v(v)}" for k, v in x.items())
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def claims_markdown(result: dict) -> str:
    lines = [f"# The papers' claims in miniature ({result['date']})", "",
             "Means with 95% bootstrap intervals [lo, hi]; n = states, runs or seeds resampled.", "",
             "| claim | mirrors | measured | value | holds |", "|---|---|---|---|---|"]
    for c in result["claims"]:
        holds = {True: "yes", False: "no", None: "not measured"}[c["holds"]]
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


def claims_main(argv) -> None:
    p = agent.Parser(prog="eval.py claims", description="Measure the papers' claims in miniature (runs/claims).")
    p.add_argument("--quick", action="store_true", help="a small run (about 15 minutes) that shows the report's shape")
    p.add_argument("--out", default=str(ROOT / "runs/claims"))
    p.add_argument("--lanes", type=int, default=0, help="independent steps run at once, each with one torch thread "
                   "(default: one per CPU core; 1: one step at a time with torch's default threads)")
    args = p.parse_args(argv)
    if args.lanes < 0:
        p.error(f"--lanes must be at least 1, not {args.lanes}")
    try:
        result = run_claims(CLAIM_PRESETS["quick" if args.quick else "full"], Path(args.out), lanes=args.lanes or None)
    except RuntimeError as e:
        sys.exit(f"eval.py claims: {e}")
    except ValueError as e:  # --out a file or in use
        p.error(str(e))
    print(claims_markdown(result))
    print(f"wrote {Path(args.out) / 'claims.json'}, {Path(args.out) / 'claims.md'}"
          + "".join(f", {Path(args.out) / n}" for n in result["plots"]))

# ================================================================================================ command line


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["claims"]:
        return claims_main(argv[1:])
    d = Config()
    p = agent.Parser(prog="eval.py", description="Evaluate agents on held-out tasks: gain avg@K/best@K, HumanRank, cost.")
    p.add_argument("--scaffold", nargs="+", choices=SCAFFOLDS, default=d.scaffolds, dest="scaffolds")
    p.add_argument("--policy", nargs="+", default=d.policies, dest="policies",
                   help="'scripted', checkpoint folders, endpoint models (default: scripted + runs/ckpt/{sft,ppo})")
    p.add_argument("--sub-agent", help="Matryoshka's Sub-Agent (default: the policy itself)")
    p.add_argument("--tasks", nargs="+", default=d.tasks, help="built-in task names or task folders")
    p.add_argument("--split", choices=("held-out", "held-in", "all"), default=d.split)
    for flag, typ in [("k", int), ("max-steps", int), ("time-limit", float), ("temperature", float),
                      ("max-tokens", int), ("price-in", float), ("price-out", float), ("rounds", int), ("calls", int),
                      ("sub-iters", int), ("seed", int), ("threads", int), ("workers", int)]:
        p.add_argument(f"--{flag}", type=typ, default=getattr(d, flag.replace("-", "_")))
    p.add_argument("--ideas", choices=("sampled", "none"), default=d.ideas)
    p.add_argument("--editor", default=d.editor, help="auto | recipes | policy | an endpoint model name")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--ppo-log", default=d.ppo_log)
    p.add_argument("--no-plots", dest="plots", action="store_false")
    args = p.parse_args(argv)
    cfg = Config(**vars(args))
    for name in ("k", "max_steps", "max_tokens", "rounds", "calls", "sub_iters"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.workers < 0:
        p.error(f"--workers must be >= 0 (0: one per CPU core), not {cfg.workers}")
    for name in ("time_limit", "temperature", "price_in", "price_out", "threads"):
        v = getattr(cfg, name)
        if not 0 <= v < math.inf or (name == "time_limit" and v == 0):  # nan fails too
            p.error(f"--{name.replace('_', '-')} must be finite and {'> 0' if name == 'time_limit' else '>= 0'}, "
                    f"not {v}")
    for flag, names in (("--policy", cfg.policies or default_policies()),
                        ("--sub-agent", [cfg.sub_agent or "scripted"]), ("--editor", [cfg.editor])):
        for name in names:
            if re.match(r"^(\.{0,2}/|runs/)", name) and not os.path.isdir(name):
                p.error(f"{flag}: no checkpoint folder {name!r}")
            if os.path.isdir(name) and not cfg.base_url:  # a broken checkpoint fails now, not as K failed runs
                try:
                    agent.check_checkpoint(name)
                except ValueError as e:
                    p.error(f"{flag} {e}")
    try:
        resolve_tasks(cfg)
        if cfg.plots and os.path.exists(cfg.ppo_log):  # read for a plot at the end: checked before the runs
            collect.read_jsonl(Path(cfg.ppo_log))
    except (env.TaskError, ValueError) as e:
        p.error(str(e))
    try:
        report = evaluate(cfg)
    except (agent.BackendError, RuntimeError) as e:  # an endpoint that cannot serve us, a worker that died
        sys.exit(f"eval.py: {e}")
    except (ValueError, OSError) as e:  # --out a file or in use, a bad line of runs.jsonl: one line
        p.error(str(e))
    print(markdown(report))
    print(f"wrote {Path(cfg.out) / 'report.json'}, {Path(cfg.out) / 'report.md'}"
          + "".join(f", {Path(cfg.out) / name}" for name in report["plots"]))


if __name__ == "__main__":
    main()
