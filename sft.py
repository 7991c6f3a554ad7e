"""Supervised fine-tuning with the loss on assistant tokens only: ML-Agent's exploration-enriched fine-tuning stage.

ML-Agent (arXiv:2505.23723, §"Exploration-enriched fine-tuning"; §Experiments "Training") fine-tunes Qwen2.5-7B on the
expert trajectories, 2 epochs at lr 2e-5 on 8 A100s. Here: runs/data/sft.jsonl (collect.py) in ChatML (model.py),
cross-entropy on assistant content + closing <|im_end|>. Where the paper is silent, Hugging Face Trainer / TRL defaults:
AdamW (0.9, 0.999, no weight decay), 3% linear warmup then cosine to 0, gradient norm 1.0, the loss averaged over an
optimizer step's trained tokens (all micro-batches, ranks), fp32 master weights, bf16 autocast on CUDA. Departures:
1. No --model: a tiny Qwen3 (width 128, 2 blocks, 4 heads) and a byte-level BPE trained on the training split, from
   scratch, so `python collect.py && python sft.py` runs offline on a CPU; random weights need far more than the paper's
   fine-tuning: lr 3e-3, 5 epochs, 2 conversations per step (our choice; tests/RESULTS.md). --decisions N shows a row
   answering env.Env's verdict (keep or undo is next) N times an epoch (pilots: tests/RESULTS.md).
2. Assistant-only loss (--prompt-loss-weight 0, the paper's), from scratch too (tests/RESULTS.md, "the miniature that
   teaches"; weights > 0: SFTModel).
3. Sequences of similar length share a micro-batch, right-padded, no packing; the rows' shared prefix (the tools'
   descriptions) is computed once (SFTModel); logits only at trained positions.
4. Several GPUs: a pre-trained model gets the paper's recipe, 64 conversations per step, --max-len 16384 (paper: 15,000
   tokens); a longer conversation loses its oldest tokens, one whose last assistant turn alone is longer is dropped,
   both reported. DDP replicates; FSDP2 (--fsdp, or on CUDA when fp32 training states do not fit half a GPU) shards,
   each rank reading its own rows; checkpoints gather weights on rank 0.

Run:  python sft.py  (tiny model from scratch; run again, it resumes);  python sft.py --model Qwen/Qwen2.5-0.5B-Instruct
      torchrun --nproc_per_node 8 sft.py --model Qwen/Qwen2.5-7B --grad-checkpointing   (DDP; --fsdp shards)
Outputs in --out (runs/ckpt/sft): the final Hugging Face folder, checkpoint-<step>/ per epoch, log.jsonl (per step).
"""
import contextlib
import dataclasses
import gc
import glob
import json
import math
import os
import random
import re
import shutil
import time

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import agent
import model

ROOT = agent.env.ROOT  # default paths: the project's runs/, from any cwd


