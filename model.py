"""A Qwen2 / Qwen2.5 / Qwen3 dense transformer written by hand, with everything needed to use real checkpoints.

What this file holds, top to bottom:
  1. `Config` (the fields of a Hugging Face `config.json`) and `tiny_config` for tests and CPU runs.
  2. The architecture: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP, tied or untied
     embeddings (Qwen2 tech report arXiv:2407.10671, Qwen3 tech report arXiv:2505.09388), a KV cache and batched
     generation with left padding that returns the new tokens and their log-probs (what PPO needs).
  3. A safetensors reader and writer written by hand (sharded checkpoints included).
  4. The byte-level BPE tokenizer read from `tokenizer.json`, the ChatML template, and a small BPE trainer.
  5. `load` (a local folder, the local Hugging Face cache, or a resumable download) and `save` (a folder that
     `transformers`, vLLM and this file all load).
  6. An OpenAI-compatible HTTP server, so agents talk to a local checkpoint as they talk to vLLM.
  7. A command line.

How it departs from Hugging Face `transformers`:
  - Only the dense models with the default RoPE: no MoE, no sliding-window attention, no RoPE scaling (YaRN).
  - The chat template is ChatML written in Python, not the checkpoint's Jinja template: no tools, and no Qwen3
    `<think>` handling; no default system message unless one is passed.
  - Downloads put plain files into `snapshots/<commit>/` of the hub cache instead of blobs plus symlinks.
  - `forward` returns fp32 logits; positions come from the attention mask (cumsum - 1, as HF `generate` computes
    them) in every call, so left-padded batches need no position_ids. No dropout (Qwen trains without it).
  - The safetensors reader reads each tensor with readinto() straight into its parameter (built empty on the meta
    device) instead of memory-mapping, so a load never holds a second copy of the weights.
  - The server does not stream.

Run it:
  python model.py generate --model Qwen/Qwen2.5-0.5B-Instruct --prompt "Write a haiku about GPUs"
  python model.py serve --model runs/ckpt/sft --port 8000      # then POST /v1/chat/completions
"""
import argparse
import dataclasses
import heapq
import json
import math
import os
import struct
import sys
import threading
import time
import unicodedata
import uuid
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import regex
import requests
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm


# ----------------------------------------------------------------------------------------------------------------
# 1. Configuration

@dataclasses.dataclass
class Config:
    """The fields of a Qwen2 / Qwen3 `config.json` that the architecture needs (defaults: Qwen3-0.6B)."""
    model_type: str = "qwen3"             # "qwen2" (Qwen2 and Qwen2.5) or "qwen3"
    vocab_size: int = 151936              # rows of the embedding, often padded beyond the tokenizer's size
    hidden_size: int = 1024               # C, the residual stream width
    intermediate_size: int = 3072         # width of the SwiGLU MLP
    num_hidden_layers: int = 28
    num_attention_heads: int = 16         # query heads H
    num_key_value_heads: int = 8          # key/value heads, shared by H / Hkv query heads each (GQA)
    head_dim: int | None = None           # D; None -> hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0         # RoPE base
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True      # lm_head shares the embedding matrix
    attention_bias: bool | None = None    # None -> True for qwen2 (bias on q, k, v), False for qwen3
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"         # the dtype the checkpoint was saved in

    def __post_init__(self):
        if self.model_type not in ("qwen2", "qwen3"):
            raise ValueError(f"unsupported model_type {self.model_type!r}: only dense qwen2 / qwen3")
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"

    @classmethod
    def from_dict(cls, d):
        """From a Hugging Face config.json dict; unknown keys are ignored, unsupported features raise."""
        d = dict(d)
        if "model_type" not in d:  # fall back on the architecture name
            d["model_type"] = "qwen3" if "Qwen3ForCausalLM" in d.get("architectures", []) else "qwen2"
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}  # transformers 5 moves rope_theta here
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported RoPE scaling {rope}")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        d.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        d["torch_dtype"] = str(d.get("torch_dtype") or d.get("dtype") or cls.torch_dtype).removeprefix("torch.")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if d.get(f.name) is not None})

    def to_dict(self):
        """An HF-loadable config.json dict."""
        arch = "Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"
        return {"architectures": [arch], **dataclasses.asdict(self), "hidden_act": "silu",
                "use_sliding_window": False, "attention_dropout": 0.0, "use_cache": True}


