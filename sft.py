"""Supervised fine-tuning with the loss on assistant tokens only: ML-Agent's exploration-enriched fine-tuning stage.

ML-Agent (arXiv:2505.23723, §"Exploration-enriched fine-tuning"; §Experiments "Training") fine-tunes Qwen2.5-7B on the
expert trajectories, 2 epochs at lr 2e-5 on 8 A100s. This file trains on runs/data/sft.jsonl (collect.py): each line
{"messages": [...]} rendered with ChatML (model.py), the cross-entropy on the assistant turns' content and their closing
<|im_end|>. Reading order: config -> data (render + mask, held-out split, length-bucketed micro-batches) -> the loss ->
the model -> the learning rate -> checkpoints and resume -> evaluation (held-out loss, parse rate) -> the loop.
Where the paper is silent, the Hugging Face Trainer / TRL defaults: AdamW (0.9, 0.999, no weight decay), linear warmup
over 3% of the steps then cosine to 0, gradient norm 1.0, the loss averaged over every trained token of an optimizer
step (across micro-batches and ranks), fp32 master weights with bf16 autocast on CUDA. Departures:
1. No --model: a tiny Qwen3 (width 128, 2 blocks, 4 heads) with a byte-level BPE trained on the training split is
   trained from scratch, so `python collect.py && python sft.py` runs offline on a CPU; random weights need far more
   than the paper's fine-tuning: lr 3e-3, 8 epochs, 2 conversations per step (our choice; tests/RESULTS.md).
2. From scratch the loss also covers the prompt tokens at weight 1 (--prompt-loss-weight; a pre-trained model gets 0,
   the paper's): Instruction Modelling (Shi et al. 2024) helps most with long prompts, short outputs, few examples.
3. Sequences of similar length share a micro-batch, right-padded (no mask needed), no packing; the prefix the rows
   share (the tools' descriptions open every prompt) is computed once (SFTModel); logits only at trained positions.
4. Imports agent.py (beyond the house table's model.py) for the run-folder plumbing every command shares and for the
   held-out parse rate's agent.parse_response (--eval-parse 0 turns it off).
5. Several GPUs: a pre-trained model gets the paper's recipe, 64 conversations per step (one per rank per micro-batch,
   the rest accumulated), --max-len 16384 (the paper cuts at 15,000 tokens); a longer conversation loses its oldest
   tokens, one whose last assistant turn alone is longer is dropped, both reported. DDP replicates (NCCL, or gloo on
   CPU); FSDP2 (--fsdp, or by itself on CUDA when fp32 training states do not fit half a GPU) shards, every rank
   reading its own rows; checkpoints gather the weights on rank 0 (bf16 from CUDA, fp32 master weights kept).

Run:  python sft.py  (tiny model from scratch; run again, it resumes);  python sft.py --model Qwen/Qwen2.5-0.5B-Instruct
      torchrun --nproc_per_node 8 sft.py --model Qwen/Qwen2.5-7B-Instruct --grad-checkpointing   (DDP; --fsdp shards)
Outputs under --out (runs/ckpt/sft): the final Hugging Face folder, checkpoint-<step>/ per epoch (weights +
trainer_state.pt: optimizer, scheduler, step, epoch), log.jsonl (a line per optimizer step).
"""
import contextlib
import dataclasses
import gc
import glob
import json
import math
import os
import random
import shutil
import time
import typing

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import agent  # torch-free file helpers shared with collect.py, eval.py and orchestrator.py
import model
from agent import check_checkpoint, claim_folder, jsonl_rows, recover_folder, swap_folder

ROOT = agent.env.ROOT  # default paths live under the project's runs/, wherever sft.py is started from