@dataclasses.dataclass
class Config:
    data: str = str(ROOT / "runs/data/sft.jsonl")  # chat JSONL (collect.py)
    model: str | None = None  # a Hugging Face folder or hub id; None: the tiny model
    out: str = str(ROOT / "runs/ckpt/sft")  # the final model, checkpoint-<step>/ folders, log.jsonl
    epochs: int | None = None  # None: 2 (ML-Agent), 5 from scratch
    decisions: int = 1  # times an epoch a training row answering env's verdict is seen (a data mix; ML-Agent: 1)
    lr: float | None = None  # None: 2e-5 (ML-Agent), 3e-3 from scratch
    warmup_ratio: float = 0.03  # linear warmup over this share of the steps (TRL recipes)
    weight_decay: float = 0.0  # AdamW's (HF Trainer default)
    prompt_loss_weight: float | None = None  # loss weight of non-assistant tokens; None: 0 (ML-Agent)
    batch_size: int | None = None  # per optimizer step, all ranks; None: 64 (ML-Agent), 2 from scratch
    micro_batch: int | None = None  # per forward on one rank (accumulated); None: 1, 2 from scratch
    max_len: int = 16384  # per conversation, oldest tokens cut (paper: 15k)
    grad_clip: float = 1.0  # max gradient norm (HF Trainer default)
    heldout: float = 0.1  # share of the conversations held out
    eval_parse: int = 32  # held-out prompts answered for the parse rate (0: off)
    max_new_tokens: int = 512  # their length limit
    grad_checkpointing: bool = False  # recompute each block in backward (less memory)
    fsdp: bool = False  # torchrun: FSDP2, not DDP (anyway on CUDA if one GPU is short)
    save_dtype: str = "auto"  # auto: bfloat16 from CUDA (vLLM reads fp32 as fp16), float32 on CPU
    resume: str | None = None  # a checkpoint-<step> folder; None: the latest under --out (as "auto")
    seed: int = 0  # data order, held-out split, scratch init
    device: str | None = None  # default: this rank's GPU if available, else cpu
    threads: int = 0  # torch.set_num_threads (0: its default)
    scratch_vocab: int = 8192  # from scratch: BPE vocabulary size (at most)
    scratch_hidden: int = 128  # from scratch: width (sizes tried: tests/RESULTS.md)
    scratch_layers: int = 2  # from scratch: blocks (more no better: tests/RESULTS.md)
    scratch_heads: int = 4  # from scratch: query heads (half as many KV heads)


# ==== Data: ChatML rendering with labels on the assistant turns only

IGNORE = -100  # untrained positions' label (cross_entropy's ignore_index, as in HF)
VERDICT = re.compile(r" before the last edit\n```\s*Now respond for step \d+\.$")  # a prompt ending in Env._verdict


def encode_chat(tokenizer, messages, max_len=None, counts=None):
    """-> (ids, labels): labels = ids on assistant content + <|im_end|> (the model learns to stop), else -100. Each
    ChatML piece (model.Tokenizer's) is encoded apart: the label boundary falls exactly after `assistant\\n`. Past
    max_len the oldest tokens go (as in ppo.py's prompts); a last assistant turn too long alone gets no label."""
    ids, labels, target = [], [], 0
    for m in messages:
        train = m["role"] == "assistant"
        target = len(ids) if train else target  # the last assistant turn's start
        for text, on in ((f"<|im_start|>{m['role']}\n", False), (f"{m['content']}<|im_end|>", train), ("\n", False)):
            piece = tokenizer.encode(text)
            ids += piece
            labels += piece if on else [IGNORE] * len(piece)
    if max_len and len(ids) > max_len:
        cut = len(ids) - max_len
        ids, labels = ids[cut:], labels[cut:] if cut <= target else [IGNORE] * max_len
        if counts is not None:
            counts["cut"] = counts.get("cut", 0) + 1
    return ids, labels


def read_jsonl(path):
    rows = []
    for n, row in agent.jsonl_rows(path):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                                 isinstance(m.get("content"), str) for m in msgs):
            raise ValueError(f"{path}:{n}: expected {{\"messages\": [{{\"role\": str, \"content\": str}}, ...]}}")
        rows.append(row)
    return rows


