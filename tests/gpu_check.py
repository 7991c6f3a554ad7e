"""GPU check (not collected by pytest): the checks that need a GPU, in one run of a few minutes on one H200.

A lent GPU machine has 15 minutes of device time in all (DEVELOPERS.md), torch and transformers preinstalled and no
network, so this script builds everything it needs itself (a random Qwen2.5-shaped model, a BPE tokenizer, synthetic
states and chats) and prints one block per check:

1. parity: logits of model.py against transformers on the same bf16 weights (left padding included), and how many
   greedy tokens agree;
2. decode (issue 44): greedy tokens/s of model.generate at batch 1, 16 and 64 on a Qwen2.5-1.5B-shaped bf16 model,
   eager and compiled (torch.compile'd steps replayed as CUDA graphs), each as a share of the memory-bandwidth
   roofline (a step reads every weight and each row's KV cache so far: batch x bandwidth / (weight bytes + batch x
   KV bytes), the device's datasheet bandwidth), the first call's extra seconds (compilation and captures), whether
   both pick the same greedy tokens, host operations (and eager kernels) per step; transformers' generate at batch 1
   and 16; the rollout-like workload of tests/bench_model.py (64 prompts of 500-2,000 tokens, stops at varied
   lengths, at most 16 rows at a time) against transformers; issue 44's targets (batch 1 at 40% of the roofline or
   more, batch 16 at 8 x 690 tokens/s or more, the rollout at 3x transformers or more) met or not;
3. prefill: prompts of 4,100-6,000 tokens (three prefill chunks) generated with SDPA's math kernel switched off, so
   every attention call must reach a fused kernel, and the same tokens as with every kernel allowed; then a wave
   whose later prompt is longer: the KV cache's allocations (one, sized for the longest request, is what the code
   promises);
4. ppo: three PPO iterations (ppo.train, world 1, fp32 master weights, bf16 autocast, gradient checkpointing) with
   the sandbox replaced by a stub reward (the environment needs scikit-learn, which the GPU image may lack): time
   split and peak memory next to tests/bench_memory.py's plan for the same configuration; then one with --lora-rank
   16 (frozen bf16 base), against the plan's ppo-lora;
5. sft: sft.train for one epoch over synthetic chats, 4 micro-batches accumulated per step: tokens/s of the steps
   (and with the checkpoint's save), peak memory (next to the plan; a peak includes what was still allocated when
   its check started, start_gib; with --memory-history, what was allocated at sft's peak) and MFU (6 x params x tokens/s over the chip's dense bf16
   peak, 989 TFLOP/s for an H200 SXM by NVIDIA's datasheet; recomputation is not counted);
6. fsdp: `torchrun --nproc_per_node 1 sft.py --fsdp` (FSDP2 over a mesh of one: sharding, per-shard loading, the
   gathered save), then a second run resuming from its first checkpoint;
7. sandbox: a script run by env.run_script with set_script_gpu(0) starts CUDA under the data-segment limit and
   multiplies on the GPU.

    python tests/gpu_check.py                      # on the GPU: Qwen2.5-0.5B shape, ~3 minutes
    python tests/gpu_check.py --size tiny          # anywhere: the same code on a tiny model, seconds on a CPU
    python tests/gpu_check.py --size 7b --parts ppo_lora16  # the README's one-GPU LoRA line at Qwen2.5-7B's shape
    python tests/gpu_check.py --parts decode --decode eager  # issue 44's decode measures only (--decode: the others')
Everything it prints is also written to --out/gpu_check.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import pandas  # noqa: F401  (env.py imports it at module level; the checks below never use it)
except ImportError:  # the GPU image may have no pandas: a stand-in lets ppo.py import env.py
    sys.modules["pandas"] = types.ModuleType("pandas")
import torch  # noqa: E402

import model  # noqa: E402

SIZES = {  # Qwen2.5-0.5B's shape (its config.json), and a tiny one for a CPU dry run
    "0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1000000.0, torch_dtype="bfloat16"),
    "1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1000000.0, torch_dtype="bfloat16"),
    "7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
               tie_word_embeddings=False, rope_theta=1000000.0, torch_dtype="bfloat16"),  # for --parts ppo_lora16
    "tiny": dict(model_type="qwen2", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 tie_word_embeddings=True, torch_dtype="bfloat16"),
}
PEAK_BF16 = 989e12  # H200 SXM dense bf16 FLOP/s (NVIDIA datasheet; the H100 SXM's is the same)
BANDWIDTHS = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s,
# NVIDIA's datasheets (HBM3e, HBM3, HBM2e; the A100 80GB SXM's); the first name the device's contains
TARGETS = dict(batch1_of_roofline=0.40, batch16_tokens_per_s=8 * 690, rollout_over_transformers=3.0)  # issue 44
HISTORY = False  # --memory-history: record sft's allocations and print what was alive at its peak
WORDS = "data model train score feature split learning rate forest boost tree linear target metric".split()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device, reserved=False):
    if device.type != "cuda":
        return float("nan")
    return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / 2**30


def reset_peak(device, history=False):
    """-> GiB still allocated when a check starts (earlier checks' leftovers count in its peak); history: record
    allocations for peak_breakdown (sft only: with torch 2.11 a recorded PPO update's backward raised SystemError)."""
    if device.type != "cuda":
        return float("nan")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if history:  # a fresh history per check: its peak is this check's
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    return torch.cuda.memory_allocated() / 2**30


def peak_breakdown(device, top=12):
    """--memory-history: what was allocated at the check's peak, grouped by the innermost frame in this project's
    files (allocations made before reset_peak are not in the history: the peak here counts only the check's own)."""
    if not (HISTORY and device.type == "cuda"):  # only check_sft records
        return None
    try:
        return _breakdown(torch.cuda.memory._snapshot()["device_traces"][0], top)
    except Exception as e:  # the check's own numbers must survive a history this torch writes otherwise
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        torch.cuda.memory._record_memory_history(None)


def _breakdown(events, top):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    now, best, at = 0, 0, 0
    for i, e in enumerate(events):  # the peak's position, replaying allocations and frees
        now += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if now > best:
            best, at = now, i
    alive = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    groups = {}
    for e in alive.values():
        mine = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in e.get("frames", [])
                if os.path.abspath(f["filename"]).startswith(root) and not f["filename"].endswith("gpu_check.py")]
        key = " < ".join(mine[:2]) or "other"  # the allocating line, then its caller (innermost frame first)
        n, b = groups.get(key, (0, 0))
        groups[key] = (n + 1, b + e["size"])
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    return {"peak_gib": best / 2**30, "events": len(events),
            "top": [f"{b / 2**30:.3f} GiB x{n} {k}" for k, (n, b) in rows[:top]]}


def build(size, folder):
    """A random model of the size's shape with a small BPE tokenizer, saved in bf16 as a Hugging Face folder."""
    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(200)]
    tok = model.train_tokenizer(text, 600)
    torch.manual_seed(0)
    big = size == "7b" and torch.cuda.is_available()  # 7.6B parameters initialise in seconds on the GPU
    with torch.device("cuda" if big else "cpu"):
        lm = model.Qwen(model.Config(**{**SIZES[size], "eos_token_id": tok.im_end_id}))
    model.save(lm, tok, folder, dtype=torch.bfloat16)
    n = sum(p.numel() for p in lm.parameters())
    del lm
    if big:
        torch.cuda.empty_cache()
    return n, tok


