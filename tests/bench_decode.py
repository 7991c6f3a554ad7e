"""Benchmark (not collected by pytest): model.py's decoding against a baseline model.py read from git, in one run.

`git show REV:model.py` is imported as a second module; one random Qwen3 model (the same weights in both) generates
with each, interleaved (baseline, current, baseline, ...), the best of --repeats timed runs after one warm-up each:

- greedy, batch 1 and batch 8, --new-tokens tokens each, no early stop;
- rollout-like: --rollout-prompts prompts of LO-HI tokens, each stopping at its own length (8 .. --new-tokens), at
  most --rollout-batch rows at a time (continuous batching), greedy, then sampled with a seed per prompt.

It prints tokens/s of each and the ratio current / baseline, and how many greedy sequences are the same (sampled
rows draw differently since issue 44: a hash of seed and position, not a generator per row).

    python tests/bench_decode.py --baseline 725a445 --threads 1            # issue 44's change, on CPU
    python tests/bench_decode.py --baseline main --hidden 256 --layers 4 --new-tokens 32   # a quick look
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import model  # noqa: E402


def baseline_module(rev, folder):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:model.py"], capture_output=True, text=True)
    if src.returncode:
        sys.exit(f"bench_decode.py: error: --baseline {rev}: {src.stderr.strip()}")
    path = Path(folder) / "model_baseline.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("model_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def best_times(fns, repeats):
    """Best wall time of each function, interleaved after one warm-up of each (other load hits all alike)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def compare(name, lms, prompts, tokens, repeats, **kw):
    """-> a row: name, tokens/s baseline, current, ratio, same greedy sequences."""
    out = [None, None]

    def runner(i):
        def run():
            out[i] = lms[i].generate(prompts, stop_token_ids=[], **kw).tokens
        return run

    with torch.inference_mode():
        t_base, t_new = best_times([runner(0), runner(1)], repeats)
    n = tokens(out[1])
    same = sum(a == b for a, b in zip(*out))
    return name, n / t_base, n / t_new, t_base / t_new, f"{same}/{len(prompts)} sequences the same"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="725a445", help="a git revision whose model.py is the baseline")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rollout-prompts", type=int, default=32)
    p.add_argument("--rollout-batch", type=int, default=8)
    p.add_argument("--rollout-prompt-len", type=int, nargs=2, default=[50, 300], metavar=("LO", "HI"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        base = baseline_module(a.baseline, tmp)
        torch.manual_seed(0)
        cfg = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8, torch_dtype="float32",
                   tie_word_embeddings=False)
        new = model.Qwen(model.Config(**cfg)).eval()
        old = base.Qwen(base.Config(**cfg)).eval()
        old.load_state_dict(new.state_dict())
        lms = [old, new]
        print(f"model: Qwen3 hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, "
              f"{sum(q.numel() for q in new.parameters()) / 1e6:.1f}M params, fp32, {torch.get_num_threads()} threads; "
              f"baseline: model.py at {a.baseline}", flush=True)
        g = torch.Generator().manual_seed(0)
        count = lambda toks: sum(map(len, toks))  # noqa: E731

        def show(r):  # one row as it is measured
            print(f"{r[0]}: {r[2]:.1f} tok/s, baseline {r[1]:.1f} ({r[3]:.2f}x), {r[4]}", flush=True)
        rows = []
        for b in a.batches:
            prompts = [torch.randint(0, a.vocab, (a.prompt_len - i % 3,), generator=g).tolist() for i in range(b)]
            rows.append(compare(f"greedy, batch {b}, {a.new_tokens} new", lms, prompts, count, a.repeats,
                                max_new_tokens=a.new_tokens))
            show(rows[-1])
        lo, hi = a.rollout_prompt_len
        prompts = [torch.randint(0, a.vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(a.rollout_prompts)]
        stop_at = [int(torch.randint(8, a.new_tokens + 1, (1,), generator=g)) for _ in prompts]
        kw = dict(max_new_tokens=a.new_tokens, max_batch=a.rollout_batch, stop_fn=lambda i, t: len(t) >= stop_at[i])
        what = f"{a.rollout_prompts} prompts of {lo}-{hi}, batch {a.rollout_batch}"
        rows.append(compare(f"rollout-like greedy ({what})", lms, prompts, count, a.repeats, **kw))
        show(rows[-1])
        rows.append(compare("rollout-like, sampled, seeded", lms, prompts, count, a.repeats, temperature=1.0,
                            seeds=list(range(len(prompts))), **kw))
        show(rows[-1])
    print(f"\n| {'measurement':<52} | {'baseline tok/s':>14} | {'current tok/s':>13} | {'ratio':>6} | note")
    print(f"|{'-' * 54}|{'-' * 16}|{'-' * 15}|{'-' * 8}|------")
    for name, t_base, t_new, ratio, note in rows:
        print(f"| {name:<52} | {t_base:>14.1f} | {t_new:>13.1f} | {ratio:>6.2f} | {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
