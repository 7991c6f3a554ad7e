"""Tests for model.py: the hand-written Qwen2/Qwen3 model, its tokenizer, checkpoint I/O and CLI.

What is tested, all on CPU with tiny random checkpoints built here (no network, nothing from a hub):

- Parity with `transformers` on the same random weights (Qwen2 with q/k/v bias, Qwen3 with q/k norms and an
  explicit head_dim != hidden/heads; GQA; tied and untied embeddings; RMSNorm weights moved away from 1):
  fp32 logits within 1e-4 (also a left-padded batch), loss and gradients of every weight (what SFT and PPO
  train through), greedy generation token for token (with a stop token),
  KV-cache decoding equal to the full forward, left padding equal to running each prompt alone, seeded sampling
  reproducible, tiny top_p equal to greedy, padded vocabulary rows never sampled.
- Tokenizer parity with the `tokenizers` library on a byte-level BPE trained here with Qwen2's pre-tokenizer
  (both merge formats), decode round trips, the ChatML template, and `train_tokenizer` when present.
- safetensors: write/read round trips against the `safetensors` library, sharded checkpoints, the strict key check.
- `save` -> `transformers` (model, tokenizer, chat template) and `save` -> `load`; a hub id found in the local HF
  cache; a download from a fake hub on loopback that resumes after a dropped connection; no network -> one line.
- The command line (bad values and a removed subcommand: one line, exit 2).
- bf16 on CPU close to fp32; CUDA parity where a GPU is present.
"""
import contextlib
import dataclasses
import http.server
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import unicodedata
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias
import transformers
from safetensors.torch import load_file as st_load_file, save_file as st_save_file
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import model

ROOT = Path(__file__).resolve().parent.parent
# transformers 5 renamed from_pretrained's torch_dtype to dtype
DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"

# The pre-tokenizer regex of Qwen2/Qwen2.5/Qwen3 tokenizer.json (digits are split one by one).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A ChatML template as in Qwen instruct tokenizer_config.json, without the default system message.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it? We'll see.",
    "def train(model, data):\n    for x, y in data:\n        loss = model(x) - y\n    return loss\n\n",
    "import numpy as np\nx = np.zeros((3, 4))\nprint(x.shape)  # (3, 4)\n",
    "Le café est délicieux, très crémeux. Ça va? Über schön, naïve façade.",
    "机器学习是人工智能的一个分支。深度学习使用神经网络。",
    "Emoji time 🤖🚀🔥 and more 😀😀 text.",
    "Numbers: 3.14159, 2024-06-01, 1,000,000 and 42.",
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHi! How can I help?<|im_end|>\n",
    "    indented\n\tTabbed\n\n\nMany newlines   and   spaces.",
] * 4

TEXTS = [
    "Hello, world!",
    "The café's crème brûlée isn't bad; we'll see. THEY'RE sure I'd've said DON'T.",
    "e\u0301te\u0301 is decomposed, NFC makes it \u00e9t\u00e9",
    "中文分词测试，混合English和数字12345。",
    "emoji 🤖🚀 and a flag 🇫🇷 and ZWJ 👩\u200d💻!",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "if (a&&b) { x += 1; }\treturn;\t\t// tabs",
    "numbers 3.14159 and 1,000,000 and 2024-06-01 and 007",
    "   leading spaces and trailing   ",
    "line1\n\nline2\r\nline3\n \n  \n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>tail <|im_start|>",
    "Ünïcödé ÅÆØ ßẞ Ωmega русский текст עברית العربية",
    "",
    "a" * 40,
    "x  \n",
    "\u00a0nbsp and \u3000 ideographic space",
]


# ---------------------------------------------------------------------------------------------------------------
# Fixtures: a Qwen2-style tokenizer and tiny Hugging Face checkpoints with random weights
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from threads, and threads thrash when the machine is busy (CI, other jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_hf_tokenizer(vocab_size=400):
    """A byte-level BPE built like Qwen2's tokenizer.json, trained with the `tokenizers` library."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)  # after the BPE vocabulary, as in Qwen (151643...)
    return tok


def set_merges_format(src, dst, fmt):
    """Rewrite tokenizer.json merges as "a b" strings (fmt="str", real Qwen files) or ["a", "b"] pairs."""
    d = json.loads(Path(src).read_text(encoding="utf-8"))
    merges = [m.split(" ") if isinstance(m, str) else m for m in d["model"]["merges"]]
    d["model"]["merges"] = [" ".join(m) for m in merges] if fmt == "str" else merges
    Path(dst).write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A folder holding tokenizer.json (string merges, like real Qwen) and tokenizer_config.json."""
    d = tmp_path_factory.mktemp("tok")
    train_hf_tokenizer().save(str(d / "raw.json"))
    set_merges_format(d / "raw.json", d / "tokenizer.json", "str")
    (d / "raw.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({
        "add_prefix_space": False, "bos_token": None, "chat_template": CHATML, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}))
    return d


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    return HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return model.Tokenizer.from_file(str(tok_dir / "tokenizer.json"), str(tok_dir / "tokenizer_config.json"))


CASES = {  # name: (model_type, tie_word_embeddings, head_dim)
    "qwen2-untied": ("qwen2", False, None),
    "qwen2-tied": ("qwen2", True, None),
    "qwen3-tied-hd24": ("qwen3", True, 24),  # explicit head_dim != hidden / heads = 16
    "qwen3-untied": ("qwen3", False, 16),
}


def build_hf_model(model_type, tie, head_dim, vocab_size, eos_token_id=None, seed=0, hidden=64, layers=2):
    """A random HF Qwen model: GQA 4/2 heads, rope_theta 1e6, nonzero biases, norm weights away from 1."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
              max_position_embeddings=512, tie_word_embeddings=tie, initializer_range=0.1,
              bos_token_id=None, eos_token_id=eos_token_id, attn_implementation="eager")
    if model_type == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=head_dim, **kw))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return hf.eval()


@pytest.fixture(scope="module")
def cases(tmp_path_factory, tok_dir, hf_tok):
    """cases(name) -> a checkpoint folder written by transformers, the HF model, and ours loaded from the folder."""
    cache = {}

    def get(name):
        if name not in cache:
            model_type, tie, head_dim = CASES[name]
            n_tok = hf_tok.get_vocab_size(with_added_tokens=True)
            vocab = (n_tok // 64 + 2) * 64  # padded embedding rows beyond the tokenizer, as in real Qwen
            hf = build_hf_model(model_type, tie, head_dim, vocab, eos_token_id=hf_tok.token_to_id("<|im_end|>"))
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tok_dir / f, path / f)
            ours, tk = model.load(str(path), dtype=torch.float32)
            ours.eval()
            cache[name] = SimpleNamespace(name=name, path=path, hf=hf, ours=ours, tok=tk, n_tok=n_tok, vocab=vocab,
                                          pad=tk.pad_token_id, im_end=hf_tok.token_to_id("<|im_end|>"))
        return cache[name]
    return get


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, cases):
    return cases(request.param)


def prompts_for(tk):
    """Three prompts of different lengths, one of them a chat prompt."""
    chat = tk.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    return [tk.encode("Hello, world!"), tk.encode("def f(x):\n    return x ** 2  # square"), tk.encode(chat)]


def left_pad(prompts, pad_id):
    """(B, T) ids and 1/0 mask, left padded."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    return ids, mask


