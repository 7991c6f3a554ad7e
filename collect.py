"""Exploration-enriched expert data (ML-Agent, arXiv:2505.23723, §"Exploration-enriched fine-tuning", App. B.1):
idea pools, a diversity filter, expert trajectories (ideas in the first prompt), SFT data, step-wise RL's states pool.

Outputs under --out (runs/data/): ideas.json, filtered pools {task: {category: [idea, ...]}}; trajectories.jsonl, the
record of truth, agent.Trajectory lines (id "<task>-<i>") with their step rewards' config (a resume must match);
sft.jsonl, {"messages": [system, user, assistant]} per valid step; states.jsonl, a state s_t per step (task, step,
prompt, env.Env.restore snapshot, m_t, m_init, m_best, the expert's step and reward config) for ppo.py's J_step;
errors.jsonl, failed rollouts (no-step ones too), retried next run.

Departures from the paper:
1. The paper: 10k GPT-4o-mini trajectories on 9 MLAgentBench/MLE-bench tasks. Offline, agent.ScriptedExpert (a
   STAND-IN for the LLM expert) works held-in tasks with env.py's recipe ideas (a few per category, all kept by
   the filter), not >= 100 LLM ideas. Scripts see no GPU (as eval.py's).
2. The paper names no embedding or diversity filter: /v1/embeddings (TF-IDF offline), greedy farthest-point selection
   on cosine distance (Gonzalez, 1985: 2-approximation of k-center) from the idea nearest the centroid: deterministic.

Run:  python collect.py  (offline: scripted expert, held-in tasks, ~minutes)
      python collect.py --tasks digits wine --trajectories 20 --workers 2
      OPENAI_API_KEY=... python collect.py --expert gpt-4o-mini --base-url https://api.openai.com/v1
      python collect.py --no-corner-term --out runs/data-no-corner  (ML-Agent Table 3 ablation of the reward)
"""
from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import random
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

import agent
import env
import reward

CATEGORIES = ("data", "model", "learning")  # ML-Agent's categories of optimisation strategies
CATEGORY_HINTS = {"data": "feature engineering, preprocessing, cleaning, augmentation, feature selection",
                  "model": "the model family, its architecture, ensembles of models",
                  "learning": "the training procedure: hyperparameters, regularisation, loss, validation, calibration"}

# ==== idea pools

IDEA_PROMPT = """Here is a machine-learning task; its train.py is a plain baseline.

{description}

Propose {n} different ideas of the category "{category}" ({hint}) that could improve the validation score of train.py.
Each idea is one sentence: a concrete instruction that a programmer can apply to the script. Make them as different
from each other as you can{avoid}. Answer with a numbered list, one idea per line, and nothing else."""


def parse_ideas(text: str) -> list[str]:
    """Ideas of a numbered or bulleted list, less markdown emphasis and too-short lines."""
    items = re.finditer(r"^\s*(?:\d+[.):]|[-*\u2022])\s+(.+?)\s*$", text, re.M)
    ideas = (re.sub(r"\*\*|__|`", "", m.group(1)).strip() for m in items)
    return [idea for idea in ideas if len(idea) >= 15]


def propose_ideas(backend, task: env.Task, category: str, n=100, batch=25) -> list[str]:
    """At least `n` distinct LLM ideas, `batch` a request, or what 2n/batch requests gave."""
    ideas: dict[str, str] = {}
    for _ in range(max(1, 2 * n // batch)):
        avoid = "; do not repeat these: " + "; ".join(list(ideas.values())[-30:]) if ideas else ""
        text = backend.chat([{"role": "user", "content": IDEA_PROMPT.format(
            description=task.description, n=batch, category=category, hint=CATEGORY_HINTS[category], avoid=avoid)}],
            temperature=1.0, max_tokens=3000).texts[0]
        for idea in parse_ideas(text):
            ideas.setdefault(idea.lower().rstrip("."), idea)
        if len(ideas) >= n:
            break
    return list(ideas.values())


def recipe_ideas(task_name: str) -> dict[str, list[str]]:
    return {c: [r.idea for r in env.recipes_for(task_name) if r.category == c] for c in CATEGORIES}


def read_pools(path: Path) -> dict:
    """ideas.json or {}; else a one-line ValueError naming it."""
    if not path.exists():
        return {}
    try:
        pools = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}); delete it to make the pools again") from None
    if not (isinstance(pools, dict) and all(isinstance(p, dict) and all(
            isinstance(v, list) and all(isinstance(i, str) for i in v) for v in p.values()) for p in pools.values())):
        raise ValueError(f"{path}: expected {{task: {{category: [idea, ...]}}}}; delete it to make the pools again")
    return pools

# ==== the diversity filter


