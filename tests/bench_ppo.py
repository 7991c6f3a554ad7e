"""PPO variants against their SFT start (not collected by pytest): does a setting of ppo.py raise J_step?

Each variant is one `python ppo.py` run from the same SFT model on the same states pool, with the flags given; then
J_step (bench_claims.estimate_objective: one sampled action in each of --objective-states seeded states, repeated for
--objective-seeds seeds) is measured for the SFT model and for every variant on the same states with the same
sampling seeds, so each PPO - SFT difference is paired by state and seed and gets a 95% bootstrap interval
(bench_claims.bootstrap). This is how tests/RESULTS.md's "PPO on the tiny model" numbers are made; a student who
changes the reward (reward.py) or a PPO detail runs it to see whether the change shows.

  python tests/bench_ppo.py                                  # the two default variants, from runs/ckpt/sft
  python tests/bench_ppo.py --variant "lam1: --lam 1.0" --variant "group8: --advantage group --samples-per-state 8"
  python tests/bench_ppo.py --iterations 16                  # longer runs (an existing run resumes from its last
                                                             # checkpoint; ppo.py's own resume)

The course loop (README, "The reward, and how to change it"): after the quick pipeline, a reward change as a variant
trained as the pipeline's ppo.py (15 iterations) against the pipeline's own PPO run as it is (NAME=FOLDER: a finished
ppo.py run, not trained again; it must come from --model and --states with --iterations iterations), over 8 J_step
seeds:

  python tests/bench_ppo.py --variant "full=runs/ckpt/ppo" --variant "no-format: --no-format-term" --iterations 15 \
      --objective-seeds 8

Each later variant is paired against the first too: J_step, the share of invalid actions (what the format term acts
on), and the J_step difference the pairs can detect (bench_claims.power).

The PPO runs and the J_step measurements (one process per seed and policy) run --lanes at a time, each with one torch
thread, the PPO runs first (with CUDA one at a time); their output goes to --out/<job>.out. Writes --out/results.json
and --out/results.md (the table printed at the end), and --out/<variant>/ (the actor) with <variant>.jsonl (ppo.py's
log). A measured J_step seed is kept in --out/objective-<name>-<seed>.json with reward.py's code hash (reward.CODE)
and the policy's id (eval.policy_id: its files): measured again when reward.py or the policy changed, or when the file
is deleted.
"""
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import agent  # noqa: E402
import bench_claims  # noqa: E402  (beside this file)
from eval import policy_id  # noqa: E402
import reward  # noqa: E402

VARIANTS = ["gae: --batch-size 64",  # the paper's PPO with a critic, 64 actions per iteration
            "group: --advantage group --samples-per-state 4 --batch-size 16"]  # no critic, 64 actions per iteration


def parse_variant(text):
    """'NAME: FLAGS' (a ppo.py run to train) or 'NAME=FOLDER' (a finished one) -> (name, flags, folder or None)."""
    name, _, flags = text.partition(":")
    name, _, folder = name.partition("=")
    if not name.strip() or not name.strip().replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--variant {text!r}: expected NAME: FLAGS or NAME=FOLDER, NAME letters, digits, - or _")
    if folder.strip() and flags.strip():
        raise ValueError(f"--variant {text!r}: a finished run (NAME=FOLDER) takes no flags: it ran with its own")
    return name.strip(), shlex.split(flags), folder.strip() or None


def finished_run(name, folder, model, states, iterations):
    """A finished ppo.py run as a variant, checked against this bench: the same start model, states pool and number
    of iterations (else its J_step pairs are not comparable) -> (its log, the reward config it recorded)."""
    path = Path(folder) / "trainer_state" / "progress.json"
    if not path.exists():
        raise ValueError(f"--variant {name}={folder}: no ppo.py checkpoint there ({path} is missing)")
    progress = json.loads(path.read_text())
    cfg = progress.get("config", {})
    for key, want in (("model", model), ("states", states)):
        if os.path.abspath(cfg.get(key, "")) != os.path.abspath(want):
            raise ValueError(f"--variant {name}={folder}: trained from {key} {cfg.get(key)}, not --{key} {want}")
    if progress.get("iteration") != iterations:
        raise ValueError(f"--variant {name}={folder}: ran {progress.get('iteration')} iterations, not --iterations "
                         f"{iterations}")
    log = cfg.get("log_file")
    log = [json.loads(line) for line in open(log, encoding="utf-8")] if log and os.path.exists(log) else []
    return log, reward.from_record(cfg.get("reward"))


def measure(out, name, policy, states, n, seed):
    """J_step of `policy` on one seed's n states (bench_claims.estimate_objective), kept in
    out/objective-<name>-<seed>.json with reward.py's code hash and the policy's id (eval.policy_id: its files)."""
    x = bench_claims.estimate_objective(policy, states, n=n, seed=seed)
    agent.write_atomic(out / f"objective-{name}-{seed}.json", json.dumps(
        {"rewards": x["rewards"], "kinds": x["kinds"], "reward_code": reward.CODE, "policy": policy_id(policy)}))


