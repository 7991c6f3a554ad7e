"""A Qwen2 / Qwen2.5 / Qwen3 dense transformer written by hand, with everything needed to use real checkpoints.

Architecture: Qwen2 (arXiv:2407.10671) and Qwen3 (arXiv:2505.09388) tech reports. `save` writes folders that
`transformers`, vLLM (`vllm serve runs/ckpt/ppo`) and `load` read.

Departures from HF `transformers`:
  - Dense, default RoPE: no MoE, sliding-window attention or RoPE scaling (YaRN).
  - ChatML in Python, not the checkpoint's Jinja template: no tools, `<think>` or default system message.
  - Downloads: plain files in the hub cache's `snapshots/<commit>/`, no blobs and symlinks.
  - `forward` returns fp32 logits; positions from the attention mask (cumsum - 1, as HF `generate`): left-padded
    batches need no position_ids. No dropout (Qwen trains without).
  - safetensors readinto() the parameters (built on meta), not memory-mapped: no second copy.

Run: python model.py generate --model Qwen/Qwen2.5-0.5B-Instruct --prompt "Write a haiku about GPUs"
"""
import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import functools
import heapq
import json
import math
import os
import pickle
import shutil
import struct
import sys
import traceback
import unicodedata
from collections import Counter, defaultdict

import regex
import requests
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm


# ==== 1. Configuration

@dataclasses.dataclass
class Config:
    """config.json fields the architecture needs (defaults: Qwen3-0.6B's)."""
    model_type: str = "qwen3"  # "qwen2" (Qwen2, Qwen2.5) or "qwen3"
    vocab_size: int = 151936  # embedding rows (often > the tokenizer's)
    hidden_size: int = 1024  # C
    intermediate_size: int = 3072  # SwiGLU width
    num_hidden_layers: int = 28
    num_attention_heads: int = 16  # H
    num_key_value_heads: int = 8  # Hkv (GQA)
    head_dim: int | None = None  # D; None -> C // H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0  # RoPE base
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    attention_bias: bool | None = None  # None -> model_type == "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    # set by `load` (not config.json): Qwen(lm.config) stops and samples alike
    stop_token_ids: list[int] | None = None  # None -> eos_token_id
    sample_vocab_size: int | None = None  # rows sampled; None -> vocab_size
    generation: dict | None = None  # generation_config.json (sampling), kept by `save`

    def __post_init__(self):
        if self.model_type not in ("qwen2", "qwen3"):
            raise ValueError(f"unsupported model_type {self.model_type!r}: only dense qwen2 / qwen3")
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"

    @classmethod
    def from_dict(cls, d):
        """HF config.json dict: unknown keys ignored, unsupported features refused."""
        d = dict(d)
        d.setdefault("model_type", "qwen3" if "Qwen3ForCausalLM" in d.get("architectures", []) else "qwen2")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}  # transformers 5 puts rope_theta here
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported RoPE scaling {rope}")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        d.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        d["torch_dtype"] = str(d.get("torch_dtype") or d.get("dtype") or cls.torch_dtype).removeprefix("torch.")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if d.get(f.name) is not None})

    def to_dict(self):
        arch = "Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"
        local = ("stop_token_ids", "sample_vocab_size", "generation")  # set by `load`
        saved = {k: v for k, v in dataclasses.asdict(self).items() if k not in local}
        return {"architectures": [arch], **saved, "hidden_act": "silu",
                "use_sliding_window": False, "attention_dropout": 0.0, "use_cache": True}


def tiny_config(model_type="qwen3", vocab_size=512, **overrides):  # tests, CPU runs
    d = dict(model_type=model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=2048, torch_dtype="float32")
    return Config(**{**d, **overrides})


# ==== 2. Architecture

def _as_list(ids):
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # fp32, cast back before the weight, as HF Qwen2RMSNorm (bf16/fp16)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """cos, sin (B, 1, T, D) of positions (B, T), in fp32 (RoFormer arXiv:2104.09864)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # split halves (HF): i and i + D/2 share a frequency
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):  # x (B, H, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # HF rotate_half


class KVCache:
    """Keys, values (B, Hkv, T, D) a layer, appended; a batch-1 prefix broadcasts to later rows."""

    def __init__(self):
        self.k, self.v, self.length = {}, {}, 0

    def update(self, layer, k, v):
        if layer in self.k:
            k = torch.cat((self.k[layer].expand(k.shape[0], -1, -1, -1), k), 2)
            v = torch.cat((self.v[layer].expand(v.shape[0], -1, -1, -1), v), 2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class Linear(nn.Linear):
    """Reads `weight_t`, an Engine's (in, out) CPU copy: faster at batch 1 (tests/RESULTS.md, "model.py:
    transposed weight copies")."""
    weight_t = None

    def forward(self, x):
        t = self.weight_t  # once: another thread's engine may drop it
        if t is None or torch.is_grad_enabled():  # training: the weight itself
            return super().forward(x)
        return F.linear(x, t.t(), self.bias)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C, D, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = Linear(C, self.n_head * D, bias=b)  # Qwen2: q, k, v biased (HF modeling_qwen2)
        self.k_proj = Linear(C, self.n_kv * D, bias=b)
        self.v_proj = Linear(C, self.n_kv * D, bias=b)
        self.o_proj = Linear(self.n_head * D, C, bias=b and cfg.model_type == "qwen3")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:  # Qwen3: per-head RMSNorm of q, k before RoPE (Qwen3 tech report)
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer):  # x (B, T, C)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        # mask (B, 1, T, Tk): bool (True = attend) or additive; None: causal
        if T == 1 and self.n_kv != self.n_head:
            # decode: kv head h's G query heads (HF repeat_kv) as G positions (fused kernels take a mask)
            G = self.n_head // self.n_kv
            y = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, G, self.head_dim), k, v, attn_mask=mask)
            return self.o_proj(y.reshape(B, 1, -1))  # (B, Hkv, G, D) is (B, H, 1, D) in memory
        past = k.shape[2] - T
        if mask is None and T > 1 and past:
            # causal with an offset (a bool mask with GQA leaves CUDA only SDPA's math kernel):
            if past < T:  # is_causal aligns first query and key: pad `past` zero queries
                q = F.pad(q, (0, 0, past, 0))  # (tests/RESULTS.md, "model.py: causal attention over a cached prefix")
            else:  # more cached than new: lower-right causal bias (flash attention takes it)
                from torch.nn.attention.bias import causal_lower_right  # (here: it imports dynamo)
                mask = causal_lower_right(T, past + T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=self.n_kv != self.n_head)[:, :, -T:]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(C, I, bias=False)
        self.up_proj = Linear(C, I, bias=False)
        self.down_proj = Linear(I, C, bias=False)

    def forward(self, x):  # SwiGLU (Shazeer, arXiv:2002.05202)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer):  # pre-norm
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new tokens a row, a stop token too
    logprobs: list[list[float]]  # under softmax(logits / temperature)
    finish_reasons: list[str]  # "stop" or "length"


