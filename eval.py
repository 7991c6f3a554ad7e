"""Evaluation as the papers report it: K seeded runs of a scaffold (MLAB's research agent; Matryoshka and its
monolithic baseline, orchestrator.py) with a policy on each held-out task; per task m_init, avg@K, best@K (private
scores), the measures below, valid-submission rate, tokens and cost per trajectory.

Performance gain Delta_r = beta * (m_avg@K - m_init) / m_init, beta = -1 if lower is better, K = 8 (ML-Agent,
arXiv:2505.23723, §Experiments "Testing"); HumanRank s = 1 - p / N, p leaderboard entries strictly better, N its size,
invalid submissions 0 (Matryoshka Agent, arXiv:2607.25090, App. A Eq. 5); context growth, the Orchestrator's prompt
per round against the monolithic chat's per execution (App. F). Departures:
1. We divide by |m_init|: the right sign for a negative m_init. Scores are PRIVATE-part: a run's final train.py re-run
   in the sandbox (cached), graded on the hidden rows.
2. Ties are not "strictly better"; the built-in leaderboards are not human entries (env.py, departure 6).
3. A failed run stays among the K: invalid (HumanRank 0: MLE-bench gives no medal), scored m_init (MLAgentBench's
   success rate credits only a final submission beating the baseline); dropping it would reward failures, the
   leaderboard's worst entry punish by its spread.
4. The offline scripted expert needs ideas: `--ideas sampled` (default) draws 1-3 recipe ideas per run, seeded by
   (seed, task, run), alike for all policies; `--ideas none` is the paper's test prompt.
5. Temperature 0.2 (the papers give none): at PPO's 0.7 the tiny students' steps are more often invalid. Own ideas
   and seed per run: the K runs differ, and --workers give the same results. Matryoshka submits its best attempt by
   public score, maybe the starter. Offline stand-ins: agent.py, orchestrator.py.
6. Scripts see no GPU (env.py's CPU-only limits), as collect.py's: only ppo.py's --script-gpu gives one.

Run:  python eval.py  (offline, after collect/sft/ppo: scripted expert, runs/ckpt/sft, runs/ckpt/ppo; MLAB, K=2)
      python eval.py --k 8 --max-steps 15 ;  python eval.py --scaffold matryoshka monolithic --tasks wine
      OPENAI_API_KEY=... python eval.py --policy gpt-4o-mini --price-in 0.15 --price-out 0.6 --split held-in
Outputs under --out (runs/eval): runs.jsonl (a restart skips its runs), report.json, report.md, and plots (.png).
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import agent
import collect
import env
import orchestrator

ROOT = env.ROOT
SCAFFOLDS = ("mlab", "matryoshka", "monolithic")
FAILED_RUN_SCORE = "m_init"  # departure 3
GAIN_CLIP, RESAMPLES = 0.5, 2000  # a run's gain clip (no one run decides); bootstrap draws


@dataclass
class Config:
    scaffolds: list = field(default_factory=lambda: ["mlab"])  # agents around each policy
    policies: list = field(default_factory=list)  # scripted, folders, endpoints; []: scripted + runs/ckpt/{sft,ppo}
    sub_agent: str | None = None  # Matryoshka's Sub-Agent; None: the policy itself
    tasks: list = field(default_factory=list)  # built-in names or task folders; []: the built-in tasks of --split
    split: str = "held-out"  # the built-in tasks evaluated
    k: int = 2  # runs per task (paper: 8)
    max_steps: int = 8  # MLAB steps per trajectory (paper: 15)
    time_limit: float = 1800.0  # seconds per trajectory (paper: 30 minutes)
    temperature: float = 0.2  # of the policy; the papers give none (departure 5)
    max_tokens: int | None = None  # per response; None: 1024 mlab, 4096 matryoshka, <= a local model's context / 4
    ideas: str = "sampled"  # the ideas injected (departure 4)
    editor: str = "auto"  # recipes, policy or an endpoint model run Edit Script (AI); auto: policy if an endpoint
    base_url: str | None = None  # OpenAI-compatible endpoint; None: $OPENAI_BASE_URL
    price_in: float = 0.0  # dollars per million prompt tokens
    price_out: float = 0.0  # dollars per million completion tokens
    rounds: int = orchestrator.Config.rounds  # Matryoshka (monolithic: rounds x calls x sub_iters runs)
    calls: int = orchestrator.Config.calls  # Matryoshka: tool calls per round
    sub_iters: int = orchestrator.Config.sub_iters  # Matryoshka: executions per Sub-Agent (the paper: 10)
    seed: int = 0  # run r of a task uses seed * 100003 + r
    out: str = str(ROOT / "runs/eval")  # runs.jsonl, report.json, report.md, plots
    ppo_log: str = str(ROOT / "runs/ppo/log.jsonl")  # ppo.py's log: its "reward" field is plotted
    plots: bool = True  # PNG plots when matplotlib is installed; --no-plots: none
    threads: int = 1  # torch CPU threads of a local checkpoint (tiny models: 1 is fastest)
    workers: int = 0  # runs at once, a process each; 0: a core each up to 4 (CUDA + checkpoint: 1)

# ==== the two metrics


def performance_gain(m_avg, m_init, higher_is_better) -> float:
    """ML-Agent's Delta_r over |m_init| (departure 1)."""
    if m_init == 0:
        raise ValueError("m_init is 0: the relative gain is undefined")
    return (1.0 if higher_is_better else -1.0) * (m_avg - m_init) / abs(m_init) + 0.0  # + 0.0: no "-0.00%"


