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
against the reward as it is, each trained as the pipeline's ppo.py (15 iterations), over 8 J_step seeds:

  python tests/bench_ppo.py --variant "full:" --variant "no-format: --no-format-term" --iterations 15 \
      --objective-seeds 8

Each later variant is paired against the first too: J_step, the share of invalid actions (what the format term acts
on), and the J_step difference the pairs can detect (bench_claims.power).

Writes --out/results.json and --out/results.md (the table printed at the end), and --out/<variant>/ (the actor) with
<variant>.jsonl (ppo.py's log). A measured J_step is kept in --out/objective-<name>.json with reward.py's code hash
(reward.CODE): measured again when reward.py changed, or when the file is deleted.
"""
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import agent  # noqa: E402
import bench_claims  # noqa: E402  (beside this file)
import reward  # noqa: E402

VARIANTS = ["gae: --batch-size 64",  # the paper's PPO with a critic, 64 actions per iteration
            "group: --advantage group --samples-per-state 4 --batch-size 16"]  # no critic, 64 actions per iteration


def parse_variant(text):
    name, _, flags = text.partition(":")
    if not name.strip() or not name.strip().replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--variant {text!r}: expected NAME: FLAGS, NAME letters, digits, - or _")
    return name.strip(), shlex.split(flags)


def objective(out, name, policy, states, n, seeds):
    """J_step of `policy` over seeds x n states, kept in out/objective-<name>.json."""
    path = out / f"objective-{name}.json"
    if path.exists() and json.loads(path.read_text()).get("reward_code") == reward.CODE:  # else reward.py changed
        return json.loads(path.read_text())
    runs = [bench_claims.estimate_objective(policy, states, n=n, seed=s) for s in range(seeds)]
    result = {"rewards": [r for x in runs for r in x["rewards"]], "kinds": [k for x in runs for k in x["kinds"]],
              "reward_code": reward.CODE}
    agent.write_atomic(path, json.dumps(result))
    return result


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
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = agent.Parser(prog="bench_ppo.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "runs/ckpt/sft"), help="the SFT model every variant starts from")
    p.add_argument("--states", default=str(ROOT / "runs/data/states.jsonl"), help="the states pool (collect.py)")
    p.add_argument("--out", default=str(ROOT / "runs/bench-ppo"), help="where the runs and results go")
    p.add_argument("--variant", action="append", help="NAME: ppo.py flags (repeatable; default: gae and group)")
    p.add_argument("--iterations", type=int, default=8, help="PPO iterations of every variant")
    p.add_argument("--objective-states", type=int, default=64, help="states per J_step seed")
    p.add_argument("--objective-seeds", type=int, default=3, help="J_step seeds (each a fresh sample of states)")
    a = p.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in a.variant or VARIANTS]
    except ValueError as e:
        p.error(str(e))
    if a.iterations < 1 or a.objective_states < 1 or a.objective_seeds < 1:
        p.error("--iterations, --objective-states and --objective-seeds must be at least 1")
    for path, what in ((a.model, "--model"), (a.states, "--states")):
        if not os.path.exists(path):
            p.error(f"{what} {path} does not exist (run collect.py and sft.py first)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = objective(out, "sft", a.model, a.states, a.objective_states, a.objective_seeds)
    rows, first = [], None
    for name, flags in variants:
        cmd = [sys.executable, str(ROOT / "ppo.py"), "--model", a.model, "--states", a.states, "--out",
               str(out / name), "--log-file", str(out / f"{name}.jsonl"), "--iterations", str(a.iterations), *flags]
        print("bench_ppo.py:", " ".join(map(shlex.quote, cmd[1:])), flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            sys.exit(f"bench_ppo.py: error: variant {name} failed (ppo.py's message above)")
        log = [json.loads(line) for line in open(out / f"{name}.jsonl", encoding="utf-8")]
        obj = objective(out, f"{name}-{a.iterations}", str(out / name), a.states, a.objective_states,
                        a.objective_seeds)
        rows.append(row(name, flags, obj, base, first, log))
        first = first or obj  # later variants are also paired against the first
    result = {"date": time.strftime("%Y-%m-%d"), "model": a.model, "objective_states": a.objective_states,
              "objective_seeds": a.objective_seeds, "sft": {"j_step": sum(base["rewards"]) / len(base["rewards"]),
                                                            "invalid": base["kinds"].count("invalid") / len(base["kinds"])},
              "rows": rows}
    agent.write_atomic(out / "results.json", json.dumps(result, indent=1))
    agent.write_atomic(out / "results.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