@dataclasses.dataclass
class Config:
    data: str = str(ROOT / "runs/data/sft.jsonl")  # chat JSONL, one {"messages": [...]} per line
    model: str | None = None                # a Hugging Face folder or hub id; None: the tiny model from scratch
    out: str = str(ROOT / "runs/ckpt/sft")  # the final checkpoint, checkpoint-<step>/ folders and log.jsonl
    epochs: int | None = None               # None: 2 (ML-Agent) for a pre-trained model, 8 from scratch
    lr: float | None = None                 # None: 2e-5 (ML-Agent) for a pre-trained model, 3e-3 from scratch
    warmup_ratio: float = 0.03              # linear warmup over this share of the steps (TRL/LLaMA-Factory recipes)
    weight_decay: float = 0.0               # AdamW decoupled weight decay (HF Trainer default)
    prompt_loss_weight: float | None = None  # loss weight of non-assistant tokens; None: 0 (ML-Agent), 1 from scratch
    batch_size: int | None = None           # sequences per optimizer step over all ranks; None: 64 (ML-Agent's
                                            # effective batch), 2 from scratch
    micro_batch: int | None = None          # sequences per forward/backward on one rank; the rest is accumulation;
                                            # None: 1 (16k-token rows), 2 from scratch
    max_len: int = 16384                    # tokens per conversation; a longer one loses its oldest tokens, never
                                            # its last assistant turn (ML-Agent's cutoff: 15,000 tokens)
    grad_clip: float = 1.0                  # max global gradient norm (HF Trainer default)
    heldout: float = 0.1                    # share of the conversations kept out for the held-out loss and parse rate
    eval_parse: int = 32                    # held-out prompts answered greedily to measure the parse rate (0: off)
    max_new_tokens: int = 512               # length limit of those responses
    grad_checkpointing: bool = False        # recompute each block's activations in backward (less memory)
    fsdp: bool = False                      # under torchrun: shard with FSDP2 instead of replicating with DDP (chosen
                                            # anyway on CUDA when the training states do not fit one GPU)
    save_dtype: str = "auto"                # weights of the Hugging Face folders: auto = bfloat16 from CUDA runs
                                            # (vLLM's dtype=auto reads fp32 as fp16), float32 on CPU; or float32
    resume: str | None = None               # a checkpoint-<step> folder; None / "auto": the latest under --out, if any
    seed: int = 0                           # data order, held-out split, from-scratch init
    device: str | None = None               # default: cuda (this rank's GPU) if available, else cpu
    threads: int = 0                        # CPU threads per process (torch.set_num_threads); 0: torch's default
    scratch_vocab: int = 8192               # from scratch: BPE vocabulary size (at most; merges stay within words)
    scratch_hidden: int = 128               # from scratch: width (the sizes tried: tests/RESULTS.md)
    scratch_layers: int = 2                 # from scratch: blocks (more were no better: tests/RESULTS.md)
    scratch_heads: int = 4                  # from scratch: query heads (half as many key/value heads, GQA)


# ----------------------------------------------------------------------------------------------------------------
# Data: ChatML rendering with labels on the assistant turns only

IGNORE = -100  # the label of untrained positions (PyTorch cross_entropy's ignore_index, as HF uses it)


def encode_chat(tokenizer, messages, max_len=None, counts=None):
    """-> (ids, labels), lists of the same length; labels are the ids on assistant content + <|im_end|>, else -100.

    Each message is rendered `<|im_start|>{role}\\n` + `{content}<|im_end|>` + `\\n` (model.Tokenizer's ChatML) and
    the three pieces are encoded separately, so the label boundary falls exactly between `assistant\\n` (the
    generation prompt, not trained) and the content; the <|im_end|> that ends the turn is trained (it is how the model
    learns to stop), the `\\n` after it is not (generation stops before it). tests/test_sft.py checks the pieces
    concatenate to the encoding of the whole rendered conversation. Longer than max_len: the oldest tokens go, so
    the last assistant turn stays whole; if that turn alone does not fit, nothing is labelled (`train` drops the
    conversation and reports it). counts, a dict: counts["cut"] is incremented when the conversation was cut."""
    ids, labels, target = [], [], 0
    for m in messages:
        train = m["role"] == "assistant"
        target = len(ids) if train else target  # where the last assistant turn begins
        for text, on in ((f"<|im_start|>{m['role']}\n", False), (f"{m['content']}<|im_end|>", train), ("\n", False)):
            piece = tokenizer.encode(text)
            ids += piece
            labels += piece if on else [IGNORE] * len(piece)
    if max_len and len(ids) > max_len:  # cut the oldest tokens, as PPO cuts its prompts: the last turn is the target
        cut = len(ids) - max_len
        ids, labels = ids[cut:], labels[cut:] if cut <= target else [IGNORE] * max_len  # no room: nothing to train
        if counts is not None:
            counts["cut"] = counts.get("cut", 0) + 1
    return ids, labels


def read_jsonl(path):
    rows = []
    for n, row in jsonl_rows(path):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                                 isinstance(m.get("content"), str) for m in msgs):
            raise ValueError(f"{path}:{n}: expected {{\"messages\": [{{\"role\": str, \"content\": str}}, ...]}}")
        rows.append(row)
    return rows


def split_heldout(n, share, seed):
    """(train indices, held-out indices): a seeded shuffle; at least one held out when share > 0 and n >= 2."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(max(round(share * n), 1), n - 1) if share > 0 and n >= 2 else 0
    return sorted(order[k:]), sorted(order[:k])


def micro_batches(lengths, micro, seed, epoch, bucket=16):
    """Length-bucketed micro-batches of indices: shuffle, sort each window of `bucket` micro-batches by length (so
    sequences in a micro-batch pad little), cut, shuffle the micro-batches. Deterministic in (seed, epoch)."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    out, w = [], micro * bucket
    for i in range(0, len(order), w):
        window = sorted(order[i:i + w], key=lambda j: lengths[j])
        out += [window[j:j + micro] for j in range(0, len(window), micro)]
    rng.shuffle(out)
    return out


