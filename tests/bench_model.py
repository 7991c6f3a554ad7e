"""Benchmark: model.py against transformers on CPU, same random weights and dtype, both in one run.

It measures, and prints as a table with the ratio ours / transformers:

- greedy generation tokens/s at batch 1 and batch 8 (128 new tokens, no early stop, prompts of slightly
  different lengths so the batch is left-padded), fp32;
- a rollout-like workload: 64 prompts of 500-2,000 tokens whose responses stop at different lengths, at most 16
  rows at a time (ours: continuous batching; transformers: consecutive batches of 16), in useful tokens/s;
- training tokens/s: forward + cross-entropy + backward over (batch, seq) random tokens, fp32;
- peak memory while loading a ~200M-parameter checkpoint (bf16 by default), each loader in a fresh subprocess:
  the rise of the RSS high-water mark (VmHWM, reset through /proc/self/clear_refs after the imports) during the
  load and one read of every weight (transformers memory-maps safetensors, so its weights become resident only
  when read; the note gives the rise before that read), as a ratio to the weights' bytes. In the memory row the
  ours and transformers columns are those ratios.

The aim: generation and training at least as fast as transformers (ratio >= 1) and a loading peak under
1.3x the weights. Not collected by pytest (the file name does not start with test_).

    python tests/bench_model.py                         # hidden 512, 8 layers: minutes on a CPU
    python tests/bench_model.py --threads 1             # steadier numbers on a machine shared with other work
    python tests/bench_model.py --hidden 256 --layers 4 --new-tokens 32 --skip-load   # a quick look
    python tests/bench_model.py --load-hidden 1024 --load-layers 12 --load-vocab 32000  # the ~200M load check
    python tests/bench_model.py --skip-load --skip-rollout --no-copies   # ours without the weight copies
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

ROOT = Path(__file__).resolve().parents[1]
DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5
sys.path.insert(0, str(ROOT))
import model  # noqa: E402

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def write_folder(path: Path, *, hidden, layers, vocab, heads, kv_heads, intermediate, tie, dtype, seed=0):
    """A Qwen3 checkpoint with random weights written by transformers, plus a byte-level tokenizer.json."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=hidden // heads, tie_word_embeddings=tie, rope_theta=1e6,
                                   max_position_embeddings=4096, initializer_range=0.1, eos_token_id=None)
    hf = transformers.Qwen3ForCausalLM(cfg).to(dtype)
    hf.save_pretrained(path)
    n_params = sum(p.numel() for p in hf.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    del hf
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return n_params, n_bytes


def timed_pair(fa, fb, repeats):
    """Best wall time of each of two functions, interleaved (a, b, a, b, ...) after one warm-up of each, so that
    load from other processes hits both alike."""
    fa(), fb()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((fa, fb)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def bench_generation(ours, hf, batch, new_tokens, prompt_len, repeats):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 256, (prompt_len - i % 3,), generator=g).tolist() for i in range(batch)]
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    out = {}

    def run_ours():
        out["ours"] = ours.generate(prompts, max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=[]).tokens

    def run_hf():
        out["hf"] = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[:, T:].tolist()

    with torch.inference_mode():
        t_ours, t_hf = timed_pair(run_ours, run_hf, repeats)
    n = batch * new_tokens
    assert all(len(s) == new_tokens for s in out["ours"]), "ours stopped early"
    same = sum(a == b for a, b in zip(out["ours"], out["hf"]))
    return n / t_ours, n / t_hf, f"{same}/{batch} sequences identical"