def split_heldout(n, share, seed):
    """(train, held-out) indices, seeded; at least one held out if share > 0 and n >= 2."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(max(round(share * n), 1), n - 1) if share > 0 and n >= 2 else 0
    return sorted(order[k:]), sorted(order[:k])


def micro_batches(lengths, micro, seed, epoch, bucket=16):
    """Length-bucketed micro-batches: shuffle, sort windows of `bucket` micro-batches by length, cut, shuffle."""
    rng, order = random.Random(seed * 1000 + epoch), list(range(len(lengths)))
    rng.shuffle(order)
    out, w = [], micro * bucket
    for i in range(0, len(order), w):
        window = sorted(order[i:i + w], key=lambda j: lengths[j])
        out += [window[j:j + micro] for j in range(0, len(window), micro)]
    rng.shuffle(out)
    return out


def collate(examples, pad_id, device):
    """Right-padded (B, T) ids and labels (pad -100), (B,) lengths, shared prefix."""
    pad = nn.utils.rnn.pad_sequence
    ids = pad([torch.tensor(x) for x, _ in examples], batch_first=True, padding_value=pad_id)
    labels = pad([torch.tensor(y) for _, y in examples], batch_first=True, padding_value=IGNORE)
    lengths = torch.tensor([len(x) for x, _ in examples])
    return ids.to(device), labels.to(device), lengths.to(device), shared_prefix(examples)


def shared_prefix(examples):
    """Leading (id, label) pairs all examples share (SFTModel computes them once), at most the shortest length - 1."""
    (x0, y0), n = examples[0], min(len(x) for x, _ in examples) - 1
    for p in range(n):
        if any(x[p] != x0[p] or y[p] != y0[p] for x, y in examples[1:]):
            return p
    return max(n, 0)


def token_counts(examples):
    """(assistant, other) tokens predicted (every position but the first) in (ids, labels) pairs."""
    ours = sum(sum(y != IGNORE for y in lab[1:]) for _, lab in examples)
    return ours, sum(len(ids) - 1 for ids, _ in examples) - ours

# ==== The loss


class LinearCrossEntropy(torch.autograd.Function):
    """-log softmax(h W^T)[target] per row: lm_head and cross-entropy in one. The softmax stays in the logits' buffer
    and becomes their gradient in place; autograd through F.cross_entropy would also keep the log-softmax and a zero
    (N, V) gradient (tests/RESULTS.md). Same loss, gradients up to rounding (tests/test_sft.py)."""

    @staticmethod
    def forward(ctx, h, weight, targets):  # (N, C), (V, C), (N,) -> (N,)
        logits = (h @ weight.t()).float()  # autocast: bf16 product, fp32 softmax
        picked, top = logits.gather(1, targets[:, None])[:, 0], logits.amax(-1, keepdim=True)
        probs = logits.sub_(top).exp_()  # in place: one exp for the loss and the softmax
        total = probs.sum(-1, keepdim=True)
        loss = (top + total.log())[:, 0] - picked  # log-sum-exp - the target's logit
        ctx.save_for_backward(h, weight, targets, probs.div_(total))  # the softmax
        kind = h.device.type
        ctx.amp = kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # grad (N,): d objective / d each row's loss
        h, weight, targets, probs = ctx.saved_tensors
        probs[torch.arange(len(targets), device=probs.device), targets] -= 1  # d loss / d logits
        d = probs.mul_(grad[:, None])
        with torch.autocast(ctx.amp[0], dtype=ctx.amp[2], enabled=ctx.amp[1]):  # the forward's
            gh, gw = d @ weight, d.t() @ h
        return gh.to(h.dtype), gw.to(weight.dtype), None


class SFTModel(nn.Module):
    """model.Qwen as one DDP / FSDP forward. Other real tokens weigh `prompt_weight`: 0 is ML-Agent's SFT; > 0 also
    models the prompt (Instruction Modelling, Shi et al. 2024, arXiv 2405.14394; weighted: Chatterjee et al. 2025, arXiv
    2507.07817). prefix > 1: the common prefix goes once into a KV cache, its losses counted B times (same result:
    tests/test_sft.py); off if share_prefix=False (FSDP; checkpointing rewrites it)."""

    def __init__(self, lm, prompt_weight=0.0, share_prefix=False):
        super().__init__()
        self.lm, self.prompt_weight, self.share_prefix = lm, prompt_weight, share_prefix

    def forward(self, input_ids, labels, lengths, prefix=0):  # (B, T), (B, T), (B,), int
        B, P = input_ids.shape[0], int(prefix)
        if not (self.share_prefix and B > 1 and P > 1):
            return self.loss(self.lm.hidden(input_ids), input_ids, labels, lengths)  # right padding: no mask
        cache = model.KVCache()
        head = self.lm.hidden(input_ids[:1, :P], cache=cache)  # once
        tail = self.lm.hidden(input_ids[:, P:], cache=cache)  # the rest, over the cache
        shared = self.loss(head, input_ids[:1, :P], labels[:1, :P], lengths[:1])  # tokens 1 .. P-1
        own = self.loss(torch.cat((head[:, -1:].expand(B, 1, -1), tail), 1), input_ids[:, P - 1:],
                        labels[:, P - 1:], lengths - (P - 1))  # tokens P .. of each row
        return tuple(B * a + b for a, b in zip(shared, own))

    def loss(self, h, input_ids, labels, lengths):
        """h (B, T, C): outputs at input_ids' positions; the one at t predicts token t + 1."""
        targets = labels[:, 1:]  # labels are not pre-shifted (as in HF)
        rows = ours = targets != IGNORE
        if self.prompt_weight:  # every real position (padding predicts nothing)
            rows = torch.arange(targets.shape[1], device=lengths.device) < (lengths[:, None] - 1)
            targets = input_ids[:, 1:]  # = labels where not -100
        loss = LinearCrossEntropy.apply(h[:, :-1][rows], self.lm.lm_head.weight, targets[rows])
        mine = ours[rows]  # (N,): assistant tokens
        weighted = torch.where(mine, loss, loss * self.prompt_weight).sum()
        return weighted, loss[mine].sum().detach(), mine.sum()