def prompts_of(tok, n, length, seed):
    rng = random.Random(seed)
    return [tok.encode(" ".join(rng.choice(WORDS) for _ in range(length)))[:length] for _ in range(n)]


def check_parity(folder, tok, device, report):
    import transformers
    ours, _ = model.load(folder, device, torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    prompts = prompts_of(tok, 4, 256, 1)
    prompts[1] = prompts[1][:100]  # left padding in one row
    L = max(map(len, prompts))
    ids = torch.zeros(4, L, dtype=torch.long)
    mask = torch.zeros(4, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):], mask[b, L - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).float()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        b = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    real = mask.bool()
    diff = (a - b).abs()[real]
    n = 32
    g = ours.generate(prompts, n, stop_token_ids=[])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                      eos_token_id=None, suppress_tokens=list(range(len(tok), hf.config.vocab_size)))
    theirs = out[:, L:].tolist()
    agree = sum(x == y for r, s in zip(g.tokens, theirs) for x, y in zip(r, s)) / (4 * n)
    report["parity"] = dict(max_abs=float(diff.max()), mean_abs=float(diff.mean()), logit_std=float(b[real].std()),
                            argmax_agree=float((a.argmax(-1) == b.argmax(-1))[real].float().mean()),
                            greedy_tokens_agree=agree)