def bench_rollout(ours, hf, n_prompts, batch, new_tokens, lo, hi, repeats):
    """A PPO-rollout-like workload: n_prompts prompts of lo..hi tokens, each response stopping at its own length
    (8 .. new_tokens, drawn once), at most `batch` rows at a time. Ours: one call, continuous batching (a finished
    row's slot goes to the next prompt). transformers: generate() over consecutive batches of `batch` prompts, each
    running until its longest response ends, with the same per-row stops. -> (useful tok/s ours, theirs, note)"""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    stop_at = [int(torch.randint(8, new_tokens + 1, (1,), generator=g)) for _ in range(n_prompts)]
    out = {}

    class StopAt(transformers.StoppingCriteria):  # row i is done once it has stop_at[i] new tokens
        def __init__(self, start, lengths):
            self.start, self.lengths = start, torch.tensor(lengths)

        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - self.start) >= self.lengths.to(input_ids.device)

    def run_ours():
        out["ours"] = ours.generate(prompts, new_tokens, stop_token_ids=[], max_batch=batch,
                                    stop_fn=lambda i, toks: len(toks) >= stop_at[i]).tokens

    def run_hf():
        res = []
        for a in range(0, n_prompts, batch):
            chunk = prompts[a:a + batch]
            T = max(map(len, chunk))
            ids = torch.tensor([[0] * (T - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in chunk])
            ids, mask = ids.to(hf.device), mask.to(hf.device)
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, stopping_criteria=[StopAt(T, stop_at[a:a + batch])])
            res += [row[T:T + stop_at[a + i]].tolist() for i, row in enumerate(gen)]
        out["hf"] = res

    sync = torch.cuda.synchronize if hf.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        t_ours, t_hf = timed_pair(lambda: (run_ours(), sync()), lambda: (run_hf(), sync()), repeats)
    useful = sum(stop_at)
    same = sum(a == b for a, b in zip(out["ours"], out["hf"]))
    return useful / t_ours, useful / t_hf, (f"{n_prompts} prompts of {lo}-{hi} tokens, stops at 8-{new_tokens}, "
                                            f"batch {batch}; {same}/{n_prompts} sequences identical")


def bench_training(ours, hf, batch, seq, vocab, repeats):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step(m, logits_of):
        def run():
            m.zero_grad(set_to_none=True)
            logits = logits_of(ids)
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        return run

    ours.train(), hf.train()
    t_ours, t_hf = timed_pair(step(ours, lambda x: ours(x)), step(hf, lambda x: hf(input_ids=x).logits), repeats)
    ours.eval(), hf.eval()
    return batch * seq / t_ours, batch * seq / t_hf


LOAD_CHILD = r"""
import json, sys, time, torch
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
which, path, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
if which == "ours":
    sys.path.insert(0, sys.argv[4]); import model
    load = lambda: model.load(path, device="cpu", dtype=dtype)
else:
    import transformers
    kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(path, **{kw: dtype})
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
base = status("VmRSS"); t0 = time.perf_counter()
m = load()
dt = time.perf_counter() - t0
m = m[0] if isinstance(m, tuple) else m
loaded = status("VmHWM")
with torch.no_grad():  # touch every weight once: memory-mapped weights only become resident when read
    for p in m.parameters():
        p.float().sum() if p.numel() < 2**20 else p.sum()
print(json.dumps({"base": base, "peak_load": loaded, "peak": status("VmHWM"), "after": status("VmRSS"), "seconds": dt}))
"""


