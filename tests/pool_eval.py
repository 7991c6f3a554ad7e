"""Pool eval.py's reports over seeds (not collected by pytest): one evaluation seed decides little, and one training
seed says nothing about the next (issue 42; tests/RESULTS.md has the pooled numbers this prints).

Each REPORT is an `eval.py --out` folder (or its report.json): one evaluation seed of one set of trained policies.
Policies are named as eval.py names them, by their folder's last part ("scripted", "sft", "ppo"), so the same
labels in every report: evaluate each training seed's runs/ckpt/{sft,ppo} into its own --out. Printed, per report
and pooled over all of them:
- each policy's clipped gain (eval.py's measure), its ideas followed and keep/undo right (issue 42's target 1);
- B - A of the clipped gains, paired by (task, run) within each report, as eval.py pairs them.
Two intervals for the pooled numbers (95%, percentile bootstrap):
- "tasks": eval.py's, the tasks resampled, each with every report's runs of it: the spread of tasks only;
- "two-level": the reports resampled, then the tasks within each: the spread between seeds too. Use this one for a
  claim about training seeds; with few reports its outer draw is coarse (two reports: three possible draws).

  python tests/pool_eval.py runs/eval runs/eval-seed1                      # two evaluation seeds
  python tests/pool_eval.py runs/s*/eval --a sft --b ppo                   # one report per training seed
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent import Parser, write_atomic  # noqa: E402
from eval import RESAMPLES, task_bootstrap  # noqa: E402


def load(path: str, scaffold: str) -> dict:
    """{policy label: {task: [clipped gain per run], "followed"/"agreed": [right, of n]}} of one report."""
    file = Path(path) / "report.json" if Path(path).is_dir() else Path(path)
    try:
        groups = json.loads(file.read_text())["groups"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: not an eval.py report.json ({type(e).__name__}: {e})") from None
    return {g["policy"]: {"tasks": {t["task"]: t["gains_clipped"] for t in g["tasks"]},
                          **{k: [sum(t[k] for t in g["tasks"]), sum(t[f"{k}_n"] for t in g["tasks"])]
                             for k in ("followed", "agreed")}}
            for g in groups if g["scaffold"] == scaffold}


def two_level(per_report: list[list[list[float]]], seed: int = 0) -> tuple:
    """The 95% interval of the mean over runs, the reports resampled and then the tasks within each drawn report."""
    per_report = [[v for v in tasks if v] for tasks in per_report]
    sums = [np.array([sum(v) for v in tasks]) for tasks in per_report if tasks]
    counts = [np.array([len(v) for v in tasks]) for tasks in per_report if tasks]
    if not sums:
        return None, None
    rng, means = np.random.default_rng(seed), []
    for _ in range(RESAMPLES):
        total = n = 0.0
        for i in rng.integers(len(sums), size=len(sums)):
            pick = rng.integers(len(sums[i]), size=len(sums[i]))
            total, n = total + sums[i][pick].sum(), n + counts[i][pick].sum()
        means.append(total / n)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def pooled(per_report: list[dict]) -> dict:
    """mean, the tasks interval and the two-level interval of per-report {task: [values]}."""
    by_task: dict = {}
    for tasks in per_report:
        for name, values in tasks.items():
            by_task.setdefault(name, []).extend(values)
    mean, low, high = task_bootstrap(list(by_task.values()))
    return {"mean": mean, "tasks": [low, high], "two_level": list(two_level([list(t.values()) for t in per_report])),
            "runs": sum(map(len, by_task.values())), "reports": len(per_report)}


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def said(name: str, g: dict, unit: str) -> str:
    """One pooled line: the mean, both intervals and the count."""
    return (f"  {name}: {pct(g['mean'])} [{pct(g['tasks'][0])}, {pct(g['tasks'][1])}] tasks, "
            f"[{pct(g['two_level'][0])}, {pct(g['two_level'][1])}] two-level; {g['runs']} {unit}")


def main(argv=None):
    p = Parser(prog="pool_eval.py", description="Pool eval.py's reports over evaluation or training seeds: each "
               "policy's clipped gain, and B - A paired by (task, run), with their intervals.")
    p.add_argument("reports", nargs="+", metavar="REPORT", help="eval.py --out folders or their report.json")
    p.add_argument("--a", default="sft", help="the policy subtracted (default: sft)")
    p.add_argument("--b", default="ppo", help="the policy it is subtracted from (default: ppo)")
    p.add_argument("--scaffold", default="mlab", help="the scaffold's runs to pool (default: mlab)")
    p.add_argument("--json", metavar="FILE", help="also write the pooled numbers to FILE")
    args = p.parse_args(argv)
    try:
        reports = [load(r, args.scaffold) for r in args.reports]
    except ValueError as e:
        p.error(str(e))
    for path, report in zip(args.reports, reports):
        for name in (args.a, args.b):
            if name not in report:
                p.error(f"{path}: no {args.scaffold} policy {name!r} (it has: {', '.join(report) or 'none'})")
    labels = [name for name in reports[0] if all(name in r for r in reports)]
    diffs = [{t: [y - x for x, y in zip(r[args.a]["tasks"][t], r[args.b]["tasks"].get(t, []))]
              for t in r[args.a]["tasks"]} for r in reports]
    print("| report | " + " | ".join(labels) + f" | {args.b} - {args.a} [95%, tasks] |")
    print("|---" * (len(labels) + 2) + "|")
    for path, r, d in zip(args.reports, reports, diffs):
        gains = [task_bootstrap(list(r[name]["tasks"].values()))[0] for name in labels]
        mean, low, high = task_bootstrap(list(d.values()))
        print(f"| {path} | " + " | ".join(map(pct, gains)) + f" | {pct(mean)} [{pct(low)}, {pct(high)}] |")
    result = {"reports": args.reports, "scaffold": args.scaffold, "policies": {}, "pair": [args.b, args.a]}
    print(f"\npooled over {len(reports)} report(s):")
    for name in labels:
        g = result["policies"][name] = pooled([r[name]["tasks"] for r in reports])
        rates = {k: [sum(r[name][k][0] for r in reports), sum(r[name][k][1] for r in reports)]
                 for k in ("followed", "agreed")}
        g.update(rates)
        counts = ", ".join(f"{k} {right}/{n}" + (f" ({right / n:.0%})" if n else "") for k, (right, n) in rates.items())
        print(said(name, g, "runs") + f"; {counts}")
    print(said(f"{args.b} - {args.a}", result.setdefault("difference", pooled(diffs)), "pairs"))
    if args.json:
        try:
            write_atomic(args.json, json.dumps(result, indent=1))
        except OSError as e:
            p.error(f"--json {args.json}: {e.strerror or e}")


if __name__ == "__main__":
    main()