# ==== The model: a checkpoint, or the tiny configuration from scratch; gradient checkpointing; DDP / FSDP


def scratch_model(rows, args):
    texts = [f"{m['role']}\n{m['content']}\n" for r in rows for m in r["messages"]]  # special tokens apart
    tokenizer = model.train_tokenizer(texts, args.scratch_vocab)
    heads = args.scratch_heads
    cfg = model.tiny_config("qwen3", vocab_size=len(tokenizer), hidden_size=args.scratch_hidden,
                           intermediate_size=3 * args.scratch_hidden, num_hidden_layers=args.scratch_layers,
                           num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                           head_dim=args.scratch_hidden // heads, max_position_embeddings=max(2048, args.max_len),
                           eos_token_id=tokenizer.im_end_id)
    torch.manual_seed(args.seed)
    return model.Qwen(cfg), tokenizer


def place(lm, source, master, prompt_weight, args, world, device):
    """SFTModel(lm) training on device, FSDP2 (departure 4) or whole (DDP); master: a bf16 checkpoint's fp32 weights."""
    if args.grad_checkpointing:
        model.enable_grad_checkpointing(lm)
    n_params = sum(p.numel() for p in lm.parameters())
    if world == 1:
        model.check_fits(n_params, 16, device, "shard over GPUs (torchrun --nproc_per_node 8 sft.py)")
    sharded = dist.is_initialized() and (args.fsdp or model.too_big_for_one_gpu(n_params, device))
    net = SFTModel(lm, prompt_weight, share_prefix=not (args.grad_checkpointing or sharded))
    if source:  # tensor by tensor into fp32 master weights; sharded, each rank its rows
        tensors = master.items() if master else model.weight_tensors(source)
        net = model.place(net, lm, tensors, device, sharded and world)
    elif sharded:
        net = model.shard(net, lm.model.layers, world, device)
    return (net if sharded else model.wrap(net.to(device), world, device)).train(), sharded

# ==== Checkpoints: a Hugging Face folder + trainer_state.pt, written to a temporary name then renamed


def save_checkpoint(net, lm, tokenizer, optim, sched, info, args, rank, device):
    """out/checkpoint-<step>/ (weights, trainer_state.pt: fp32 masters if saved in bf16); its model files at out/."""
    state, ostate = model.full_state(net), model.optim_state(net, optim)  # FSDP: a collective, every rank
    if rank != 0:
        return
    path = os.path.join(args.out, f"checkpoint-{info['step']}")
    tmp, master = model.save_checkpoint_folder(lm, tokenizer, path, model.save_dtype(args.save_dtype, device), state)
    torch.save({"optimizer": ostate, "scheduler": sched.state_dict(), "master": master, **info},
               os.path.join(tmp, "trainer_state.pt"))
    agent.swap_folder(tmp, path)  # a kill leaves the old or the new checkpoint-<step> (recover_out)
    publish(path, args.out)