def human_rank(score, leaderboard_scores, higher_is_better) -> float:
    """Matryoshka's HumanRank of `score`; None (invalid) -> 0."""
    board = [float(s) for s in leaderboard_scores]
    if not board:
        raise ValueError("an empty leaderboard has no HumanRank")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return 0.0
    p = sum(s > score if higher_is_better else s < score for s in board)
    return 1.0 - p / len(board)

# ==== policies


def policy_label(name: str) -> str:
    return Path(name).name if os.path.isdir(name) else name


def policy_id(name: str) -> str:
    """A folder's id has its files' sizes and times: retraining invalidates its runs."""
    if not os.path.isdir(name):
        return name
    stamp = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(name).iterdir() if p.is_file())
    return f"{Path(name).resolve()}@{hashlib.sha256(repr(stamp).encode()).hexdigest()[:12]}"


def default_policies(log=None) -> list[str]:
    """log(a line) names the checkpoints not made yet."""
    missing = [p for p in ("runs/ckpt/sft", "runs/ckpt/ppo") if not (ROOT / p).is_dir()]
    if missing and log:
        log(f"eval.py: no {' or '.join(missing)} (sft.py / ppo.py make them): evaluating without")
    return ["scripted"] + [str(ROOT / p) for p in ("runs/ckpt/sft", "runs/ckpt/ppo") if p not in missing]


_BACKENDS: dict = {}  # a checkpoint loads once for all runs and roles


def get_backend(name: str, role: str, cfg: Config):
    """role: "agent" (MLAB), "orchestrator" or "sub-agent"."""
    key = (name, role if name == "scripted" else "model")
    if key not in _BACKENDS:
        if os.path.isdir(name) and cfg.threads > 0:
            import torch
            torch.set_num_threads(cfg.threads)
        b = _BACKENDS[key] = orchestrator.make_backend(name, cfg.base_url, role, cfg.seed)
        b.usage.price_in, b.usage.price_out = cfg.price_in, cfg.price_out
    return _BACKENDS[key]


def seed_everything(seed: int):
    """Call before a checkpoint loads and samples (unseeded: per process)."""
    import torch
    random.seed(seed)
    torch.manual_seed(seed)

# ==== one run