def tiny_config(model_type="qwen3", vocab_size=512, **overrides):
    """A few-hundred-thousand-parameter model for tests and CPU runs (GQA: 4 query heads share 2 kv heads)."""
    d = dict(model_type=model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype="float32")
    return Config(**{**d, **overrides})


# ----------------------------------------------------------------------------------------------------------------
# 2. Architecture

def _as_list(ids):  # an eos_token_id field: None, one id or a list
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # computed in fp32 then cast back before the weight, as HF Qwen2RMSNorm does (matters in bf16/fp16)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """cos, sin (B, 1, T, D) for integer positions (B, T); computed in fp32 (RoFormer arXiv:2104.09864)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # split-halves layout: dims i and i + D/2 share a frequency (HF)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):  # x (B, H, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # rotate_half(x) = (-x2, x1)


class KVCache:
    """Per-layer key/value buffers (B, Hkv, capacity, D) written in place; they grow by doubling when full."""

    def __init__(self, capacity=0):
        self.k, self.v = {}, {}
        self.length, self.capacity = 0, capacity  # positions already cached; initial buffer length

    def update(self, layer, k, v):  # k, v (B, Hkv, T, D) -> all keys/values so far (B, Hkv, length + T, D)
        end = self.length + k.shape[2]
        if layer not in self.k or end > self.k[layer].shape[2]:
            old = self.k[layer].shape[2] if layer in self.k else 0
            cap = max(end, self.capacity, 2 * old)
            for buf, x in ((self.k, k), (self.v, v)):
                new = x.new_empty(*x.shape[:2], cap, x.shape[3])
                if old:
                    new[:, :, :self.length] = buf[layer][:, :, :self.length]
                buf[layer] = new
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C, D, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(C, self.n_head * D, bias=b)  # Qwen2: bias on q, k, v only (HF modeling_qwen2)
        self.k_proj = nn.Linear(C, self.n_kv * D, bias=b)
        self.v_proj = nn.Linear(C, self.n_kv * D, bias=b)
        self.o_proj = nn.Linear(self.n_head * D, C, bias=b and cfg.model_type == "qwen3")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:  # Qwen3: RMSNorm on q and k per head, before RoPE (Qwen3 tech report; HF modeling_qwen3)
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
            k, v = cache.update(layer, k, v)  # (B, Hkv, Tk, D)
        # mask (B, 1, T, Tk) bool, True = may attend; None = plain causal (or a single query over the whole cache)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=self.n_kv != self.n_head)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):  # SwiGLU (Shazeer, arXiv:2002.05202)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer):  # pre-norm residual block
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]       # new tokens per prompt, up to and including a stop token
    logprobs: list[list[float]]   # log-prob of each new token under softmax(logits / temperature)
    finish_reasons: list[str]     # "stop" or "length"