def publish(ckpt, out):
    """The checkpoint's model files to out/ (atomic renames), stale shards removed; recover_out repairs a kill's mix."""
    names = [n for n in os.listdir(ckpt) if n != "trainer_state.pt"]
    marker = os.path.join(out, ".publishing")  # while out/ may mix two checkpoints
    open(marker, "w").close()
    for name in os.listdir(out):
        if name.startswith("model") and ".safetensors" in name and name not in names:
            os.remove(os.path.join(out, name))
    for name in names:
        shutil.copyfile(os.path.join(ckpt, name), os.path.join(out, name + ".tmp"))
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    os.remove(marker)


def recover_out(out):
    """After a kill while saving: checkpoint-<step>.old back or gone, *.tmp deleted, a mixed out/ republished."""
    for old in glob.glob(os.path.join(out, "checkpoint-*.old")):
        agent.recover_folder(old.removesuffix(".old"))
    # checkpoint-<step>.tmp, publish's and write_atomic's temporaries
    for tmp in glob.glob(os.path.join(out, "*.tmp")) + glob.glob(os.path.join(out, ".*.tmp")):
        shutil.rmtree(tmp) if os.path.isdir(tmp) else os.remove(tmp)
    if os.path.exists(os.path.join(out, ".publishing")):
        latest = latest_checkpoint(out)
        publish(latest, out) if latest else os.remove(os.path.join(out, ".publishing"))


def resume_point(args, say):
    """The checkpoint to resume (--resume's or the latest) + trainer state, or None, {}; another run's (data, model,
    seed, prompt loss weight): a one-line error."""
    resume = latest_checkpoint(args.out) if args.resume in (None, "auto") else args.resume
    if args.resume == "auto" and resume is None:
        say(f"no checkpoint under {args.out}: starting fresh")
    if not resume:
        return None, {}
    st = model.load_trainer_state(os.path.join(resume, "trainer_state.pt"), ("step", "epoch", "optimizer", "scheduler"),
                                  "sft.py", "resume from an earlier checkpoint-<step>")
    recorded = st.get("args", {})
    for key in ("data", "model", "seed", "prompt_loss_weight"):
        mine = getattr(args, key)
        if key in recorded and mine is not None and recorded[key] != mine and \
                not (key == "data" and os.path.abspath(recorded[key]) == os.path.abspath(mine)):
            raise ValueError(f"{resume} was trained with --{key.replace('_', '-')} {recorded[key]}, not {mine}; "
                             "pass the same or another --out")
    agent.resolve_model(resume, endpoint=None)  # loadable
    return resume, st


def latest_checkpoint(out):
    found = [p for p in glob.glob(os.path.join(out, "checkpoint-*"))
             if p.rsplit("-", 1)[1].isdigit() and os.path.exists(os.path.join(p, "trainer_state.pt"))]
    return max(found, key=lambda p: int(p.rsplit("-", 1)[1]), default=None)

# ==== Evaluation


@torch.no_grad()
def heldout_loss(net, data, args, rank, world, pad_id, device):
    """Mean loss per assistant token of held-out conversations, each rank its share."""
    net.eval()
    total, per_round = torch.zeros(2, device=device), world * args.micro_batch
    with model.autocast(device):
        for i in range(rank * args.micro_batch, math.ceil(len(data) / per_round) * per_round, per_round):
            batch = data[i:i + args.micro_batch]  # as many forwards on every rank (FSDP gathers in each)
            _, loss, n = net(*collate(batch or data[:1], pad_id, device))
            total += torch.stack([loss.float(), n.float()]) * bool(batch)
    model.reshard(net)
    total = model.Ranks(world=world, device=device).sum(total)
    net.train()
    return (total[0] / total[1].clamp(min=1)).item()


