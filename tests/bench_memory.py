"""Memory plan (not collected by pytest): per-rank GPU memory of ppo.py and sft.py at the paper's scale, with no GPU.

For a model config, a world size and a sequence length it prints, per training mode, one line per item of GPU memory
on one rank (GiB), how the number was derived, the total, the headroom against the GPU and FITS / DOES NOT FIT (at
least 10% headroom). The designs it models:

- `ppo`: full fine-tuning under torchrun, FSDP2 (`fully_shard` per transformer block and the root,
  MixedPrecisionPolicy param_dtype bf16, reduce_dtype fp32). Actor and critic: fp32 master weights, fp32 grads and
  AdamW's two moments, all sharded (16 B/param / N); frozen bf16 reference, sharded (2 B/param / N). Rollout ("hybrid
  engine"): each rank gathers a full bf16 copy of the actor to generate from, plus the KV cache and one step's
  logits, and frees it before the update. Update: at most 2 unsharded bf16 blocks (the current one and the prefetched
  next) + the root unit's unsharded params + activations + chunked logits. The peak is max(rollout, update).
- `ppo-lora`: one GPU; actor and critic bases frozen in bf16 (two copies), the reference is the actor with its adapters
  off; rank-r adapters on q, k, v, o, gate, up, down of both, fp32 with grads and AdamW; generation on the actor.
- `sft`: FSDP2 as ppo's actor, no critic, no reference; the loss (and so the logits) only at trained positions,
  modelled as chunked like ppo's.

Activations assume gradient checkpointing: each layer keeps its block input (hidden x 2 B per token) and one block at
a time holds its full saved activations during its recompute and backward. That last number is measured, not
assumed: one real-width model.Block is built on the CPU (bf16 weights, as FSDP's param_dtype gives the compute) and
run forward under bf16 autocast; torch.autograd.graph.saved_tensors_hooks counts the bytes autograd saves (distinct
storages, the block's inputs excluded), at T/2 and at T tokens; the difference over T/2 tokens is the per-token cost
(constant terms such as bf16 casts of fp32 adapters cancel). The LoRA block is measured the same way with ppo.py's
adapters. The causal path is measured (no padding mask, as model.response_hidden runs); the CPU's SDPA kernel, like
the fused GPU kernels, keeps no (T, T) scores.

Notes under each table list transients this design does not count (the reduce-scatter of one block's gradients)
with a second verdict that includes them. model.generate's prefill, prefill_chunk (2048) prompt positions at a time,
is counted in the rollout.

    python tests/bench_memory.py                                  # the README's GPU recipe: Qwen2.5-7B on 8 x 80 GiB
    python tests/bench_memory.py --model qwen2.5-1.5b --world 1
    python tests/bench_memory.py --model path/to/config.json --mode sft --seq 8192 --micro-batch 2
"""
from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402

GiB = 2 ** 30
HEADROOM = 0.10  # the design asks for at least 10% of the GPU left over
MODES = ("ppo", "ppo-lora", "sft")