def bandwidth(device):
    """The device's peak memory bandwidth (bytes/s) and its name; None where the name is not in the table (a CPU, an
    unlisted GPU): no roofline share is reported then, rather than another device's."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return next((bw for key, bw in BANDWIDTHS.items() if key in name), None), name


def host_ops_per_step(lm, prompts, new_tokens, device, kernels):
    """Top-level PyTorch operations the host issues per decode step (a profile of one generate call, CPU activity);
    kernels=True: also the CUDA kernels per step (eager decoding only: no CUDA graph is captured under the profiler)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = kernels and device.type == "cuda"
    replays, replay = [0], torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda g: replays.__setitem__(0, replays[0] + 1) or replay(g)
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            lm.generate(prompts, new_tokens, stop_token_ids=[])
            sync(device)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    steps, events = new_tokens - 1, prof.events()
    out = {"host_ops_per_step": sum(e.cpu_parent is None and e.name.startswith("aten::") for e in events) / steps,
           "graph_replays_per_step": replays[0] / steps}
    if cuda:
        out["kernels_per_step"] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events) / steps
    return out


def check_decode(work, device, report, size, new_tokens, rollout):
    """Greedy decoding of model.generate at batch 1, 16 and 64: eager (model.DECODE = "eager") and compiled (the
    default: torch.compile'd steps captured as CUDA graphs), each against the bandwidth roofline (a step reads every
    weight once and each row's keys and values so far: tokens/s <= batch x bandwidth / (weight bytes + batch x KV
    bytes)); the first call's extra seconds (compilation, captures), whether eager and compiled pick the same greedy
    tokens, host operations (and eager kernels) per step; transformers' generate at batch 1 and 16 and the
    rollout-like workload of tests/bench_model.py for comparison; issue 44's targets met or not."""
    import transformers
    folder = os.path.join(work, "decode-model")
    n_params, tok = build(size, folder)
    cfg = model.Config(**SIZES[size])
    ours, _ = model.load(folder, device, torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    bw, name = bandwidth(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())  # a tied embedding counted once
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    eager_tokens = min(new_tokens, model.GRAPH_MIN_TOKENS)  # eager's rate is the same over fewer tokens
    rows = dict(device=name, bandwidth=bw, params=n_params, weight_bytes=weight_bytes, new_tokens=new_tokens,
                eager_new_tokens=eager_tokens, prompt_tokens=128)

    def timed(run):
        sync(device)
        t = time.perf_counter()
        out = run()
        sync(device)
        return out, time.perf_counter() - t

    default = model.DECODE
    try:
        for batch in (1, 16, 64):
            prompts = prompts_of(tok, batch, 128, 2)
            tokens = {}
            for mode, n in (("eager", eager_tokens), ("compile", new_tokens)):
                model.DECODE = mode
                gen = lambda: ours.generate(prompts, n, stop_token_ids=[]).tokens  # noqa: E731
                _, first = timed(gen)  # compiles (once a process and model) and captures
                tokens[mode], dt = timed(gen)  # captures again: graphs live for one generate call
                rate = batch * n / dt
                roofline = bw and batch * bw / (weight_bytes + batch * kv_token * (128 + n / 2))
                rows.update({f"{mode}_batch{batch}_tokens_per_s": rate,
                             f"{mode}_batch{batch}_of_roofline": roofline and rate / roofline,
                             f"{mode}_batch{batch}_first_call_extra_s": first - dt})
            pairs = [(a, b[:len(a)]) for a, b in zip(tokens["eager"], tokens["compile"])]
            rows[f"batch{batch}_greedy_same_sequences"] = f"{sum(a == b for a, b in pairs)}/{batch}"
            same = sum(x == y for a, b in pairs for x, y in zip(a, b))
            rows[f"batch{batch}_greedy_same_tokens"] = same / (batch * eager_tokens)
            rows[f"roofline_batch{batch}_tokens_per_s"] = bw and batch * bw / (weight_bytes + batch * kv_token *
                                                                                (128 + new_tokens / 2))
        prompts = prompts_of(tok, 1, 128, 2)
        for mode in ("eager", "compile"):
            model.DECODE = mode
            ops = host_ops_per_step(ours, prompts, max(eager_tokens, model.GRAPH_MIN_TOKENS), device, mode == "eager")
            rows.update({f"{mode}_batch1_{k}": v for k, v in ops.items()})
    finally:
        model.DECODE = default
    for batch in (1, 16):
        prompts = prompts_of(tok, batch, 128, 2)
        ids = torch.tensor(prompts, device=device)
        run = lambda: hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),  # noqa: E731
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        run()  # warm-up
        _, dt = timed(run)
        theirs = rows[f"transformers_batch{batch}_tokens_per_s"] = batch * new_tokens / dt
        rows[f"ours_over_transformers_batch{batch}"] = rows[f"compile_batch{batch}_tokens_per_s"] / theirs
    if device.type == "cuda":  # rows at different positions decode under a padding mask: no math kernel needed?
        from torch.nn.attention import SDPBackend, sdpa_kernel
        prompts = [p[:n] for p, n in zip(prompts_of(tok, 4, 128, 3), (128, 40, 90, 7))]
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                for mode in ("eager", "compile"):
                    model.DECODE = mode
                    ours.generate(prompts, model.GRAPH_MIN_TOKENS, stop_token_ids=[])
            rows["masked_decode_on_fused_kernels"] = True
        except RuntimeError as e:
            rows["masked_decode_on_fused_kernels"] = f"no: {str(e).splitlines()[0][:200]}"
        finally:
            model.DECODE = default
    if rollout:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_model
        ours.sample_vocab_size = hf.config.vocab_size  # transformers samples every row: the same work
        o, t, note = bench_model.bench_rollout(ours, hf, 64, 16, 128, 500, 2000, 1)
        rows.update(rollout_ours_tokens_per_s=o, rollout_transformers_tokens_per_s=t, rollout_ratio=o / t,
                    rollout_note=note)
    rows["targets"] = {  # compiled decoding; None: not measured in this run
        "batch1 >= 40% of roofline": None if bw is None else
        rows["compile_batch1_of_roofline"] >= TARGETS["batch1_of_roofline"],
        "batch16 >= 8 x 690 tokens/s": rows["compile_batch16_tokens_per_s"] >= TARGETS["batch16_tokens_per_s"],
        "rollout >= 3 x transformers": rows["rollout_ratio"] >= TARGETS["rollout_over_transformers"] if rollout
        else None}
    report["decode"] = rows