@torch.no_grad()
def parse_rate(lm, tokenizer, rows, max_new_tokens, batch=8):
    """Shares of greedy held-out responses agent.parse_response accepts, and that choose the expert's action."""
    prompts, expert = [], []
    for r in rows:
        last = max(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(r["messages"][:last])))
        expert.append(r["messages"][last]["content"])
    stops = model.stop_ids(lm, tokenizer)  # what agent.LocalBackend stops at
    gen = lm.generate(prompts, max_new_tokens, stop_token_ids=stops, max_batch=batch)  # none: []
    ok = same = 0
    for toks, ref in zip(gen.tokens, expert):
        try:
            action, _ = agent.parse_response(tokenizer.decode(toks, skip_special_tokens=True))
        except agent.ParseError:
            continue
        ok += 1
        same += action == agent.parse_entries(ref).get("Action", "").strip()
    return ok / max(len(prompts), 1), same / max(len(prompts), 1)


def heldout_parse_rate(args, rows, rank, world, device):
    """The checkpoint just written, loaded as ppo.py and eval.py do, answers held-out prompts, each rank its share."""
    lm, tokenizer = model.load(args.out, device)
    mine = rows[rank::world]
    ok = torch.tensor(parse_rate(lm, tokenizer, mine, args.max_new_tokens), device=device) * len(mine)
    rate, same = (model.Ranks(world=world, device=device).sum(ok) / len(rows)).tolist()
    return {"parse_rate": rate, "same_action_as_expert": same, "parse_states": len(rows)}

# ==== Training


def lr_factor(step, warmup, total):
    """Linear warmup, then cosine decay to 0 (HF get_cosine_schedule_with_warmup)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def optimizer_step(net, optim, sched, batches, pad_id, device, args, world):
    """One optimizer step on this rank's micro-batches: the weighted loss over all ranks' trained tokens / their summed
    weight -> (assistant tokens' mean loss, count, all tokens seen)."""
    ranks, (ours, other) = model.Ranks(world=world, device=device), token_counts([x for b in batches for x in b])
    n = ranks.sum(torch.tensor([float(ours), ours + model.unwrap(net).prompt_weight * other], device=device))
    total, seen = 0.0, 0  # DDP / FSDP average gradients over ranks: hence * world
    for j, b in enumerate(batches):
        ids, labels, lengths, prefix = collate(b, pad_id, device)
        wait = isinstance(net, nn.parallel.DistributedDataParallel) and j < len(batches) - 1
        sync = net.no_sync() if wait else contextlib.nullcontext()  # DDP: all-reduce gradients once per step
        # FSDP2 reduce-scatters after every micro-batch (as torchtune): else each rank holds whole fp32 gradients
        with sync:
            with model.autocast(device):
                weighted, loss, _ = net(ids, labels, lengths, prefix)
            (weighted * world / n[1].clamp(min=1)).backward()
        total, seen = total + loss.item(), seen + ids.numel()
    if args.grad_clip:
        nn.utils.clip_grad_norm_(net.parameters(), args.grad_clip)
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)
    total = ranks.sum(torch.tensor(total, device=device)).item()
    return total / n[0].clamp(min=1).item(), int(n[0].item()), seen


