"""Benchmark: the throughput of collect.py and where its time goes.

Runs a small offline collection (scripted expert, recipe ideas) into a temporary folder and prints collect.py's
summary, whose last line gives trajectories per minute and the share of rollout time spent in the LLM (the expert's
chat calls; ~0 for the scripted stand-in), in the sandbox (env.reset and env.step: script runs, cached or not) and in
bookkeeping (prompts, parsing, snapshots, JSONL). Sandbox runs are cached in runs/cache, so a second run measures the
agent loop with cache hits; --fresh uses a temporary cache folder so every distinct script really runs.
Not collected by pytest (the file name does not start with test_).

    python tests/bench_collect.py                        # held-in tasks, 2 trajectories each, 2 workers
    python tests/bench_collect.py --trajectories 4 --workers 1 --fresh
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collect  # noqa: E402
import env  # noqa: E402


def main():
    held_in = [n for n, s in env.BUILTIN_TASKS.items() if s.split == "held-in"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=held_in)
    p.add_argument("--trajectories", type=int, default=2, help="per task")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fresh", action="store_true", help="an empty sandbox cache (runs every script)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        if args.fresh:
            env.CACHE_DIR = Path(out) / "cache"  # forked workers inherit the patched module attribute
        print(collect.collect(args.tasks, args.trajectories, args.workers, out=out, progress=False))


if __name__ == "__main__":
    main()
