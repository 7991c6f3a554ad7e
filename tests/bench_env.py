"""Benchmark: what the sandbox of env.py costs per run.

For each task's starter script it times, N times each (interleaved, after one warm-up of each):

- plain:   `subprocess.run([python, "train.py"], cwd=<a copy of public/>)`, nothing else;
- plain-1: the same with OMP/OPENBLAS/MKL_NUM_THREADS=1, as the sandbox sets them (one core per run, so that parallel
           runs share the machine): on a multi-core machine this is the like-for-like baseline for the sandbox's cost;
- sandbox: `env.run_script(task, code, cache=False)`: fresh workspace, scrubbed environment, rlimits, other user,
           no network, process-group kill, bounded output, and grading of the submission; the script runs in a fork
           of env.py's fork server, which imported numpy, pandas and scikit-learn once;
- sbx-new: the same with env.FORK_SERVER = False: a new interpreter per run, which imports them itself (how every
           run was made before the fork server);
- cache:   `env.run_script(task, code, cache=True)` once the result is cached (a cache hit).

It prints the mean (and min) times, the ratio sandbox / plain (the aim: at most 1.2x) and the fork server's speed-up,
sbx-new / sandbox.
Not collected by pytest (the file name does not start with test_).

    python tests/bench_env.py                       # digits, 5 repeats
    python tests/bench_env.py --tasks digits wine --repeats 10
    python tests/bench_env.py --tasks all
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import env  # noqa: E402


ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def time_plain(task, code: str, one_thread: bool = False) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-plain-") as d:
        work = Path(d) / "work"
        shutil.copytree(task.public_dir, work)
        (work / "train.py").write_text(code)
        environ = {**os.environ, **ONE_THREAD} if one_thread else None
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "train.py"], cwd=work, capture_output=True, text=True, env=environ)
        dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{task.name}: the starter fails outside the sandbox:\n{p.stderr[-2000:]}")
    return dt


def time_sandbox(task, code: str, fork_server: bool = True) -> float:
    env.FORK_SERVER = fork_server
    t0 = time.perf_counter()
    r = env.run_script(task, code, cache=False)
    dt = time.perf_counter() - t0
    env.FORK_SERVER = True
    if r.status != "success":
        raise SystemExit(f"{task.name}: the starter ends as {r.status} in the sandbox:\n{r.output[-2000:]}")
    return dt


def time_cache_hit(task, code: str, repeats: int) -> float:
    env.run_script(task, code, cache=True)  # make sure it is cached
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = env.run_script(task, code, cache=True)
        times.append(time.perf_counter() - t0)
        if not r.cached:
            raise SystemExit(f"{task.name}: the second identical run was not served from the cache")
    return statistics.mean(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=["digits"], help="task names, or 'all'")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per task and method (default 5)")
    args = ap.parse_args()
    names = sorted(env.BUILTIN_TASKS) if args.tasks == ["all"] else args.tasks

    rows = []
    for name in names:
        task = env.load_task(name)
        code = (task.public_dir / "train.py").read_text()
        time_plain(task, code), time_sandbox(task, code)  # warm-up: page cache, imports, .pyc files, the server
        plain, plain1, sandbox, fresh = [], [], [], []
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits all four alike
            plain.append(time_plain(task, code))
            plain1.append(time_plain(task, code, one_thread=True))
            sandbox.append(time_sandbox(task, code))
            fresh.append(time_sandbox(task, code, fork_server=False))
        hit = time_cache_hit(task, code, args.repeats)
        rows.append((name, *map(statistics.mean, (plain, plain1, sandbox)), min(sandbox), hit,
                     statistics.mean(fresh)))
        print(f"  {name}: done", file=sys.stderr, flush=True)

    print(f"\nsandbox cost per run: mean of {args.repeats} runs in seconds (cache hit in milliseconds); "
          f"{os.cpu_count()} CPU cores\n")
    head = (f"{'task':<14}{'plain':>8}{'plain-1':>9}{'sandbox':>9}{'sbx min':>9}{'/plain':>8}{'/plain-1':>10}"
            f"{'overhead':>10}{'cache hit':>11}{'sbx-new':>9}{'new/sbx':>9}  aim <= 1.2x")
    print(head)
    print("-" * len(head))
    for name, p, p1, sb, sbmin, hit, new in rows:
        print(f"{name:<14}{p:>8.3f}{p1:>9.3f}{sb:>9.3f}{sbmin:>9.3f}{sb / p:>7.2f}x{sb / p1:>9.2f}x{sb - p1:>+10.3f}"
              f"{hit * 1000:>9.1f}ms{new:>9.3f}{new / sb:>8.2f}x  {'ok' if max(sb / p, sb / p1) <= 1.2 else 'OVER'}")
    if len(rows) > 1:
        p, p1, sb, new = (statistics.mean(r[i] for r in rows) for i in (1, 2, 3, 6))
        print("-" * len(head))
        print(f"{'mean':<14}{p:>8.3f}{p1:>9.3f}{sb:>9.3f}{'':>9}{sb / p:>7.2f}x{sb / p1:>9.2f}x{sb - p1:>+10.3f}"
              f"{'':>11}{new:>9.3f}{new / sb:>8.2f}x")
    print("\nplain: subprocess.run([python, 'train.py']) in a copy of public/; plain-1: the same with one BLAS/OpenMP "
          "thread, as in the sandbox;\noverhead: sandbox - plain-1 (workspace copy, isolation, rlimits, kill, grading); "
          "sbx-new: the sandbox with a new interpreter per run (env.FORK_SERVER = False).")

if __name__ == "__main__":
    main()