class Qwen(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = cfg = config
        self.model = nn.ModuleDict(dict(  # HF's parameter names: state dicts load both ways
            # from_pretrained: no init (normal_ on meta imports much)
            embed_tokens=nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False),
            layers=nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.lm_head.weight.is_meta:  # (meta: `load` fills them)
            for m in self.modules():  # HF's init
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.tie_weights()
        self.sample_vocab_size = cfg.sample_vocab_size or cfg.vocab_size
        self.stop_token_ids = _as_list(cfg.eos_token_id if cfg.stop_token_ids is None else cfg.stop_token_ids)

    def tie_weights(self):
        if self.config.tie_word_embeddings and self.lm_head is not None:  # (ppo.Critic's has none)
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden(self, input_ids, attention_mask=None, cache=None):
        """Final-norm hidden states (B, T, C); attention_mask (B, T_past + T): 1 tokens, 0 left padding."""
        B, T = input_ids.shape
        dev, past = input_ids.device, cache.length if cache is not None else 0
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: causal, SDPA's fastest kernel
        if attention_mask is None:
            positions = torch.arange(past, past + T, device=dev).expand(B, T)
            mask = None
        else:
            keep = attention_mask.bool()
            positions = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            q_idx = torch.arange(past, past + T, device=dev)[:, None]
            k_idx = torch.arange(past + T, device=dev)[None]
            # causal and not padding; a padding query sees itself (no empty softmax row)
            mask = ((k_idx <= q_idx) & keep[:, None, None, :]) | (k_idx == q_idx)  # (B, 1, T, Tk)
        x = self.blocks(input_ids, positions, mask, cache)
        if cache is not None:
            cache.length += T
        return x

    def blocks(self, input_ids, positions, mask, cache):
        """Embeddings, blocks, final norm: ids at positions (B, T) or their RoPE (cos, sin) -> (B, T, C)."""
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = positions if isinstance(positions, tuple) else \
            rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i)
        return self.model.norm(x)

    def forward(self, input_ids, attention_mask=None, cache=None):
        return self.lm_head(self.hidden(input_ids, attention_mask, cache)).float()

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens=128, temperature=0.0, top_p=1.0, stop_token_ids=None, generator=None,
                 stop_fn=None, seeds=None, prefill_chunk=2048, max_batch=None, n=1, on_done=None):
        """Token-id prompts -> Generation, n rows a prompt, max_batch (default all) at a time. stop_fn(i, tokens):
        row i stops; on_done(i, tokens, reason) as row i ends (ppo.py acts then). seeds (one a prompt): draws no
        batch changes (torchrun); else `generator`."""
        stops, seqs = set(self.stop_token_ids if stop_token_ids is None else stop_token_ids), []
        for j, p in enumerate(prompts):
            for k in range(n):  # distinct, reproducible draws
                seed = None if seeds is None else (seeds[j] * 1000003 + k if k else seeds[j])
                seqs.append(Sequence(list(p), seed, index=j * n + k))
        engine = Engine(self, max_new_tokens, temperature, top_p, stops, max_batch or len(seqs),
                        prefill_chunk, generator, stop_fn, on_done)
        try:
            engine.run([seqs[j * n:(j + 1) * n] for j in range(len(prompts))])
        finally:
            engine.close()  # the weights may change (PPO)
        return Generation([s.tokens for s in seqs], [s.logprobs for s in seqs], [s.reason for s in seqs])


# ---- Decoding (issue 44) at fixed shapes (cache whole, RoPE table, rows and keys rounded up, one mask): on CUDA
# each shape's compiled step is one CUDA graph launch (gpt-fast (pytorch-labs), generate.py, model.py).
DECODE = os.environ.get("MODEL_DECODE", "compile")  # CUDA: "compile" (+ graphs), "graphs" (eager kernels), "eager"
GRAPH_MIN_TOKENS, GRAPH_DEVICES = 64, ("cuda",)  # shorter calls eager (tests fake graphs on "cpu")
KEY_BUCKETS = 8  # key lengths: multiples of capacity / 8


@dataclasses.dataclass
class Sequence:
    prompt: list
    seed: int | None = None  # its draws (_uniform); None: engine's generator
    index: int = 0  # its row in generate's output
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    reason: str | None = None  # "stop" or "length"


class SlotCache:
    """Engine's KV cache: (slots, Hkv, capacity, D) zeros a layer (masked values count: 0 * NaN is NaN); live
    sequences in slots 0 .. live-1."""

    def __init__(self, slots, capacity, dtype):
        self.slots, self.capacity, self.dtype, self.k, self.v = slots, capacity, dtype, {}, {}

    def at(self, rows, start=0, pos=None, keys=None):
        """Next forward: rows (a slice) write at start .. start + T, or rows 0 .. R-1 at pos (R,) read keys (Tk,)."""
        self.rows, self.start, self.pos, self.keys = rows, start, pos, keys
        if pos is not None:
            self.kv = {i: (K[:len(rows)], self.v[i][:len(rows)]) for i, K in self.k.items()}

    def update(self, layer, k, v):  # -> rows' keys, values so far
        if self.pos is not None:  # (prefill allocated every layer)
            (K, V), r = self.kv[layer], self.rows
            K[r, :, self.pos], V[r, :, self.pos] = k[:, :, 0], v[:, :, 0]
            return K[:, :, :self.keys.shape[0]], V[:, :, :self.keys.shape[0]]
        if layer not in self.k:
            shape = (self.slots, k.shape[1], self.capacity, k.shape[3])
            self.k[layer] = torch.zeros(shape, dtype=self.dtype, device=k.device)
            self.v[layer] = torch.zeros(shape, dtype=self.dtype, device=k.device)
        K, V, r, end = self.k[layer], self.v[layer], self.rows, self.start + k.shape[2]
        K[r, :, self.start:end], V[r, :, self.start:end] = k, v
        return K[r, :, :end], V[r, :, :end]

    def copy(self, src, dst, length):
        for buf in (*self.k.values(), *self.v.values()):
            buf[dst, :, :length] = buf[src, :, :length]


def _uniform(seeds, at):
    """Counter-based uniforms (as Philox, Salmon et al. SC 2011): hash(seed, position), alike in any batch."""
    x = seeds
    for y in (0, 0, at, 0, 0):  # Mueller's 32-bit hash, rounds (in int64: no product reaches 2^63)
        x = ((x ^ y) >> 16 ^ x ^ y) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 8).float() / 2 ** 24


def logits_of(lm, h):
    return lm.lm_head(h).float()[:, :lm.sample_vocab_size]