def tfidf_embed(texts: list[str]) -> np.ndarray:
    from sklearn.feature_extraction.text import TfidfVectorizer
    return TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit_transform(texts).toarray()


def farthest_point(X: np.ndarray, k: int) -> list[int]:
    """k rows of X as departure 2 picks them; ties: the lowest index."""
    X = np.asarray(X, dtype=np.float64)
    X = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)  # unit rows
    if len(X) <= k:
        return list(range(len(X)))
    picked = [int(np.argmax(X @ X.mean(axis=0)))]  # the most typical idea
    nearest = 1.0 - X @ X[picked[0]]  # cosine distance to the nearest picked row
    while len(picked) < k:
        nearest[picked] = -np.inf
        nxt = int(np.argmax(nearest))
        picked.append(nxt)
        nearest = np.minimum(nearest, 1.0 - X @ X[nxt])
    return picked


def diverse_pool(candidates: dict[str, list[str]], k: int, embed) -> dict[str, list[str]]:
    """k ideas per category, far apart in `embed(texts) -> (N, D)` space."""
    pool = {}
    for category, ideas in candidates.items():
        ideas = list(dict.fromkeys(ideas))
        pool[category] = [ideas[i] for i in farthest_point(embed(ideas), k)] if len(ideas) > k else ideas
    return pool


def sample_ideas(pool: dict[str, list[str]], rng: random.Random) -> list[tuple[str, str]]:
    """ML-Agent, App. B.1: 1-3 categories in random order, an idea from each."""
    categories = [c for c in CATEGORIES if pool.get(c)]
    chosen = rng.sample(categories, rng.randint(1, min(3, len(categories)))) if categories else []
    rng.shuffle(chosen)
    return [(c, rng.choice(pool[c])) for c in chosen]

# ==== rollouts

expert_backend = functools.cache(agent.make_backend)  # one per worker process, on first use


def usage_of(backends, since=None) -> dict:
    """Usage and cost summed over distinct backends (eval.py's too), less an earlier sum `since`."""
    seen = {id(b): b for b in backends}.values()
    keys = ("calls", "prompt_tokens", "completion_tokens", "seconds", "cost")
    now = {k: sum(getattr(b.usage, k) for b in seen) for k in keys}
    return {k: v - since[k] for k, v in now.items()} if since else now


def rollout(job: dict) -> dict:
    """An expert trajectory and its backend's usage (in a worker)."""
    backend = expert_backend(job["expert"], job["base_url"], *job["prices"])
    scripted = isinstance(backend, agent.ScriptedExpert)
    e = env.Env(job["task"], editor=env.recipe_editor if scripted else agent.LLMEditor(backend), cache=True)
    before = usage_of([backend])
    config = reward.from_record(job.get("reward_config"))  # a dict: jobs travel to workers
    traj = agent.run_episode(e, backend, [tuple(i) for i in job["ideas"]], max_steps=job["max_steps"],
                             time_limit=job["time_limit"], reward_config=config)
    return {"id": job["id"], **asdict(traj), "usage": usage_of([backend], before), "reward_config": asdict(config)}


def _safe_rollout(fn, job) -> tuple[dict, dict | None, str | None]:
    try:
        return job, fn(job), None
    except Exception:  # noqa: BLE001 - logged; the other rollouts go on
        return job, None, traceback.format_exc()

# ==== SFT data and states pool


def sft_rows(trajectories):
    for t in trajectories:
        for s in t["steps"]:
            if s["kind"] != "invalid":
                yield {"messages": s["messages"] + [{"role": "assistant", "content": s["response"]}]}


def state_rows(trajectories):
    """A state per step, before the expert acted (d^{pi_e}(s_t) of J_step)."""
    for t in trajectories:
        for s in t["steps"]:
            yield {"id": f"{t['id']}/{s['index']}", "task": t["task"], "task_dir": s["snapshot"]["task_dir"],
                   "step": s["index"], "messages": s["messages"], "snapshot": s["snapshot"],
                   "m_t": s["snapshot"]["metric"], "m_init": t["m_init"], "m_best": t["m_best"],
                   "higher_is_better": t["higher_is_better"], "ideas": t["ideas"],
                   "expert": {"action": s["action"], "kind": s["kind"], "reward": s["reward"]},
                   "reward_config": asdict(reward.from_record(t.get("reward_config")))}

# ==== the summary