def collate(examples, pad_id, device):
    """Right-padded (B, T) input_ids and labels (padding labelled -100), the (B,) true lengths, and how many leading
    positions every row shares (shared_prefix; SFTModel computes them once)."""
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for b, (x, y) in enumerate(examples):
        ids[b, :len(x)], labels[b, :len(y)] = torch.tensor(x), torch.tensor(y)
    lengths = torch.tensor([len(x) for x, _ in examples])
    return ids.to(device), labels.to(device), lengths.to(device), shared_prefix(examples)


def shared_prefix(examples):
    """The number of leading (id, label) pairs that all examples have in common, at most the shortest length - 1 (so
    every row keeps a position of its own)."""
    (x0, y0), n = examples[0], min(len(x) for x, _ in examples) - 1
    for p in range(n):
        if any(x[p] != x0[p] or y[p] != y0[p] for x, y in examples[1:]):
            return p
    return max(n, 0)


def token_counts(examples):
    """(assistant tokens, other tokens) that are predicted (every position but the first) in (ids, labels) pairs."""
    ours = sum(sum(y != IGNORE for y in lab[1:]) for _, lab in examples)
    return ours, sum(len(ids) - 1 for ids, _ in examples) - ours

# ----------------------------------------------------------------------------------------------------------------
# The loss


class LinearCrossEntropy(torch.autograd.Function):
    """-log softmax(h W^T)[target] of each row of h (N, C): the lm_head and the cross-entropy as one step. The forward
    keeps the softmax, in the logits' own buffer; the backward turns it in place into the logits' gradient, softmax
    minus one-hot (the cross-entropy's derivative) times each row's incoming gradient, and multiplies it out. Autograd
    through F.cross_entropy instead keeps the log-softmax too, fills a zero (N, V) gradient to scatter into and runs
    log-softmax's backward, a share of an SFT step of the tiny model that the profiler shows (tests/RESULTS.md).
    The same loss and gradients up to rounding (tests/test_sft.py); under autocast the products are bf16, as the
    lm_head's would be, and the softmax fp32."""

    @staticmethod
    def forward(ctx, h, weight, targets):  # (N, C), (V, C), (N,) -> (N,)
        logits = (h @ weight.t()).float()  # (N, V)
        picked, top = logits.gather(1, targets[:, None])[:, 0], logits.amax(-1, keepdim=True)
        probs = logits.sub_(top).exp_()  # in place: one exp for both the loss and the softmax
        total = probs.sum(-1, keepdim=True)
        loss = (top + total.log())[:, 0] - picked  # log-sum-exp - the target's logit
        ctx.save_for_backward(h, weight, targets, probs.div_(total))  # the softmax
        kind = h.device.type
        ctx.amp = kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # grad (N,): d(what is minimised) / d(each row's loss)
        h, weight, targets, probs = ctx.saved_tensors
        probs[torch.arange(len(targets), device=probs.device), targets] -= 1  # d loss / d logits
        d = probs.mul_(grad[:, None])
        with torch.autocast(ctx.amp[0], dtype=ctx.amp[2], enabled=ctx.amp[1]):  # the backward runs outside the
            # forward's autocast: the products in the same dtype
            gh, gw = d @ weight, d.t() @ h
        return gh.to(h.dtype), gw.to(weight.dtype), None