def decode_step(lm, cache, tok, cos, sin):
    """Rows 0 .. R-1 feed tok (R,) at cache.pos -> fp32 logits (R, V')"""
    pos = cache.pos
    mask = torch.where(cache.keys <= pos[:, None], 0.0, -math.inf).to(cache.dtype)[:, None, None]
    return logits_of(lm, lm.blocks(tok[:, None], (cos[pos, None, None], sin[pos, None, None]), mask, cache)[:, 0])


TRANSPOSED_COPY_BYTES = 1 << 30


class Engine:
    """Continuous batching (Orca, Yu et al. OSDI 2022; vLLM), no paging: a freed slot goes to waiting groups (a
    prompt's n samples, prefilled once, copied to n - 1 slots). One host sync a step."""

    def __init__(self, model, max_new_tokens=128, temperature=0.0, top_p=1.0, stop_ids=(),
                 max_batch=16, prefill_chunk=2048, generator=None, stop_fn=None, on_done=None):
        self.model, self.max_batch, self.prefill_chunk, self.generator = model, max_batch, prefill_chunk, generator
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop_ids, self.stop_fn, self.on_done = stop_ids, stop_fn, on_done
        self.waiting, self.live, self.fresh = [], [], None
        # on CPU every Linear reads a transposed copy until `close`, or none
        self.linears = [m for m in model.modules() if isinstance(m, Linear)]
        if any(m.weight.device.type != "cpu" for m in self.linears) or \
                sum(m.weight.nbytes for m in self.linears) > TRANSPOSED_COPY_BYTES:
            self.linears = []
        for m in self.linears:
            m.weight_t = m.weight.detach().t().contiguous()

    def close(self):
        for m in self.linears:
            m.weight_t = None

    @torch.inference_mode()
    def run(self, groups):
        """Generate every group (a prompt's Sequences), longest prompts first (less padding, fewer keys read)."""
        self.waiting = sorted((g[i:i + self.max_batch] for g in groups for i in range(0, len(g), self.max_batch)),
                              key=lambda g: -len(g[0].prompt))
        lm, B, w = self.model, self.max_batch, self.model.lm_head.weight
        dev, cfg = w.device, lm.config
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else w.dtype
        # sized once for the longest request: regrowing holds two caches (vLLM sizes it at start-up)
        need = max((len(s.prompt) for g in groups for s in g), default=0) + self.max_new_tokens + 1
        self.cache, self.quantum = SlotCache(B, need, dtype), -(-need // KEY_BUCKETS)
        # per slot: newest token, its position, seed (apart, offset 0: torch.compile)
        self.last, self.lengths, self.seeds = (torch.zeros(B, dtype=torch.long, device=dev) for _ in range(3))
        self.ids = torch.arange(max(B, need), device=dev)  # slots, key positions
        self.rope = tuple(t[0, 0] for t in rope_cos_sin(self.ids[None, :need], cfg.head_dim, cfg.rope_theta,
                                                        lm.model.embed_tokens.weight.dtype))
        on = dev.type in GRAPH_DEVICES and DECODE != "eager" and self.max_new_tokens >= GRAPH_MIN_TOKENS
        self.graphs = {} if on and not is_sharded(lm) else None  # (not FSDP's hooks)
        if self.graphs is not None:  # all graphs' logits
            self.pool, self.out = torch.cuda.graph_pool_handle(), torch.empty(B, lm.sample_vocab_size, device=dev)
        while self.live or self.waiting:
            self._admit()  # (a group fits max_batch: with none live one is admitted)
            self._decode()

    def _admit(self):
        free, groups = self.max_batch - len(self.live), []
        while self.waiting and len(self.waiting[0]) <= free:
            free -= len(self.waiting[0])
            groups.append(self.waiting.pop(0))
        if not groups:
            return
        dev, A, P = self.lengths.device, len(self.live), len(groups)
        prompts = [g[0].prompt for g in groups]
        lens = list(map(len, prompts))  # right padding: no token attends to a later pad
        ids = nn.utils.rnn.pad_sequence([torch.tensor(p) for p in prompts], batch_first=True).to(dev)
        ends = torch.tensor(lens, device=dev) - 1
        for a in range(0, max(lens), self.prefill_chunk):
            x = ids[:, a:a + self.prefill_chunk]
            T = x.shape[1]
            self.cache.at(slice(A, A + P), start=a)
            h = self.model.blocks(x, tuple(t[a:a + T] for t in self.rope), None, self.cache)
            pick = h[torch.arange(P, device=dev), (ends - a).clamp(0, T - 1)]
            h_last = pick if a == 0 else torch.where((ends >= a)[:, None], pick, h_last)
        seqs, leaders = [g[0] for g in groups], list(range(P))  # leaders: slots A .. A + P - 1, others after
        for b, g in enumerate(groups):
            for s in g[1:]:
                self.cache.copy(A + b, A + len(seqs), lens[b])
                seqs.append(s)
                leaders.append(b)
        at = torch.tensor([len(s.prompt) for s in seqs], device=dev)
        seeds = torch.tensor([-1 if s.seed is None else s.seed % 2**32 for s in seqs], device=dev)
        tok, lp = self._sample(logits_of(self.model, h_last)[leaders], seeds, at)
        new = slice(A, A + len(seqs))  # sequence i in slot A + i
        self.last[new], self.lengths[new], self.seeds[new] = tok, at, seeds
        self.live += seqs
        self.fresh = (seqs, tok, lp)  # reported at next decode's sync

    def _sample(self, logits, seeds, at):
        """-> tokens, log-probs (R,) under softmax(logits / T) (T = 0: greedy); seeds >= 0 draw for positions `at`."""
        logp = torch.log_softmax(logits / (self.temperature or 1.0), -1)
        tok = logits.argmax(-1)
        if self.temperature:
            probs, order = logp.exp(), None
            if self.top_p < 1:
                probs, order = probs.sort(-1, descending=True)  # nucleus: least prefix reaching top_p
                probs[(probs.cumsum(-1) - probs) > self.top_p] = 0  # (the first token stays)
            # inverse CDF: a uniform a row, one search
            u = torch.rand(len(seeds), generator=self.generator, device=probs.device)
            u = torch.where(seeds >= 0, _uniform(seeds, at), u)
            cdf = probs.cumsum(-1)
            draw = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
            draw = draw.clamp(max=probs.shape[-1] - 1)  # (rounding)
            tok = (draw if order is None else order.gather(-1, draw)).squeeze(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    def _step(self, A, end):
        """decode_step of A rows over keys 0 .. end-1, rounded up (dead rows unread)."""
        R = min(self.max_batch, 1 << (A - 1).bit_length())
        Tk = min(self.cache.capacity, -(-end // self.quantum) * self.quantum)
        g = self.graphs
        if g is None or (R, Tk) not in g:
            self.cache.at(self.ids[:R], pos=self.lengths[:R], keys=self.ids[:Tk])
            args = self.model, self.cache, self.last[:R], *self.rope
            if g is None:
                return decode_step(*args)[:A]
            step = torch.compile(decode_step, dynamic=True) if DECODE == "compile" else decode_step  # cached
            run = lambda: self.out[:R].copy_(step(*args))  # noqa: E731
            run()  # compiles, allocates before capture (replay redoes its writes)
            with torch.cuda.graph(g.setdefault((R, Tk), torch.cuda.CUDAGraph()), self.pool,
                                  capture_error_mode="thread_local"):
                run()  # recorded, not run
        g[R, Tk].replay()
        return self.out[:A]

    def _decode(self):
        A = len(self.live)
        end = max(len(s.prompt) + max(len(s.tokens) - 1, 0) for s in self.live) + 1  # cached and this one
        logits, pos = self._step(A, end), self.lengths[:A]
        tok, lp = self._sample(logits, self.seeds[:A], pos + 1)
        self.last[:A], self.lengths[:A] = tok, pos + 1
        fresh, toks, lps = self.fresh or ([], tok[:0], lp[:0])  # last admission's tokens
        self.fresh = None
        host = torch.stack([torch.cat([toks, tok]).double(), torch.cat([lps, lp]).double()]).tolist()  # one sync
        for s, t, l in zip([*fresh, *self.live], *host):  # a fresh sequence's first, then second token
            if s.reason is None:
                self._append(s, int(t), l)
        self._compact()

    def _append(self, s, tok, lp):
        s.tokens.append(tok)
        s.logprobs.append(lp)
        if tok in self.stop_ids or (self.stop_fn is not None and self.stop_fn(s.index, s.tokens)):
            s.reason = "stop"
        elif len(s.tokens) >= self.max_new_tokens:
            s.reason = "length"
        if s.reason and self.on_done is not None:
            self.on_done(s.index, s.tokens, s.reason)

    def _compact(self):
        for hole in sorted((i for i, s in enumerate(self.live) if s.reason), reverse=True):
            last, s = len(self.live) - 1, self.live.pop()
            if hole != last:
                self.cache.copy(last, hole, len(s.prompt) + len(s.tokens))
                for t in (self.last, self.lengths, self.seeds):
                    t[hole] = t[last]
                self.live[hole] = s


def response_hidden(lm, ids, lengths, starts):
    """Hidden states predicting each response token (output t - 1 predicts t), tokens: (B, R, C), (B, R), R the
    longest; response b: columns starts[b] .. lengths[b] - 1 of row b // n of ids (G, W). n = 1: prompt + response
    rows, right-padded; n > 1 (ppo.py): a prompt, its n responses as n rows over its KV cache (no gradient
    checkpointing). The caller masks columns past an end."""
    B, (G, W), dev = lengths.shape[0], ids.shape, ids.device
    n, R = B // G, max(int((lengths - starts).max()), 1)
    if n * G != B:
        raise ValueError(f"{B} responses do not split into the {G} rows of ids")
    col = (starts[:, None] + torch.arange(R, device=dev)).clamp(max=W - 1)
    tokens = ids.gather(0, (torch.arange(B, device=dev) // n)[:, None].expand(-1, W)).gather(1, col)
    if n == 1:
        h = lm.hidden(ids)
        return h.gather(1, (col - 1)[..., None].expand(-1, -1, h.shape[-1])), tokens
    out = []
    for g in range(G):
        P, cache = int(starts[g * n]), KVCache()
        prompt = lm.hidden(ids[g:g + 1, :P], cache=cache)
        resp = lm.hidden(ids[g, col[g * n:(g + 1) * n]], cache=cache)  # over the prompt
        out.append(torch.cat((prompt[:, -1:].expand(n, 1, -1), resp[:, :-1]), 1))
    return torch.cat(out), tokens


def response_logprobs(lm, ids, lengths, starts, temperature=1.0, vocab=None, chunk=1024):
    """log pi(token_t | tokens_<t) (B, R) under generate's softmax(logits[:vocab] / T) (N-details: in training too);
    lm_head `chunk` tokens at a time, recomputed in backward."""
    h, tokens = response_hidden(lm, ids, lengths, starts)
    B, R, C = h.shape
    h, tokens = h.reshape(B * R, C), tokens.reshape(B * R)

    def piece(h_, t_):
        logits = lm.lm_head(h_).float()[:, :vocab] / temperature
        return logits.gather(-1, t_[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)

    run = functools.partial(checkpoint, piece, use_reentrant=False) if torch.is_grad_enabled() else piece
    return torch.cat([run(h[a:a + chunk], tokens[a:a + chunk]) for a in range(0, B * R, chunk)]).view(B, R)


# ==== 3. safetensors: 8-byte little-endian header length, JSON header {name: {dtype, shape, data_offsets}}, raw data

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "BOOL": torch.bool,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _read_header(path):
    """(header, data offset); ValueError naming a file not safetensors or cut."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else 0
        if size < 8 or n > size - 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes; the header needs {8 + n}; an interrupted "
                             f"download?)")
        try:
            header = json.loads(f.read(n))
        except ValueError:  # JSON or UTF-8
            header = None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object of tensors)")
    header.pop("__metadata__", None)
    need = 8 + n + max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if size != need:  # (safetensors refuses extra bytes too)
        raise ValueError(f"{path}: {'truncated' if size < need else 'too long'} ({size} bytes, its header says {need}; "
                         "an interrupted download?)")
    return header, 8 + n


def _read_file(path, params=None):
    """(name, CPU tensor) by readinto(), into the same-named `params` tensor if it fits."""
    header, start = _read_header(path)
    with open(path, "rb", buffering=0) as f:
        for name, info in header.items():
            shape, dtype, p = info["shape"], _DTYPES[info["dtype"]], (params or {}).get(name)
            direct = p is not None and p.device.type == "cpu" and p.dtype == dtype and list(p.shape) == shape
            t = p.data if direct else torch.empty(shape, dtype=dtype)
            buf, (a, b) = memoryview(t.reshape(-1).view(torch.uint8).numpy()), info["data_offsets"]
            if b - a != len(buf):
                raise ValueError(f"{path}: {name} has {b - a} bytes for its shape {shape} ({len(buf)})")
            f.seek(start + a)
            done = 0
            while done < len(buf):  # a read() returns 2 GiB at most
                got = f.readinto(buf[done:])
                if not got:  # cut after the header (no hang on 0)
                    raise ValueError(f"{path}: truncated ({start + a + done} bytes, the header needs {start + b})")
                done += got
            yield name, t


def read_safetensors(path):
    return dict(_read_file(path))


def write_safetensors(path, tensors, metadata=None):
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header, off = {"__metadata__": metadata or {"format": "pt"}}, 0
    for k, t in tensors.items():
        header[k] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors'
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


# ==== 4. Tokenizer: byte-level BPE (GPT-2, Radford et al. 2019) as Qwen2's, from tokenizer.json

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")  # HF tokenization_qwen2.PRETOKENIZE_REGEX: digits one by one
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # ByteLevel(use_regex)


def _split_pattern(pre):
    for step in (pre or {}).get("pretokenizers", [pre] if pre else []):
        if step["type"] == "Split":
            return step["pattern"].get("Regex") or regex.escape(step["pattern"]["String"])
        if step["type"] == "ByteLevel" and step.get("use_regex", True):
            return GPT2_PATTERN
    return r"(?s).+"  # no pre-tokenizer: one word


def bytes_to_unicode():
    """GPT-2's bytes -> printable characters (themselves, or from 256)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def _merge(parts, pair):
    out = []
    for p in parts:  # a joined symbol is no pair[0]: no overlaps
        if out and (out[-1], p) == pair:
            out[-1] += p
        else:
            out.append(p)
    return out


class Tokenizer:
    def __init__(self, data, config=None):
        """data, config: tokenizer.json, tokenizer_config.json (optional), parsed."""
        self.data, self.config = data, config or {}
        m = data["model"]
        self.vocab = dict(m["vocab"])  # byte-level text -> id
        merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]  # "a b", [a, b]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.ignore_merges = m.get("ignore_merges", False)  # vocab words: one token
        self.added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        self.special_ids = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
        self.id_to_token = {i: s for d in (self.vocab, self.added) for s, i in d.items()}
        # added tokens split first, longest first (as `tokenizers`)
        alts = "|".join(regex.escape(s) for s in sorted(self.added, key=len, reverse=True))
        self.added_re = regex.compile(f"({alts})") if alts else None
        norm = data.get("normalizer") or {}
        self.nfc = any(n["type"] == "NFC" for n in norm.get("normalizers", [norm]) if n)
        self.pattern = regex.compile(_split_pattern(data.get("pre_tokenizer")))
        self.byte_enc = bytes_to_unicode()
        self.byte_dec = {c: b for b, c in self.byte_enc.items()}
        self._bpe = functools.lru_cache(100_000)(self._bpe)  # words recur

        def token(key):  # a string or {"content": ...}; Qwen's eos and pad by default
            v = self.config.get(key, "<|endoftext|>")
            return v.get("content") if isinstance(v, dict) else v
        self.eos_token_id = self.added.get(token("eos_token"))
        self.pad_token_id = self.added.get(token("pad_token"), self.eos_token_id)
        self.im_end_id = self.added.get("<|im_end|>")

    @classmethod
    def from_file(cls, path, config_path=None):
        config_path = config_path or os.path.join(os.path.dirname(path), "tokenizer_config.json")
        return cls(read_json(path), read_json(config_path) if os.path.exists(config_path) else None)

    def __len__(self):
        return max(self.id_to_token) + 1

    def _bpe(self, word):
        """ids of a pre-tokenized word: the adjacent pair of lowest rank merged while one has a rank."""
        parts = [self.byte_enc[b] for b in word.encode("utf-8")]
        if self.ignore_merges and "".join(parts) in self.vocab:
            parts = ["".join(parts)]
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: self.ranks.get(p, math.inf))
            if pair not in self.ranks:
                break
            parts = _merge(parts, pair)
        return [self.vocab[p] for p in parts if p in self.vocab]

    def encode(self, text):
        ids = []
        pieces = self.added_re.split(text) if self.added_re else [text]
        for i, piece in enumerate(pieces):
            if i % 2:  # an added / special token
                ids.append(self.added[piece])
            else:
                words = self.pattern.findall(unicodedata.normalize("NFC", piece) if self.nfc else piece)
                ids += [t for word in words for t in self._bpe(word)]
        return ids

    def decode(self, ids, skip_special_tokens=False):
        skip = self.special_ids if skip_special_tokens else ()
        return b"".join(self._bytes.get(i, b"") for i in ids if i not in skip).decode("utf-8", errors="replace")

    @functools.cached_property
    def _bytes(self):  # once: stop strings decode every tail every step
        ok = lambda tok: all(c in self.byte_dec for c in tok)  # else UTF-8 (tokenizers' ByteLevel decoder)
        return {i: bytes(self.byte_dec[c] for c in t) if ok(t) else t.encode() for i, t in self.id_to_token.items()}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        """ChatML (Qwen2.5 / Qwen3 instruct)."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def save(self, path):
        _write_json(path, self.data, indent=1)


CHATML_JINJA = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")  # the same, for transformers / vLLM


def train_tokenizer(texts, vocab_size, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """Byte-level BPE training (Sennrich et al. 2016): from the 256 bytes, merge the most frequent adjacent pair of
    pre-tokenized words, repeatedly; pair counts updated in place, a lazy heap."""
    pattern, enc = regex.compile(QWEN2_PATTERN), bytes_to_unicode()
    counts = Counter(w for t in texts for w in pattern.findall(unicodedata.normalize("NFC", t)))
    words, freqs = [[] for _ in counts], list(counts.values())
    vocab, merges, heap = {enc[b]: b for b in range(256)}, [], []  # heap: most frequent pair first, ties by text
    pairs, where = Counter(), defaultdict(set)  # pair -> frequency; pair -> indices of its words

    def rewrite(wi, new):  # word wi := `new`; changed pairs queued
        old, words[wi] = words[wi], new
        for p in zip(old, old[1:]):
            pairs[p] -= freqs[wi]
        for p in zip(new, new[1:]):
            pairs[p] += freqs[wi]
            where[p].add(wi)
        for p in set(zip(old, old[1:])) | set(zip(new, new[1:])):
            if pairs[p] > 0:
                heapq.heappush(heap, (-pairs[p], p))

    for wi, w in enumerate(counts):
        rewrite(wi, [enc[b] for b in w.encode("utf-8")])
    while len(vocab) < vocab_size - len(special_tokens) and heap:
        n, pair = heapq.heappop(heap)
        if pairs.get(pair, 0) != -n:
            continue  # stale
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
        for wi in where.pop(pair):
            rewrite(wi, _merge(words[wi], pair))
        pairs.pop(pair, None)
    added = [{"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(special_tokens)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    data = {"version": "1.0", "added_tokens": added, "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
                byte_level]}, "post_processor": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "vocab": vocab, "merges": [list(p) for p in merges]}}  # others: defaults
    return Tokenizer(data)


# ==== 5. Finding, loading, saving a Hugging Face model folder

def _weight_files(folder):
    """A folder's safetensors files; [] if one is absent."""
    index = os.path.join(folder, "model.safetensors.index.json")
    names = sorted(set(read_json(index)["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    files = [os.path.join(folder, n) for n in names]
    return files if all(map(os.path.exists, files)) else []


def _download(repo_id, repo_dir):
    """A model's files into the hub-cache layout, resumably (under resolve's lock: .incomplete files ours)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}

    def fetch(name, required=True):  # into `folder` at `rev` (below) -> path; None: absent and optional
        dest = os.path.join(folder, name)
        if os.path.exists(dest):
            return dest
        part = dest + ".incomplete"
        have = os.path.getsize(part) if os.path.exists(part) else 0
        rng = {"Range": f"bytes={have}-"} if have else {}
        with requests.get(f"{endpoint}/{repo_id}/resolve/{rev}/{name}", headers={**headers, **rng},
                          stream=True, timeout=30) as r:
            if r.status_code == 404 and not required:
                return None
            if r.status_code != 416:  # 416: the .incomplete file is whole
                r.raise_for_status()
                have = have if r.status_code == 206 else 0  # range ignored: restart
                total = have + int(r.headers.get("Content-Length", 0))
                with open(part, "ab" if have else "wb") as f, \
                        tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=name) as bar:
                    for chunk in r.iter_content(1 << 20):
                        bar.update(f.write(chunk))
                    os.fsync(f.fileno())  # on disk before its name says whole
        os.replace(part, dest)
        return dest

    try:
        with requests.get(f"{endpoint}/{repo_id}/resolve/main/config.json", headers=headers, timeout=30) as r:
            if r.status_code == 404:
                raise FileNotFoundError(f"{repo_id}: no such model on {endpoint}")
            if r.status_code in (401, 403):  # (a gated model's are all)
                raise PermissionError(f"{repo_id}: access denied ({r.status_code}); set HF_TOKEN for gated models")
            r.raise_for_status()
            rev = r.headers.get("X-Repo-Commit", "main")  # all files from one commit
        folder = os.path.join(repo_dir, "snapshots", rev)
        os.makedirs(folder, exist_ok=True)
        os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
        with open(os.path.join(repo_dir, "refs", "main"), "w") as f:
            f.write(rev)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            fetch(name, required=name in ("config.json", "tokenizer.json"))
        if fetch("model.safetensors", required=False) is None:
            index = read_json(fetch("model.safetensors.index.json"))
            for shard in sorted(set(index["weight_map"].values())):
                fetch(shard)
    except (requests.ConnectionError, requests.Timeout) as e:
        raise ConnectionError(f"{repo_id} is not in the cache ({repo_dir}) and {endpoint} cannot be reached "
                              f"({type(e).__name__}); pass a local folder or connect to the network") from None
    except requests.HTTPError as e:
        raise ConnectionError(f"downloading {repo_id} failed: {e}") from None
    return folder


def resolve(path_or_id):
    """A local folder, else a hub id from the HF cache (models--Org--Name/snapshots/<refs/main>) or downloaded."""
    if os.path.isdir(path_or_id):
        return path_or_id
    if path_or_id.count("/") != 1 or path_or_id.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no model folder {path_or_id!r} (and not a hub id like Org/Name)")
    home = os.environ.get("HF_HOME", os.path.join("~", ".cache", "huggingface"))
    cache = os.path.expanduser(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))
    repo_dir = os.path.join(cache, "models--" + path_or_id.replace("/", "--"))
    ref = os.path.join(repo_dir, "refs", "main")

    def cached():  # refs/main's snapshot if whole (fetch renames each file once whole)
        with contextlib.suppress(OSError), open(ref) as f:
            folder = os.path.join(repo_dir, "snapshots", f.read().strip())
            return folder if os.path.exists(os.path.join(folder, "config.json")) and _weight_files(folder) else None
    if folder := cached():
        return folder
    os.makedirs(os.path.join(cache, ".locks"), exist_ok=True)  # (huggingface_hub's)
    with open(os.path.join(cache, ".locks", os.path.basename(repo_dir) + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process a node downloads (torchrun), others find it
        return cached() or _download(path_or_id, repo_dir)


def weight_tensors(path_or_hub_id):
    for path in _weight_files(resolve(path_or_hub_id)):
        yield from _read_file(path)


def read_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {str(e).splitlines()[0][:80]})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a JSON object")
    return obj


def _empty(config, dtype, device=None):
    with torch.device("meta"):
        model = Qwen(config).to(dtype)
    if device is not None:
        model = model.to_empty(device=device)
        model.tie_weights()
    return model


def load(path_or_hub_id, device=None, dtype=None, meta=False):
    """-> (model, tokenizer); dtype: the config's on CUDA, float32 on CPU; meta: no weights read (shard, fill)"""
    folder = resolve(path_or_hub_id)
    cfg = Config.from_dict(read_json(os.path.join(folder, "config.json")))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (cfg.torch_dtype if device.type == "cuda" else torch.float32)
    dtype, files = (getattr(torch, dtype) if isinstance(dtype, str) else dtype), _weight_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no model.safetensors (or incomplete shards)")
    for path in files:  # a cut download fails here, before memory or sharding
        _read_header(path)
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    cfg.sample_vocab_size = min(len(tokenizer), cfg.vocab_size)
    gen_path = os.path.join(folder, "generation_config.json")  # (instruct models: <|im_end|>)
    cfg.generation = read_json(gen_path) if os.path.exists(gen_path) else {}
    cfg.stop_token_ids = list(dict.fromkeys(_as_list(cfg.eos_token_id) + _as_list(cfg.generation.get("eos_token_id"))))
    model = _empty(cfg, dtype, None if meta else device)
    if not meta:
        params = dict(model.named_parameters())
        fill(model, (item for path in files for item in _read_file(path, params)))
    return model.eval(), tokenizer


def _write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)


def save(model, tokenizer, path, max_shard_bytes=5 * 2**30, dtype=None, weights=None):
    """An HF model folder; dtype, weights (a state dict): the model's by default; LoRA merged."""
    os.makedirs(path, exist_ok=True)
    at = functools.partial(os.path.join, path)
    for name in os.listdir(path):  # an earlier save's weights confuse loaders
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(at(name))
    cfg, dtype = model.config, dtype or model.lm_head.weight.dtype
    _write_json(at("config.json"), {**cfg.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")})
    weights = {k.replace(".base.", "."): v for k, v in (weights or model.state_dict()).items()
               if not k.endswith((".A", ".B"))}  # LoRA: the base layer's bias; its weight merged below
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            weights[name + ".weight"] = m.merged()
    tensors = {k: v.to(dtype) for k, v in weights.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    shards = [{}]
    for k, v in tensors.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + v.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][k] = v
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(at(name), shard)
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        _write_json(at("model.safetensors.index.json"),
                    {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map})
    tokenizer.save(at("tokenizer.json"))
    token = tokenizer.id_to_token.get
    tok_cfg = {"chat_template": CHATML_JINJA, **tokenizer.config, "tokenizer_class": "Qwen2Tokenizer",
               "eos_token": token(tokenizer.eos_token_id), "pad_token": token(tokenizer.pad_token_id),
               "bos_token": None, "errors": "replace", "model_max_length": cfg.max_position_embeddings,
               "clean_up_tokenization_spaces": False, "split_special_tokens": False}
    tok_cfg.pop("added_tokens_decoder", None)  # tokenizer.json rules added tokens
    _write_json(at("tokenizer_config.json"), tok_cfg)
    _write_json(at("generation_config.json"), {"do_sample": False, **(cfg.generation or {}),  # the source's sampling
        "bos_token_id": cfg.bos_token_id, "eos_token_id": model.stop_token_ids or tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id})


def stop_ids(lm, tokenizer):
    ends = [*lm.stop_token_ids, tokenizer.eos_token_id, tokenizer.im_end_id]
    return [i for i in dict.fromkeys(ends) if i is not None]


def keep_end(ids, context, reserve):  # a prompt's last ids: `reserve` more tokens fit in `context`
    return ids[-max(context - reserve, 1):]


def stop_strings(tokenizer, strings):
    """generate's stop_fn (or None): True once a decoded tail holds a string (as vLLM); the caller cuts the text."""
    strings = [s for s in strings or [] if s]
    if not strings:
        return None
    window = 4 * max(map(len, strings)) + 4  # tokens a string spans
    return lambda i, toks: any(s in tokenizer.decode(toks[-window:], skip_special_tokens=True) for s in strings)


# ==== 6. Devices (sft.py, ppo.py, orchestrator.py): torchrun, FSDP2, autocast, checkpoints, rollout copy, LoRA

def enable_grad_checkpointing(lm):
    for block in lm.model.layers:
        def fwd(*a, _f=block.forward):
            return checkpoint(_f, *a, use_reentrant=False) if torch.is_grad_enabled() else _f(*a)
        block.forward = fwd


def setup_distributed(args, timeout=2 * 3600):
    """(rank, world, device) from torchrun's variables (set_device refuses "cuda": the rank's index); collectives
    wait `timeout` s (NCCL's 10 minutes < a task script: torchtitan, OpenRLHF)."""
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    device = torch.device(args.device or "cpu")
    if cuda:  # one process may name its GPU
        device = device if world == 1 and device.index is not None else torch.device("cuda", local)
        torch.cuda.set_device(device)
    torchrun = "RANK" in os.environ and "MASTER_ADDR" in os.environ  # (one process too: sft.py --fsdp)
    if (world > 1 or torchrun) and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    return (dist.get_rank() if world > 1 else 0), world, device


class Ranks:
    def __init__(self, rank=0, world=1, device=torch.device("cpu")):
        self.rank, self.world, self.device = rank, world, device

    def sum(self, t):
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t

    def max(self, x):
        t = torch.tensor(float(x), device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def gather(self, items):  # every rank's list, in rank order
        if self.world == 1:
            return list(items)
        parts = [None] * self.world
        dist.all_gather_object(parts, list(items))
        return [x for part in parts for x in part]


def shard(net, blocks, world, device):
    """FSDP2: a unit a block (gathered for forward and backward, freed after), the root the rest; CUDA: bf16
    gathered copies, fp32 reduction and master shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # (here, as _dcp)
    mesh = init_device_mesh(device.type, (world,))
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(net, mesh=mesh, mp_policy=mp)


def place(net, lm, tensors, device, world=0):
    if world:
        net = shard(net, lm.model.layers, world, device)
    net.to_empty(device=device)
    lm.tie_weights()
    fill(lm, tensors)
    return net


def reshard(*nets):
    """Free FSDP2 root units a no_grad forward gathered for a backward that never comes (embeddings, lm_head: 2 GiB
    bf16 at 7B), as VeRL's reference."""
    for net in nets:
        if callable(getattr(net, "reshard", None)):  # an FSDPModule
            net.reshard()


def fill(lm, tensors):
    """(name, full CPU tensor) one by one into the same-named parameter (DTensor: this rank's rows)."""
    params, seen, unexpected = dict(lm.named_parameters()), set(), []
    with torch.no_grad():
        for name, full in tensors:
            p = params.get(name)
            if p is None and name.endswith(("lm_head.weight", "rotary_emb.inv_freq")):
                continue  # tied; recomputed
            if p is None or tuple(p.shape) != tuple(full.shape):
                unexpected.append(name if p is None else f"{name}{list(full.shape)}!={list(p.shape)}")
                continue
            if isinstance(p, DTensor):  # FSDP2's Shard(0): rows cut on CPU (torch.chunk's split); only this rank's
                rows, rank = full.chunk(p.device_mesh.size(), 0), p.device_mesh.get_local_rank()
                p.to_local().copy_(rows[rank] if rank < len(rows) else full[:0])  # reach the GPU, no communication
            elif full.data_ptr() != p.data_ptr():  # (`load` may have read it in place)
                p.copy_(full)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing or unexpected:
        short = lambda names: ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
        raise ValueError(f"checkpoint does not match the model: missing [{short(missing)}], "
                         f"unexpected [{short(unexpected)}]")


def check_fits(n_params, per_param, device, advice):
    """One line, not an OOM traceback, where training states (per_param B a parameter) exceed the GPU."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else math.inf
    if per_param * n_params > total:
        raise ValueError(f"{n_params / 1e9:.1f}B parameters at {per_param} B each (weights, gradients, AdamW) need "
                         f"{per_param * n_params / 2**30:.0f} GiB; this GPU has {total / 2**30:.0f}: {advice}")


def too_big_for_one_gpu(n_params, device):
    """fp32 weights, gradients, AdamW moments (16 B a parameter) over half the GPU: FSDP without --fsdp."""
    return device.type == "cuda" and 16 * n_params > 0.5 * torch.cuda.get_device_properties(device).total_memory


def wrap(net, world, device):
    if world == 1:
        return net
    return nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)


def unwrap(net):
    return net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net


def _dcp():  # imported on use (~1 s)
    import torch.distributed.checkpoint.state_dict as dcp
    return dcp, dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, in CPU


def is_sharded(net):
    return isinstance(net, nn.Module) and any(isinstance(p, DTensor) for p in net.parameters())


def full_state(net):
    """Under FSDP a collective."""
    return _dcp()[0].get_model_state_dict(net, options=_dcp()[1]) if is_sharded(net) else unwrap(net).state_dict()


def optim_state(net, optim):
    return _dcp()[0].get_optimizer_state_dict(net, optim, options=_dcp()[1]) if is_sharded(net) else optim.state_dict()


def set_optim_state(net, optim, state):  # FSDP: each rank takes its shard
    if is_sharded(net):
        dcp = _dcp()[0]
        dcp.set_optimizer_state_dict(net, optim, state, options=dcp.StateDictOptions(full_state_dict=True))
    else:
        optim.load_state_dict(state)


def autocast(device):  # CUDA: bf16 matmuls, fp32 master weights (a 1e-6 lr vanishes in bf16); CPU: fp32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def save_dtype(name, device):
    return torch.float32 if name == "float32" or device.type != "cuda" else torch.bfloat16


def save_checkpoint_folder(lm, tokenizer, path, dtype, state):
    """Rank 0: lm's HF folder (LoRA merged) in `dtype` at <path>.tmp, from `state` (full_state of lm's holder, as
    `.lm`) -> (.tmp, fp32 master weights if dtype rounds them, or None)"""
    weights, tmp = {k.removeprefix("lm."): v for k, v in state.items()}, path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save(lm, tokenizer, tmp, dtype=dtype, weights=weights if is_sharded(lm) else None)
    return tmp, None if dtype == torch.float32 or has_lora(lm) else weights


def load_trainer_state(path, need, script, advice):
    """A trainer state (torch.save), memory-mapped; torn or without `need`: ValueError."""
    try:
        st = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}; a torn checkpoint?); {advice}") from None
    if not (isinstance(st, dict) and set(need) <= set(st)):
        raise ValueError(f"{path} is not a trainer state of {script}; {advice}")
    return st


def run_main(script, train, cfg, errors=(OSError, ValueError)):
    """An error of `errors`: one line naming the rank, exit status 2 (others: the traceback, 1). Under
    torchrun it leaves once printed: destroy_process_group blocks while other ranks wait in a collective
    (pytorch/torchtitan#1342); exiting with a live gloo group aborts in C++."""
    try:
        train(cfg)
    except BaseException as e:
        mine, ranked = isinstance(e, errors), dist.is_initialized()
        if not (mine or ranked):
            raise
        rank = f" (rank {dist.get_rank()})" if ranked else ""
        print(f"{script}: error{rank}: {e}", file=sys.stderr) if mine else traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        if ranked:
            os._exit(2 if mine else 1)
        sys.exit(2)
    if dist.is_initialized():
        dist.destroy_process_group()


def rollout_copy(lm, device, dtype=None):
    """Through FSDP every token would gather every block: each rank gathers a copy to roll out with (cast first; bf16
    on CUDA), freed before the update (VeRL's "hybrid engine"); one GPU's fp32 weights too. LoRA: the adapted layers
    merged beside the shared rest: a decode step runs no adapter matmuls."""
    if has_lora(lm):
        merged = {f"{n}.weight": m.merged().detach() for n, m in lm.named_modules() if isinstance(m, LoRALinear)}
        copy = _empty(lm.config, lm.lm_head.weight.dtype)  # on meta: each tensor assigned (tied ones too)
        state = {k.replace(".base.", "."): v for k, v in lm.state_dict().items() if not k.endswith((".A", ".B"))}
        copy.load_state_dict(state | merged, assign=True)
        return copy.eval()
    if not (is_sharded(lm) or (device.type == "cuda" and lm.lm_head.weight.dtype == torch.float32)):
        return lm
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    copy = _empty(lm.config, dtype, device)
    params = lm.named_parameters()  # an all-gather a tensor, in every rank's order
    fill(copy, ((n, p.to(dtype).full_tensor() if isinstance(p, DTensor) else p) for n, p in params))
    return copy.eval()


# LoRA (Hu et al. 2021, arXiv:2106.09685): ppo.py's --lora-rank, a large Orchestrator's training

class LoRALinear(nn.Module):
    """y = W x + (alpha / r) B A x, W frozen, A ~ N(0, 1/r), B = 0 (the base model at first)."""

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.base, self.scale, self.enabled = base, alpha / rank, True
        self.A = nn.Parameter(torch.randn(rank, base.in_features, device=base.weight.device) / rank)
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x):
        y = self.base(x)
        return y + self.scale * (x.to(self.A.dtype) @ self.A.T @ self.B.T).to(y.dtype) if self.enabled else y

    def merged(self):
        return self.base.weight + (self.scale * self.B @ self.A).to(self.base.weight.dtype)


def add_lora(lm, rank, alpha):
    lm.requires_grad_(False)
    for block in lm.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, rank, alpha))


def has_lora(lm):
    return any(isinstance(m, LoRALinear) for m in lm.modules())


def set_lora(lm, enabled):  # off: the base, the reference policy
    for m in lm.modules():
        if isinstance(m, LoRALinear):
            m.enabled = enabled


# ==== 7. Command line

def bad_device(name):
    """Why `name` is no usable device here (one line), or None."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        return f"--device {name!r} is not a device ({str(e).splitlines()[0]})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {name}: CUDA is not available on this machine"
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)"
    if dev.type not in ("cpu", "cuda", "mps"):
        return f"--device {name}: only cpu, cuda and mps are supported"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def refusing(kind, why_not):
    def read(text):
        value = kind(text)
        if why_not(value):
            raise argparse.ArgumentTypeError(why_not(value))
        return value
    read.__name__ = kind.__name__
    return read


def main(argv=None):
    parser = _Parser(prog="model.py", description="Generate with a Qwen2/Qwen2.5/Qwen3 checkpoint.")
    p = parser.add_subparsers(dest="command", required=True).add_parser("generate")
    p.add_argument("--model", required=True, help="a local folder or a hub id such as Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--device", type=refusing(str, bad_device), help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the config's; CPU: float32")
    p.add_argument("--prompt", required=True, help="the user message (--raw: the whole text)")
    p.add_argument("--max-new-tokens", type=refusing(int, lambda v: v < 1 and "must be at least 1"), default=128,
                   help="tokens generated at most (default: %(default)s)")
    p.add_argument("--temperature", type=refusing(float, lambda v: not 0 <= v < math.inf and "must be finite and >= 0"),
                   default=0.0, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-p", type=refusing(float, lambda v: not 0 < v <= 1 and "must be in (0, 1]"), default=1.0,
                   help="nucleus sampling (default: %(default)s)")
    p.add_argument("--raw", action="store_true", help="no chat template around the prompt")
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load(args.model, args.device, args.dtype)
    except (OSError, ValueError) as e:
        parser.error(f"--model: {e}")
    text = args.prompt if args.raw else tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    gen = model.generate([tokenizer.encode(text)], args.max_new_tokens, args.temperature, args.top_p,
                         stop_token_ids=stop_ids(model, tokenizer))
    print(tokenizer.decode(gen.tokens[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