# the architecture fields of the Qwen2.5 config.json files
PRESETS = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def load_config(name):
    """A preset name, a config.json, or a folder holding one -> model.Config. ValueError (one line) otherwise."""
    if name in PRESETS:
        return model.Config(model_type="qwen2", rope_theta=1e6, max_position_embeddings=32768, **PRESETS[name])
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise ValueError(f"--model: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    try:
        with open(path) as f:
            return model.Config.from_dict(json.load(f))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--model: cannot read {path}: {e}".splitlines()[0]) from None


# ----------------------------------------------------------------------------------------------------------------
# Counting: exact, from model.py's own modules built on the meta device (no memory, no init)

def count_params(cfg):
    """{'total', 'block', 'root'}: all parameters (tied ones once), one transformer block, the rest (FSDP's root
    unit: embeddings, final norm, an untied lm_head)."""
    with torch.device("meta"):
        lm = model.Qwen(cfg)
    total = sum(p.numel() for p in lm.parameters())
    block = sum(p.numel() for p in lm.model.layers[0].parameters())
    return {"total": total, "block": block, "root": total - cfg.num_hidden_layers * block}


def lora_params(cfg, rank, merged=False):
    """Adapter parameters of one model: rank x (in + out) per linear layer of attention and MLP, every block
    (the layers model.add_lora wraps); merged: those layers' weights (in x out), as model.rollout_copy merges them."""
    with torch.device("meta"):
        block = model.Block(cfg)
    linears = [m for parent in (block.self_attn, block.mlp) for m in parent.children() if isinstance(m, nn.Linear)]
    return cfg.num_hidden_layers * sum(m.weight.numel() if merged else rank * (m.in_features + m.out_features)
                                       for m in linears)


def kv_bytes_per_token(cfg):
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, every layer, bf16


# ----------------------------------------------------------------------------------------------------------------
# Measuring: the bytes one block's forward saves for backward, per token

def measure_block(cfg, tokens=256, lora_rank=0):
    """(bytes saved per token by one block's forward, 'bf16 autocast' or 'fp32'). lora_rank > 0: ppo.py's adapters
    on a frozen base, as --lora-rank trains."""
    dtype, how = torch.bfloat16, "bf16 autocast"
    try:
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:  # a CPU without bf16 matmuls: fp32 throughout (about twice the bytes)
        dtype, how = torch.float32, "fp32"
    with torch.device("meta"):
        block = model.Block(cfg).to(dtype)
    block.to_empty(device="cpu")
    with torch.no_grad():  # the values do not change what is saved; small ones keep the arithmetic finite
        for p in block.parameters():
            p.uniform_(-0.02, 0.02)
    if lora_rank:
        holder = nn.Module()
        holder.model = nn.ModuleDict({"layers": nn.ModuleList([block])})
        model.add_lora(holder, lora_rank, 16.0)  # as ppo.py's --lora-rank trains

    def saved_bytes(T):
        x = torch.randn(1, T, cfg.hidden_size, dtype=dtype, requires_grad=True)  # (B, T, C)
        cos, sin = model.rope_cos_sin(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta, dtype)
        skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *block.parameters())}  # inputs kept elsewhere
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                seen[s.data_ptr()] = s.nbytes()  # one entry per storage: views are not counted twice
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = block(x, cos, sin, None, None, 0)  # mask None: the causal path
        del y
        return sum(seen.values())

    half = tokens // 2
    return (saved_bytes(tokens) - saved_bytes(half)) / (tokens - half), how


# ----------------------------------------------------------------------------------------------------------------
# The plan: pure arithmetic. Rows (phase, item, bytes, how); phase 'states' is held throughout, 'rollout', 'update' and
# 'parse-check' (sft.py's end) come on top of it, each also with FRAGMENTATION of its total.

CONTEXT = 1.0 * GiB  # assumed: the CUDA context, cuBLAS workspaces and kernels loaded by torch (tests/gpu_check.py
NCCL = 1.0 * GiB     # reports the measured context); NCCL's communicator buffers over 8 ranks, assumed
FRAGMENTATION = 0.05  # assumed: the caching allocator's blocks that are reserved but not allocated, of each phase