def bench_load(path, dtype_name, which):
    p = subprocess.run([sys.executable, "-c", LOAD_CHILD, which, str(path), dtype_name, str(ROOT)],
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{which} load failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--train-batch", type=int, default=2)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats after one warm-up; the best is kept")
    ap.add_argument("--load-hidden", type=int, default=1024)
    ap.add_argument("--load-layers", type=int, default=12)
    ap.add_argument("--load-vocab", type=int, default=32000)
    ap.add_argument("--load-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rollout-prompts", type=int, default=64)
    ap.add_argument("--rollout-batch", type=int, default=16)
    ap.add_argument("--rollout-prompt-len", type=int, nargs=2, default=[500, 2000], metavar=("LO", "HI"))
    ap.add_argument("--rollout-new-tokens", type=int, default=128)
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--no-copies", action="store_true",
                    help="ours without model.Engine's transposed weight copies on CPU (TRANSPOSED_COPY_BYTES = 0)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_copies:
        model.TRANSPOSED_COPY_BYTES = 0
    rows, results = [], {"threads": torch.get_num_threads()}

    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        if not args.skip_speed:
            folder = Path(tmp) / "speed"
            n_params, _ = write_folder(folder, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                                       heads=args.heads, kv_heads=args.kv_heads, intermediate=3 * args.hidden,
                                       tie=False, dtype=torch.float32)
            print(f"speed model: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                  f"{n_params / 1e6:.1f}M params, fp32, {torch.get_num_threads()} threads", flush=True)
            ours, _ = model.load(str(folder), device="cpu", dtype=torch.float32)
            ours.sample_vocab_size = args.vocab  # transformers samples every row; make the work identical
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, **{DTYPE_KW: torch.float32})
            ours.eval(), hf.eval()
            for b in args.batches:
                o, t, note = bench_generation(ours, hf, b, args.new_tokens, args.prompt_len, args.repeats)
                rows.append((f"greedy generation tok/s, batch {b}, {args.new_tokens} new", o, t, o / t, note))
                results[f"generate_b{b}"] = {"ours": o, "transformers": t, "ratio": o / t}
                print(f"  generation batch {b}: ours {o:.1f} tok/s, transformers {t:.1f} tok/s ({note})", flush=True)
            if not args.skip_rollout:
                o, t, note = bench_rollout(ours, hf, args.rollout_prompts, args.rollout_batch,
                                           args.rollout_new_tokens, *args.rollout_prompt_len, args.repeats)
                rows.append(("rollout-like generation, useful tok/s", o, t, o / t, note))
                results["rollout"] = {"ours": o, "transformers": t, "ratio": o / t, "note": note}
                print(f"  rollout: ours {o:.1f} tok/s, transformers {t:.1f} tok/s ({note})", flush=True)
            o, t = bench_training(ours, hf, args.train_batch, args.train_seq, args.vocab, args.repeats)
            rows.append((f"train fwd+bwd tok/s, {args.train_batch}x{args.train_seq}", o, t, o / t, ""))
            results["train"] = {"ours": o, "transformers": t, "ratio": o / t}
            print(f"  training: ours {o:.1f} tok/s, transformers {t:.1f} tok/s", flush=True)
            del ours, hf

        if not args.skip_load:
            folder = Path(tmp) / "load"
            dtype = getattr(torch, args.load_dtype)
            n_params, n_bytes = write_folder(folder, hidden=args.load_hidden, layers=args.load_layers,
                                             vocab=args.load_vocab, heads=16, kv_heads=8,
                                             intermediate=3 * args.load_hidden, tie=False, dtype=dtype)
            print(f"load model: {n_params / 1e6:.0f}M params, {args.load_dtype}, {n_bytes / 2**20:.0f} MiB of weights",
                  flush=True)
            mem = {w: bench_load(folder, args.load_dtype, w) for w in ("ours", "transformers")}
            ratio = {w: (m["peak"] - m["base"]) / n_bytes for w, m in mem.items()}
            at_load = {w: (m["peak_load"] - m["base"]) / n_bytes for w, m in mem.items()}
            rows.append(("load peak RSS rise / weight bytes", ratio["ours"], ratio["transformers"],
                         ratio["ours"] / ratio["transformers"],
                         f"{n_params / 1e6:.0f}M params; before touching: ours {at_load['ours']:.2f}, "
                         f"transformers {at_load['transformers']:.2f}; load s: ours {mem['ours']['seconds']:.1f}, "
                         f"transformers {mem['transformers']['seconds']:.1f}"))
            results["load"] = {"weight_bytes": n_bytes, **{w: dict(m, ratio=ratio[w]) for w, m in mem.items()}}

    print()
    print(f"| {'measurement':<44} | {'ours':>10} | {'transformers':>12} | {'ours/theirs':>11} | note")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 14}|{'-' * 13}|------")
    for name, o, t, r, note in rows:
        print(f"| {name:<44} | {o:>10.2f} | {t:>12.2f} | {r:>11.2f} | {note}")
    print("\naims: generation and training ratios >= 1 (batch 1: >= 1.2, rollout-like: >= 2); load peak of ours < 1.3 "
          "(x the weights' bytes)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