class SFTModel(nn.Module):
    """Wraps a model.Qwen so DDP / FSDP see one forward: (input_ids, labels, lengths, prefix) -> (the weighted loss
    summed over the batch, the assistant tokens' loss summed, the assistant tokens' count).

    Every assistant token weighs 1. Every other real token (system, user, the ChatML markup) weighs `prompt_weight`:
    0 is the usual SFT loss on assistant tokens only (ML-Agent); > 0 also models the prompt, as Instruction
    Modelling does (Shi et al. 2024, arXiv 2405.14394; weighted: Chatterjee et al. 2025, arXiv 2507.07817).

    prefix > 1 (collate's `shared_prefix`: the rows' first `prefix` ids and labels are the same): the prefix is
    computed once, into a KV cache, and every row's rest runs over that cache, as ppo.py computes a prompt once for its
    samples (model.response_hidden). Every prompt begins with the same system prompt (the tools' descriptions come
    before the task's), so a batch of B rows computes that part once instead of B times; the prefix's losses count
    B times, so the result is the same as without sharing (tests/test_sft.py). share_prefix=False (gradient
    checkpointing, which would write the cache again when it recomputes a block; FSDP) ignores `prefix`."""

    def __init__(self, lm, prompt_weight=0.0, share_prefix=False):
        super().__init__()
        self.lm, self.prompt_weight, self.share_prefix = lm, prompt_weight, share_prefix

    def forward(self, input_ids, labels, lengths, prefix=0):  # (B, T), (B, T), (B,), int
        B, P = input_ids.shape[0], int(prefix)
        if not (self.share_prefix and B > 1 and P > 1):
            return self.loss(self.lm.hidden(input_ids), input_ids, labels, lengths)  # right padding: no mask needed
        cache = model.KVCache()
        head = self.lm.hidden(input_ids[:1, :P], cache=cache)  # (1, P, C): positions 0 .. P-1, once
        tail = self.lm.hidden(input_ids[:, P:], cache=cache)  # (B, T-P, C): each row's rest over the cache, broadcast
        shared = self.loss(head, input_ids[:1, :P], labels[:1, :P], lengths[:1])  # predicts tokens 1 .. P-1
        own = self.loss(torch.cat((head[:, -1:].expand(B, 1, -1), tail), 1), input_ids[:, P - 1:],
                        labels[:, P - 1:], lengths - (P - 1))  # predicts tokens P .. of each row
        return tuple(B * a + b for a, b in zip(shared, own))

    def loss(self, h, input_ids, labels, lengths):
        """h (B, T, C) are the outputs at the positions of input_ids (B, T); the output at t predicts token t + 1."""
        targets = labels[:, 1:]  # token t is predicted from positions < t (labels are not pre-shifted, as in HF)
        ours = targets != IGNORE  # (B, T-1): the assistant tokens
        rows = ours
        if self.prompt_weight:  # every real position: t < length (padding predicts nothing)
            rows = torch.arange(targets.shape[1], device=lengths.device) < (lengths[:, None] - 1)
            targets = input_ids[:, 1:]  # the labels are these ids wherever they are not -100
        loss = LinearCrossEntropy.apply(h[:, :-1][rows], self.lm.lm_head.weight, targets[rows])  # (N,): the lm_head
        # only where a token is trained
        mine = ours[rows]  # (N,): which of the computed positions are assistant tokens
        weighted = torch.where(mine, loss, loss * self.prompt_weight).sum()
        return weighted, loss[mine].sum().detach(), mine.sum()

# ----------------------------------------------------------------------------------------------------------------
# The model: a checkpoint, or the tiny configuration from scratch; gradient checkpointing; DDP / FSDP


def scratch_model(rows, args):
    """The tiny Qwen3 with a BPE tokenizer trained on the (training) conversations; eos = <|im_end|> (instruct)."""
    texts = [f"{m['role']}\n{m['content']}\n" for r in rows for m in r["messages"]]  # special tokens are added apart
    tokenizer = model.train_tokenizer(texts, args.scratch_vocab)
    heads = args.scratch_heads
    cfg = model.tiny_config("qwen3", vocab_size=len(tokenizer), hidden_size=args.scratch_hidden,
                           intermediate_size=3 * args.scratch_hidden, num_hidden_layers=args.scratch_layers,
                           num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                           head_dim=args.scratch_hidden // heads,
                           max_position_embeddings=max(2048, args.max_len), eos_token_id=tokenizer.im_end_id)
    torch.manual_seed(args.seed)
    return model.Qwen(cfg), tokenizer


def place(lm, tokenizer, source, master, prompt_weight, args, world, device):
    """The SFTModel around lm (on the meta device when read from `source`) on this rank's device, in training mode:
    sharded by FSDP2 (--fsdp, or on CUDA when the training states do not fit), each rank reading its rows of the
    checkpoint, or whole (DDP over several ranks). master: fp32 weights of a checkpoint saved in bf16.
    -> net, lm, tokenizer, sharded"""
    if args.grad_checkpointing:
        model.enable_grad_checkpointing(lm)
    sharded = dist.is_initialized() and (args.fsdp or model.too_big_for_one_gpu(sum(p.numel() for p in lm.parameters()),
                                                                          device))
    share = not (args.grad_checkpointing or sharded)  # SFTModel: the batch's common prefix computed once
    net = SFTModel(lm, prompt_weight, share)
    if sharded:
        net = model.shard(net, lm.model.layers, world, device)
        if source:  # each rank reads the checkpoint tensor by tensor and keeps its shard
            net.to_empty(device=device)
            lm.tie_weights()
            model.fill(lm, master.items() if master else model.weight_tensors(source))
    else:
        if source:
            lm, tokenizer = model.load(source, device, torch.float32)  # fp32 master weights; autocast computes in bf16
            if master:
                lm.load_state_dict(master)
            if args.grad_checkpointing:
                model.enable_grad_checkpointing(lm)
            net = SFTModel(lm, prompt_weight, share)
        net = model.wrap(net.to(device), world, device)
    return net.train(), lm, tokenizer, sharded