def measured(out, name, policy, seed):
    """The kept measurement of one seed, or None when there is none for this reward.py and these weights."""
    path = out / f"objective-{name}-{seed}.json"
    x = json.loads(path.read_text()) if path.exists() else {}
    return x if x.get("reward_code") == reward.CODE and x.get("policy") == policy_id(policy) else None


class Lanes:
    """This bench's subprocesses, `n` at a time (one torch thread each when n > 1), in the order they ask (CPython's
    Semaphore wakes its waiters first come, first served); output in out/<job>.out."""

    def __init__(self, n, out):
        self.slots, self.out, self.threads = threading.Semaphore(n), out, 1 if n > 1 else 0

    def run(self, job, cmd):
        with self.slots, open(self.out / f"{job}.out", "w") as f:
            print(f"bench_ppo.py: {job}: {shlex.join(cmd[1:])}", flush=True)
            env = {**os.environ, **({"OMP_NUM_THREADS": str(self.threads)} if self.threads else {})}
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        if code != 0:
            raise RuntimeError(f"{job} failed (exit {code}); its output: {f.name}")


def objective(lanes, a, name, policy):
    """J_step of `policy` over the seeds (each seed in a lane of its own unless kept): the seeds' rewards and kinds
    joined in seed order."""
    def one(seed):
        if measured(lanes.out, name, policy, seed) is None:
            lanes.run(f"objective-{name}-{seed}", [sys.executable, __file__, "--measure", name, policy, str(seed),
                                                  "--states", a.states, "--out", str(lanes.out),
                                                  "--objective-states", str(a.objective_states)])
        return measured(lanes.out, name, policy, seed)
    with ThreadPoolExecutor(a.objective_seeds) as pool:
        parts = list(pool.map(one, range(a.objective_seeds)))
    return {"rewards": [r for x in parts for r in x["rewards"]], "kinds": [k for x in parts for k in x["kinds"]]}


def paired(a, b):
    """a - b of J_step and of the invalid share, paired by (seed, state): the same states and sampling seeds for every
    policy; with J_step's power (bench_claims.power: the difference these pairs detect, the pairs a mean needs)."""
    d = [x - y for x, y in zip(a["rewards"], b["rewards"])]
    invalid = [(x == "invalid") - (y == "invalid") for x, y in zip(a["kinds"], b["kinds"])]
    return {**bench_claims.bootstrap(d), **bench_claims.power(d), "invalid": bench_claims.bootstrap(invalid)}


def row(name, flags, obj, base, first, log):
    last = log[-1] if log else {}
    return {"variant": name, "flags": " ".join(flags), "j_step": sum(obj["rewards"]) / len(obj["rewards"]),
            "minus_sft": paired(obj, base), "minus_first": None if first is None else paired(obj, first),
            "invalid": obj["kinds"].count("invalid") / len(obj["kinds"]),
            "clipfrac_max": max((x["clipfrac"] for x in log), default=None), "kl_end": last.get("kl"),
            "explained_variance_end": last.get("explained_variance"), "iterations": len(log),
            "seconds": sum(x["time_total"] for x in log)}


