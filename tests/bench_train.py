"""Training benchmarks (not collected by pytest): one function per part, chosen with --part sft|ppo|ppo-update|all.

sft: tokens/s of sft.py's optimizer step (SFTModel: hidden states, lm_head only at trained positions, masked
cross-entropy, backward, clip, AdamW) against a plain `transformers` training step (Qwen*ForCausalLM(input_ids,
labels=labels).loss, backward, clip, AdamW) on the same weights and the same batch, measured in the same run,
interleaved, best of --repeats. The batch imitates SFT data: the first 90% of every sequence is prompt (label -100).
On CUDA both sides run under bf16 autocast with fp32 weights, as sft.py does; --gpu-model also measures a real
checkpoint (e.g. Qwen/Qwen2.5-0.5B-Instruct) with peak memory.

  python tests/bench_train.py --part sft                      # CPU: a 4-layer, 256-wide Qwen3
  python tests/bench_train.py --part ppo                      # the time split of one PPO iteration (tiny model)
  python tests/bench_train.py --part ppo-update               # the update with a state's prompt once, against n times
  python tests/bench_train.py --part sft --hidden 896 --layers 24 --vocab 151936 --seq 1024 --batch 4
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402
import sft  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def sft_batch(vocab, batch, seq, device, prompt_share=0.9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, :int(prompt_share * seq)] = sft.IGNORE
    return ids.to(device), labels.to(device)


def bench_sft(a):
    import transformers
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory() as folder:
        if a.model:  # a real checkpoint
            folder = model.resolve(a.model)
            cfg = model.load(folder, "cpu", torch.float32)[0].config
        else:
            heads = max(4, a.hidden // 64)
            cfg = model.tiny_config("qwen3", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                                    num_hidden_layers=a.layers, num_attention_heads=heads,
                                    num_key_value_heads=heads // 2, head_dim=a.hidden // heads,
                                    max_position_embeddings=max(2048, a.seq))
            torch.manual_seed(0)
            tok = model.train_tokenizer(["hello world"], 300)
            model.save(model.Qwen(cfg), tok, folder)
        ours, _ = model.load(folder, device, torch.float32)
        ours.train()
        kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).to(device).train()
    ids, labels = sft_batch(cfg.vocab_size, a.batch, a.seq, device)
    net = sft.SFTModel(ours)
    opt_ours = torch.optim.AdamW(net.parameters(), lr=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_ours, lambda s: 1.0)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    args = sft.Config(micro_batch=a.batch, grad_clip=1.0)
    examples = [(x.tolist(), y.tolist()) for x, y in zip(ids.cpu(), labels.cpu())]

    def step_ours():
        sft.optimizer_step(net, opt_ours, sched, [examples], 0, device, args, 1)

    def step_hf():
        with model.autocast(device):
            loss = hf(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    best = {"ours": float("inf"), "transformers": float("inf")}
    peak = {}
    for name, fn in (("ours", step_ours), ("transformers", step_hf)):  # warm up (allocations, AdamW state)
        fn()
    for _ in range(a.repeats):
        for name, fn in (("ours", step_ours), ("transformers", step_hf)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            t = time.perf_counter()
            for _ in range(a.steps):
                fn()
            sync(device)
            best[name] = min(best[name], (time.perf_counter() - t) / a.steps)
            if device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated() / 2**30
    n = a.batch * a.seq
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    print(f"sft step on {device}, {params:.1f}M params, batch {a.batch} x {a.seq} tokens (90% prompt), "
          f"best of {a.repeats} x {a.steps} steps, {torch.get_num_threads()} threads")
    for name in best:
        mem = f", peak {peak[name]:.2f} GiB" if name in peak else ""
        print(f"  {name:12s} {n / best[name]:10.0f} tokens/s{mem}")
    print(f"  ratio ours / transformers: {best['transformers'] / best['ours']:.2f}x tokens/s")


def bench_ppo(args):
    """The time split of one PPO iteration on the tiny model (CPU): generating, executing in the sandboxes, and
    updating (the scoring forwards of actor, reference and critic, GAE, and the PPO minibatches), each as a share of
    the iteration; and the update against the named baseline "plain step": one forward+backward of the same model
    over the same states and lengths, timed in this run (PPO does 3 no-grad forwards and 2 forward+backwards per
    token: about 3x a plain step, counting a backward as two forwards)."""
    import shutil

    import agent
    import collect
    import ppo

    tmp = Path(tempfile.mkdtemp(prefix="bench_ppo_"))
    states_path = ROOT / "runs" / "data" / "states.jsonl"
    if not states_path.exists():  # one short scripted trajectory on a built-in task
        traj = collect.rollout({"id": "digits-0000", "task": "digits", "ideas": [], "expert": "scripted",
                                "base_url": None, "prices": (0.0, 0.0), "max_steps": 4, "time_limit": 600.0})
        states_path = tmp / "states.jsonl"
        agent.write_atomic(states_path, (json.dumps(s) + "\n" for s in collect.state_rows([traj])))
    states = [json.loads(line) for line in states_path.read_text().splitlines()]
    policy = ROOT / "runs" / "ckpt" / "sft"  # the SFT model acts validly, so the sandboxes get real work
    if not (policy / "config.json").exists():  # else a random tiny model: every action is invalid
        tok = model.train_tokenizer([m["content"] for s in states[:50] for m in s["messages"]], 1024)
        torch.manual_seed(0)
        policy = tmp / "tiny"
        model.save(model.Qwen(model.tiny_config(vocab_size=len(tok))), tok, policy)
    cfg = ppo.Config(model=str(policy), states=str(states_path), out=str(tmp / "ckpt"),
                     log_file=str(tmp / "log.jsonl"), iterations=1, batch_size=args.ppo_batch,
                     max_new_tokens=args.ppo_new_tokens, device="cpu")
    ppo.train(cfg)
    log = json.loads((tmp / "log.jsonl").read_text().splitlines()[-1])

    # the baseline: one plain forward+backward of the same model over the iteration's states (the same shuffle as
    # ppo.train's first iteration), each prompt + the mean response length, in micro-batches of similar lengths
    lm, tok = model.load(str(policy), "cpu", torch.float32)
    order = list(range(len(states)))
    random.Random(f"{cfg.seed}:0").shuffle(order)
    R = int(log["response_tokens"])
    lengths = sorted(len(model.keep_end(tok.encode(tok.apply_chat_template(states[i]["messages"])),  # as ppo.generate
                                        lm.config.max_position_embeddings, cfg.max_new_tokens)) + R
                     for i in order[:args.ppo_batch])
    start = time.perf_counter()
    for k in range(0, len(lengths), cfg.micro_batch):
        ids = torch.randint(0, len(tok), (len(lengths[k:k + cfg.micro_batch]), max(lengths[k:k + cfg.micro_batch])))
        lm(ids)[:, -R - 1:].float().logsumexp(-1).mean().backward()
    plain = time.perf_counter() - start
    total = log["time_total"]
    print(f"ppo: one iteration of {policy}, {log['actions']} actions, {log['response_tokens']:.0f} response tokens per state, "
          f"{total:.1f}s")
    for name in ("generate", "execute", "update"):
        print(f"  {name:<9}{log['time_' + name]:7.1f}s  {100 * log['time_' + name] / total:5.1f}% of the iteration")
    print(f"  update / plain step (one forward+backward over the same states and lengths, {plain:.1f}s): "
          f"{log['time_update'] / plain:.2f}x  (PPO: 3 no-grad forwards + 2 forward+backwards, ~3x)")
    shutil.rmtree(tmp, ignore_errors=True)


def bench_ppo_update(args):
    """The update of one PPO iteration (the scoring forwards of actor and reference, then the PPO minibatches) on the
    same rollout in two layouts: the named baseline "one row per response" (prompt + response, n rows per state) and
    "one row per state" (the prompt once, then its n responses: ppo.make_batch with group = n, the tiny defaults'
    layout). Needs runs/ckpt/sft and runs/data/states.jsonl (python collect.py && python sft.py)."""
    import copy

    import ppo

    policy, states_path = ROOT / "runs" / "ckpt" / "sft", ROOT / "runs" / "data" / "states.jsonl"
    if not (policy / "config.json").exists() or not states_path.exists():
        sys.exit(f"bench_train.py: --part ppo-update needs {policy} and {states_path} (collect.py, sft.py)")
    lm, tok = model.load(str(policy), "cpu", torch.float32)
    states = ppo.load_states(str(states_path))[:args.ppo_batch]
    cfg, dev = ppo.resolve_defaults(ppo.Config(max_new_tokens=args.ppo_new_tokens), 1), torch.device("cpu")
    n = cfg.samples_per_state
    prompts, tokens, *_ = ppo.generate(lm, tok, [s["messages"] for s in states], cfg, dev,
                                       seeds=list(range(len(states))), n=n)
    print(f"ppo-update: {len(states)} states x {n} responses, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, responses {min(map(len, tokens))}-{max(map(len, tokens))} tokens")
    best = {}
    for _ in range(args.repeats):
        for group, name in ((1, "one row per response"), (n, "one row per state")):
            ids, lengths, mask, starts = ppo.make_batch(prompts, tokens, tok.pad_token_id, dev, group)
            actor, ref = ppo.Actor(copy.deepcopy(lm), cfg.temperature), ppo.Actor(copy.deepcopy(lm), cfg.temperature)
            opt = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr)
            start = time.perf_counter()
            lp, _, values = ppo.forward_scores(actor, None, ref, ids, lengths, starts, mask.shape[1], cfg, dev)
            adv = torch.randn(len(tokens), 1, generator=torch.Generator().manual_seed(0)) * mask
            data = dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=lp * mask, values=values,
                        advantages=adv, returns=adv, group=n)
            ppo.ppo_update(actor, None, opt, None, data, cfg, dev, torch.Generator().manual_seed(0))
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    base, ours = best["one row per response"], best["one row per state"]
    print(f"  one row per response (baseline) {base:.2f}s, one row per state {ours:.2f}s: {base / ours:.2f}x "
          f"(best of {args.repeats})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["sft", "ppo", "ppo-update", "all"], default="all")
    p.add_argument("--model", default=None, help="a real checkpoint folder or hub id instead of a random model")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--ppo-batch", type=int, default=8, help="states in the one PPO iteration timed by --part ppo")
    p.add_argument("--ppo-new-tokens", type=int, default=256, help="max new tokens per action in that iteration")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    parts = {"sft": [bench_sft], "ppo": [bench_ppo], "ppo-update": [bench_ppo_update],
             "all": [bench_sft, bench_ppo, bench_ppo_update]}
    for fn in parts[a.part]:
        fn(a)


if __name__ == "__main__":
    main()