def response_tokens(cfg: Config, scaffold: str, backend) -> int:
    """Config.max_tokens' default (tiny models: 2048 positions)."""
    n = cfg.max_tokens or (1024 if scaffold == "mlab" else orchestrator.Config.max_tokens)
    lm = getattr(backend, "lm", None)
    return min(n, lm.config.max_position_embeddings // 4) if lm is not None and not cfg.max_tokens else n


def run_mlab(cfg: Config, policy: str, task, ideas) -> dict:
    backend = get_backend(policy, "agent", cfg)
    if cfg.editor == "recipes" or (cfg.editor == "auto" and (policy == "scripted" or os.path.isdir(policy))):
        editor = env.recipe_editor
    else:
        editor = agent.LLMEditor(backend if cfg.editor in ("auto", "policy") else get_backend(cfg.editor, "agent", cfg))
    e, backends = env.Env(task, editor=editor), [backend, getattr(editor, "backend", backend)]
    before = collect.usage_of(backends)
    traj = agent.run_episode(e, backend, ideas, max_steps=cfg.max_steps, time_limit=cfg.time_limit,
                             temperature=cfg.temperature, max_tokens=response_tokens(cfg, "mlab", backend))
    others = {k: v for k, v in e.files.items() if k != "train.py"}
    final = env.run_script(task, e.files["train.py"], files=others)
    tok = getattr(backend, "tokenizer", None)
    return {"submission": final.status, "public": final.score, "private": final.test_score,
            "steps": len(traj.steps), "stopped": traj.stopped, **collect.usage_of(backends, before),
            "context": [orchestrator.prompt_tokens(s.messages, tok) for s in traj.steps],
            "actions": [[s.action, s.kind, s.reward] for s in traj.steps], **conditioning(traj, ideas)}


def conditioning(traj, ideas) -> dict:
    """Per train.py edit: is it a run's idea ("followed"); per valid step after running an edited train.py: did it
    undo exactly when the public score did not beat the pre-edit one ("agreed")."""
    texts, followed, agreed = {idea.strip().lower() for _, idea in ideas}, [], []
    for prev, s in zip([None, *traj.steps], traj.steps):
        if s.action == "Edit Script (AI)" and s.action_input and s.action_input.get("save_name") == "train.py":
            followed.append(str(s.action_input.get("edit_instruction", "")).strip().lower() in texts)
        edits = [h for h in s.snapshot["history"] if h["script"] == "train.py"]
        if (prev is not None and prev.action == "Execute Script" and prev.kind == "neutral" and edits
                and (prev.action_input or {}).get("script_name") == "train.py" and s.kind != "invalid"
                and None not in (s.snapshot["metric"], edits[-1]["metric"])):
            now, before = s.snapshot["metric"], edits[-1]["metric"]
            agreed.append((s.action == "Undo Edit Script") != (now > before if traj.higher_is_better else now < before))
    return {"followed": followed, "agreed": agreed}


def run_hierarchical(cfg: Config, scaffold: str, policy: str, task, seed: int) -> dict:
    """Matryoshka (the policy orchestrates, cfg.sub_agent or the policy codes) or the monolithic baseline;
    `valid_attempts` omits the starter (attempt 0)."""
    if scaffold == "matryoshka":
        backends = [get_backend(policy, "orchestrator", cfg), get_backend(cfg.sub_agent or policy, "sub-agent", cfg)]
        if hasattr(backends[0], "rng"):  # scripted Orchestrator: seeded per run
            backends[0].rng.seed(seed)
        run, role = orchestrator.run_matryoshka, "orchestrator"
    else:
        backends = [get_backend(policy, "sub-agent", cfg)]
        run, role = orchestrator.run_monolithic, "monolithic"
    ocfg = orchestrator.Config(task=str(task.dir), rounds=cfg.rounds, calls=cfg.calls, sub_iters=cfg.sub_iters,
                               time_limit=cfg.time_limit, temperature=cfg.temperature, seed=seed,
                               max_tokens=min(response_tokens(cfg, scaffold, b) for b in backends))
    before = collect.usage_of(backends)
    res = run(ocfg, *backends, out=None, log=lambda *a, **k: None)  # one log line per run
    context: dict = {}  # round -> the role's largest prompt (re-asks are longer)
    for r in res["records"]:
        if r["role"] == role:
            context[r["round"]] = max(context.get(r["round"], 0), r["tokens"])
    best = res["best"]
    return {"submission": "success" if best["private"] is not None else "invalid_submission",
            "public": best["public"], "private": best["private"], "steps": len(res["attempts"]) - 1,
            "valid_attempts": sum(a["score"] is not None for a in res["attempts"][1:]),
            "stopped": "finish" if res["finished"] else "budget", **collect.usage_of(backends, before),
            "context": [context[k] for k in sorted(context)], "token_counter": res["token_counter"]}


def run_one(cfg: Config, scaffold: str, policy: str, task, r: int) -> dict:
    """One seeded run; an exception fails it, but agent.BackendError stops the evaluation (a restart retries)."""
    seed, ideas = cfg.seed * 100003 + r, []
    if scaffold == "mlab" and cfg.ideas == "sampled":
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
    except Exception as e:  # noqa: BLE001 - departure 3
        row.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0][:500], submission="failed",
                   public=None, private=None, steps=0, stopped="error", calls=0, prompt_tokens=0,
                   completion_tokens=0, cost=0.0, context=[])
    row["valid"] = row["submission"] == "success" and row["private"] is not None
    row["seconds"] = time.time() - start
    return row