# ----------------------------------------------------------------------------------------------------------------
# Learning rate: linear warmup then cosine decay to 0 (HF get_cosine_schedule_with_warmup)


def lr_factor(step, warmup, total):
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: a Hugging Face folder (model.save) + trainer_state.pt, written to a temporary name then renamed


def save_checkpoint(net, lm, tokenizer, optim, sched, info, args, rank, device):
    """out/checkpoint-<step>/ (weights + trainer_state.pt) and the final folder's files at out/ itself. Weights saved
    in bf16 leave the fp32 master weights in trainer_state.pt, so a resume continues exactly."""
    state, ostate = model.full_state(net), model.optim_state(net, optim)  # collective under FSDP: every rank
    if rank != 0:
        return
    path = os.path.join(args.out, f"checkpoint-{info['step']}")
    tmp, master = model.save_checkpoint_folder(lm, tokenizer, path, model.save_dtype(args.save_dtype, device), state)
    torch.save({"optimizer": ostate, "scheduler": sched.state_dict(), "master": master, **info},
               os.path.join(tmp, "trainer_state.pt"))
    swap_folder(tmp, path)  # a kill at any moment leaves the old checkpoint-<step> or the new one (recover_out)
    publish(path, args.out)


def publish(ckpt, out):
    """The checkpoint's model files also at out/ itself, file by file (each rename is atomic), stale weight shards
    removed. A kill in between leaves a mix, which the next start repairs (recover_out publishes the checkpoint it
    resumes)."""
    names = [n for n in os.listdir(ckpt) if n != "trainer_state.pt"]
    marker = os.path.join(out, ".publishing")  # present while out/ may hold a mix of two checkpoints
    open(marker, "w").close()
    for name in os.listdir(out):
        if name.startswith("model") and ".safetensors" in name and name not in names:
            os.remove(os.path.join(out, name))
    for name in names:
        shutil.copyfile(os.path.join(ckpt, name), os.path.join(out, name + ".tmp"))
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    os.remove(marker)


def recover_out(out):
    """At start, what a kill while saving left under out/: each checkpoint-<step>.old back or gone, half-written
    checkpoint-<step>.tmp folders and out/*.tmp files deleted, and out/'s model files, if a kill mixed them, those of
    the latest checkpoint again."""
    for old in glob.glob(os.path.join(out, "checkpoint-*.old")):
        recover_folder(old.removesuffix(".old"))
    for tmp in glob.glob(os.path.join(out, "*.tmp")) + glob.glob(os.path.join(out, ".*.tmp")):  # checkpoint-<step>.tmp
        # folders, <file>.tmp files of publish, .<file>.<pid>.tmp of agent.write_atomic
        shutil.rmtree(tmp) if os.path.isdir(tmp) else os.remove(tmp)
    if os.path.exists(os.path.join(out, ".publishing")):
        latest = latest_checkpoint(out)
        publish(latest, out) if latest else os.remove(os.path.join(out, ".publishing"))


def check_same_run(recorded, args, resume):
    """A resume continues the run that wrote the checkpoint: the same data, model and seed, or a one-line error
    (an --out that holds another run is never trained over)."""
    for key in ("data", "model", "seed", "prompt_loss_weight"):
        if key in recorded and getattr(args, key) is not None and recorded[key] != getattr(args, key) and \
                not (key == "data" and os.path.abspath(recorded[key]) == os.path.abspath(args.data)):
            raise ValueError(f"{resume} was trained with --{key.replace('_', '-')} {recorded[key]}, not "
                             f"{getattr(args, key)}; pass the same or another --out")


def resume_point(args, say):
    """The checkpoint to go on from (--resume's, or the latest under --out, as ppo.py resumes), provided it is of this
    run (check_same_run), and its trainer state; or None and {}."""
    resume = latest_checkpoint(args.out) if args.resume in (None, "auto") and os.path.isdir(args.out) else args.resume
    if args.resume == "auto" and resume is None:
        say(f"no checkpoint under {args.out}: starting fresh")
    if not resume:
        return None, {}
    st = model.load_trainer_state(os.path.join(resume, "trainer_state.pt"), ("step", "epoch", "optimizer", "scheduler"),
                                  "sft.py", "resume from an earlier checkpoint-<step>")
    check_same_run(st.get("args", {}), args, resume)
    check_checkpoint(resume)
    return resume, st