class Qwen(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = cfg = config
        self.model = nn.ModuleDict(dict(  # parameter names match HF exactly, so state dicts load both ways
            # from_pretrained skips nn.Embedding's own init (normal_ on the meta device pulls in ~75 MB of imports)
            embed_tokens=nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False),
            layers=nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.lm_head.weight.is_meta:  # on the meta device `load` fills the weights from a checkpoint instead
            for m in self.modules():  # HF init: normal(0, initializer_range=0.02), zero biases
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.tie_weights()
        self.sample_vocab_size = cfg.vocab_size  # `load` lowers it to the tokenizer's size
        self.stop_token_ids = _as_list(cfg.eos_token_id)  # generate's default; `load` adds generation_config's

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden(self, input_ids, attention_mask=None, cache=None):
        """Final-norm hidden states (B, T, C). attention_mask (B, T_past + T) is 1 for tokens, 0 for left padding."""
        B, T = input_ids.shape
        dev, past = input_ids.device, cache.length if cache is not None else 0
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the plain causal path lets SDPA pick its fastest kernel
        if attention_mask is None:
            positions = torch.arange(past, past + T, device=dev).expand(B, T)
            mask = None
            if past and T > 1:  # causal with an offset: query i sees keys 0 .. past + i
                mask = (torch.arange(past + T, device=dev) <= positions[0, :, None])[None, None]
        else:
            keep = attention_mask.bool()  # (B, Tk)
            positions = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]  # positions skip the padding (HF generate)
            q_idx = torch.arange(past, past + T, device=dev)[:, None]  # (T, 1)
            k_idx = torch.arange(past + T, device=dev)[None]  # (1, Tk)
            # causal AND not padding; a padding query sees itself so no row of the softmax is empty
            mask = ((k_idx <= q_idx) & keep[:, None, None, :]) | (k_idx == q_idx)  # (B, 1, T, Tk)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.length += T
        return self.model.norm(x)

    def forward(self, input_ids, attention_mask=None, cache=None):
        return self.lm_head(self.hidden(input_ids, attention_mask, cache)).float()  # (B, T, V)

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens=128, temperature=0.0, top_p=1.0, stop_token_ids=None,
                 pad_token_id=None, generator=None, stop_fn=None, seeds=None, prefill_chunk=2048):
        """Batched generation from token-id prompts of different lengths (left-padded here) with a KV cache.
        stop_fn(i, new_tokens) -> bool, if given, is asked after each step whether sequence i should stop
        (the server's stop strings); the token that made it true is the last one kept. seeds (one int per prompt):
        each row samples from its own generator, so a row's tokens do not depend on which rows share its batch
        (ppo.py under torchrun splits a batch across ranks and still samples what one process would). The prompts
        enter the cache prefill_chunk positions at a time, so a long prompt never runs the MLP on all its tokens
        at once (for 16 rows of 15k tokens at Qwen2.5-7B's width that would be ~29 GiB)."""
        dev = self.lm_head.weight.device
        stops = self.stop_token_ids if stop_token_ids is None else list(stop_token_ids)
        pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), pad, dtype=torch.long)
        keep = torch.ones(B, L + max_new_tokens, dtype=torch.long)  # 1 = real token, 0 = left padding
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
            keep[b, :L - len(p)] = 0
        ids, keep = ids.to(dev), keep.to(dev)
        stop_t = torch.tensor(stops, dtype=torch.long, device=dev)
        cache = KVCache(L + max_new_tokens)
        out_tok = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, max_new_tokens, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        x, steps, cut = ids, 0, {}  # cut: sequence -> number of tokens kept when stop_fn stopped it
        while x.shape[1] > prefill_chunk:  # all but the last chunk of the prompts: into the cache, no lm_head
            self.hidden(x[:, :prefill_chunk], keep[:, :L - x.shape[1] + prefill_chunk], cache)
            x = x[:, prefill_chunk:]
        rows = [torch.Generator(dev).manual_seed(s) for s in seeds] if seeds is not None else None

        def draw(p):  # (B, V) probabilities -> (B,) sampled ids
            if rows is None:
                return torch.multinomial(p, 1, generator=generator).squeeze(-1)
            return torch.cat([torch.multinomial(p[b:b + 1], 1, generator=g) for b, g in enumerate(rows)]).squeeze(-1)

        for t in range(max_new_tokens):
            h = self.hidden(x, keep[:, :L + t], cache)[:, -1]  # (B, C): the lm_head only on the last position
            logits = self.lm_head(h).float()[:, :self.sample_vocab_size]  # (B, V'): padded vocab rows never sampled
            if temperature == 0:
                logp = torch.log_softmax(logits, -1)
                tok = logits.argmax(-1)  # (B,)
            else:
                logp = torch.log_softmax(logits / temperature, -1)  # PPO scores tokens under this same softmax
                probs = logp.exp()
                if top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p
                    p_sorted, idx = probs.sort(-1, descending=True)
                    p_sorted[(p_sorted.cumsum(-1) - p_sorted) > top_p] = 0  # the first token is always kept
                    tok = idx.gather(-1, draw(p_sorted)[:, None]).squeeze(-1)
                else:
                    tok = draw(probs)
            tok = torch.where(done, pad, tok)  # finished sequences keep feeding padding
            out_tok[:, t], out_lp[:, t] = tok, logp.gather(-1, tok[:, None]).squeeze(-1)
            done |= torch.isin(tok, stop_t)
            steps = t + 1
            if stop_fn is not None:
                for i in (~done).nonzero().flatten().tolist():
                    if stop_fn(i, out_tok[i, :steps].tolist()):
                        done[i], cut[i] = True, steps
            if done.all():
                break
            x = tok[:, None]  # (B, 1)
        tokens, logprobs, reasons = [], [], []
        for b, (row, lps) in enumerate(zip(out_tok[:, :steps].tolist(), out_lp[:, :steps].tolist())):
            end = cut.get(b) or next((i + 1 for i, tk in enumerate(row) if tk in stops), None)
            tokens.append(row[:end])
            logprobs.append(lps[:end])
            reasons.append("stop" if end is not None else "length")
        return Generation(tokens, logprobs, reasons)