def plan(cfg, mode, world=8, max_prompt=15000, max_new=1024, gen_batch=16, micro_tokens=16384, sft_len=16384,
         micro=1, lora_rank=16, logits_chunk=1024, *, act, act_lora=None, prefill_chunk=2048, eval_rows=8,
         eval_new=400, sft_trained=None):
    """The rows of one mode, as the code allocates: ppo.py (FSDP2 or LoRA) at --max-prompt-len max_prompt,
    --max-new-tokens max_new, --gen-batch gen_batch, --micro-tokens micro_tokens; sft.py at --max-len sft_len,
    --micro-batch micro, and its parse check of eval_rows rows (--eval-parse split over the ranks) at eval_new new
    tokens; sft_trained: the trained (assistant) tokens of a micro-batch, None: all of them. act / act_lora: the bytes
    one block (full / LoRA) saves per token, from measure_block."""
    n = count_params(cfg)
    P, L, C, V, I = n["total"], cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    N = 1 if mode == "ppo-lora" else world
    row = max_prompt + max_new  # the longest rollout row (ppo.generate cuts prompts to max_prompt)
    tokens = max(micro_tokens, row) if mode != "sft" else micro * sft_len  # one forward of the update
    rows = []

    def add(phase, item, nbytes, how):
        rows.append((phase, item, float(nbytes), how))

    # model states, held throughout; gradients exist only in the update (every step frees them: set_to_none)
    add("states", "CUDA context, cuBLAS, kernels (assumed)", CONTEXT, "a fixed allowance")
    if N > 1:
        add("states", "NCCL buffers (assumed)", NCCL, "a fixed allowance")
    if mode in ("ppo", "sft"):
        who = "actor" if mode == "ppo" else "model"
        add("states", f"{who} fp32 master weights", 4 * P / N, f"{P:,} params x 4 B / {N} rank{'s' if N > 1 else ''}")
        add("states", f"{who} AdamW exp_avg + exp_avg_sq", 8 * P / N, f"{P:,} x 2 x 4 B / {N}")
    Pc = P - (0 if cfg.tie_word_embeddings else V * C) + C + 1  # the policy's backbone (no lm_head) + a value head
    if mode == "ppo":
        add("states", "critic fp32 weights + AdamW", 12 * Pc / N, f"{Pc:,} x 12 B / {N} (ppo.Critic has no lm_head)")
        add("states", "reference bf16, frozen", 2 * P / N, f"{P:,} x 2 B / {N}, no grads, no optimizer")
    A = lora_params(cfg, lora_rank)
    if mode == "ppo-lora":
        add("states", "actor base bf16, frozen", 2 * P, f"{P:,} x 2 B")
        add("states", "critic base bf16, frozen", 2 * (Pc - C - 1), f"{Pc - C - 1:,} x 2 B (a copy, no lm_head)")
        add("states", "reference", 0, "the actor with its adapters off: no copy")
        add("states", f"adapters r={lora_rank}, actor + critic", 2 * A * 12,
            f"2 x {A:,} (r x (in + out) per q,k,v,o,gate,up,down) x 12 B (fp32 weight, AdamW)")
        add("states", "critic value head", (C + 1) * 12, f"{C + 1:,} x 12 B")

    # rollout (ppo.generate -> model.generate): the cache sized once for the longest row of the wave
    if mode != "sft":
        if mode == "ppo":
            add("rollout", "actor inference copy, bf16, full", 2 * P, f"{P:,} x 2 B, gathered then freed before update")
            add("rollout", "its gather: the largest tensor, bf16", 2 * V * C, f"{V:,} x {C} x 2 B, once at a time")
        else:
            W = lora_params(cfg, lora_rank, merged=True)
            add("rollout", "actor with its adapters merged, bf16", 2 * W,
                f"{W:,} x 2 B: the adapted layers' weights (the rest shared), freed before update")
        add("rollout", "KV cache, bf16", kv_bytes_per_token(cfg) * gen_batch * (row + 1),
            f"{kv_bytes_per_token(cfg):,} B/token (2 x {L} layers x {cfg.num_key_value_heads} kv heads x "
            f"{cfg.head_dim} x 2 B) x {gen_batch} slots x ({max_prompt:,} + {max_new:,} + 1) positions")
        add("rollout", "sampling: logits, log-probs, probs, cdf, fp32", 4 * gen_batch * V * 4,
            f"4 x {gen_batch} x {V:,} x 4 B")
        pc = min(max_prompt, prefill_chunk)
        add("rollout", "prefill of one chunk, MLP", (3 * I + 2 * C) * 2 * gen_batch * pc,
            f"estimate: (3 x {I} (silu(gate), up, product) + 2 x {C}) x 2 B x {gen_batch} rows x {pc:,} positions; "
            "attention: fused kernels, no scores (causal bias, no dense mask)")

    # update: gradients, FSDP's gathered params and its reduce-scatter, activations, logits
    if mode == "ppo":
        add("update", "actor + critic fp32 grads, sharded", (4 * P + 4 * Pc) / N, f"({P:,} + {Pc:,}) x 4 B / {N}")
    elif mode == "sft":
        add("update", "fp32 grads, sharded (reduce-scattered every micro-batch)", 4 * P / N, f"{P:,} x 4 B / {N}")
    else:
        add("update", "adapter grads, actor + critic", 2 * A * 4 + (C + 1) * 4, f"(2 x {A:,} + {C + 1:,}) x 4 B")
    if mode in ("ppo", "sft"):
        add("update", "2 unsharded bf16 blocks", 2 * n["block"] * 2, f"2 x {n['block']:,} x 2 B (current + prefetched)")
        add("update", "root unit unsharded, bf16 (one model)", n["root"] * 2,
            f"{n['root']:,} (embeddings, final norm{', lm_head' if not cfg.tie_word_embeddings else ''}) x 2 B; the "
            "scoring forward's roots are resharded (model.reshard)")
        add("update", "one block's grads at reduce-scatter", 6 * n["block"],
            f"{n['block']:,} x (2 B bf16 grad + 4 B fp32 copy, reduce_dtype)")
    lora_block = mode == "ppo-lora" and act_lora is not None
    per_block = act_lora if lora_block else act
    add("update", "checkpointed block inputs, bf16", (L * C + 2 * cfg.head_dim) * 2 * tokens,
        f"({L} layers x {C} + cos/sin 2 x {cfg.head_dim}) x 2 B x {tokens:,} tokens")
    add("update", "one block's saved activations", per_block * tokens,
        f"{per_block / 1024:.1f} KiB/token (measured{', LoRA block' if lora_block else ''}) x {tokens:,} tokens")
    if mode == "sft":  # sft.LinearCrossEntropy: one product over every trained position, no chunks
        trained = tokens if sft_trained is None else sft_trained
        add("update", "fused loss: fp32 softmax + 2 bf16 casts", 8 * trained * V,
            f"{trained:,} trained tokens ({'at most every one' if sft_trained is None else 'given'}) x {V:,} x "
            "(4 B kept for backward + 2 x 2 B, its bf16 casts for the two backward products)")
    else:
        chunk = min(logits_chunk, max_new * max(tokens // row, 1))  # response tokens
        add("update", "logits chunk: fp32 logits, softmax, grad", 3 * chunk * V * 4,
            f"3 x {chunk:,} tokens x {V:,} x 4 B (recomputed per chunk in backward)")

    # sft.py's end: the optimizer goes, the saved checkpoint comes back in bf16 and answers the held-out prompts
    if mode == "sft":
        rows_here = max(eval_rows // N, 1)
        add("parse-check", "AdamW moments freed first", -8 * P / N, f"-{P:,} x 8 B / {N}")
        add("parse-check", "the saved checkpoint, bf16", 2 * P, f"{P:,} x 2 B")
        add("parse-check", "its KV cache, bf16", kv_bytes_per_token(cfg) * rows_here * (sft_len + eval_new + 1),
            f"{rows_here} rows x ({sft_len:,} + {eval_new} + 1) positions")
    return rows


def totals(rows):
    """{phase: bytes} for every phase (the states, the phase's rows, FRAGMENTATION of both), and 'peak', the largest."""
    states = sum(b for ph, _, b, _ in rows if ph == "states")
    phases = dict.fromkeys(ph for ph, *_ in rows if ph != "states")
    t = {ph: (1 + FRAGMENTATION) * (states + sum(b for p, _, b, _ in rows if p == ph)) for ph in phases}
    t["peak"] = max(t.values())
    return t


def verdict(nbytes, gpu_gib):
    """(headroom percent, 'FITS' or 'DOES NOT FIT') against a GPU of gpu_gib GiB."""
    room = 100 * (1 - nbytes / (gpu_gib * GiB))
    return room, "FITS" if room >= 100 * HEADROOM else "DOES NOT FIT"


# ----------------------------------------------------------------------------------------------------------------
# Printing and the command line

def print_plan(rows, mode, a):
    N = 1 if mode == "ppo-lora" else a.world
    ranks = f"{N} rank{'s' if N > 1 else ''}"
    title = {"ppo": f"full fine-tuning, FSDP2 over {ranks}", "ppo-lora": "LoRA, one GPU",
             "sft": f"FSDP2 over {ranks}"}[mode]
    print(f"\n== {mode} ({title}): GiB per rank")
    for ph, item, b, how in rows:
        print(f"{ph:11} {item:46} {b / GiB:7.2f}  {how}")
    t = totals(rows)
    phases = ", ".join(f"{ph} {v / GiB:.2f}" for ph, v in t.items() if ph != "peak")
    room, ok = verdict(t["peak"], a.gpu_gib)
    print(f"{'total':11} {'peak = max(' + phases + ')':46} {t['peak'] / GiB:7.2f}  (each phase + "
          f"{100 * FRAGMENTATION:.0f}% fragmentation) headroom {room:.1f}% of {a.gpu_gib:g} GiB: {ok} "
          f"(needs >= {100 * HEADROOM:.0f}%)")
    return ok == "FITS"


def parse_args(argv=None):
    p = model._Parser(prog="bench_memory.py", description="Per-rank GPU memory plan of ppo.py and sft.py (no GPU needed).")
    p.add_argument("--model", default="qwen2.5-7b", help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    p.add_argument("--mode", default="all", choices=("all", *MODES))
    p.add_argument("--world", type=int, default=8, help="ranks (GPUs) of ppo and sft; ppo-lora uses 1")
    p.add_argument("--max-prompt-len", type=int, default=15000, help="ppo.py --max-prompt-len")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="ppo.py --max-new-tokens (the README's line)")
    p.add_argument("--gen-batch", type=int, default=16, help="ppo.py --gen-batch")
    p.add_argument("--micro-tokens", type=int, default=16384, help="ppo.py --micro-tokens")
    p.add_argument("--max-len", type=int, default=16384, help="sft.py --max-len")
    p.add_argument("--micro-batch", type=int, default=1, help="sft.py --micro-batch (a pre-trained model's default)")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU in GiB")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--logits-chunk", type=int, default=1024, help="ppo.py --logits-chunk")
    p.add_argument("--measure-tokens", type=int, default=256, help="tokens of the measured block forward")
    a = p.parse_args(argv)
    for flag in ("world", "max_prompt_len", "max_new_tokens", "gen_batch", "micro_tokens", "max_len", "micro_batch",
                 "lora_rank", "logits_chunk"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.gpu_gib <= 0:
        p.error(f"--gpu-gib must be > 0, got {a.gpu_gib:g}")
    if a.measure_tokens < 4:
        p.error(f"--measure-tokens must be >= 4, got {a.measure_tokens}")
    a.modes = MODES if a.mode == "all" else (a.mode,)
    try:
        a.cfg = load_config(a.model)
    except ValueError as e:
        p.error(str(e))
    return a


def main(argv=None):
    a = parse_args(argv)
    cfg, n = a.cfg, count_params(a.cfg)
    print(f"memory plan: {a.model}: {n['total']:,} params (block {n['block']:,} x {cfg.num_hidden_layers}, "
          f"root {n['root']:,}); world {a.world}; ppo: prompts <= {a.max_prompt_len:,} + {a.max_new_tokens:,} new "
          f"tokens, gen-batch {a.gen_batch}, micro-tokens {a.micro_tokens:,}; sft: max-len {a.max_len:,}, micro-batch "
          f"{a.micro_batch}; GPU {a.gpu_gib:g} GiB")
    act, how = measure_block(cfg, a.measure_tokens)
    print(f"measured: one block saves {act / 1024:.1f} KiB per token ({how}, hidden {cfg.hidden_size}, "
          f"forward at {a.measure_tokens // 2} and {a.measure_tokens} tokens, inputs excluded)")
    act_lora = None
    if "ppo-lora" in a.modes:
        act_lora, how = measure_block(cfg, a.measure_tokens, a.lora_rank)
        print(f"measured: one LoRA block (r={a.lora_rank}, frozen base) saves {act_lora / 1024:.1f} KiB per token "
              f"({how})")
    fits = [print_plan(plan(cfg, mode, a.world, a.max_prompt_len, a.max_new_tokens, a.gen_batch, a.micro_tokens,
                            a.max_len, a.micro_batch, a.lora_rank, a.logits_chunk, act=act, act_lora=act_lora),
                       mode, a) for mode in a.modes]
    return 0 if all(fits) else 1


if __name__ == "__main__":
    sys.exit(main())