def plan_gib(size, mode, **kw):
    """tests/bench_memory.py's peak for this configuration, GiB (its block activations measured on the CPU)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_memory
    cfg = model.Config(**SIZES[size])
    act = bench_memory.measure_block(cfg, 64)[0]
    act_lora = bench_memory.measure_block(cfg, 64, 16)[0] if mode == "ppo-lora" else None
    rows = bench_memory.plan(cfg, mode, world=1, act=act, act_lora=act_lora, **kw)
    return bench_memory.totals(rows)["peak"] / 2**30


def check_prefill(folder, tok, device, report):
    """Long prompts with the math kernel off; a wave whose later prompt is longer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lm, _ = model.load(folder, device, torch.bfloat16)
    prompts = [p[:n] for p, n in zip(prompts_of(tok, 3, 6000, 4), (6000, 4100, 5000))]
    rows = {"prompt_tokens": [len(p) for p in prompts]}
    ref = lm.generate(prompts, 16, stop_token_ids=[])
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(fused):
            got = lm.generate(prompts, 16, stop_token_ids=[])
        rows["long_prefill_without_math_kernel"] = True
        rows["same_tokens_as_with_math"] = sum(a == b for r, s in zip(got.tokens, ref.tokens)
                                               for a, b in zip(r, s)) / (16 * len(prompts))
    except RuntimeError as e:
        rows["long_prefill_without_math_kernel"] = f"no: {str(e).splitlines()[0][:200]}"
    made, slot_cache = [], model.SlotCache
    model.SlotCache = lambda slots, cap, dtype: made.append((slots, cap)) or slot_cache(slots, cap, dtype)
    try:
        wave = [p[:n] for p, n in zip(prompts_of(tok, 4, 2000, 5), (1000, 1000, 1100, 2000))]
        lm.generate(wave, 32, stop_token_ids=[], max_batch=2)
    finally:
        model.SlotCache = slot_cache
    rows["wave_cache_allocations"] = made  # expected: one, of 2 slots x (2000 + 32 + 1) positions
    report["prefill"] = rows