# ==== the resumable run log


def run_key(cfg: Config, scaffold: str, policy: str, task, r: int) -> str:
    """All that changes a run's outcome; a restart skips finished runs by it."""
    what = {"scaffold": scaffold, "policy": policy_id(policy), "task": str(task.dir), "run": r, "seed": cfg.seed,
            "max_steps": cfg.max_steps, "time_limit": cfg.time_limit, "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens, "ideas": cfg.ideas, "editor": cfg.editor}
    if scaffold != "mlab":
        what.update(sub_agent=policy_id(cfg.sub_agent or policy), rounds=cfg.rounds, calls=cfg.calls,
                    sub_iters=cfg.sub_iters)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def read_runs(path: Path) -> dict:
    """key -> each finished run's record; cuts a torn last line."""
    return {r["key"]: r for r in agent.read_jsonl(path, repair=True) if "key" in r}

# ==== aggregation


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def task_summary(task, m_init: dict, runs: list[dict]) -> dict:
    """One (scaffold, policy, task)'s numbers from its K runs."""
    higher, board, init = task.higher_is_better, [s for _, s in task.leaderboard()], m_init["private"]
    scores = [r["private"] if r["valid"] else init for r in runs]  # FAILED_RUN_SCORE
    avg, best = _mean(scores), ((max if higher else min)(scores) if scores and None not in scores else None)

    def gain(m):  # None if m_init is missing or 0 (performance_gain's ValueError)
        return performance_gain(m, init, higher) if m is not None and init else None
    ranks = [human_rank(r["private"] if r["valid"] else None, board, higher) for r in runs] if board else []
    clipped = [min(max(gain(m), -GAIN_CLIP), GAIN_CLIP) for m in scores] if init and None not in scores else []
    k = max(len(runs), 1)
    # MLAB's "actions": [action, kind, reward] a step
    acted = [r["actions"] for r in runs if r.get("actions") is not None]
    steps = [a for actions in acted for a in actions]
    return {"task": task.name, "metric": task.metric, "higher_is_better": higher, "runs": len(runs),
            "m_init_public": m_init["public"], "m_init": init, "avg@K": avg, "best@K": best,
            "gain_avg": gain(avg), "gain_best": gain(best), "gains_clipped": clipped, "human_rank_avg": _mean(ranks),
            "human_rank_best": human_rank(best, board, higher) if board and best is not None else None,
            "valid_rate": sum(r["valid"] for r in runs) / k, "failed": sum(r["status"] == "failed" for r in runs),
            "tokens_per_traj": sum(r["prompt_tokens"] + r["completion_tokens"] for r in runs) / k,
            "cost_per_traj": sum(r["cost"] for r in runs) / k, "seconds_per_traj": sum(r["seconds"] for r in runs) / k,
            "steps_per_traj": sum(r["steps"] for r in runs) / k,
            "invalid_step_rate": sum(kind == "invalid" for _, kind, _ in steps) / len(steps) if steps else None,
            "undone_gains_per_traj": sum(a == "Undo Edit Script" and kind == "edit" and rew < 0
                                         for a, kind, rew in steps) / len(acted) if acted else None,
            **{f"{k}_n": sum(len(r.get(k) or []) for r in runs) for k in ("followed", "agreed")},
            **{k: sum(sum(r.get(k) or []) for r in runs) for k in ("followed", "agreed")}}


def overall(rows: list[dict]) -> dict:
    """Mean over tasks of each per-task number."""
    keys = ("gain_avg", "gain_best", "human_rank_avg", "human_rank_best", "valid_rate", "tokens_per_traj",
            "cost_per_traj", "seconds_per_traj", "steps_per_traj", "invalid_step_rate", "undone_gains_per_traj")
    counts = {f"{k}_n": sum(r[f"{k}_n"] for r in rows) for k in ("followed", "agreed")}  # every run's edits/steps
    pooled = {f"{k}_rate": sum(r[k] for r in rows) / n if (n := counts[f"{k}_n"]) else None
              for k in ("followed", "agreed")}
    mean, low, high = task_bootstrap([r["gains_clipped"] for r in rows])
    return {"tasks": len(rows), "runs": sum(r["runs"] for r in rows), "failed": sum(r["failed"] for r in rows),
            **{k: _mean([r[k] for r in rows]) for k in keys}, "gain_clipped": mean, "gain_clipped_ci": [low, high],
            **pooled, **counts}


def task_bootstrap(per_task: list[list[float]], seed: int = 0) -> tuple:
    """(mean over runs, 95% percentile-bootstrap interval) of per-task run values, resampling whole tasks: a task's K
    runs share its data and difficulty."""
    tasks = [np.asarray(v, dtype=float) for v in per_task if len(v)]
    if not tasks:
        return None, None, None
    sums, counts = np.array([v.sum() for v in tasks]), np.array([len(v) for v in tasks])
    draws = np.random.default_rng(seed).integers(len(tasks), size=(RESAMPLES, len(tasks)))
    low, high = np.percentile(sums[draws].sum(1) / counts[draws].sum(1), [2.5, 97.5])
    return float(sums.sum() / counts.sum()), float(low), float(high)


def paired(groups: list[dict]) -> list[dict]:
    """Clipped gains b - a per (task, run), for each policy b after a policy a of one scaffold: run r of a task has
    the same seed and ideas for all policies, so pairing cancels what runs share."""
    out = []
    for j, b in enumerate(groups):
        for a in (a for a in groups[:j] if a["scaffold"] == b["scaffold"]):
            diffs = [[y - x for x, y in zip(ta["gains_clipped"], tb["gains_clipped"])]
                     for ta, tb in zip(a["tasks"], b["tasks"])]
            mean, low, high = task_bootstrap(diffs)
            out.append({"scaffold": b["scaffold"], "a": a["policy"], "b": b["policy"], "mean": mean, "low": low,
                        "high": high, "tasks": sum(bool(d) for d in diffs), "runs": sum(map(len, diffs))})
    return out

# ==== report and plots


def _f(x, pct=False, digits=4):
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:+.2f}%"
    return f"{x:.0f}" if abs(x) >= 1e4 else f"{x:.{digits}f}"