def train(args):
    """The whole run -> (summary, also printed; this rank's trained model.Qwen)."""
    if args.threads:  # 1 on a busy machine: no OpenMP oversubscription (README)
        torch.set_num_threads(args.threads)
    rank, world, device = model.setup_distributed(args)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    rows = read_jsonl(args.data)
    if len(rows) < 2 and args.heldout > 0:
        raise ValueError(f"{args.data}: need at least 2 conversations (one is held out)")
    train_idx, held_idx = split_heldout(len(rows), args.heldout, args.seed)
    lock = agent.claim_folder(args.out) if rank == 0 else None  # one sft.py per --out
    if rank == 0:
        recover_out(args.out)
    if world > 1:
        dist.barrier()
    resume, st = resume_point(args, say)
    if rank == 0:  # steps after the checkpoint are redone: drop their lines
        agent.trim_log(os.path.join(args.out, "log.jsonl"), "step", st.get("step", 0))
    source = resume or args.model  # meta: weights are read once sharding is decided
    lm, tokenizer = model.load(source, "cpu", torch.float32, meta=True) if source else \
        scratch_model([rows[i] for i in train_idx], args)
    from_scratch = st.get("scratch", False) if resume else args.model is None
    epochs = args.epochs or (5 if from_scratch else 2)  # ML-Agent: 2 epochs
    lr = args.lr or (3e-3 if from_scratch else 2e-5)  # ML-Agent: 2e-5
    batch_size = args.batch_size or (2 if from_scratch else 64)  # ML-Agent's effective batch
    args = dataclasses.replace(args, micro_batch=(micro := args.micro_batch or (2 if from_scratch else 1)))
    prompt_weight = args.prompt_loss_weight if args.prompt_loss_weight is not None else st.get("prompt_weight", 0.0)
    if batch_size < micro * world:
        raise ValueError(f"--batch-size {batch_size} < --micro-batch {micro} x {world} ranks")
    net, sharded = place(lm, source, st.get("master"), prompt_weight, args, world, device)
    pad_id, counts = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0), {"cut": 0}
    data = [encode_chat(tokenizer, r["messages"], args.max_len, counts) for r in rows]
    kept = [i for i in train_idx if any(y != IGNORE for y in data[i][1][1:])]
    seen = [args.decisions if VERDICT.search(rows[i]["messages"][-2:][0]["content"]) else 1 for i in kept]
    train_set = [data[i] for i, n in zip(kept, seen) for _ in range(n)]  # departure 1; [-2:][0]: the last prompt
    dropped, repeated = len(train_idx) - len(kept), len(train_set) - len(kept)
    if not train_set:
        raise ValueError(f"{args.data}: no conversation keeps an assistant turn within --max-len {args.max_len}")
    held_set = [data[i] for i in held_idx]
    optim = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                              fused=device.type == "cuda")
    per_rank = batch_size // world // micro  # micro-batches per rank and step
    lengths = [len(x) for x, _ in train_set]
    n_micro = math.ceil(len(lengths) / args.micro_batch) // world  # micro-batches per rank, alike on all
    steps_per_epoch = math.ceil(n_micro / per_rank)
    total = steps_per_epoch * epochs
    warmup = round(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, warmup, total))
    step = st.get("step", 0)
    if resume:
        model.set_optim_state(net, optim, st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        say(f"resumed from {resume} at step {step} (epoch {st['epoch']})")
    say(f"sft: {len(kept)} train (+{repeated} repeated decisions) / {len(held_set)} held-out conversations, {epochs} "
        f"epochs x {steps_per_epoch} steps, lr {lr:g}{' (from scratch)' if from_scratch else ''}, prompt loss weight "
        f"{prompt_weight:g}, {world} rank(s) on {device}{' (FSDP2)' if sharded else ''}, "
        f"{sum(p.numel() for p in lm.parameters()) / 1e6:.2f}M params; {counts['cut']} conversation(s) cut to "
        f"--max-len {args.max_len} (oldest tokens), {dropped} dropped (the last assistant turn alone is longer)")
    start, tokens, train_loss, held = time.time(), 0, float("nan"), float("nan")
    bar = tqdm(total=total, initial=step, desc="sft", disable=rank != 0, dynamic_ncols=True)
    for epoch in range(step // steps_per_epoch, epochs):
        mb = micro_batches(lengths, args.micro_batch, args.seed, epoch)[:n_micro * world][rank::world]
        epoch_losses = []
        for s in range(step - epoch * steps_per_epoch, steps_per_epoch):  # from the resume point
            chunk = [[train_set[i] for i in b] for b in mb[s * per_rank:(s + 1) * per_rank]]
            train_loss, n_tok, seen = optimizer_step(net, optim, sched, chunk, pad_id, device, args, world)
            step, tokens = step + 1, tokens + seen * world
            epoch_losses.append(train_loss)
            bar.update()
            bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
            if rank == 0:
                agent.append_jsonl(os.path.join(args.out, "log.jsonl"), {
                    "step": step, "epoch": epoch, "loss": train_loss, "lr": sched.get_last_lr()[0],
                    "trained_tokens": n_tok, "tokens_per_s": tokens / (time.time() - start)})
        held = heldout_loss(net, held_set, args, rank, world, pad_id, device) if held_set else float("nan")
        train_loss = sum(epoch_losses) / max(len(epoch_losses), 1)
        say(f"epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f}, held-out loss {held:.4f}, "
            f"{tokens / (time.time() - start):.0f} tokens/s")
        info = {"step": step, "epoch": epoch + 1, "scratch": from_scratch, "prompt_weight": prompt_weight,
                "train_loss": train_loss, "heldout_loss": held, "args": dataclasses.asdict(args)}
        save_checkpoint(net, lm, tokenizer, optim, sched, info, args, rank, device)
    bar.close()
    seconds = time.time() - start
    summary = {"out": args.out, "steps": step, "epochs": epochs, "lr": lr, "batch_size": batch_size,
               "micro_batch": micro, "prompt_loss_weight": prompt_weight, "cut": counts["cut"], "dropped": dropped,
               "decisions": args.decisions, "repeated": repeated, "train_loss": train_loss, "heldout_loss": held,
               "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds)}
    if args.eval_parse and held_idx and step > 0:
        if world > 1:
            dist.barrier()  # rank 0 has written the checkpoint
        optim = sched = net = None  # the optimizer's moments (twice the fp32 model) go before a second model
        gc.collect()  # scheduler and optimizer refer to each other
        torch.cuda.empty_cache()  # a no-op if CUDA is unused
        summary.update(heldout_parse_rate(args, [rows[i] for i in held_idx[:args.eval_parse]], rank, world, device))
        say(f"held-out parse rate: {summary['parse_rate']:.1%} of {summary['parse_states']} greedy responses parse as "
            f"a valid action ({summary['same_action_as_expert']:.1%} choose the expert's action)")
    say(json.dumps(summary))
    if dist.is_initialized():
        dist.barrier()  # run_main leaves the process group
    if lock:
        lock.close()
    return summary, lm

# ==== Command line


HALF_OPEN = agent.checked(float, lambda v: 0 <= v < 1, "in [0, 1)")
TYPES = {**dict.fromkeys(("eval_parse", "threads"), agent.COUNT), "seed": int,
         **dict.fromkeys(("weight_decay", "prompt_loss_weight", "grad_clip"), agent.NONNEGATIVE),
         **dict.fromkeys(("warmup_ratio", "heldout"), HALF_OPEN), "device": model.refusing(str, model.bad_device),
         "data": agent.checked(str, os.path.exists, "an existing file (python collect.py writes it)"),
         "resume": agent.checked(str, lambda v: v == "auto" or os.path.isfile(os.path.join(v, "trainer_state.pt")),
                                 "a checkpoint-<step> folder (with trainer_state.pt)")}


def parser():
    """A flag per Config field, type-checked (one-line error, exit 2); torchrun passes them on unchanged."""
    p = agent.Parser(prog="sft.py", description="Supervised fine-tuning on chat JSONL, loss on assistant tokens.")
    agent.add_fields(p, Config, TYPES, {"save_dtype": ("auto", "float32")}, switch="store_true",
                     more={"resume": dict(nargs="?", const="auto")})  # --resume alone: "auto"
    return p


def main(argv=None):
    p = parser()
    args = Config(**vars(p.parse_args(argv)))
    if args.scratch_hidden % (2 * args.scratch_heads):
        p.error(f"--scratch-hidden {args.scratch_hidden} does not split into --scratch-heads {args.scratch_heads} "
                "heads of an even size")
    agent.check_model(p, "--model", args.model, endpoint=None)  # before --out is made
    model.run_main("sft.py", train, args)


if __name__ == "__main__":
    main()