def check_ppo(folder, tok, device, report, work, prompt_words, new_tokens, size, runs=(("ppo", 0, 3),
                                                                                     ("ppo_lora16", 16, 1))):
    import ppo
    states = [{"task": "stub", "task_dir": "", "step": 0, "snapshot": None, "m_init": 0.0, "m_best": 1.0,
               "higher_is_better": True, "ideas": [],
               "messages": [{"role": "system", "content": "You are a research agent."},
                            {"role": "user", "content": " ".join(random.Random(i).choice(WORDS)
                                                                 for _ in range(prompt_words))}]} for i in range(16)]
    path = os.path.join(work, "states.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in states)

    class StubEnv:  # the sandbox needs scikit-learn; the reward here is a fixed function of the response
        def restore(self, snapshot):
            pass

    ppo.make_env = lambda task, task_dir, editor: StubEnv()
    ppo.execute = lambda e, text, *a: {"kind": "neutral", "reward": (hash(text) % 201 - 100) / 100, "m_prev": None,
                                       "m_new": None, "done": False, "observation": ""}
    for name, lora, iterations in runs:
        start_gib = reset_peak(device)
        out = os.path.join(work, name)
        t = time.perf_counter()
        cfg = ppo.Config(model=folder, states=path, out=out, log_file=out + ".jsonl", batch_size=16,
                         max_new_tokens=new_tokens, iterations=iterations, workers=2, lora_rank=lora,
                         device=str(device), critic_warmup=0, advantage="gae")
        ppo.train(cfg)
        log = json.loads(open(out + ".jsonl").read().splitlines()[-1])
        prompt = max(len(tok.encode(tok.apply_chat_template(s["messages"]))) for s in states)
        plan = plan_gib(size, "ppo-lora" if lora else "ppo", max_prompt=prompt, max_new=new_tokens, gen_batch=16,
                        micro_tokens=cfg.micro_tokens, lora_rank=16)
        report[name] = dict(iterations=iterations, wall_s=time.perf_counter() - t, start_gib=start_gib,
                            peak_gib=peak_gib(device), peak_reserved_gib=peak_gib(device, True), plan_peak_gib=plan,
                            **{k: log[k] for k in ("time_generate", "time_execute", "time_update", "time_total",
                                                   "response_tokens", "kl", "clipfrac", "explained_variance",
                                                   "generate_vs_forward_logprob_gap")},
                            saved_dtype=json.load(open(os.path.join(out, "config.json")))["torch_dtype"])


def check_sft(folder, tok, device, report, work, n_params, words, size):
    import sft
    rng = random.Random(3)
    chats = [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))},
                           {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(words // 8))}]}
             for _ in range(64)]
    path = os.path.join(work, "chats.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in chats)
    start_gib = reset_peak(device, HISTORY)
    summary, _ = sft.train(sft.Config(data=path, model=folder, out=os.path.join(work, "sft"), epochs=1, batch_size=16,
                                    micro_batch=4, eval_parse=0, heldout=0.0, grad_checkpointing=True,
                                    device=str(device)))
    with open(os.path.join(work, "sft", "log.jsonl")) as f:
        tps = json.loads(f.read().splitlines()[-1])["tokens_per_s"]  # the training steps' rate; the summary's counts the checkpoint's save too
    rows = [sft.encode_chat(tok, c["messages"]) for c in chats]
    longest = max(len(ids) for ids, _ in rows)
    trained = 4 * max(sum(y != sft.IGNORE for y in labels) for _, labels in rows)  # 4 rows a micro-batch at most
    report["sft"] = dict(tokens_per_s=tps, tokens_per_s_with_save=summary["tokens_per_s"], seconds=summary["seconds"],
                         steps=summary["steps"],
                         start_gib=start_gib, peak_gib=peak_gib(device), peak_reserved_gib=peak_gib(device, True),
                         plan_peak_gib=plan_gib(size, "sft", sft_len=longest, micro=4, sft_trained=trained), at_peak=peak_breakdown(device),
                         mfu=6 * n_params * tps / PEAK_BF16 if device.type == "cuda" else None)


def check_fsdp(folder, work, device, report):
    """torchrun with one process through FSDP2: train 2 epochs (a checkpoint each), then resume from the first."""
    path, out = os.path.join(work, "chats.jsonl"), os.path.join(work, "fsdp")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = {}
    for name, extra in (("train", []), ("resume", ["--resume", None])):
        if extra:
            first = min((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d[11:]))
            extra = ["--resume", os.path.join(out, first)]
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                            "29533", os.path.join(root, "sft.py"), "--data", path, "--model", folder, "--out",
                            out + ("-again" if extra else ""), "--fsdp", "--epochs", "2", "--batch-size", "16",
                            "--micro-batch", "4", "--eval-parse", "0", "--heldout", "0", "--grad-checkpointing",
                            "--device", str(device), *extra], capture_output=True, text=True, timeout=600)
        lines = [x for x in r.stdout.splitlines() if "FSDP2" in x or "resumed" in x or x.startswith("{")]
        rows[name] = dict(rc=r.returncode, seconds=time.perf_counter() - t, lines=lines[-3:],
                          stderr_tail=r.stderr[-600:] if r.returncode else "")
    report["fsdp"] = rows