def markdown(result):
    f = lambda x, d=3: "-" if x is None else f"{x:+.{d}f}"  # noqa: E731
    lines = [f"PPO from `{result['model']}`, J_step on {result['objective_seeds']} x {result['objective_states']} "
             f"seeded states ({result['date']}): SFT {result['sft']['j_step']:+.3f}, invalid "
             f"{result['sft']['invalid']:.1%}", "",
             f"| variant | flags | iterations | J_step | PPO - SFT [95%] | - {result['rows'][0]['variant']} [95%] | "
             f"invalid | invalid - {result['rows'][0]['variant']} [95%] | clip fraction (max) | KL at the end | "
             "EV at the end | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ci = lambda d: "-" if d is None else f"{f(d['mean'])} [{f(d['lo'])}, {f(d['hi'])}]"  # noqa: E731
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | `{r['flags']}` | {r['iterations']} | {r['j_step']:+.3f} | "
                     f"{ci(r['minus_sft'])} | {ci(r['minus_first'])} | {r['invalid']:.1%} | "
                     f"{ci(r['minus_first'] and r['minus_first']['invalid'])} | {f(r['clipfrac_max'], 4)} | "
                     f"{f(r['kl_end'], 2)} | {f(r['explained_variance_end'], 2)} | {r['seconds']:.0f} |")
    power = [f"{r['variant']} - {result['rows'][0]['variant']}: {r['minus_first']['detectable']:.3f} ("
             f"{r['minus_first']['units_needed']} pairs for its mean)" for r in result["rows"][1:]
             if r["minus_first"]["detectable"] is not None]
    if power:
        lines += ["", "J_step differences these pairs detect (80% power, 5%): " + "; ".join(power)]
    lines += [f"- {n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = agent.Parser(prog="bench_ppo.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "runs/ckpt/sft"), help="the SFT model every variant starts from")
    p.add_argument("--states", default=str(ROOT / "runs/data/states.jsonl"), help="the states pool (collect.py)")
    p.add_argument("--out", default=str(ROOT / "runs/bench-ppo"), help="where the runs and results go")
    p.add_argument("--variant", action="append", help="NAME: ppo.py flags, or NAME=FOLDER: a finished ppo.py run "
                   "(repeatable; default: gae and group)")
    p.add_argument("--iterations", type=int, default=8, help="PPO iterations of every variant")
    p.add_argument("--objective-states", type=int, default=64, help="states per J_step seed")
    p.add_argument("--objective-seeds", type=int, default=3, help="J_step seeds (each a fresh sample of states)")
    p.add_argument("--lanes", type=int, default=0, help="PPO runs and J_step seeds at once, one torch thread each "
                   "(default: the CPU count; 1 with CUDA)")
    p.add_argument("--measure", nargs=3, metavar=("NAME", "POLICY", "SEED"), help="only J_step of POLICY on one seed, "
                   "kept in --out: what each lane runs (default: the whole bench)")
    a = p.parse_args(argv)
    a.model, a.states, a.out = map(os.path.abspath, (a.model, a.states, a.out))  # the jobs run in the project root
    if a.iterations < 1 or a.objective_states < 1 or a.objective_seeds < 1 or a.lanes < 0:
        p.error("--iterations, --objective-states and --objective-seeds must be at least 1, --lanes at least 0")
    out = Path(a.out)
    if a.measure:
        name, policy, seed = a.measure[0], os.path.abspath(a.measure[1]), a.measure[2]
        if not seed.isdigit() or not os.path.isdir(policy) or not os.path.exists(a.states):
            p.error(f"--measure {' '.join(a.measure)}: expected a name, a model folder and a seed (with --states)")
        out.mkdir(parents=True, exist_ok=True)
        return measure(out, name, policy, a.states, a.objective_states, int(seed))
    try:
        variants = [(name, flags, folder and os.path.abspath(folder))
                    for name, flags, folder in map(parse_variant, a.variant or VARIANTS)]
    except ValueError as e:
        p.error(str(e))
    if len({v[0] for v in variants}) < len(variants):
        p.error("--variant: two variants share a name")
    for path, what in ((a.model, "--model"), (a.states, "--states")):
        if not os.path.exists(path):
            p.error(f"{what} {path} does not exist (run collect.py and sft.py first)")
    try:
        finished = {name: finished_run(name, folder, a.model, a.states, a.iterations)
                    for name, _, folder in variants if folder}
    except ValueError as e:
        p.error(str(e))
    out.mkdir(parents=True, exist_ok=True)
    lanes = Lanes(a.lanes or (1 if torch.cuda.is_available() else os.cpu_count() or 1), out)  # a GPU: one model

    def variant(name, flags, folder):  # -> (J_step, ppo.py's log)
        if folder:
            return objective(lanes, a, f"{name}-{a.iterations}", folder), finished[name][0]
        lanes.run(name, [sys.executable, str(ROOT / "ppo.py"), "--model", a.model, "--states", a.states, "--out",
                         str(out / name), "--log-file", str(out / f"{name}.jsonl"), "--iterations",
                         str(a.iterations), *flags])
        log = [json.loads(line) for line in open(out / f"{name}.jsonl", encoding="utf-8")]
        return objective(lanes, a, f"{name}-{a.iterations}", str(out / name)), log

    with ThreadPoolExecutor(len(variants) + 1) as pool:  # the PPO runs ask for a lane first
        jobs = {v[0]: pool.submit(variant, *v) for v in sorted(variants, key=lambda v: v[2] is not None)}
        base = pool.submit(objective, lanes, a, "sft", a.model)
    try:
        base, done = base.result(), {name: job.result() for name, job in jobs.items()}
    except RuntimeError as e:
        sys.exit(f"bench_ppo.py: error: {e}")
    rows, first, notes = [], None, []
    for name, flags, folder in variants:
        obj, log = done[name]
        rows.append(row(name, flags if not folder else [f"(the run in {folder})"], obj, base, first, log))
        first = first or obj  # later variants are also paired against the first
        if folder and finished[name][1].code != reward.CODE:
            notes.append(f"{name} was trained under reward.py {finished[name][1].code}, now {reward.CODE}: it stands "
                         "for the reward of its flags only where the change left them as they were "
                         "(tests/test_reward.py)")
    sft = {"j_step": sum(base["rewards"]) / len(base["rewards"]),
           "invalid": base["kinds"].count("invalid") / len(base["kinds"])}
    result = {"date": time.strftime("%Y-%m-%d"), "model": a.model, "objective_states": a.objective_states,
              "objective_seeds": a.objective_seeds, "sft": sft, "rows": rows, "notes": notes}
    agent.write_atomic(out / "results.json", json.dumps(result, indent=1))
    agent.write_atomic(out / "results.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