# ----------------------------------------------------------------------------------------------------------------
# 3. safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw data

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _read_header(path):
    """(header without __metadata__, byte offset where the data starts)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_into(f, start, info, out):
    """Read one tensor's bytes straight into the CPU tensor `out` (no intermediate copy)."""
    buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    a, b = info["data_offsets"]
    assert b - a == len(buf), f"bad size for {info}"
    f.seek(start + a)
    done = 0
    while done < len(buf):  # one read() returns at most ~2 GiB on Linux
        done += f.readinto(buf[done:])


def read_safetensors(path, device="cpu"):
    """All tensors of one .safetensors file as a dict."""
    header, start = _read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            _read_into(f, start, info, t)
            out[name] = t.to(device)
    return out


def write_safetensors(path, tensors, metadata=None):
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header, off = {"__metadata__": metadata or {"format": "pt"}}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _load_weights(model, files):
    """Copy each checkpoint tensor into the (empty) parameter of the same name; strict about names and shapes."""
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as model.embed_tokens.weight
    seen, unexpected = set(), []
    for path in files:
        header, start = _read_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, info in header.items():
                tied_copy = name == "lm_head.weight" and model.config.tie_word_embeddings
                if tied_copy or name.endswith("rotary_emb.inv_freq"):  # a copy of the embedding; a recomputed buffer
                    continue
                p = params.get(name)
                if p is None or list(p.shape) != info["shape"]:
                    unexpected.append(name if p is None else f"{name}{info['shape']}!={list(p.shape)}")
                    continue
                src = _DTYPES[info["dtype"]]
                if p.device.type == "cpu" and p.dtype == src:  # read straight into the parameter
                    _read_into(f, start, info, p.data)
                else:  # one tensor at a time through a CPU buffer: at most one extra tensor in memory
                    buf = torch.empty(info["shape"], dtype=src)
                    _read_into(f, start, info, buf)
                    p.data.copy_(buf)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing or unexpected:
        short = lambda names: ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
        raise ValueError(f"checkpoint does not match the {model.config.model_type} config: "
                         f"missing [{short(missing)}], unexpected [{short(unexpected)}]")


# ----------------------------------------------------------------------------------------------------------------
# 4. Tokenizer: byte-level BPE (GPT-2, Radford et al. 2019) as Qwen2 uses it, read from tokenizer.json

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")  # HF tokenization_qwen2.PRETOKENIZE_REGEX: digits one by one
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # ByteLevel(use_regex)


def _split_pattern(pre):
    """The word-splitting regex of a tokenizer.json pre_tokenizer (Qwen2: Split(regex) then ByteLevel)."""
    for step in (pre or {}).get("pretokenizers", [pre] if pre else []):
        if step["type"] == "Split":
            return step["pattern"].get("Regex") or regex.escape(step["pattern"]["String"])
        if step["type"] == "ByteLevel" and step.get("use_regex", True):
            return GPT2_PATTERN
    return r"(?s).+"  # no pre-tokenizer: the whole text is one word