def check_sandbox(work, report):
    """A script in the sandbox, given GPU 0 as a torchrun rank gives its own: CUDA starts under the data limit."""
    import env
    task_dir = os.path.join(work, "probe-task")
    os.makedirs(os.path.join(task_dir, "public"), exist_ok=True)
    task = env.Task(name="cuda-probe", dir=env.Path(task_dir), metric="accuracy", higher_is_better=True,
                    id_column="id", target_columns=["y"], best_score=1.0, time_limit=120.0, split="held-in",
                    description="")
    env.set_script_gpu(0)
    code = ("import os, resource, torch\nx = torch.ones(1024, 1024, device='cuda')\n"
            "print('CUDA_OK', os.environ.get('CUDA_VISIBLE_DEVICES'), float((x @ x).sum()), "
            "resource.getrlimit(resource.RLIMIT_DATA)[0] // 2**30, 'GiB data limit')\n")
    r = env.run_script(task, code, cache=False, timeout=120)
    line = next((x for x in r.output.splitlines() if x.startswith("CUDA_OK")), None)
    report["sandbox"] = dict(status=r.status, cuda_ok=line, output_tail=None if line else r.output[-600:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="0.5b")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    p.add_argument("--parts", default="parity,prefill,decode,ppo,sft,fsdp,sandbox")
    p.add_argument("--memory-history", action="store_true", help="sft: what was allocated at the peak")
    p.add_argument("--decode", choices=["compile", "graphs", "eager"], default=model.DECODE,
                   help="model.DECODE for the parts other than decode, which measures eager and compiled itself")
    a = p.parse_args(argv)
    model.DECODE = a.decode
    import torch._dynamo
    for limit in ("recompile_limit", "cache_size_limit"):  # several model shapes compile decode_step in one process
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    global HISTORY
    HISTORY = a.memory_history
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = a.size == "tiny"
    report = {"size": a.size, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        folder = os.path.join(work, "model")
        n_params, tok = build(a.size, folder)
        report["params"] = n_params
        checks = {"parity": lambda: check_parity(folder, tok, device, report),
                  "prefill": lambda: check_prefill(folder, tok, device, report),
                  "decode": lambda: check_decode(work, device, report, "tiny" if tiny else "1.5b", 32 if tiny else 256,
                                                 not tiny),
                  "ppo": lambda: check_ppo(folder, tok, device, report, work, 60 if tiny else 1500,
                                           16 if tiny else 256, a.size),
                  "ppo_lora16": lambda: check_ppo(folder, tok, device, report, work, 60 if tiny else 1500,
                                                16 if tiny else 256, a.size, (("ppo_lora16", 16, 1),)),
                  "sft": lambda: check_sft(folder, tok, device, report, work, n_params, 60 if tiny else 1800, a.size),
                  "fsdp": lambda: check_fsdp(folder, work, device, report),
                  "sandbox": lambda: check_sandbox(work, report)}
        for part in a.parts.split(","):
            t = time.perf_counter()
            try:
                checks[part]()
            except Exception as e:  # one failed check must not hide the others' numbers
                report[part] = {"error": f"{type(e).__name__}: {e}"}
            report.setdefault(part, {})["check_s"] = time.perf_counter() - t
            print(f"== {part}: {json.dumps(report[part])}", flush=True)
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if not any(isinstance(v, dict) and "error" in v for v in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