@torch.no_grad()
def hf_logits(hf, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # HF forward does not derive positions from the mask; generate does
    return hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


@torch.no_grad()
def our_logits(m, ids, mask=None):
    return m(ids, attention_mask=mask).float()


@contextlib.contextmanager
def full_vocab(m):
    """Let generation use every row so its log-probs can be compared with a plain log_softmax of the logits."""
    old = m.sample_vocab_size
    m.sample_vocab_size = m.config.vocab_size
    try:
        yield m
    finally:
        m.sample_vocab_size = old


def upto_stop(seq, stop):
    seq = list(seq)
    return seq[:seq.index(stop) + 1] if stop in seq else seq


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------

QWEN25_CONFIG = {  # Qwen2.5-0.5B-Instruct config.json
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_CONFIG = {  # Qwen3-0.6B config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_config_from_real_qwen_config_json():
    c2 = model.Config.from_dict(QWEN25_CONFIG)
    assert (c2.model_type, c2.hidden_size, c2.num_key_value_heads, c2.rope_theta) == ("qwen2", 896, 2, 1e6)
    assert c2.attention_bias is True and c2.tie_word_embeddings is True and c2.eos_token_id == 151645
    c3 = model.Config.from_dict(QWEN3_CONFIG)
    assert (c3.model_type, c3.head_dim, c3.num_attention_heads, c3.rope_theta) == ("qwen3", 128, 16, 1e6)
    assert not c3.attention_bias
    # transformers >= 5 writes rope_theta inside "rope_parameters"
    v5 = dict(QWEN3_CONFIG, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    del v5["rope_theta"]
    assert model.Config.from_dict(v5).rope_theta == 5e5
    for c in (c2, c3):
        assert model.Config.from_dict(c.to_dict()) == c
        assert c.to_dict()["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[c.model_type]]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_tiny_config_state_dict_loads_into_transformers(model_type, tmp_path):
    torch.manual_seed(0)
    ours = model.Qwen(model.tiny_config(model_type)).eval()
    (tmp_path / "config.json").write_text(json.dumps(ours.config.to_dict()))
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    sd = ours.state_dict()
    assert set(sd) - {"lm_head.weight"} == set(hf.state_dict()) - {"lm_head.weight"}
    hf.load_state_dict(sd, strict=False)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    ids = torch.randint(0, ours.config.vocab_size, (2, 9))
    lo = our_logits(ours, ids)
    assert lo.shape == (2, 9, ours.config.vocab_size)
    torch.testing.assert_close(lo, hf_logits(hf, ids, torch.ones_like(ids)), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers on the same random weights
# ---------------------------------------------------------------------------------------------------------------

def test_load_sets_sample_vocab_to_tokenizer(ckpt):
    assert ckpt.ours.config.vocab_size == ckpt.vocab > ckpt.n_tok == len(ckpt.tok)
    assert ckpt.ours.sample_vocab_size == ckpt.n_tok
    if CASES[ckpt.name][0] == "qwen3":
        assert ckpt.ours.config.head_dim == CASES[ckpt.name][2]


def test_logits_match_transformers(ckpt):
    prompts = prompts_for(ckpt.tok)
    ids = torch.tensor([prompts[2]])
    torch.testing.assert_close(our_logits(ckpt.ours, ids), hf_logits(ckpt.hf, ids, torch.ones_like(ids)),
                               atol=1e-4, rtol=0)
    ids, mask = left_pad(prompts, ckpt.pad)
    ours, theirs = our_logits(ckpt.ours, ids, mask), hf_logits(ckpt.hf, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-untied", "qwen3-tied-hd24"])
def test_gradients_match_transformers(cases, name):
    """SFT and PPO train through forward(): the loss and the gradients of every weight equal transformers'."""
    c = cases(name)
    ids, mask = left_pad(prompts_for(c.tok), c.pad)
    targets = ids[:, 1:].masked_fill((mask[:, :-1] == 0) | (mask[:, 1:] == 0), -100)  # predicted from real tokens

    def grads(m, logits_of):
        m.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits_of().float()[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        g = {k: p.grad.clone() for k, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return loss.detach(), g

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    loss, ours = grads(c.ours, lambda: c.ours(ids, attention_mask=mask))
    loss_hf, theirs = grads(c.hf, lambda: c.hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits)
    torch.testing.assert_close(loss, loss_hf, atol=1e-5, rtol=0)
    assert set(ours) == set(theirs)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-4, rtol=1e-3, msg=k)


def test_greedy_generation_matches_transformers(ckpt):
    prompts, n = prompts_for(ckpt.tok), 12
    ids, mask = left_pad(prompts, ckpt.pad)
    suppress = list(range(ckpt.n_tok, ckpt.vocab))  # HF may pick padded rows; ours never does

    def hf_generate(stop):
        out = ckpt.hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                               eos_token_id=stop, pad_token_id=ckpt.pad, suppress_tokens=suppress)
        return out[:, ids.shape[1]:].tolist()

    # a stop token the first prompt really emits, so stopping inside a batch is exercised
    stop = hf_generate([ckpt.vocab - 1])[0][3]  # (a suppressed id as eos: no early stop)
    expected = [upto_stop(s, stop) for s in hf_generate(stop)]
    for max_batch in (None, 2, 1):  # all at once; continuous batching (a finished row's slot goes to a waiting prompt)
        done = []  # on_done: each row once, as it finishes, with its final tokens (the stopped row before the others)
        g = ckpt.ours.generate(prompts, max_new_tokens=n, temperature=0.0, stop_token_ids=[stop], max_batch=max_batch,
                               on_done=lambda i, toks, reason: done.append((i, list(toks), reason)))
        assert g.tokens == expected, max_batch
        assert sorted(done) == [(i, t, r) for i, (t, r) in enumerate(zip(g.tokens, g.finish_reasons))]
        if max_batch is None:  # all rows decode together: the shortest finishes first
            assert len(done[0][1]) == min(map(len, g.tokens)) < n and done[0][2] == "stop"
    assert g.finish_reasons == ["stop" if s[-1] == stop else "length" for s in expected]
    assert g.finish_reasons[0] == "stop" and all(len(s) == n for s, r in zip(g.tokens, g.finish_reasons) if r == "length")
    assert [len(lp) for lp in g.logprobs] == [len(s) for s in g.tokens]


def test_chunked_prefill_and_per_row_seeds(ckpt):
    """Prompts entering the cache 2 positions at a time give the same greedy tokens and log-probs as one prefill; with
    per-row seeds a row samples the same tokens whichever rows share its batch (and another seed changes them)."""
    prompts, n = prompts_for(ckpt.tok), 8
    kw = dict(max_new_tokens=n, stop_token_ids=[])
    whole, chunked = (ckpt.ours.generate(prompts, temperature=0.0, prefill_chunk=c, **kw) for c in (2048, 2))
    assert chunked.tokens == whole.tokens and max(len(p) for p in prompts) > 2
    for a, b in zip(chunked.logprobs, whole.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    batch = ckpt.ours.generate(prompts, temperature=1.0, seeds=[7, 8, 9], **kw)
    alone = ckpt.ours.generate(prompts[1:2], temperature=1.0, seeds=[8], **kw)
    other = ckpt.ours.generate(prompts[1:2], temperature=1.0, seeds=[80], **kw)
    assert alone.tokens[0] == batch.tokens[1] and other.tokens[0] != batch.tokens[1]


def test_the_transposed_weight_copies_change_nothing(ckpt, monkeypatch):
    """On CPU the engine's linear layers multiply by (in, out) copies of their weights (faster to stream): the same
    tokens and log-probs as the weights themselves (TRANSPOSED_COPY_BYTES = 0 turns the copies off), and generate()
    drops the copies when it returns (a later training step changes the weights)."""
    prompts, kw = prompts_for(ckpt.tok), dict(max_new_tokens=8, stop_token_ids=[], seeds=[1, 2, 3], temperature=1.0)
    layers = [m for m in ckpt.ours.modules() if isinstance(m, model.Linear)]
    engine = model.Engine(ckpt.ours)
    assert len(engine.linears) == len(layers) == 7 * ckpt.ours.config.num_hidden_layers + 1
    assert all(m.weight_t is not None and torch.equal(m.weight_t, m.weight.t()) for m in layers)
    ids = torch.tensor([prompts[0]])
    ckpt.ours(ids).sum().backward()  # a training forward while the copies exist still reaches every weight
    assert all(m.weight.grad is not None for m in layers)
    ckpt.ours.zero_grad(set_to_none=True)
    engine.close()
    assert all(m.weight_t is None for m in layers)
    copy = ckpt.ours.generate(prompts, **kw)
    assert all(m.weight_t is None for m in layers)
    monkeypatch.setattr(model, "TRANSPOSED_COPY_BYTES", 0)
    assert model.Engine(ckpt.ours).linears == []
    plain = ckpt.ours.generate(prompts, **kw)
    assert copy.tokens == plain.tokens
    for a, b in zip(copy.logprobs, plain.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def sdpa_with_bias(sdpa, q, k, v, attn_mask=None, **kw):
    """The real SDPA under a test's spy: a CausalBias dispatches itself only when it is handed to the function it knows
    (which the spy has replaced), so the spy hands it over to that dispatch itself."""
    if isinstance(attn_mask, CausalBias):
        with unittest.mock.patch.object(F, "scaled_dot_product_attention", sdpa):
            return CausalBias._dispatch(q, k, v, attn_mask, **kw)
    return sdpa(q, k, v, attn_mask=attn_mask, **kw)


@pytest.mark.parametrize("past", [4, 12])
def test_rows_over_a_shared_cache_match_the_full_forward(past, monkeypatch):
    """sft.py's shared prefix: the prefix once (one row, into a cache), then every row's rest over that cache. With
    past < T the rest runs with front-padded queries and no mask (the fused causal kernel), with past >= T under the
    lower-right causal bias; both give the full forward's hidden states and gradients."""
    torch.manual_seed(0)
    lm = model.Qwen(model.tiny_config("qwen3", vocab_size=50))
    ids = torch.randint(0, 50, (3, 20))
    ids[:, :past] = ids[0, :past]  # the rows share their first `past` ids
    masks, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: masks.append(k["attn_mask"]) or
                        sdpa_with_bias(sdpa, *a, **k))
    cache = model.KVCache()
    head = lm.hidden(ids[:1, :past], cache=cache)
    tail = lm.hidden(ids[:, past:], cache=cache)
    assert (masks[-1] is None) == (past < 20 - past)  # else the lower-right causal bias (no dense mask)
    assert masks[-1] is None or isinstance(masks[-1], CausalBias)
    grads = torch.autograd.grad(head.pow(2).sum() * 3 + tail.pow(2).sum(), list(lm.parameters()))
    full = lm.hidden(ids)
    torch.testing.assert_close(tail, full[:, past:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.expand(3, -1, -1), full[:, :past], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, torch.autograd.grad(full.pow(2).sum(), list(lm.parameters()))):
        assert float((a - b).norm()) <= 1e-4 * float(b.norm())  # fp32 sums in another order


def test_kv_cache_logprobs_match_full_forward(ckpt):
    prompts, n = prompts_for(ckpt.tok), 10
    with full_vocab(ckpt.ours) as m:
        g = m.generate(prompts, max_new_tokens=n, temperature=0.0, stop_token_ids=[])
        alone = m.generate(prompts[2:], max_new_tokens=n, temperature=0.0, stop_token_ids=[])
    assert g.finish_reasons == ["length"] * 3 and all(len(s) == n for s in g.tokens)
    for ps, gen in [(prompts, g), (prompts[2:], alone)]:  # a left-padded batch, and one prompt without padding
        ids, mask = left_pad([p + s for p, s in zip(ps, gen.tokens)], ckpt.pad)
        T = ids.shape[1]
        for name, logits in [("ours", our_logits(ckpt.ours, ids, mask)), ("transformers", hf_logits(ckpt.hf, ids, mask))]:
            lp = F.log_softmax(logits, -1)[:, T - n - 1:T - 1]  # (B, n, V): the positions that predict the new tokens
            full = lp.gather(-1, torch.tensor(gen.tokens)[..., None])[..., 0]
            torch.testing.assert_close(torch.tensor(gen.logprobs), full, atol=1e-4, rtol=0, msg=f"vs {name} full forward")
            assert (lp.argmax(-1) == torch.tensor(gen.tokens)).all()  # greedy = argmax of the full forward


def test_left_padding_gives_same_tokens_as_alone(ckpt):
    prompts = prompts_for(ckpt.tok)
    batch = ckpt.ours.generate(prompts, max_new_tokens=8, stop_token_ids=[])
    for i, p in enumerate(prompts):
        alone = ckpt.ours.generate([p], max_new_tokens=8, stop_token_ids=[])
        assert alone.tokens[0] == batch.tokens[i]
        torch.testing.assert_close(torch.tensor(alone.logprobs[0]), torch.tensor(batch.logprobs[i]), atol=1e-4, rtol=0)


def test_sampling_is_reproducible_and_logprobs_use_temperature(cases):
    c = cases("qwen2-untied")
    prompts, n, temp = prompts_for(c.tok), 10, 0.7
    with full_vocab(c.ours) as m:
        runs = [m.generate(prompts, max_new_tokens=n, temperature=temp, stop_token_ids=[],
                           generator=torch.Generator().manual_seed(123)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].logprobs == runs[1].logprobs
    greedy = c.ours.generate(prompts, max_new_tokens=n, stop_token_ids=[])
    assert runs[0].tokens != greedy.tokens  # it really samples
    ids, mask = left_pad([p + s for p, s in zip(prompts, runs[0].tokens)], c.pad)
    T = ids.shape[1]
    lp = F.log_softmax(our_logits(c.ours, ids, mask) / temp, -1)[:, T - n - 1:T - 1]
    full = lp.gather(-1, torch.tensor(runs[0].tokens)[..., None])[..., 0]
    torch.testing.assert_close(torch.tensor(runs[0].logprobs), full, atol=1e-4, rtol=0)


def test_n_samples_share_one_prefill_and_log_probs_match_a_full_forward(cases, monkeypatch):
    """n = 3 samples of each of 3 prompts, at most 4 rows at a time (continuous batching, groups admitted whole):
    one prefill per prompt, not per sample; the sampled tokens' log-probs equal those of a full forward pass."""
    c = cases("qwen2-untied")
    prompts, n, temp = prompts_for(c.tok), 6, 0.9
    prefills, blocks = [], model.Qwen.blocks

    def counting(self, ids, positions, mask, cache):
        if ids.shape[1] > 1:  # a prefill (decode steps feed one token per row)
            prefills.append(ids.shape[0])
        return blocks(self, ids, positions, mask, cache)

    monkeypatch.setattr(model.Qwen, "blocks", counting)
    with full_vocab(c.ours) as m:
        g = m.generate(prompts, max_new_tokens=n, temperature=temp, stop_token_ids=[], n=3, max_batch=4,
                       generator=torch.Generator().manual_seed(5))
    assert sum(prefills) == len(prompts) and len(g.tokens) == 9  # 3 prompt rows prefilled for 9 sequences
    assert len({tuple(t) for t in g.tokens[:3]}) > 1  # the samples of one prompt differ
    monkeypatch.setattr(model.Qwen, "blocks", blocks)
    rows = [p for p in prompts for _ in range(3)]
    ids, mask = left_pad([p + s for p, s in zip(rows, g.tokens)], c.pad)
    T = ids.shape[1]
    lp = F.log_softmax(our_logits(c.ours, ids, mask) / temp, -1)[:, T - n - 1:T - 1]
    full = lp.gather(-1, torch.tensor(g.tokens)[..., None])[..., 0]
    torch.testing.assert_close(torch.tensor(g.logprobs), full, atol=1e-4, rtol=0)


def test_tiny_top_p_is_greedy(cases):
    c = cases("qwen3-tied-hd24")
    prompts = prompts_for(c.tok)
    greedy = c.ours.generate(prompts, max_new_tokens=8, stop_token_ids=[])
    nucleus = c.ours.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=1e-6, stop_token_ids=[],
                              generator=torch.Generator().manual_seed(0))
    assert nucleus.tokens == greedy.tokens


def test_sampled_tokens_follow_the_softmax_and_stay_in_the_nucleus():
    """The engine's inverse-CDF draw: token frequencies match softmax(logits / T) over 20,000 rows, from the engine's
    generator and from 20,000 seeds alike; a seeded row repeats its draw for the same seed and position, and with
    top_p no token outside the nucleus is ever drawn."""
    eng = model.Engine(torch.nn.Module(), temperature=0.8, generator=torch.Generator().manual_seed(0))
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, float("-inf")]).repeat(20000, 1)
    unseeded, at = torch.full((20000,), -1), torch.full((20000,), 7)
    want = torch.softmax(logits[0] / 0.8, -1)
    for seeds in (unseeded, torch.arange(20000)):
        tok, lp = eng._sample(logits, seeds, at)
        assert (torch.bincount(tok, minlength=6) / 20000 - want).abs().max() < 0.015  # ~3 standard errors
        assert torch.allclose(lp, want.log()[tok])
    eng.temperature, eng.top_p = 1.0, 0.6
    tok, _ = eng._sample(logits[:2000], unseeded[:2000], at[:2000])
    assert set(tok.tolist()) == {0, 1}  # p = 0.56, 0.21, 0.13, ...: the first two reach 0.6
    eng.top_p = 1.0
    draw = lambda at: eng._sample(logits[:50], torch.arange(50), at[:50])[0].tolist()  # noqa: E731
    assert draw(at) == draw(at) != draw(at + 1)


def test_never_samples_padded_vocab_rows():
    torch.manual_seed(0)
    cfg = model.tiny_config("qwen3", vocab_size=320, tie_word_embeddings=False)
    m = model.Qwen(cfg).eval()
    n_real = 256
    with torch.no_grad():
        m.lm_head.weight[n_real:] *= 4  # make the padded rows attractive
    m.sample_vocab_size = n_real
    prompts = [[1, 2, 3, 4], [5, 6]]
    ids, mask = left_pad(prompts, 0)
    p = F.softmax(our_logits(m, ids, mask)[:, -1] / 2.0, -1)
    assert p[:, n_real:].sum(-1).min() > 0.1 or our_logits(m, ids, mask)[:, -1].argmax(-1).ge(n_real).any()  # precondition
    for temp in (0.0, 2.0):
        g = m.generate(prompts, max_new_tokens=30, temperature=temp, stop_token_ids=[],
                       generator=torch.Generator().manual_seed(0))
        assert max(max(s) for s in g.tokens) < n_real


# ---- issue 44: decoding at fixed shapes ----

def lively_tiny(model_type, **overrides):
    """A tiny random model whose greedy tokens vary from step to step (weights of std 0.5, not 0.02)."""
    torch.manual_seed(0)
    lm = model.Qwen(model.tiny_config(model_type, vocab_size=96, **overrides)).eval()
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    return lm


def mixed_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def greedy_by_full_forward(lm, prompt, n, stops):
    """Greedy tokens and their log-probs, each from a forward over everything so far (no cache)."""
    ids, toks, lps = list(prompt), [], []
    for _ in range(n):
        logp = F.log_softmax(our_logits(lm, torch.tensor([ids]))[0, -1, :lm.sample_vocab_size], -1)
        toks.append(int(logp.argmax()))
        lps.append(float(logp[toks[-1]]))
        ids.append(toks[-1])
        if toks[-1] in stops:
            break
    return toks, lps


@pytest.mark.parametrize("model_type, kv_heads", [("qwen2", 2), ("qwen3", 2), ("qwen3", 4)])
def test_fixed_shape_decoding_gives_a_full_forwards_greedy_tokens(model_type, kv_heads):
    """The decode step of issue 44 (rows and key length rounded up, RoPE from a table, one additive mask a step) gives
    the greedy tokens and log-probs of a full forward per token: prompts of 1-30 tokens, rows stopping at different
    steps, 7 rows through 4 slots; grouped-query heads (2 kv heads) and plain ones (4)."""
    lm = lively_tiny(model_type, num_key_value_heads=kv_heads)
    prompts = mixed_prompts([3, 17, 9, 30, 1, 12, 5])
    stop = lm.generate(prompts[:1], max_new_tokens=4, stop_token_ids=[]).tokens[0][3]  # row 0 stops at its 4th
    out = lm.generate(prompts, max_new_tokens=20, stop_token_ids=[stop], max_batch=4)
    assert "length" in out.finish_reasons and len({len(t) for t in out.tokens}) > 1, out.tokens  # precondition
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        want, want_lp = greedy_by_full_forward(lm, p, 20, [stop])
        assert toks == want
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lp), atol=1e-4, rtol=0)


def test_a_seeded_row_draws_alike_in_any_batch_with_one_draw_call_a_step(monkeypatch):
    """A seeded row's uniforms hash its seed and position (model._uniform): the same tokens alone as among other rows
    (7 prompts x 2 samples through 5 slots), and one torch.rand call a sampling step however many rows are seeded
    (the seeded rows had a generator call each)."""
    lm = lively_tiny("qwen3")
    prompts, kw = mixed_prompts([3, 17, 9, 30, 1, 12, 5]), dict(max_new_tokens=12, temperature=1.0, stop_token_ids=[])
    rands, steps, rand, sample = [], [], torch.rand, model.Engine._sample
    monkeypatch.setattr(torch, "rand", lambda *a, **k: rands.append(1) or rand(*a, **k))
    monkeypatch.setattr(model.Engine, "_sample", lambda self, *a: steps.append(1) or sample(self, *a))
    batch = lm.generate(prompts, seeds=list(range(10, 17)), n=2, max_batch=5, **kw)
    assert len(rands) == len(steps) > 12
    for j in (0, 3, 6):
        assert lm.generate([prompts[j]], seeds=[10 + j], n=2, **kw).tokens == batch.tokens[2 * j:2 * j + 2]
    assert lm.generate([prompts[3]], seeds=[99], **kw).tokens[0] != batch.tokens[6]


def test_decode_steps_take_a_few_shapes_and_build_nothing_per_layer(monkeypatch):
    """15 prompts of 1-57 tokens, each stopping at its own length (up to 64 tokens), 8 slots: every decode step's
    shape (rows, keys) is a power of two of rows by a multiple of capacity / 8 keys (or all), a handful of shapes for
    some 90 steps; inside a step no arange and no RoPE are computed, and every layer gets the step's one additive
    mask (a bool one is converted in every layer). The longest prompts are admitted first; a CPU never compiles."""
    lm = lively_tiny("qwen2")
    prompts = mixed_prompts(range(1, 60, 4))
    stop_at = [3 + 29 * i % 62 for i in range(len(prompts))]
    shapes, masks, widths, inside = [], [], [], [False]
    step, arange, rope, sdpa, blocks = (model.decode_step, torch.arange, model.rope_cos_sin,
                                        F.scaled_dot_product_attention, model.Qwen.blocks)

    def spy_step(*a):
        shapes.append((a[2].shape[0], a[1].keys.shape[0]))
        inside[0] = True
        try:
            return step(*a)
        finally:
            inside[0] = False

    def outside(f, what):
        def spy(*a, **k):
            assert not inside[0], f"{what} inside a decode step"
            return f(*a, **k)
        return spy

    def spy_sdpa(*a, **k):
        if inside[0]:
            masks.append((len(shapes), id(k["attn_mask"]), k["attn_mask"].dtype))
        return sdpa(*a, **k)

    monkeypatch.setattr(model, "decode_step", spy_step)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile on CPU"))
    monkeypatch.setattr(torch, "arange", outside(arange, "arange"))
    monkeypatch.setattr(model, "rope_cos_sin", outside(rope, "RoPE"))
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(model.Qwen, "blocks", lambda self, x, *a: blocks(self, x, *a) if inside[0] else
                        widths.append(x.shape[1]) or blocks(self, x, *a))  # prefill widths
    g = lm.generate(prompts, max_new_tokens=64, stop_token_ids=[], max_batch=8,
                    stop_fn=lambda i, toks: len(toks) >= stop_at[i])
    assert [len(t) for t in g.tokens] == stop_at
    capacity, quantum = 57 + 64 + 1, -(-(57 + 64 + 1) // model.KEY_BUCKETS)
    assert all(r in (1, 2, 4, 8) and (k % quantum == 0 or k == capacity) for r, k in shapes), set(shapes)
    assert len(shapes) > 80 and len(set(shapes)) <= 12, sorted(set(shapes))
    assert {i for i, _, _ in masks} == set(range(1, len(shapes) + 1))
    assert len(masks) == len(shapes) * lm.config.num_hidden_layers and len(set(masks)) == len(shapes)
    assert all(dtype.is_floating_point for _, _, dtype in masks)
    assert widths[0] == 57 and widths == sorted(widths, reverse=True)  # longest prompts first


def test_the_cuda_graph_path_replays_steps_that_read_fixed_buffers_only(monkeypatch):
    """Engine._step's CUDA branch, run on CPU with CUDA graphs faked: a fake capture records the decode_step it would
    have run (and runs nothing: its logits are NaN); a replay runs that step again with the recorded arguments, as a
    real graph reruns its kernels on the same addresses. The greedy tokens equal eager decoding's only if every input
    of a step is a fixed buffer of the run, refilled in place; each (rows, keys) is captured once, after a warm-up, of
    the step torch.compile made (dynamic shapes: dynamo's cache serves every shape)."""
    lm = lively_tiny("qwen3")
    prompts = mixed_prompts([3, 17, 9, 30, 1, 12, 5])
    kw = dict(max_new_tokens=24, stop_token_ids=[], max_batch=4, stop_fn=lambda i, toks: len(toks) >= 10 + 2 * i)
    eager = lm.generate(prompts, **kw)
    graphs, compiled, engines, capturing, steps = [], [], [], [None], []
    step, run, step_of = model.decode_step, model.Engine.run, model.Engine._step

    class FakeGraph:
        replays = 0

        def replay(self):  # the cache's views as at the capture: the addresses a real graph holds
            self.replays += 1
            self.args[1].__dict__.update(self.views)
            out = step(*self.args)
            engines[-1].out[:out.shape[0]].copy_(out)

    def spy_step(*a):
        if capturing[0] is None:
            return step(*a)
        capturing[0].args, capturing[0].views = a, dict(vars(a[1]))
        capturing[0].shape = (a[2].shape[0], a[1].keys.shape[0])
        return torch.full((a[2].shape[0], lm.sample_vocab_size), float("nan"))

    @contextlib.contextmanager
    def fake_capture(g, pool, capture_error_mode):
        graphs.append(g)
        capturing[0] = g
        yield
        capturing[0] = None

    monkeypatch.setattr(model, "decode_step", spy_step)
    monkeypatch.setattr(model, "GRAPH_DEVICES", ("cpu",))
    monkeypatch.setattr(model, "GRAPH_MIN_TOKENS", 16)
    monkeypatch.setattr(model.Engine, "run", lambda self, groups: engines.append(self) or run(self, groups))
    monkeypatch.setattr(model.Engine, "_step", lambda self, *a: steps.append(1) or step_of(self, *a))
    monkeypatch.setattr(torch, "compile", lambda fn, **k: compiled.append(k) or fn)
    for name, fake in dict(CUDAGraph=FakeGraph, graph=fake_capture, graph_pool_handle=lambda: None).items():
        monkeypatch.setattr(torch.cuda, name, fake)
    graphed = lm.generate(prompts, **kw)
    assert graphed.tokens == eager.tokens and graphed.finish_reasons == eager.finish_reasons
    for a, b in zip(graphed.logprobs, eager.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    shapes = [g.shape for g in graphs]
    assert len(shapes) == len(set(shapes)) > 1 and compiled == [dict(dynamic=True)] * len(shapes)
    assert sum(g.replays for g in graphs) == len(steps) > 20  # every step replayed, none run eagerly


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_tokenizers_library(text, tok, hf_tok):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text).ids
    assert tok.decode(ids) == unicodedata.normalize("NFC", text) == hf_tok.decode(ids, skip_special_tokens=False)


def test_encode_matches_tokenizers_library_on_random_strings(tok, hf_tok):
    pieces = list("abcXYZ éüß中文🤖0123456789 \n\t\r.,;:'\"!?()[]{}#_-+*/\\") + \
        ["'s", "'LL", "'ve", "<|im_end|>", "<|endoftext|>", "  ", "\n\n", "e\u0301", "\u00a0", "the", "def ", "    "]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text).ids, repr(text)
        assert tok.decode(ids) == unicodedata.normalize("NFC", text), repr(text)


def test_special_tokens_and_sizes(tok, hf_tok):
    assert len(tok) == hf_tok.get_vocab_size(with_added_tokens=True)
    assert tok.im_end_id == hf_tok.token_to_id("<|im_end|>") == tok.eos_token_id
    assert tok.pad_token_id == hf_tok.token_to_id("<|endoftext|>")
    ids = tok.encode("a<|im_start|>b")
    assert hf_tok.token_to_id("<|im_start|>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    assert tok.encode("1234567") == [hf_tok.token_to_id(c) for c in "1234567"]  # digits one by one


def test_merges_pair_format_gives_same_ids(tok_dir, tmp_path, tok):
    set_merges_format(tok_dir / "tokenizer.json", tmp_path / "pairs.json", "pairs")
    pairs = model.Tokenizer.from_file(str(tmp_path / "pairs.json"))
    for text in TEXTS:
        assert pairs.encode(text) == tok.encode(text)


def test_decode_invalid_utf8_does_not_raise(tok, hf_tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # the emoji is several byte tokens in this small vocab
    assert tok.decode(ids[:1]) == hf_tok.decode(ids[:1])  # a partial character becomes U+FFFD


def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    msgs2 = msgs + [{"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(msgs2, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\nHello.<|im_end|>\n")


def test_train_tokenizer_round_trips_and_loads_in_tokenizers(tmp_path):
    if not hasattr(model, "train_tokenizer"):
        pytest.skip("model.train_tokenizer not implemented")
    trained = model.train_tokenizer(CORPUS, vocab_size=350)
    assert 256 + len(SPECIALS) < len(trained) <= 350 + len(SPECIALS)
    trained.save(str(tmp_path / "tokenizer.json"))
    ref = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert trained.encode(text) == ref.encode(text).ids
        assert trained.decode(trained.encode(text)) == unicodedata.normalize("NFC", text)
    assert len(trained.encode(CORPUS[0])) < len(CORPUS[0].encode())  # merges were learnt


# ---------------------------------------------------------------------------------------------------------------
# safetensors and checkpoints
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_safetensors_round_trip(dtype, tmp_path):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(5, 7).to(dtype), "b.bias": torch.randn(3).to(dtype),
               "c": torch.randn(2, 3, 4).to(dtype), "scalar": torch.tensor(1.5, dtype=dtype)}
    model.write_safetensors(str(tmp_path / "ours.safetensors"), tensors, metadata={"format": "pt"})
    for got in (model.read_safetensors(str(tmp_path / "ours.safetensors")), st_load_file(tmp_path / "ours.safetensors")):
        assert set(got) == set(tensors)
        for k, t in tensors.items():
            assert got[k].dtype == dtype and got[k].shape == t.shape and torch.equal(got[k], t)
    st_save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    got = model.read_safetensors(str(tmp_path / "lib.safetensors"))
    assert all(torch.equal(got[k], t) and got[k].dtype == dtype for k, t in tensors.items())


def test_sharded_checkpoint_loads(cases, tmp_path):
    c = cases("qwen2-untied")
    c.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(c.path / f, tmp_path / f)
    sharded, _ = model.load(str(tmp_path), dtype=torch.float32)
    ids = torch.tensor([prompts_for(c.tok)[1]])
    assert torch.equal(our_logits(sharded, ids), our_logits(c.ours, ids))


def test_strict_key_check_names_missing_and_unexpected(cases, tmp_path):
    c = cases("qwen3-tied-hd24")
    for f in c.path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    sd = st_load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    st_save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception) as err:
        model.load(str(tmp_path), dtype=torch.float32)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.1.mlp.extra_proj.weight" in str(err.value)


def test_save_loads_in_transformers_and_back(ckpt, tmp_path):
    model.save(ckpt.ours, ckpt.tok, str(tmp_path))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / f).exists(), f
    assert ("lm_head.weight" in st_load_file(tmp_path / "model.safetensors")) != CASES[ckpt.name][1]
    ids, mask = left_pad(prompts_for(ckpt.tok), ckpt.pad)
    expected = our_logits(ckpt.ours, ids, mask)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **{DTYPE_KW: torch.float32}).eval()
    valid = mask.bool()
    torch.testing.assert_close(hf_logits(hf, ids, mask)[valid], expected[valid], atol=1e-4, rtol=0)
    back, tk = model.load(str(tmp_path), dtype=torch.float32)
    torch.testing.assert_close(our_logits(back, ids, mask), expected, atol=0, rtol=0)
    assert len(tk) == len(ckpt.tok) and back.sample_vocab_size == ckpt.ours.sample_vocab_size
    hf_tk = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf_tk(text, add_special_tokens=False)["input_ids"] == ckpt.tok.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert hf_tk.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ckpt.tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert hf_tk.eos_token == "<|im_end|>"


def test_save_keeps_the_source_models_sampling_defaults(cases, tmp_path):
    """Issue 44: `save` wrote generation_config.json anew, so `vllm serve runs/ckpt/ppo` sampled at temperature 1 where
    the instruct model's own defaults say 0.7; now the loaded model's are kept (a model from scratch: greedy)."""
    c = cases("qwen2-tied")
    shutil.copytree(c.path, tmp_path / "src")
    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "src" / "generation_config.json").write_text(json.dumps({**sampling, "eos_token_id": 7}))
    m, tk = model.load(str(tmp_path / "src"), "cpu")
    model.save(m, tk, str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert {k: saved[k] for k in sampling} == sampling and 7 in saved["eos_token_id"]
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").temperature == 0.7
    model.save(model.Qwen(dataclasses.replace(m.config, generation=None)), tk, str(tmp_path / "new"))
    assert json.loads((tmp_path / "new" / "generation_config.json").read_text())["do_sample"] is False

def test_save_sharded_loads_in_transformers(cases, tmp_path):
    c = cases("qwen3-untied")
    model.save(c.ours, c.tok, str(tmp_path), max_shard_bytes=50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.tensor([prompts_for(c.tok)[2]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **{DTYPE_KW: torch.float32}).eval()
    torch.testing.assert_close(hf_logits(hf, ids, torch.ones_like(ids)), our_logits(c.ours, ids), atol=1e-4, rtol=0)
    back, _ = model.load(str(tmp_path), dtype=torch.float32)
    assert torch.equal(our_logits(back, ids), our_logits(c.ours, ids))


def test_save_in_bf16_from_fp32_weights_loads_in_transformers(cases, tmp_path):
    """What sft.py / ppo.py write from CUDA runs: fp32 master weights saved as bf16 (model.save(dtype=...))."""
    c = cases("qwen3-untied")
    model.save(c.ours, c.tok, str(tmp_path), dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in st_load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    assert next(c.ours.parameters()).dtype == torch.float32  # the model itself is untouched
    ids = torch.tensor([prompts_for(c.tok)[2]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **{DTYPE_KW: torch.bfloat16}).eval()
    back, _ = model.load(str(tmp_path), dtype=torch.bfloat16)
    torch.testing.assert_close(hf_logits(hf, ids, torch.ones_like(ids)), our_logits(back, ids), atol=2e-2, rtol=0)
    rounded = {k: v.to(torch.bfloat16) for k, v in c.ours.state_dict().items()}
    assert all(torch.equal(v, rounded[k]) for k, v in back.state_dict().items())  # exactly the rounded weights


def test_saved_chat_template_matches_ours_in_transformers(cases, tmp_path):
    c = cases("qwen2-tied")
    shutil.copy(c.path / "tokenizer.json", tmp_path / "tokenizer.json")  # no tokenizer_config.json: model.py's template
    bare = model.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    model.save(c.ours, bare, str(tmp_path / "out"))
    hf_tk = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."},
            {"role": "user", "content": "Again\nplease"}]
    for gen_prompt in (True, False):
        assert hf_tk.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt) == \
            bare.apply_chat_template(msgs, add_generation_prompt=gen_prompt)


# ---------------------------------------------------------------------------------------------------------------
# Model lookup: the local Hugging Face cache, and a download (from a fake hub on loopback)

def test_load_hub_id_from_local_cache(cases, tmp_path, monkeypatch):
    """The HF cache layout: models--Org--Name/{blobs/<hash>, snapshots/<rev>/<file> -> blob, refs/main}."""
    c = cases("qwen3-untied")
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for i, f in enumerate(sorted(c.path.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (repo / "snapshots" / "0123abcd" / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: no download may happen
    m, tk = model.load("tiny-org/tiny-qwen", dtype=torch.float32)
    ids = torch.tensor([prompts_for(c.tok)[0]])
    assert torch.equal(our_logits(m, ids), our_logits(c.ours, ids)) and len(tk) == len(c.tok)


def test_missing_hub_id_without_network_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(Exception) as err:
        model.load("tiny-org/absent")
    assert "tiny-org/absent" in str(err.value) and "\n" not in str(err.value).strip()


class FakeHub(http.server.BaseHTTPRequestHandler):
    """GET /<org>/<name>/resolve/<rev>/<file> from server.root, with Range support; the first full request for
    model.safetensors is cut in the middle, as a dropped connection would."""

    def do_GET(self):
        self.server.requests.append((self.path, self.headers.get("Range")))
        parts = self.path.split("/")
        f = self.server.root / "/".join(parts[5:]) if len(parts) > 5 and parts[3] == "resolve" else None
        if f is None or not f.is_file():
            self.send_response(404)
            self.end_headers()
            return
        data, start = f.read_bytes(), 0
        rng = self.headers.get("Range")
        if rng:
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.end_headers()
                return
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("X-Repo-Commit", "feedbeef")
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if f.name == "model.safetensors" and not rng and not self.server.cut:
            self.server.cut = True
            self.wfile.write(data[:len(data) // 2])  # then the connection drops
            self.close_connection = True
            return
        for a in range(start, len(data), 1 << 16):  # server.delay apart: concurrent downloads overlap
            self.wfile.write(data[a:a + (1 << 16)])
            time.sleep(getattr(self.server, "delay", 0))

    def log_message(self, *args):
        pass


def test_download_from_hub_resumes(cases, tmp_path, monkeypatch):
    c = cases("qwen2-untied")
    torch.manual_seed(0)  # weights of a few MiB, so that the cut falls after some whole download chunks
    big = model.Qwen(model.tiny_config("qwen2", vocab_size=8192, tie_word_embeddings=False)).eval()
    model.save(big, c.tok, str(tmp_path / "repo"))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    srv.root, srv.requests, srv.cut = tmp_path / "repo", [], False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
        try:
            model.load("tiny-org/tiny-qwen", dtype=torch.float32)  # the weights arrive cut: may fail
        except Exception:
            pass
        m, _ = model.load("tiny-org/tiny-qwen", dtype=torch.float32)
        ranges = [r for p, r in srv.requests if p.endswith("/model.safetensors") and r]
        assert ranges and int(ranges[-1].split("=")[1].split("-")[0]) > 0, srv.requests  # resumed, not restarted
        ids = torch.tensor([prompts_for(c.tok)[1]])
        assert torch.equal(our_logits(m, ids), our_logits(big, ids))
        n = len(srv.requests)
        model.load("tiny-org/tiny-qwen", dtype=torch.float32)
        assert len(srv.requests) == n  # the third load is served from the cache
    finally:
        srv.shutdown()
        srv.server_close()


RESOLVE = """import os, sys, time
sys.path.insert(0, sys.argv[1])
import model
open(f"{sys.argv[2]}.{os.getpid()}", "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
print(model.resolve("tiny-org/tiny-qwen"))
"""


def test_processes_resolving_one_id_at_once_download_it_once_and_whole(cases, tmp_path):
    """Issue 44: torchrun's ranks resolve a hub id at once. They shared <file>.incomplete: 3 of 4 crashed, a file grew
    past what was served. Now one process downloads (a lock per repo), the others wait and find every file whole."""
    c = cases("qwen2-untied")
    torch.manual_seed(0)  # weights of a few MiB, sent in pieces: the four processes overlap
    big = model.Qwen(model.tiny_config("qwen2", vocab_size=8192, tie_word_embeddings=False)).eval()
    model.save(big, c.tok, str(tmp_path / "repo"))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    srv.root, srv.requests, srv.cut, srv.delay = tmp_path / "repo", [], True, 0.005
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    go, env = tmp_path / "go", dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), OMP_NUM_THREADS="1",
                                    HF_ENDPOINT=f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", RESOLVE, str(ROOT), str(go)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
        deadline = time.time() + 120
        while len(list(tmp_path.glob("go.*"))) < 4 and time.time() < deadline:  # every one imported: start at once
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        srv.shutdown()
        srv.server_close()
    assert [p.returncode for p in procs] == [0] * 4, [err[-400:] for _, err in outs]
    folders = {Path(out.strip()) for out, _ in outs}
    assert len(folders) == 1, folders
    folder = folders.pop()
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(folder))
    for f in folder.iterdir():  # and nothing left over (.incomplete)
        assert f.read_bytes() == (tmp_path / "repo" / f.name).read_bytes(), f.name
    assert len([p for p, _ in srv.requests if p.endswith("/model.safetensors")]) == 1, srv.requests


class RefusingHub(http.server.BaseHTTPRequestHandler):
    """Every request answered with server.status and no body."""

    def do_GET(self):
        self.server.requests.append(self.path)
        self.send_response(self.server.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, error, hint", [(401, PermissionError, "set HF_TOKEN for gated models"),
                                                 (403, PermissionError, "set HF_TOKEN for gated models"),
                                                 (404, FileNotFoundError, "no such model")])
def test_a_gated_or_absent_hub_id_is_a_one_line_error_at_the_first_request(tmp_path, monkeypatch, status, error,
                                                                              hint):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RefusingHub)
    srv.status, srv.requests = status, []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
        with pytest.raises(error) as err:
            model.load("tiny-org/gated")
        message = str(err.value)
        assert "tiny-org/gated" in message and hint in message and "\n" not in message.strip()
        assert srv.requests == ["/tiny-org/gated/resolve/main/config.json"]  # nothing fetched after the refusal
    finally:
        srv.shutdown()
        srv.server_close()


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------

def run_cli(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "model.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def test_cli_generate(cases):
    r = run_cli("generate", "--model", str(cases("qwen2-tied").path), "--prompt", "hi", "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("extra", [["generate", "--prompt", "hi", "--temperature", "nan"],
                                   ["generate", "--prompt", "hi", "--max-new-tokens", "0"],
                                   ["generate", "--prompt", "hi", "--device", "tpu9"],
                                   ["serve"]])  # the server went: vLLM and `transformers serve` serve saved folders
def test_cli_bad_values_are_one_line_exit_2(cases, extra, cli):  # main(argv) here (conftest.cli), not a python
    r = cli(model.main, [extra[0], "--model", str(cases("qwen2-tied").path), *extra[1:]], cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_missing_model_is_one_line_exit_2(tmp_path, cli):
    r = cli(model.main, ["generate", "--model", str(tmp_path / "no-such-model"), "--prompt", "hi"], cwd=ROOT)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr



@pytest.mark.parametrize("error, status", [(ValueError("bad --out"), 2), (RuntimeError("CUDA out of memory"), 1)])
def test_an_error_under_torchrun_is_printed_first_and_leaves_without_destroying_the_group(monkeypatch, capsys, error,
                                                                                         status):
    """Issue 44: destroy_process_group on the error path blocks under NCCL while the other ranks wait in a collective,
    and an uncaught error's traceback came only after it. Now (a faked process group) the error is printed, then the
    process leaves (os._exit) with no destroy; a run that ends well still leaves the group cleanly."""
    events = []
    monkeypatch.setattr(model.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(model.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(model.dist, "destroy_process_group", lambda: events.append("destroy"))

    def leave(code):  # what stderr holds when the process leaves
        events.append((code, capsys.readouterr().err))
        raise SystemExit(code)
    monkeypatch.setattr(model.os, "_exit", leave)

    def train(cfg):
        raise error
    with pytest.raises(SystemExit):
        model.run_main("x.py", train, None)
    assert len(events) == 1 and events[0][0] == status, events
    err = events[0][1]
    assert err == "x.py: error (rank 1): bad --out\n" if status == 2 else "Traceback" in err and str(error) in err
    model.run_main("x.py", lambda cfg: None, None)
    assert events[1:] == ["destroy"]

# ---------------------------------------------------------------------------------------------------------------
# Other dtypes and devices
# ---------------------------------------------------------------------------------------------------------------

def test_bf16_cpu_close_to_fp32(cases):
    c = cases("qwen2-untied")
    m16, _ = model.load(str(c.path), dtype=torch.bfloat16)
    assert next(m16.parameters()).dtype == torch.bfloat16
    ids, mask = left_pad(prompts_for(c.tok), c.pad)
    lo16, lo32 = our_logits(m16, ids, mask), our_logits(c.ours, ids, mask)
    valid = mask.bool()
    assert (lo16[valid] - lo32[valid]).abs().max() < 0.1 * lo32.abs().max() + 0.05
    g = m16.generate(prompts_for(c.tok), max_new_tokens=4, stop_token_ids=[])
    assert all(len(s) == 4 for s in g.tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(cases):
    c = cases("qwen3-tied-hd24")
    ids, mask = left_pad(prompts_for(c.tok), c.pad)
    valid = mask.bool()
    gpu, _ = model.load(str(c.path), device="cuda", dtype=torch.float32)
    lo = our_logits(gpu, ids.cuda(), mask.cuda()).cpu()
    torch.testing.assert_close(lo[valid], our_logits(c.ours, ids, mask)[valid], atol=1e-3, rtol=0)
    g = gpu.generate(prompts_for(c.tok), max_new_tokens=6, stop_token_ids=[])
    assert g.tokens == c.ours.generate(prompts_for(c.tok), max_new_tokens=6, stop_token_ids=[]).tokens
    b16, _ = model.load(str(c.path), device="cuda", dtype=torch.bfloat16)
    lo16 = our_logits(b16, ids.cuda(), mask.cuda()).cpu()
    assert (lo16[valid] - lo[valid]).abs().max() < 0.1 * lo.abs().max() + 0.05


@pytest.mark.parametrize("change, what", [(lambda b: b[:-1000], "truncated"),  # an interrupted download
                                          (lambda b: b + b"\0" * 64, "too long")])  # two writers (issue 44)
def test_truncated_or_too_long_safetensors_is_one_clear_error_not_a_hang(cases, tmp_path, change, what):
    c = cases("qwen2-tied")
    shutil.copytree(c.path, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    f.write_bytes(change(f.read_bytes()))
    with pytest.raises(ValueError, match=what):
        model.load(str(tmp_path / "ckpt"), "cpu")
    with pytest.raises(ValueError, match=what):  # and before anything is built or sharded
        model.load(str(tmp_path / "ckpt"), "cpu", meta=True)
    r = run_cli("generate", "--model", str(tmp_path / "ckpt"), "--prompt", "hi")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and what in r.stderr


@pytest.mark.parametrize("name, content", [("config.json", b'{"hidden_size": 6'), ("tokenizer.json", b"\xff\xfe"),
                                           ("generation_config.json", b"[1, 2]")])
def test_a_broken_json_file_of_a_checkpoint_is_named(cases, tmp_path, name, content):
    c = cases("qwen2-tied")
    shutil.copytree(c.path, tmp_path / "ckpt")
    (tmp_path / "ckpt" / name).write_bytes(content)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        model.load(str(tmp_path / "ckpt"), "cpu")
    assert "\n" not in str(e.value)


# ---- the CUDA paths, on CPU (issue: "The GPU node on the first try") ----

def _sdpa_spy(monkeypatch):
    """Records (queries, dense mask?, enable_gqa) of every SDPA call the model makes with more than one query."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        if q.shape[2] > 1:
            calls.append((q.shape[2], type(attn_mask) is torch.Tensor, kw.get("enable_gqa", False)))
        return sdpa_with_bias(sdpa, q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_grouped_query_prefill_and_scoring_hand_sdpa_no_dense_mask(cases, monkeypatch):
    """On CUDA a dense boolean mask with grouped-query heads leaves SDPA only its math kernel (flash takes no mask,
    the memory-efficient kernel no GQA): fp32 scores for every head, 56 GiB for 16 rows of 16k tokens at 7B. A prompt
    prefilled in chunks (every chunk after the first is causal with an offset) and samples scored over their prompt's
    cache (ppo.py's n > 1) must reach SDPA without one, and give the tokens of a one-chunk prefill."""
    c = cases("qwen2-untied")
    assert c.ours.config.num_key_value_heads < c.ours.config.num_attention_heads  # grouped-query heads
    prompts = [p * 3 for p in prompts_for(c.tok)]  # 3 prompts of 30 or more tokens
    kw = dict(max_new_tokens=5, stop_token_ids=[], temperature=0.0)
    whole = c.ours.generate(prompts, **kw)
    calls = _sdpa_spy(monkeypatch)
    chunked = c.ours.generate(prompts, prefill_chunk=4, **kw)
    assert chunked.tokens == whole.tokens
    assert len(calls) > 2 * c.ours.config.num_hidden_layers  # several chunks were prefilled
    assert not [x for x in calls if x[1] and x[2]], calls  # no call with a dense mask and enable_gqa
    calls.clear()
    P, n, R = 12, 3, 5  # one prompt and its 3 samples in one row: the samples run over the prompt's cache (P >= R)
    ids = torch.randint(0, c.n_tok, (1, P + n * R))
    starts, lengths = torch.tensor([P, P + R, P + 2 * R]), torch.tensor([P + R, P + 2 * R, P + 3 * R])
    with torch.no_grad():
        model.response_hidden(c.ours, ids, lengths, starts)
    assert calls and not [x for x in calls if x[1] and x[2]], calls


def test_a_wave_sizes_its_kv_cache_once_for_its_longest_request(cases, monkeypatch):
    """A later, longer prompt doubled the cache (and held the old one during the copy: 14 -> 28 GiB, 42 GiB at the
    peak, for 16 slots at 7B). The cache is now allocated once, for the wave's longest prompt + max_new_tokens."""
    c = cases("qwen2-untied")
    made, slot_cache = [], model.SlotCache

    def counting(slots, capacity, dtype):
        made.append((slots, capacity))
        return slot_cache(slots, capacity, dtype)
    monkeypatch.setattr(model, "SlotCache", counting)
    short, longer = c.tok.encode("Hello, world! " * 4), c.tok.encode("Hello, world! " * 5)
    assert len(longer) > len(short)
    g = c.ours.generate([short, short, longer], max_new_tokens=6, stop_token_ids=[], max_batch=1)  # one at a time
    assert [len(t) for t in g.tokens] == [6, 6, 6]
    assert made == [(1, len(longer) + 6 + 1)]


def test_cli_a_bad_model_is_one_line_exit_2_naming_the_flag(tmp_path, no_endpoint):
    """Issue 43: `model.py: error: --model: ...` for a missing folder, a file, a hub id not in the cache offline."""
    from conftest import assert_bad_models_refused
    assert_bad_models_refused(model.main, ["generate", "--model", "{m}", "--prompt", "hi"], tmp_path, no_endpoint)