def latest_checkpoint(out):
    found = [p for p in glob.glob(os.path.join(out, "checkpoint-*"))
             if p.rsplit("-", 1)[1].isdigit() and os.path.exists(os.path.join(p, "trainer_state.pt"))]
    return max(found, key=lambda p: int(p.rsplit("-", 1)[1]), default=None)

# ----------------------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def heldout_loss(net, data, args, rank, world, pad_id, device):
    """Mean loss per trained token over the held-out conversations (each rank takes its share, then all-reduce)."""
    net.eval()
    total = torch.zeros(2, device=device)
    per_round = world * args.micro_batch
    with model.autocast(device):
        for i in range(rank * args.micro_batch, math.ceil(len(data) / per_round) * per_round, per_round):
            batch = data[i:i + args.micro_batch]  # every rank runs as many forwards (FSDP gathers in each one)
            _, loss, n = net(*collate(batch or data[:1], pad_id, device))  # the assistant tokens only
            total += torch.stack([loss.float(), n.float()]) * bool(batch)
    model.reshard(net)
    if world > 1:
        dist.all_reduce(total)
    net.train()
    return (total[0] / total[1].clamp(min=1)).item()


@torch.no_grad()
def parse_rate(lm, tokenizer, rows, max_new_tokens, batch=8):
    """Share of greedy responses to the held-out prompts that agent.parse_response accepts, and share whose action
    equals the expert's."""
    prompts, expert = [], []
    for r in rows:
        last = max(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(r["messages"][:last])))
        expert.append(r["messages"][last]["content"])
    stops = model.stop_ids(lm, tokenizer)  # what agent.LocalBackend stops at
    ok = same = 0
    if prompts:
        gen = lm.generate(prompts, max_new_tokens, stop_token_ids=stops, max_batch=batch)  # continuous batching
        for toks, ref in zip(gen.tokens, expert):
            try:
                action, _ = agent.parse_response(tokenizer.decode(toks, skip_special_tokens=True))
            except agent.ParseError:
                continue
            ok += 1
            same += action == agent.parse_entries(ref).get("Action", "").strip()
    return ok / max(len(prompts), 1), same / max(len(prompts), 1)


def heldout_parse_rate(args, rows, rank, world, device):
    """The checkpoint just written, loaded as ppo.py and eval.py will load it, answers the held-out prompts `rows`
    greedily, each rank its share (no rank waits at a barrier) -> parse_rate, same_action_as_expert, parse_states."""
    lm, tokenizer = model.load(args.out, device)
    mine = rows[rank::world]
    ok = torch.tensor(parse_rate(lm, tokenizer, mine, args.max_new_tokens), device=device) * len(mine)
    if world > 1:
        dist.all_reduce(ok)
    rate, same = (ok / len(rows)).tolist()
    return {"parse_rate": rate, "same_action_as_expert": same, "parse_states": len(rows)}

# ----------------------------------------------------------------------------------------------------------------
# Training


def optimizer_step(net, optim, sched, batches, pad_id, device, args, world):
    """One optimizer step over this rank's micro-batches (lists of (ids, labels)): the loss is the weighted sum over
    all trained tokens of the step on every rank divided by their summed weight (with prompt weight 0: the mean over
    the assistant tokens). -> (mean loss of the assistant tokens, their count, all tokens of the batches)."""
    ours, other = token_counts([x for b in batches for x in b])
    n = torch.tensor([float(ours), float(ours) + model.unwrap(net).prompt_weight * other], device=device)
    if world > 1:
        dist.all_reduce(n)  # DDP / FSDP average gradients over ranks, hence the * world below
    total, seen = 0.0, 0
    for j, b in enumerate(batches):
        ids, labels, lengths, prefix = collate(b, pad_id, device)
        last = j == len(batches) - 1
        sync = contextlib.nullcontext()
        if isinstance(net, nn.parallel.DistributedDataParallel) and not last:
            sync = net.no_sync()  # all-reduce gradients only once per step
        # FSDP2 reduce-scatters after every micro-batch and adds into the sharded gradients: skipping that
        # (set_requires_gradient_sync(False)) would keep every unsharded fp32 gradient until the last micro-batch,
        # the whole model's size on each rank (28 GiB at 7B). torchtune's FSDP2 recipes accumulate the same way.
        with sync:
            with model.autocast(device):
                weighted, loss, _ = net(ids, labels, lengths, prefix)
            (weighted * world / n[1].clamp(min=1)).backward()
        total += loss.item()
        seen += ids.numel()
    if args.grad_clip:
        nn.utils.clip_grad_norm_(net.parameters(), args.grad_clip)
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)
    if world > 1:
        t = torch.tensor([total], device=device)
        dist.all_reduce(t)
        total = t.item()
    return total / n[0].clamp(min=1).item(), int(n[0].item()), seen


