"""Tests for tests/bench_memory.py's arithmetic (the memory plan of ppo.py and sft.py), all fast:

- the qwen2.5-7b preset counts 7,615,616,512 parameters (model.Qwen on the meta device);
- the sharded model states scale as 1 / world: at world 8 they are 1/8 of world 1;
- ppo-lora's adapter count on a tiny config equals a hand computation, and its states do not depend on --world;
- the KV cache of the rollout equals 2 x layers x kv heads x head_dim x 2 B per token;
- for a tiny model, the plan's KV cache, AdamW moments, critic and LoRA rows equal the bytes the code allocates;
- the measured bytes per token of a (tiny) block are positive;
- bad input (an unknown preset, a sequence no longer than the response) exits 2 with one line.
"""
import importlib.util
from pathlib import Path

import pytest
import torch

import model

PATH = Path(__file__).resolve().parent / "bench_memory.py"
spec = importlib.util.spec_from_file_location("bench_memory", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

ACT = 200 * 1024  # a stand-in for the measured bytes per token per layer


def states(rows):
    return sum(b for phase, _, b, _ in rows if phase == "states")


def test_qwen25_7b_param_count():
    n = bench.count_params(bench.load_config("qwen2.5-7b"))
    assert n["total"] == 7_615_616_512
    assert n["root"] == 2 * 152064 * 3584 + 3584  # untied embeddings and lm_head, final norm
    assert n["total"] == n["root"] + 28 * n["block"]


@pytest.mark.parametrize("mode", ["ppo", "sft"])
def test_sharded_states_scale_as_one_over_world(mode):
    cfg = bench.load_config("qwen2.5-0.5b")
    fixed = {1: bench.CONTEXT, 8: bench.CONTEXT + bench.NCCL}  # not sharded
    one, eight = (states(bench.plan(cfg, mode, world=w, act=ACT)) - fixed[w] for w in (1, 8))
    assert eight == pytest.approx(one / 8, rel=1e-12)
    P = bench.count_params(cfg)["total"]
    # weights and AdamW held throughout (gradients only in the update: every step frees them); ppo: actor, critic, ref
    expected = 12 * P if mode == "sft" else 12 * P + 12 * (P + cfg.hidden_size + 1) + 2 * P
    assert one == pytest.approx(expected, rel=1e-12)


def test_lora_adapter_count_by_hand():
    cfg = model.tiny_config()  # hidden 64, intermediate 128, 4 heads, 2 kv heads, head_dim 16, 2 layers
    # (in + out): q 64+64, k 64+32, v 64+32, o 64+64, gate 64+128, up 64+128, down 128+64 = 1024 per block
    assert bench.lora_params(cfg, 4) == 2 * 4 * 1024
    rows = bench.plan(cfg, "ppo-lora", world=8, max_prompt=48, max_new=16, lora_rank=4, act=ACT)
    P = bench.count_params(cfg)["total"]
    assert states(rows) == bench.CONTEXT + 2 * 2 * P + 2 * 8192 * 12 + (64 + 1) * 12  # world ignored: one GPU
    assert states(rows) == states(bench.plan(cfg, "ppo-lora", world=1, max_prompt=48, max_new=16, lora_rank=4,
                                             act=ACT))


def test_kv_cache_and_peak():
    cfg = bench.load_config("qwen2.5-7b")
    assert bench.kv_bytes_per_token(cfg) == 2 * 28 * 4 * 128 * 2
    rows = bench.plan(cfg, "ppo", world=8, max_prompt=1536, gen_batch=4, max_new=512, act=ACT)
    kv = next(b for _, item, b, _ in rows if item.startswith("KV cache"))
    assert kv == 4 * (2048 + 1) * bench.kv_bytes_per_token(cfg)
    t = bench.totals(rows)
    assert t["peak"] == max(t["rollout"], t["update"]) and t["rollout"] > states(rows) * (1 + bench.FRAGMENTATION)


def row(rows, start):
    return next(b for _, item, b, _ in rows if item.startswith(start))


def test_the_plans_bytes_are_the_bytes_the_code_allocates(monkeypatch):
    """For a tiny model, each row the code can show on CPU: the KV cache model.generate allocates for a wave (bf16,
    the longest prompt at --max-prompt-len), AdamW's moments of the actor, the critic's parameters, LoRA's
    trainable adapters and the layers its rollout copy merges."""
    import ppo
    torch.manual_seed(0)
    cfg = model.tiny_config(vocab_size=96)
    lm = model.Qwen(cfg).to(torch.bfloat16).eval()
    G, prompt, new = 3, 40, 6
    rows = bench.plan(cfg, "ppo", world=1, max_prompt=prompt, max_new=new, gen_batch=G, lora_rank=4, act=ACT)
    caches, slot_cache = [], model.SlotCache
    monkeypatch.setattr(model, "SlotCache", lambda *a: caches.append(slot_cache(*a)) or caches[-1])
    lm.generate([list(range(1, prompt + 1)), [1, 2, 3], list(range(5, 25))], max_new_tokens=new, max_batch=G,
                stop_token_ids=[])
    (cache,) = caches
    assert sum(t.nbytes for t in (*cache.k.values(), *cache.v.values())) == row(rows, "KV cache")
    actor = ppo.Actor(model.Qwen(cfg))
    opt = torch.optim.AdamW(actor.parameters())
    actor(torch.randint(0, 96, (1, 8)), torch.tensor([8]), torch.tensor([4])).sum().backward()
    opt.step()
    moments = sum(t.nbytes for st in opt.state.values() for t in st.values() if t.dim())
    assert moments == row(rows, "actor AdamW")
    critic = ppo.Critic(model.Qwen(cfg))
    assert cfg.tie_word_embeddings and 12 * sum(p.numel() for p in critic.parameters()) == row(rows, "critic fp32")
    lora = model.Qwen(cfg).to(torch.bfloat16)
    model.add_lora(lora, 4, 8.0)
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == bench.lora_params(cfg, 4)
    shared = {p.data_ptr() for p in lora.parameters()}
    merged = model.rollout_copy(lora, torch.device("cpu"))  # only the merged layers are new
    rows = bench.plan(cfg, "ppo-lora", world=1, max_prompt=prompt, max_new=new, gen_batch=G, lora_rank=4, act=ACT)
    assert sum(p.nbytes for p in merged.parameters() if p.data_ptr() not in shared) == row(rows, "actor with its")


def test_measured_block_bytes_are_positive():
    per_token, how = bench.measure_block(model.tiny_config(), tokens=32)
    assert per_token > 0 and how in ("bf16 autocast", "fp32")


@pytest.mark.parametrize("argv, word", [(["--model", "qwen9-1t"], "--model"),
                                        (["--max-prompt-len", "0"], "--max-prompt-len"),
                                        (["--world", "0"], "--world")])
def test_bad_input_exits_2_with_one_line(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_memory.py: error:") and word in err


def test_the_sft_loss_row_is_what_the_fused_loss_keeps():
    """sft.py's fused loss keeps an fp32 softmax of every trained position, in no chunks: the plan's row is twice that
    (with the two bf16 casts of its backward on CUDA), past ppo.py's 1,024-token logits chunk too."""
    import sft
    cfg, n = model.tiny_config(vocab_size=96), 3000
    h, w = torch.randn(n, cfg.hidden_size, requires_grad=True), torch.randn(96, cfg.hidden_size, requires_grad=True)
    kept = sft.LinearCrossEntropy.apply(h, w, torch.randint(0, 96, (n,))).grad_fn.saved_tensors[-1]
    assert kept.shape == (n, 96) and kept.dtype == torch.float32
    assert row(bench.plan(cfg, "sft", world=1, sft_len=n, micro=1, act=ACT), "fused loss") == 2 * kept.nbytes