def _interval(mean, low, high) -> str:
    return f"{_f(mean, True)} [{_f(low, True)}, {_f(high, True)}]" if mean is not None else "-"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# Evaluation: {', '.join(c['scaffolds'])} on {len(report['tasks'])} task(s), K = {c['k']}", "",
             f"Private-part scores. Gain = beta (m - m_init) / |m_init| (ML-Agent); HumanRank = 1 - p/N against "
             f"private/leaderboard.csv (Matryoshka); a failed run scores m_init in avg@K/best@K and HumanRank 0. "
             f"MLAB steps {c['max_steps']}, ideas {c['ideas']}, temperature {c['temperature']}, seed {c['seed']}. "
             "Invalid steps: the share of the MLAB agent's steps that were not a valid action; undone gains: its Undo "
             "Edit Script steps that gave back an improvement, per run. Ideas followed: its edits of train.py that "
             "are ideas of its prompt; keep/undo right: its steps after running an edit that keep exactly when the "
             f"public score beat the one before it. Clipped gain: each run's gain clipped at +-{GAIN_CLIP:.0%}, the "
             f"mean over runs, a 95% percentile bootstrap interval over tasks ({RESAMPLES:,} draws).", "",
             "## Overall (mean over tasks)", "",
             "| scaffold | policy | tasks | runs | failed | gain avg@K | gain best@K | clipped gain [95%] | HumanRank "
             "| valid | tokens/traj | $/traj | s/traj | invalid steps | undone gains/traj | ideas followed "
             "| keep/undo right |", "|" + "---|" * 17]
    for g in report["groups"]:
        o = g["overall"]
        lines.append(f"| {g['scaffold']} | {g['policy']} | {o['tasks']} | {o['runs']} | {o['failed']} | "
                     f"{_f(o['gain_avg'], True)} | {_f(o['gain_best'], True)} | "
                     f"{_interval(o['gain_clipped'], *o['gain_clipped_ci'])} | {_f(o['human_rank_avg'], digits=3)} | "
                     f"{_f(o['valid_rate'], digits=2)} | {_f(o['tokens_per_traj'], digits=0)} | "
                     f"{_f(o['cost_per_traj'])} | {_f(o['seconds_per_traj'], digits=1)} | "
                     f"{_f(o['invalid_step_rate'], digits=2)} | {_f(o['undone_gains_per_traj'], digits=2)} | "
                     + " | ".join(f"{_f(o[k + '_rate'], digits=2)} of {o[k + '_n']}" for k in ("followed", "agreed"))
                     + " |")
    lines += ["", "## Paired differences", "", "Clipped gains of b minus a, paired by (task, run).", "",
              "| scaffold | b - a | tasks | runs | mean [95%] |", "|" + "---|" * 5]
    lines += [f"| {d['scaffold']} | {d['b']} - {d['a']} | {d['tasks']} | {d['runs']} | "
              f"{_interval(d['mean'], d['low'], d['high'])} |" for d in report["paired"]]
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
    """gain_vs_cost.png (ML-Agent Fig. 2), ppo_reward.png, context_growth.png; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []

    def save(fig, ax, name, **labels):  # xlabel, ylabel, title
        ax.set(**labels)
        fig.tight_layout()
        fig.savefig(Path(cfg.out) / name, dpi=120)
        plt.close(fig)
        made.append(name)
    groups = [g for g in report["groups"] if g["overall"]["gain_avg"] is not None]
    if groups:  # offline every cost is 0: tokens stand in
        by_cost = any(g["overall"]["cost_per_traj"] for g in groups)
        fig, ax = plt.subplots(figsize=(6, 4))
        for g in groups:
            xy = g["overall"]["cost_per_traj" if by_cost else "tokens_per_traj"], 100 * g["overall"]["gain_avg"]
            ax.scatter(*xy, s=60)
            ax.annotate(f"{g['policy']} ({g['scaffold']})", xy, fontsize=8, xytext=(4, 4), textcoords="offset points")
        save(fig, ax, "gain_vs_cost.png", ylabel="performance gain avg@K (%)",
             xlabel="cost per trajectory ($)" if by_cost else "tokens per trajectory (all costs are 0)",
             title="Performance gain against cost (ML-Agent Fig. 2)")
    log = [r for r in agent.read_jsonl(cfg.ppo_log, complete_only=True) if "reward" in r and "iteration" in r]
    if log:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["iteration"] for r in log], [r["reward"] for r in log], marker="o", ms=3, label="policy")
        vs = [r for r in log if r.get("reward_vs_expert") is not None]
        ax.plot([r["iteration"] for r in vs], [r["reward_vs_expert"] for r in vs], marker="o", ms=3,
                label="policy - expert, same states")
        ax.legend(fontsize=8)
        save(fig, ax, "ppo_reward.png", xlabel="PPO iteration", ylabel="mean step reward",
             title=f"Step-wise PPO ({cfg.ppo_log})")
    curves: dict = {}  # (scaffold, policy) -> each run's tokens per round
    for r in runs:
        if r["context"]:
            curves.setdefault((r["scaffold"], r["policy"]), []).append(r["context"])
    if any(s != "mlab" for s, _ in curves):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (scaffold, policy), cs in sorted(curves.items()):
            n = max(map(len, cs))
            mean = [_mean([c[i] for c in cs if i < len(c)]) for i in range(n)]
            ax.plot(range(1, n + 1), mean, marker="o", ms=3, label=f"{scaffold} ({policy})")
        ax.legend(fontsize=8)
        save(fig, ax, "context_growth.png", ylabel="prompt tokens", title="Context growth: Orchestrator vs monolithic",
             xlabel="round (Matryoshka: Orchestrator round; monolithic: execution; MLAB: step)")
    return made

# ==== evaluate


def resolve_tasks(cfg: Config) -> list:
    return env.load_tasks(cfg.tasks or [n for n, t in env.BUILTIN_TASKS.items() if cfg.split in ("all", t.split)])


def workers_for(cfg: Config, policies, runs: int) -> int:
    if cfg.workers:
        return max(min(cfg.workers, runs), 1)
    if any(os.path.isdir(p) for p in [*policies, cfg.sub_agent or ""]) and not cfg.base_url:
        import torch
        if torch.cuda.is_available():  # each worker loads its own copy
            return 1
    return max(min(os.cpu_count() or 1, 4, runs), 1)


def run_all(cfg: Config, todo, tasks, policies):
    """(job, row) per job (scaffold, policy, task index, run) as it ends. Workers: spawned, own backends (no inherited
    sandbox server or torch threads). agent.BackendError: runs under way finish and yield, then it raises."""
    workers = workers_for(cfg, policies, len(todo))
    if workers == 1:
        for job in todo:
            yield job, run_one(cfg, job[0], job[1], tasks[job[2]], job[3])
        return
    error = None
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(run_one, cfg, s, p, tasks[i], r): (s, p, i, r) for s, p, i, r in todo}
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
        except BrokenProcessPool as e:  # out of memory, a signal
            raise RuntimeError(f"a worker process died ({e}); run eval.py again to resume") from None
        finally:
            for g in futures:  # on a kill or an error, no new run starts
                g.cancel()
    if error:
        raise error


def evaluate(cfg: Config, log=print) -> dict:
    """Run what runs.jsonl lacks, then report."""
    with agent.claim_folder(cfg.out):  # one evaluation per --out
        out = Path(cfg.out)
        tasks, policies = resolve_tasks(cfg), cfg.policies or default_policies(log)
        path = out / "runs.jsonl"
        done, m_init = read_runs(path), {}  # m_init: the starter's scores
        for t in tasks:
            run = env.run_script(t, (t.public_dir / "train.py").read_text())
            m_init[t.name] = {"status": run.status, "public": run.score, "private": run.test_score}
            if run.status != "success":
                log(f"eval.py: the starter of {t.name} does not score ({run.status}); its gains are -")
        keys = {(s, p, i, r): run_key(cfg, s, p, t, r) for s in cfg.scaffolds for p in policies
                for i, t in enumerate(tasks) for r in range(cfg.k)}
        todo = [job for job, key in keys.items() if key not in done]
        log(f"eval.py: {len(keys)} runs ({len(keys) - len(todo)} already in {path}); policies "
            f"{', '.join(map(policy_label, policies))}; tasks {', '.join(t.name for t in tasks)}")
        for n, ((scaffold, policy, i, r), row) in enumerate(run_all(cfg, todo, tasks, policies), 1):
            row = {"key": keys[scaffold, policy, i, r], **row}
            agent.append_jsonl(path, row)  # a kill loses at most the runs under way
            done[row["key"]] = row
            log(f"[{n}/{len(todo)}] {scaffold} {row['policy']} {tasks[i].name} run {r}: "
                + (f"private {_f(row['private'])}" if row["valid"] else
                   f"INVALID ({row['error'] or row['submission']})")
                + f", {row['steps']} steps, {row['prompt_tokens'] + row['completion_tokens']} tokens, "
                  f"{row['seconds']:.1f}s")
        runs, groups = [done[key] for key in keys.values()], []
        for scaffold in cfg.scaffolds:
            for policy in policies:
                rows = [task_summary(t, m_init[t.name], [done[keys[scaffold, policy, i, r]] for r in range(cfg.k)])
                        for i, t in enumerate(tasks)]
                groups.append({"scaffold": scaffold, "policy": policy_label(policy), "policy_path": policy,
                               "overall": overall(rows), "tasks": rows})
        report = {"config": asdict(cfg) | {"policies": policies}, "failed_run_score": FAILED_RUN_SCORE,
                  "tasks": {t.name: {"split": t.split, "metric": t.metric, "higher_is_better": t.higher_is_better,
                                     "m_init": m_init[t.name], "leaderboard_size": len(t.leaderboard())}
                            for t in tasks}, "groups": groups, "paired": paired(groups),
                  "runs": [{k: v for k, v in x.items() if k != "context"} for x in runs]}
        agent.write_atomic(out / "report.json", json.dumps(report, indent=1))
        agent.write_atomic(out / "report.md", markdown(report))
        report["plots"] = plots(report, runs, cfg) if cfg.plots else []
        return report

# ==== command line


TYPES = {**dict.fromkeys(("threads", "workers"), agent.COUNT), "seed": int,
         **dict.fromkeys(("temperature", "price_in", "price_out"), agent.NONNEGATIVE)}
CHOICES = {"scaffolds": SCAFFOLDS, "split": ("held-out", "held-in", "all"), "ideas": ("sampled", "none")}
FLAGS = {"scaffolds": "--scaffold", "policies": "--policy", "plots": "--no-plots"}  # else --field-name


def main(argv=None):
    p = agent.Parser(prog="eval.py", description="Evaluate agents on held-out tasks: gain avg@K/best@K, HumanRank, cost.")
    agent.add_fields(p, Config, TYPES, CHOICES, flags=FLAGS, switch="store_false")
    cfg = Config(**vars(p.parse_args(argv)))
    named = [agent.check_model(p, "--policy", n, cfg.base_url) for n in cfg.policies or default_policies()]
    cfg.policies = named if cfg.policies else []  # defaults: evaluate() names the missing
    cfg.sub_agent = agent.check_model(p, "--sub-agent", cfg.sub_agent, cfg.base_url)  # not as K failed runs
    if cfg.editor not in ("auto", "recipes", "policy"):
        cfg.editor = agent.check_model(p, "--editor", cfg.editor, cfg.base_url)
    try:
        resolve_tasks(cfg)
        if cfg.plots:  # a plot's input, checked before the runs
            agent.read_jsonl(cfg.ppo_log, complete_only=True)
    except (env.TaskError, ValueError) as e:
        p.error(str(e))
    try:
        report = evaluate(cfg)
    except (agent.BackendError, RuntimeError) as e:  # an unusable endpoint, a dead worker
        sys.exit(f"eval.py: {e}")
    except (ValueError, OSError) as e:  # --out a file or in use, a bad line of runs.jsonl
        p.error(str(e))
    print(markdown(report))
    print("wrote " + ", ".join(str(Path(cfg.out) / name) for name in ["report.json", "report.md", *report["plots"]]))


if __name__ == "__main__":
    main()