def bytes_to_unicode():
    """GPT-2's map from the 256 bytes to printable characters: printable bytes map to themselves, the others to
    code points 256 and up, so every byte string becomes a string with no spaces or control characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def _merge(parts, pair):
    """parts with every adjacent occurrence of pair joined into one symbol, left to right."""
    out, i = [], 0
    while i < len(parts):
        if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
            out.append(parts[i] + parts[i + 1])
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


class Tokenizer:
    def __init__(self, data, config=None):
        """data: the parsed tokenizer.json; config: the parsed tokenizer_config.json (optional)."""
        self.data, self.config = data, config or {}
        m = data["model"]
        self.vocab = dict(m["vocab"])  # byte-level token string -> id
        merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]  # "a b" or ["a","b"]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.ignore_merges = m.get("ignore_merges", False)  # a word already in the vocab is one token
        self.added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        self.special_ids = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
        self.id_to_token = {**{i: s for s, i in self.vocab.items()}, **{i: s for s, i in self.added.items()}}
        # added tokens are split out before anything else, longest first (leftmost-longest like `tokenizers`)
        alts = "|".join(regex.escape(s) for s in sorted(self.added, key=len, reverse=True))
        self.added_re = regex.compile(f"({alts})") if alts else None
        norm = data.get("normalizer") or {}
        self.nfc = any(n["type"] == "NFC" for n in norm.get("normalizers", [norm]) if n)
        self.pattern = regex.compile(_split_pattern(data.get("pre_tokenizer")))
        self.byte_enc = bytes_to_unicode()
        self.byte_dec = {c: b for b, c in self.byte_enc.items()}
        self.cache = {}  # word -> ids

        def token(key):  # tokenizer_config.json holds a token as a string or as {"content": ...}
            v = self.config.get(key, "<|endoftext|>")  # Qwen's eos and pad when the config is silent
            return v.get("content") if isinstance(v, dict) else v
        self.eos_token_id = self.added.get(token("eos_token"))
        self.pad_token_id = self.added.get(token("pad_token"), self.eos_token_id)
        self.im_end_id = self.added.get("<|im_end|>")

    @classmethod
    def from_file(cls, path, config_path=None):
        """tokenizer.json, plus tokenizer_config.json (eos / pad tokens) given or found next to it."""
        config_path = config_path or os.path.join(os.path.dirname(path), "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        config = None
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(data, config)

    def __len__(self):
        return max(self.id_to_token) + 1

    def _bpe(self, word):
        """ids of one pre-tokenized word: merge the adjacent pair of lowest rank until none is left."""
        if word in self.cache:
            return self.cache[word]
        parts = [self.byte_enc[b] for b in word.encode("utf-8")]
        if self.ignore_merges and "".join(parts) in self.vocab:
            parts = ["".join(parts)]
        while len(parts) > 1:
            ranks = [self.ranks.get(pair, math.inf) for pair in zip(parts, parts[1:])]
            best = min(ranks)
            if best == math.inf:
                break
            i = ranks.index(best)
            parts = _merge(parts, (parts[i], parts[i + 1]))
        ids = [self.vocab[p] for p in parts if p in self.vocab]
        if len(self.cache) < 100_000:
            self.cache[word] = ids
        return ids

    def encode(self, text):
        ids = []
        pieces = self.added_re.split(text) if self.added_re else [text]
        for i, piece in enumerate(pieces):
            if i % 2:  # an added / special token written in the text
                ids.append(self.added[piece])
                continue
            if self.nfc:
                piece = unicodedata.normalize("NFC", piece)
            for word in self.pattern.findall(piece):
                ids.extend(self._bpe(word))
        return ids

    def decode(self, ids, skip_special_tokens=False):
        out = bytearray()
        for i in ids:
            tok = self.id_to_token.get(i)
            if tok is None or (skip_special_tokens and i in self.special_ids):
                continue
            try:
                out += bytes(self.byte_dec[c] for c in tok)
            except KeyError:  # a token outside the byte alphabet is its own UTF-8 (tokenizers ByteLevel decoder)
                out += tok.encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, default_system=None):
        """ChatML as Qwen2.5 / Qwen3 instruct models use it: <|im_start|>role\\ncontent<|im_end|>\\n."""
        if default_system and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": default_system}, *messages]
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.data, f, ensure_ascii=False, indent=1)


CHATML_JINJA = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")  # the same template for transformers / vLLM


def train_tokenizer(texts, vocab_size, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """Byte-level BPE training (Sennrich et al. 2016): start from the 256 bytes, repeatedly merge the most
    frequent adjacent pair within pre-tokenized words. Pair counts are updated incrementally, with a lazy heap."""
    pattern = regex.compile(QWEN2_PATTERN)
    enc = bytes_to_unicode()
    counts = Counter(w for t in texts for w in pattern.findall(unicodedata.normalize("NFC", t)))
    words = [[enc[b] for b in w.encode("utf-8")] for w in counts]
    freqs = list(counts.values())
    vocab = {enc[b]: b for b in range(256)}
    pairs, where = Counter(), defaultdict(set)  # pair -> frequency; pair -> indices of words holding it
    for wi, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pairs[pair] += freqs[wi]
            where[pair].add(wi)
    heap = [(-n, pair) for pair, n in pairs.items()]  # most frequent first, ties by the pair's characters
    heapq.heapify(heap)
    merges = []
    while len(vocab) < vocab_size - len(special_tokens) and heap:
        n, pair = heapq.heappop(heap)
        if pairs.get(pair, 0) != -n:
            continue  # a stale entry
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
        for wi in where.pop(pair):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pairs[p] -= f
            words[wi] = new = _merge(w, pair)
            changed = set(zip(w, w[1:])) | set(zip(new, new[1:]))
            for p in zip(new, new[1:]):
                pairs[p] += f
                where[p].add(wi)
            for p in changed:
                if pairs[p] > 0:
                    heapq.heappush(heap, (-pairs[p], p))
        pairs.pop(pair, None)
    added = [{"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(special_tokens)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    data = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
                byte_level]},
            "post_processor": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [list(p) for p in merges]}}
    return Tokenizer(data)


# ----------------------------------------------------------------------------------------------------------------
# 5. Finding, loading and saving a Hugging Face model folder

def _hub_cache():
    default = os.path.join(os.environ.get("HF_HOME", os.path.join("~", ".cache", "huggingface")), "hub")
    return os.path.expanduser(os.environ.get("HF_HUB_CACHE", default))


def _weight_files(folder):
    """The safetensors files of a folder (sharded through model.safetensors.index.json or not); [] if incomplete."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    files = [os.path.join(folder, n) for n in names]
    return files if all(map(os.path.exists, files)) else []