def summarize(trajectories, wall_seconds: float, new: int) -> str:
    steps = [s for t in trajectories for s in t["steps"]]
    actions = Counter(s["action"] or "(invalid)" for s in steps)
    ideas = {idea for t in trajectories for _, idea in t["ideas"]}
    lines = [f"{len(trajectories)} trajectories, {len(steps)} steps ({len(steps) / max(len(trajectories), 1):.1f} "
             f"per trajectory), {len(ideas)} distinct ideas used, mean step reward "
             f"{np.mean([s['reward'] for s in steps]) if steps else float('nan'):+.3f}",
             "actions: " + ", ".join(f"{a} {n}" for a, n in actions.most_common()),
             f"{'task':<15}{'traj':>5}{'m_init':>10}{'final (mean)':>14}{'final (best)':>14}"]
    for task in sorted({t["task"] for t in trajectories}):
        ts = [t for t in trajectories if t["task"] == task]
        finals = [t["steps"][-1]["metric"] for t in ts if t["steps"] and t["steps"][-1]["metric"] is not None]
        best = (max if ts[0]["higher_is_better"] else min)(finals) if finals else float("nan")
        mean = np.mean(finals) if finals else float("nan")
        lines.append(f"{task:<15}{len(ts):>5}{ts[0]['m_init']:>10.4f}{mean:>14.4f}{best:>14.4f}")
    # LLM: agent and editor (in env.step: usage seconds beyond the agent's); sandbox: rest of env.step and env.reset
    used = lambda k: sum(t.get("usage", {}).get(k, 0) for t in trajectories)  # noqa: E731
    agent_llm = sum(s["llm_seconds"] for s in steps)
    editor = max(used("seconds") - agent_llm, 0.0)
    llm = agent_llm + editor
    sandbox = sum(s["env_seconds"] for s in steps) + sum(t["reset_seconds"] for t in trajectories) - editor
    total = max(sum(t["seconds"] for t in trajectories), 1e-9)
    lines.append(f"expert tokens in/out {used('prompt_tokens')}/{used('completion_tokens')}, cost ${used('cost'):.4f}")
    lines.append(f"this run: {new} new trajectories in {wall_seconds:.1f}s = "
                 f"{60 * new / max(wall_seconds, 1e-9):.1f} trajectories/min; time in rollouts: LLM "
                 f"{100 * llm / total:.1f}%, sandbox {100 * sandbox / total:.1f}%, bookkeeping "
                 f"{100 * max(total - llm - sandbox, 0) / total:.1f}%")
    return "\n".join(lines)

# ==== collection


def collect(tasks, trajectories=5, workers=2, expert="scripted", base_url=None, out="runs/data", seed=0, k=10,
            candidates=100, max_steps=15, time_limit=1800.0, prices=(0.0, 0.0), rollout_fn=rollout,
            progress=True, reward_config=reward.RewardConfig()) -> str:
    """`trajectories` per task into `out`, resuming; -> the printed summary."""
    start, out, prices = time.time(), Path(out), tuple(prices)  # hashable: expert_backend's cache key
    with agent.claim_folder(out):  # .lock: one run per --out; a second would append every row again
        traj_path, err_path = out / "trajectories.jsonl", out / "errors.jsonl"
        keys = ("id", "task", "steps", "ideas", "m_init", "m_best", "higher_is_better")
        existing = agent.read_jsonl(traj_path, keys, repair=True)
        for old in {reward.from_record(t.get("reward_config")) for t in existing}:  # no key: the default
            if old != reward_config:
                raise ValueError(f"{traj_path} holds trajectories collected with {reward.mismatch(old, reward_config)}"
                                 "; pass the same reward flags or another --out")
        loaded = env.load_tasks(tasks)  # here, in parallel, not racing in the workers

        # 1. idea pools (on resume: ideas.json's)
        ideas_path = out / "ideas.json"
        pools = read_pools(ideas_path)
        llm = expert not in ("scripted", None) and (bool(base_url) or not os.path.isdir(expert))  # an endpoint
        backend = expert_backend(expert, base_url, *prices) if llm else None
        before, ideas_line = (usage_of([backend]) if llm else None), ""
        for task in loaded:
            if task.name in pools:
                continue
            if llm:
                cands = {c: propose_ideas(backend, task, c, candidates) for c in CATEGORIES}
                try:
                    backend.embeddings(["probe"])
                    embed = backend.embeddings
                except agent.BackendError as e:  # no /v1/embeddings
                    print(f"collect.py: embeddings unavailable ({e}); the diversity filter uses TF-IDF",
                          file=sys.stderr)
                    embed = tfidf_embed
            else:
                cands, embed = recipe_ideas(task.name), tfidf_embed
            pools[task.name] = diverse_pool(cands, k, embed)
        if llm:  # counted before the rollouts: one worker shares this backend
            u = usage_of([backend], before)
            ideas_line = (f"\nidea proposals: tokens in/out {u['prompt_tokens']}/{u['completion_tokens']}, "
                          f"cost ${u['cost']:.4f}")
        agent.write_atomic(ideas_path, json.dumps(pools, indent=1))

        # 2. jobs: ids not yet done; ideas seeded by the id
        done = {t["id"] for t in existing}
        ids = [(task.name, f"{task.name}-{i:04d}") for task in loaded for i in range(trajectories)]
        jobs = [{"id": tid, "task": name, "expert": expert, "base_url": base_url, "prices": prices,
                 "max_steps": max_steps, "time_limit": time_limit, "ideas": sample_ideas(pools[name],
                 random.Random(f"{seed}:{tid}")), "reward_config": asdict(reward_config)}
                for name, tid in ids if tid not in done]

        # 3. rollouts in workers; only this process writes, whole lines
        new, pool = 0, (mp.Pool(workers) if workers > 1 and len(jobs) > 1 else None)
        safe = functools.partial(_safe_rollout, rollout_fn)
        results = pool.imap_unordered(safe, jobs) if pool else map(safe, jobs)
        try:
            for job, traj, error in tqdm(results, total=len(jobs), desc="trajectories", disable=not progress):
                if traj is not None and not traj["steps"]:  # recorded, it would not be retried
                    traj, error = None, (f"no step within --time-limit {job['time_limit']} s "
                                         f"(stopped: {traj['stopped']})")
                if traj is not None:
                    agent.append_jsonl(traj_path, traj)
                    new += 1
                else:
                    agent.append_jsonl(err_path, {"id": job["id"], "task": job["task"],
                                                  "error": error, "time": time.time()})
                    print(f"collect.py: rollout {job['id']} failed: {error.strip().splitlines()[-1]}", file=sys.stderr)
        finally:
            if pool:
                pool.terminate()

        # 4. SFT data and states pool from trajectories.jsonl by id (sft.py's split follows row order)
        trajs = sorted(agent.read_jsonl(traj_path, complete_only=True), key=lambda t: t["id"])
        agent.write_atomic(out / "sft.jsonl", (json.dumps(r) + "\n" for r in sft_rows(trajs)))
        agent.write_atomic(out / "states.jsonl", (json.dumps(r) + "\n" for r in state_rows(trajs)))
        text = summarize(trajs, time.time() - start, new) + ideas_line
        if new < len(jobs):  # each job gives a trajectory or an error
            text += f"\n{len(jobs) - new} rollouts failed (see {err_path}); run again to retry them"
        return text