def train(args):
    """The whole run -> (summary dict, also printed; the trained model.Qwen of this rank)."""
    if args.threads:  # on a busy machine 1 thread per process avoids OpenMP oversubscription (README, "Two commands")
        torch.set_num_threads(args.threads)
    rank, world, device = model.setup_distributed(args)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    rows = read_jsonl(args.data)
    if len(rows) < 2 and args.heldout > 0:
        raise ValueError(f"{args.data}: need at least 2 conversations (one is held out)")
    train_idx, held_idx = split_heldout(len(rows), args.heldout, args.seed)
    lock = claim_folder(args.out) if rank == 0 else None  # out/.lock: one sft.py per --out
    if rank == 0:
        recover_out(args.out)  # what a kill while saving left
    if world > 1:
        dist.barrier()
    resume, st = resume_point(args, say)
    if rank == 0:  # the lines after the checkpoint (none before the first one) are redone: drop them
        agent.trim_log(os.path.join(args.out, "log.jsonl"), "step", st["step"] if resume else 0)
    source = resume or args.model
    if source:  # on the meta device first: the weights are read once it is known whether they are sharded
        lm, tokenizer = model.load(source, "cpu", torch.float32, meta=True)
    else:
        lm, tokenizer = scratch_model([rows[i] for i in train_idx], args)
    from_scratch = st.get("scratch", False) if resume else args.model is None
    epochs = args.epochs or (8 if from_scratch else 2)  # ML-Agent: 2 epochs; from scratch: our choice
    lr = args.lr or (3e-3 if from_scratch else 2e-5)  # ML-Agent: 2e-5; from scratch: our choice
    batch_size = args.batch_size or (2 if from_scratch else 64)  # ML-Agent: effective batch 64; from scratch: ours
    micro = args.micro_batch or (2 if from_scratch else 1)
    args = dataclasses.replace(args, micro_batch=micro)
    prompt_weight = args.prompt_loss_weight  # ML-Agent: assistant tokens only; from scratch: the prompt too (ours)
    if prompt_weight is None:  # a resumed run keeps its weight (checkpoints from before this option: 0)
        prompt_weight = st.get("prompt_weight", 0.0) if resume else float(from_scratch)
    if batch_size < micro * world:
        raise ValueError(f"--batch-size {batch_size} < --micro-batch {micro} x {world} ranks")
    net, lm, tokenizer, sharded = place(lm, tokenizer, source, st.get("master"), prompt_weight, args, world, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    counts = {"cut": 0}
    data = [encode_chat(tokenizer, r["messages"], args.max_len, counts) for r in rows]
    train_set = [data[i] for i in train_idx if any(y != IGNORE for y in data[i][1][1:])]
    dropped = len(train_idx) - len(train_set)
    if not train_set:
        raise ValueError(f"{args.data}: no conversation keeps an assistant turn within --max-len {args.max_len}")
    held_set = [data[i] for i in held_idx]
    optim = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                              fused=device.type == "cuda")
    per_rank = batch_size // world // micro  # micro-batches per rank per optimizer step
    lengths = [len(x) for x, _ in train_set]
    n_micro = len(micro_batches(lengths, args.micro_batch, args.seed, 0)) // world  # per rank, same on every rank
    steps_per_epoch = math.ceil(n_micro / per_rank)
    total = steps_per_epoch * epochs
    warmup = round(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, warmup, total))
    step = 0
    if resume:
        model.set_optim_state(net, optim, st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step = st["step"]
        say(f"resumed from {resume} at step {step} (epoch {st['epoch']})")
    say(f"sft: {len(train_set)} train / {len(held_set)} held-out conversations, {epochs} epochs x {steps_per_epoch} "
        f"steps, lr {lr:g}{' (from scratch)' if from_scratch else ''}, prompt loss weight {prompt_weight:g}, "
        f"{world} rank(s) on {device}{' (FSDP2)' if sharded else ''}, "
        f"{sum(p.numel() for p in lm.parameters()) / 1e6:.2f}M params; {counts['cut']} conversation(s) cut to "
        f"--max-len {args.max_len} (oldest tokens), {dropped} dropped (the last assistant turn alone is longer)")
    start, tokens, train_loss, held = time.time(), 0, float("nan"), float("nan")
    bar = tqdm(total=total, initial=step, desc="sft", disable=rank != 0, dynamic_ncols=True)
    for epoch in range(step // steps_per_epoch, epochs):
        mb = micro_batches(lengths, args.micro_batch, args.seed, epoch)[:n_micro * world][rank::world]
        epoch_losses = []
        for s in range(step - epoch * steps_per_epoch, steps_per_epoch):  # skips the steps done before a resume
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
        train_loss = sum(epoch_losses) / max(len(epoch_losses), 1)  # the epoch's mean over optimizer steps
        say(f"epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f}, held-out loss {held:.4f}, "
            f"{tokens / (time.time() - start):.0f} tokens/s")
        info = {"step": step, "epoch": epoch + 1, "scratch": from_scratch, "prompt_weight": prompt_weight,
                "train_loss": train_loss, "heldout_loss": held, "args": dataclasses.asdict(args)}
        save_checkpoint(net, lm, tokenizer, optim, sched, info, args, rank, device)
    bar.close()
    seconds = time.time() - start
    summary = {"out": args.out, "steps": step, "epochs": epochs, "lr": lr, "batch_size": batch_size,
               "micro_batch": micro, "prompt_loss_weight": prompt_weight, "cut": counts["cut"], "dropped": dropped,
               "train_loss": train_loss, "heldout_loss": held, "seconds": round(seconds, 1),
               "tokens_per_s": round(tokens / seconds)}
    if args.eval_parse and held_idx and step > 0:
        if world > 1:
            dist.barrier()  # rank 0 has written the checkpoint
        optim = sched = net = None  # the optimizer's moments (twice the fp32 model) go before a second model comes
        gc.collect()  # (the scheduler and the optimizer refer to each other)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        summary.update(heldout_parse_rate(args, [rows[i] for i in held_idx[:args.eval_parse]], rank, world, device))
        say(f"held-out parse rate: {summary['parse_rate']:.1%} of {summary['parse_states']} greedy responses parse as "
            f"a valid action ({summary['same_action_as_expert']:.1%} choose the expert's action)")
    say(json.dumps(summary))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if lock:
        lock.close()
    return summary, lm

# ----------------------------------------------------------------------------------------------------------------
# Command line


def parser():
    p = agent.Parser(prog="sft.py", description="Supervised fine-tuning on chat JSONL, loss on assistant tokens.")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            p.add_argument(flag, action="store_true", help=f"(default {f.default})")
        elif f.name == "resume":
            p.add_argument(flag, nargs="?", const="auto", default=None,
                           help="a checkpoint-<step> folder; no value: the latest under --out")
        else:
            kind = next(t for t in (int, float, str) if t is f.type or t in typing.get_args(f.type))
            p.add_argument(flag, type=kind, default=f.default, help=f"(default {f.default})")
    return p


def parse_args(argv=None):
    p = parser()
    args = Config(**vars(p.parse_args(argv)))
    if not os.path.exists(args.data):
        p.error(f"{args.data} not found (run python collect.py first, or pass --data)")
    if args.resume not in (None, "auto") and not os.path.exists(os.path.join(args.resume, "trainer_state.pt")):
        p.error(f"{args.resume} is not a checkpoint folder (no trainer_state.pt)")
    if args.save_dtype not in ("auto", "float32"):
        p.error(f"--save-dtype must be auto or float32, not {args.save_dtype!r}")
    for f in dataclasses.fields(Config):
        v = getattr(args, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            p.error(f"--{f.name.replace('_', '-')} must be finite, not {v}")
    if not (args.grad_clip >= 0 and 0 <= args.warmup_ratio < 1 and args.weight_decay >= 0 and args.threads >= 0):
        p.error("need --grad-clip >= 0 (0: off), 0 <= --warmup-ratio < 1, --weight-decay >= 0, --threads >= 0")
    if args.scratch_layers < 1 or args.scratch_heads < 1 or args.scratch_hidden % (2 * args.scratch_heads) or \
            (args.scratch_hidden // args.scratch_heads) % 2:
        p.error(f"need --scratch-layers >= 1 and --scratch-hidden ({args.scratch_hidden}) divisible by "
                f"--scratch-heads ({args.scratch_heads}) into an even head size")
    if model.bad_device(args.device):
        p.error(model.bad_device(args.device))
    if args.model and os.path.isdir(args.model):  # a hub id is checked when it is fetched
        try:
            check_checkpoint(args.model)
        except ValueError as e:
            p.error(f"--model {e}")
    for name in ("batch_size", "micro_batch", "max_len", "max_new_tokens", "scratch_vocab"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if (args.epochs is not None and args.epochs < 1) or (args.lr is not None and args.lr <= 0) or \
            not 0 <= args.heldout < 1 or args.eval_parse < 0 or (args.prompt_loss_weight or 0) < 0:
        p.error("need --epochs >= 1, --lr > 0, 0 <= --heldout < 1, --eval-parse >= 0, --prompt-loss-weight >= 0")
    return args


def main(argv=None):
    model.run_main("sft.py", train, parse_args(argv))


if __name__ == "__main__":
    main()