def _download(repo_id, repo_dir):
    """Fetch the files a model needs into the hub-cache layout, resumably, with a progress bar."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
    rev = "main"

    def fetch(name, folder, required=True):
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
            if r.status_code in (401, 403):
                raise PermissionError(f"{repo_id}: access denied ({r.status_code}); set HF_TOKEN for gated models")
            if r.status_code != 416:  # 416: the .incomplete file already holds everything
                r.raise_for_status()
                if r.status_code != 206:  # the server ignored the range: start over
                    have = 0
                total = have + int(r.headers.get("Content-Length", 0))
                with open(part, "ab" if have else "wb") as f, \
                        tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=name) as bar:
                    for chunk in r.iter_content(1 << 20):
                        bar.update(f.write(chunk))
        os.replace(part, dest)
        return dest

    try:
        with requests.get(f"{endpoint}/{repo_id}/resolve/main/config.json", headers=headers, timeout=30) as r:
            if r.status_code == 404:
                raise FileNotFoundError(f"{repo_id}: no such model on {endpoint}")
            r.raise_for_status()
            rev = r.headers.get("X-Repo-Commit", "main")  # pin every file to one commit
        folder = os.path.join(repo_dir, "snapshots", rev)
        os.makedirs(folder, exist_ok=True)
        os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
        with open(os.path.join(repo_dir, "refs", "main"), "w") as f:
            f.write(rev)
        for name in ("config.json", "tokenizer.json"):
            fetch(name, folder)
        for name in ("tokenizer_config.json", "generation_config.json"):
            fetch(name, folder, required=False)
        if fetch("model.safetensors", folder, required=False) is None:
            with open(fetch("model.safetensors.index.json", folder)) as f:
                for shard in sorted(set(json.load(f)["weight_map"].values())):
                    fetch(shard, folder)
    except (requests.ConnectionError, requests.Timeout) as e:
        raise ConnectionError(f"{repo_id} is not in the cache {_hub_cache()} and {endpoint} cannot be reached "
                              f"({type(e).__name__}); pass a local folder or connect to the network") from None
    except requests.HTTPError as e:
        raise ConnectionError(f"downloading {repo_id} failed: {e}") from None
    return folder


def resolve(path_or_id):
    """A local folder; else a hub id found in the HF cache (models--Org--Name/snapshots/<refs/main>); else a download."""
    if os.path.isdir(path_or_id):
        return path_or_id
    if path_or_id.count("/") != 1 or path_or_id.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no model folder {path_or_id!r} (and not a hub id like Org/Name)")
    repo_dir = os.path.join(_hub_cache(), "models--" + path_or_id.replace("/", "--"))
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.exists(ref):
        with open(ref) as f:
            folder = os.path.join(repo_dir, "snapshots", f.read().strip())
        if os.path.exists(os.path.join(folder, "config.json")) and _weight_files(folder):
            return folder
    return _download(path_or_id, repo_dir)


def weight_tensors(path_or_hub_id):
    """The checkpoint's tensors one at a time, (name, CPU tensor): a loader that shards (sft.py and ppo.py under
    torchrun) keeps each rank's rows of one tensor and drops the rest, so no rank holds the full model."""
    for path in _weight_files(resolve(path_or_hub_id)):
        header, start = _read_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, info in header.items():
                t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
                _read_into(f, start, info, t)
                yield name, t