# ==== command line


def main(argv=None):
    held_in = [name for name, spec in env.BUILTIN_TASKS.items() if spec.split == "held-in"]
    p = agent.Parser(prog="collect.py",
                     description="Collect exploration-enriched expert trajectories, SFT data and the states pool.")
    p.add_argument("--tasks", nargs="+", default=held_in, help="built-in task names or task folders (held-in)")
    p.add_argument("--trajectories", type=agent.POSITIVE_INT, default=3, help="trajectories per task, other ideas each")
    p.add_argument("--workers", type=agent.COUNT, default=2, help="worker processes")
    p.add_argument("--expert", default="scripted",
                   help="'scripted' (offline stand-in), an endpoint model name, or a local checkpoint folder")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL)")
    p.add_argument("--out", default=str(env.ROOT / "runs" / "data"), help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seeds the ideas of each trajectory (with its id)")
    p.add_argument("--k", type=agent.POSITIVE_INT, default=10, help="ideas kept per category by the diversity filter")
    p.add_argument("--candidates", type=agent.POSITIVE_INT, default=100, help="LLM ideas per category and task")
    p.add_argument("--max-steps", type=agent.POSITIVE_INT, default=15, help="steps per trajectory (ML-Agent: 15)")
    p.add_argument("--time-limit", type=agent.POSITIVE, default=1800.0, help="seconds per trajectory (paper: 30 min)")
    p.add_argument("--price", type=agent.NONNEGATIVE, nargs=2, default=(0.0, 0.0), metavar=("IN", "OUT"),
                   help="dollars per million input and output tokens of the expert, for the reported cost")
    reward.add_flags(p)  # the reward of the recorded steps
    args = p.parse_args(argv)
    try:
        reward_config = reward.from_flags(args)
        args.expert = agent.check_model(p, "--expert", args.expert, args.base_url)  # not in every rollout
        env.load_tasks(args.tasks)
    except (ValueError, env.TaskError) as e:
        p.error(str(e))
    try:
        print(collect(args.tasks, args.trajectories, args.workers, args.expert, args.base_url, args.out, args.seed,
                      args.k, args.candidates, args.max_steps, args.time_limit, tuple(args.price),
                      reward_config=reward_config))
    except agent.BackendError as e:
        sys.exit(f"collect.py: {e}")
    except (ValueError, OSError) as e:  # a bad file under --out, another reward config, --out in use
        p.error(str(e))


if __name__ == "__main__":
    main()