def load(path_or_hub_id, device=None, dtype=None, meta=False):
    """-> (model, tokenizer). dtype default: the config's torch_dtype on CUDA, float32 on CPU. meta=True: the model
    on the meta device, no weights read (to be sharded first, then filled from `weight_tensors`)."""
    folder = resolve(path_or_hub_id)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = Config.from_dict(json.load(f))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (cfg.torch_dtype if device.type == "cuda" else torch.float32)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    files = _weight_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no model.safetensors (or incomplete shards)")
    with torch.device("meta"):  # no memory yet: parameters are allocated empty, then filled tensor by tensor
        model = Qwen(cfg)
    model = model.to(dtype)
    if not meta:
        model = model.to_empty(device=device)
        model.tie_weights()
        _load_weights(model, files)
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    model.sample_vocab_size = min(len(tokenizer), cfg.vocab_size)
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen_path):  # instruct models list <|im_end|> as an extra eos here
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        for e in _as_list(eos):
            if e not in model.stop_token_ids:
                model.stop_token_ids.append(e)
    return model.eval(), tokenizer


def save(model, tokenizer, path, max_shard_bytes=5 * 2**30, dtype=None):
    """Write a Hugging Face model folder: config, safetensors (sharded above max_shard_bytes), tokenizer, generation.
    dtype: the stored dtype (e.g. torch.bfloat16 for a run trained in fp32 master weights); default: the model's."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):  # stale weights from an earlier save would confuse loaders
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(path, name))
    cfg = model.config
    dtype = dtype or model.lm_head.weight.dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    tensors = {k: v.to(dtype) for k, v in model.state_dict().items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    shards, size = [{}], 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k], size = v, size + n
    if len(shards) == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(path, name), shard)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    token = lambda i: tokenizer.id_to_token.get(i) if i is not None else None
    tok_cfg = {**tokenizer.config, "tokenizer_class": "Qwen2Tokenizer", "eos_token": token(tokenizer.eos_token_id),
               "pad_token": token(tokenizer.pad_token_id), "bos_token": None, "errors": "replace",
               "model_max_length": cfg.max_position_embeddings, "clean_up_tokenization_spaces": False,
               "split_special_tokens": False}
    tok_cfg.setdefault("chat_template", CHATML_JINJA)
    tok_cfg.pop("added_tokens_decoder", None)  # tokenizer.json is the source of truth for added tokens
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": model.stop_token_ids or tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id, "do_sample": False}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)


# ----------------------------------------------------------------------------------------------------------------
# 6. OpenAI-compatible server (the subset of the chat completions API the agents use)

def make_server(model, tokenizer, host="127.0.0.1", port=8000, model_name="model", default_max_tokens=512):
    lock = threading.Lock()  # one generation at a time on the one model
    ends = (*model.stop_token_ids, tokenizer.eos_token_id, tokenizer.im_end_id)  # chat turns end at <|im_end|>
    stops = [i for i in dict.fromkeys(ends) if i is not None]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test and agent output quiet
            pass

        def send(self, status, obj):
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def error(self, status, message, kind="invalid_request_error", code=None):
            self.send(status, {"error": {"message": message, "type": kind, "code": code}})

        def route(self, method):
            path = self.path.split("?")[0].rstrip("/")
            allowed = {"/v1/models": "GET", "/v1/chat/completions": "POST"}.get(path)
            if allowed is None:
                return self.error(404, f"unknown path {path}", "not_found_error", "not_found")
            if method != allowed:
                return self.error(405, f"{method} not allowed on {path}", code="method_not_allowed")
            if method == "GET":
                return self.send(200, {"object": "list", "data": [
                    {"id": model_name, "object": "model", "created": 0, "owned_by": "model.py"}]})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            except (ValueError, UnicodeDecodeError):
                return self.error(400, "request body is not valid JSON")
            if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
                return self.error(400, "'messages' must be a non-empty list")
            if req.get("model") not in (None, model_name):
                return self.error(404, f"model {req['model']!r} not found; serving {model_name!r}",
                                  "not_found_error", "model_not_found")
            try:
                self.complete(req)
            except (TypeError, ValueError, KeyError) as e:
                self.error(400, f"bad request: {e}")

        def complete(self, req):
            text = lambda c: c if isinstance(c, str) else "".join(p.get("text", "") for p in c)  # str or parts
            messages = [{"role": m["role"], "content": text(m.get("content") or "")} for m in req["messages"]]
            temperature, top_p = float(req.get("temperature", 1.0)), float(req.get("top_p", 1.0))
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or default_max_tokens)
            n, stop = int(req.get("n", 1)), req.get("stop") or []
            stop = [stop] if isinstance(stop, str) else list(stop)
            if temperature < 0 or not 0 < top_p <= 1 or max_tokens < 1 or n < 1 or req.get("stream"):
                raise ValueError("need temperature >= 0, 0 < top_p <= 1, max_tokens >= 1, n >= 1, no streaming")
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
            seed, window = req.get("seed"), 4 * max(map(len, stop), default=0) + 4  # tokens a stop string can span

            def stop_fn(i, toks):  # stop strings end generation at the token that completes one, as in vLLM
                return any(s in tokenizer.decode(toks[-window:], skip_special_tokens=True) for s in stop if s)

            with lock:
                rng = None if seed is None else torch.Generator(model.lm_head.weight.device).manual_seed(int(seed))
                gen = model.generate([prompt] * n, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                     stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id, generator=rng,
                                     stop_fn=stop_fn if stop else None)
            choices = []
            for i, (toks, reason) in enumerate(zip(gen.tokens, gen.finish_reasons)):
                content = tokenizer.decode(toks, skip_special_tokens=True)
                cut = min((j for j in (content.find(s) for s in stop if s) if j >= 0), default=-1)
                if cut >= 0:  # the text ends before the first stop string
                    content, reason = content[:cut], "stop"
                choices.append({"index": i, "message": {"role": "assistant", "content": content},
                                "finish_reason": reason})
            used = sum(map(len, gen.tokens))
            self.send(200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                            "created": int(time.time()), "model": model_name, "choices": choices,
                            "usage": {"prompt_tokens": len(prompt), "completion_tokens": used,
                                      "total_tokens": len(prompt) + used}})

        def do_GET(self):
            self.route("GET")

        def do_POST(self):
            self.route("POST")

        def do_PUT(self):
            self.route("PUT")

        def do_DELETE(self):
            self.route("DELETE")

    return ThreadingHTTPServer((host, port), Handler)


def serve(model, tokenizer, host="127.0.0.1", port=8000, model_name="model"):
    server = make_server(model, tokenizer, host, port, model_name)
    print(f"serving {model_name} on http://{host}:{server.server_address[1]}/v1", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.server_close()


# ----------------------------------------------------------------------------------------------------------------
# 7. Command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line, exit status 2
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    parser = _Parser(prog="model.py", description="Generate with, or serve, a Qwen2/Qwen2.5/Qwen3 checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("generate", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="a local folder or a hub id such as Qwen/Qwen2.5-0.5B-Instruct")
        p.add_argument("--device", default=None)
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--max-new-tokens", type=int, default=128)
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--top-p", type=float, default=1.0)
            p.add_argument("--raw", action="store_true", help="no chat template around the prompt")
        else:
            p.add_argument("--port", type=int, default=8000)
            p.add_argument("--host", default="127.0.0.1")
            p.add_argument("--name", default=None, help="model name the API reports (default: --model)")
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load(args.model, args.device, args.dtype)
    except (OSError, ValueError) as e:  # missing folder, no network, bad checkpoint: one line, exit 2
        print(f"model.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.command == "generate":
        text = args.prompt if args.raw else tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        stops = [i for i in (*model.stop_token_ids, tokenizer.im_end_id) if i is not None]
        gen = model.generate([tokenizer.encode(text)], args.max_new_tokens, args.temperature, args.top_p,
                             stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id)
        print(tokenizer.decode(gen.tokens[0], skip_special_tokens=True))
    else:
        serve(model, tokenizer, args.host, args.port, args.name or args.model)


if __name__ == "__main__":
    main()
