"""Tests for sft.py: the assistant-only labels, the masked loss, accumulation, checkpoints, resume, DDP, the CLI.

Everything runs on CPU with tiny models and chat data built here (a toy "calculator agent"), nothing from runs/:
- ChatML labels: the three encoded pieces per message concatenate to the encoding of the whole rendered
  conversation, the trained tokens decode to exactly each assistant content + <|im_end|>, and the first trained
  token follows the generation prompt `<|im_start|>assistant\\n` (also with two assistant turns);
- the masked loss equals a hand computation from the full logits (right padding changes nothing); so does the loss
  with the prompt tokens at weight 0.25 (padding still predicts nothing);
- one optimizer step over two micro-batches equals one step over their union (loss averaged over all trained tokens,
  with and without prompt tokens);
- gradient checkpointing gives the same gradients;
- the loss falls when overfitting a tiny set; a checkpoint reloads (model.load) to the same logits;
- rows whose last prompt ends with env.Env's verdict are seen --decisions times an epoch, held-out rows once;
- resume from the epoch-1 checkpoint ends with the same weights as the uninterrupted run (and prompt weight);
- 2-process DDP on gloo (prompt weight 0.5): both ranks end with identical weights, equal to a 1-process run with the
  same global batch;
- `sft.py` as a subprocess from scratch (checkpoint loads with model.py, parse rate printed); usage errors exit 2.
"""
import gc
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import model
import sft

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)  # tiny models: one thread is fastest, and far faster on a shared, busy machine
SYSTEM = "You are a calculator agent. Respond with Thought, Action and Action Input."


def conversation(rng, turns=1):
    msgs = [{"role": "system", "content": SYSTEM}]
    for _ in range(turns):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["Add", "Multiply"])
        msgs += [{"role": "user", "content": f"Please {op.lower()} {a} and {b}."},
                 {"role": "assistant", "content": f"Thought: I {op.lower()} them.\nAction: {op}\n"
                                                  f"Action Input: {{\"a\": {a}, \"b\": {b}}}"}]
    return msgs


@pytest.fixture(scope="module")
def chats():
    rng = random.Random(0)
    return [conversation(rng) for _ in range(24)]


@pytest.fixture(scope="module")
def tok(chats):
    return model.train_tokenizer([f"{m['role']}\n{m['content']}\n" for c in chats for m in c], 320)


@pytest.fixture(scope="module")
def tiny_dir(tok, tmp_path_factory):
    """A random tiny checkpoint (fp32) on disk, so every run starts from the same weights."""
    torch.manual_seed(0)
    lm = model.Qwen(model.tiny_config("qwen3", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                      head_dim=8, eos_token_id=tok.im_end_id))
    path = tmp_path_factory.mktemp("tiny")
    model.save(lm, tok, str(path))
    return str(path)


def write_jsonl(path, chats):
    with open(path, "w") as f:
        for c in chats:
            f.write(json.dumps({"messages": c}) + "\n")
    return str(path)


def args(tmp_path, data, **kw):
    base = dict(data=data, out=str(tmp_path / "out"), epochs=2, lr=1e-3, batch_size=4, micro_batch=2, eval_parse=0,
                scratch_hidden=32, scratch_vocab=320, threads=1)
    return sft.Config(**{**base, **kw})


def weights(lm):
    return {k: v.detach().clone() for k, v in lm.state_dict().items()}

# ------------------------------------------------------------------------------------------------ labels and loss


@pytest.mark.parametrize("turns", [1, 2])
def test_labels_cover_assistant_content_and_im_end_only(tok, turns):
    msgs = conversation(random.Random(turns), turns)
    ids, labels = sft.encode_chat(tok, msgs)
    assert ids == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))  # ChatML boundaries agree
    trained = [i for i, y in enumerate(labels) if y != sft.IGNORE]
    assert all(labels[i] == ids[i] for i in trained)
    spans, start = [], None  # contiguous trained spans, one per assistant turn
    for i in range(len(ids) + 1):
        on = i < len(ids) and labels[i] != sft.IGNORE
        if on and start is None:
            start = i
        if not on and start is not None:
            spans.append((start, i))
            start = None
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert [tok.decode(ids[a:b]) for a, b in spans] == [a + "<|im_end|>" for a in answers]
    first = len(tok.encode(tok.apply_chat_template(msgs[:2])))  # the prompt up to `<|im_start|>assistant\n`
    assert spans[0][0] == first and ids[spans[0][1] - 1] == tok.im_end_id


def test_truncation_cuts_the_oldest_tokens_and_keeps_the_last_assistant_turn(tok):
    msgs = conversation(random.Random(3), 2)
    ids, labels = sft.encode_chat(tok, msgs)
    answer = tok.encode(msgs[-1]["content"] + "<|im_end|>")
    tail = len(answer) + 1 + len(tok.encode("<|im_start|>assistant\n"))  # the last turn: header, answer, "\n"
    counts = {}
    for max_len in (len(ids) - 1, tail + 3, tail):  # cut a little; to just the last turn and 3 more; to it alone
        cut_ids, cut_labels = sft.encode_chat(tok, msgs, max_len, counts)
        assert cut_ids == ids[-max_len:] and cut_labels == labels[-max_len:]  # the end is kept, labels aligned
        assert [y for y in cut_labels if y != sft.IGNORE][-len(answer):] == answer  # the target is whole
    assert counts["cut"] == 3
    short_ids, short_labels = sft.encode_chat(tok, msgs, tail - 2)  # the last turn alone does not fit
    assert len(short_ids) == tail - 2 and all(y == sft.IGNORE for y in short_labels)  # nothing to train: dropped


def test_rows_that_cannot_keep_their_target_are_counted_and_dropped(tmp_path, chats, tiny_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chats[:6])
    tok = model.load(tiny_dir, "cpu")[1]
    lengths = sorted(len(sft.encode_chat(tok, c)[0]) for c in chats[:6])
    summary, _ = sft.train(args(tmp_path, data, model=tiny_dir, epochs=1, batch_size=1, micro_batch=1, heldout=0,
                                max_len=lengths[0] - 1))  # every row is cut
    assert summary["cut"] == 6 and 0 <= summary["dropped"] < 6 and summary["steps"] == 6 - summary["dropped"]
    with pytest.raises(ValueError, match="no conversation keeps an assistant turn"):
        sft.train(args(tmp_path, data, model=tiny_dir, epochs=1, batch_size=1, micro_batch=1, heldout=0, max_len=4,
                       out=str(tmp_path / "none")))


def with_verdict(chat, where):
    """chat with env.Env's verdict in its prompt: "last" ends the prompt with it (keep or undo is next), "earlier"
    shows it on an older step, "none" leaves it out."""
    verdict = "Public score (mae, lower is better): 1.5, not better than 1.2 before the last edit\n```"
    user = {"last": f"Step 3:\nObservation:\n```\n{verdict}\n\nNow respond for step 4.",
            "earlier": f"Step 3:\nObservation:\n```\n{verdict}\n\nStep 4:\nObservation:\n```\nok\n```\n\n"
                       "Now respond for step 5.", "none": chat[1]["content"]}[where]
    return [chat[0], {"role": "user", "content": user}, *chat[2:]]


def test_rows_answering_a_verdict_are_repeated_in_training_and_held_out_rows_once(tmp_path, chats, tiny_dir):
    wheres = ["last", "earlier", "none", "last"] * 3
    rows = [with_verdict(c, w) for c, w in zip(chats, wheres)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    base = dict(epochs=1, batch_size=1, micro_batch=1, heldout=0)
    summary, _ = sft.train(args(tmp_path, data, model=tiny_dir, decisions=3, out=str(tmp_path / "a"), **base))
    assert summary["repeated"] == 2 * 6 and summary["steps"] == 12 + 12  # 6 rows end with the verdict, seen 3 times
    summary, _ = sft.train(args(tmp_path, data, model=tiny_dir, out=str(tmp_path / "b"), **base))
    assert summary["decisions"] == 1 and summary["repeated"] == 0 and summary["steps"] == 12  # the paper's: once
    train_idx, held_idx = sft.split_heldout(12, 0.25, 0)
    assert sum(wheres[i] == "last" for i in held_idx) > 0  # the split holds out a row that ends with the verdict
    summary, _ = sft.train(args(tmp_path, data, out=str(tmp_path / "c"), decisions=2, **base | {"heldout": 0.25}))
    assert summary["repeated"] == sum(wheres[i] == "last" for i in train_idx)  # from scratch: the training split's
    assert summary["steps"] == len(train_idx) + summary["repeated"]


def test_masked_loss_equals_hand_computation(tok, tiny_dir, chats):
    lm, _ = model.load(tiny_dir, "cpu")
    net = sft.SFTModel(lm)
    batch = [sft.encode_chat(tok, c) for c in chats[:3]]
    batch[1] = (batch[1][0][:-5], batch[1][1][:-5])  # different lengths: right padding in the batch
    ids, labels, lengths, prefix = sft.collate(batch, tok.pad_token_id, torch.device("cpu"))
    weighted, loss, n = net(ids, labels, lengths, prefix)
    assert weighted.item() == loss.item()  # prompt weight 0: the assistant tokens only
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids), -1)  # (B, T, V)
    want, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if labels[b, t] != -100:
                want -= logp[b, t - 1, labels[b, t]].item()
                count += 1
    assert n.item() == count == sum(sum(y != -100 for y in lab[1:]) for _, lab in batch)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    alone = sum(net(*sft.collate([x], tok.pad_token_id, torch.device("cpu")))[0].item() for x in batch)
    assert loss.item() == pytest.approx(alone, rel=1e-5)  # padding does not change any sequence's loss


@pytest.mark.parametrize("amp", [False, True])
def test_the_fused_lm_head_and_cross_entropy_match_autograd(amp):
    """sft.LinearCrossEntropy: the same per-row losses and gradients as the lm_head then F.cross_entropy, each row's
    loss weighted as SFTModel weighs it; under bf16 autocast (as on CUDA) within bf16's rounding, in the inputs'
    dtypes."""
    torch.manual_seed(0)
    h, w = torch.randn(9, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    targets, weight = torch.randint(0, 40, (9,)), torch.rand(9)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ours = sft.LinearCrossEntropy.apply(h, w, targets)
        (ours * weight).sum().backward()
        h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ref = torch.nn.functional.cross_entropy((h2 @ w2.t()).float(), targets, reduction="none")
        (ref * weight).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if amp else dict(rtol=1e-5, atol=1e-6)
    assert ours.dtype == h.grad.dtype == w.grad.dtype == torch.float32
    for a, b in ((ours, ref), (h.grad, h2.grad), (w.grad, w2.grad)):
        torch.testing.assert_close(a, b, **tol)


def test_prompt_loss_weight_adds_the_other_real_tokens(tok, tiny_dir, chats):
    lm, _ = model.load(tiny_dir, "cpu")
    net = sft.SFTModel(lm, prompt_weight=0.25)
    batch = [sft.encode_chat(tok, c) for c in chats[:3]]
    batch[1] = (batch[1][0][:-5], batch[1][1][:-5])
    ids, labels, lengths, prefix = sft.collate(batch, tok.pad_token_id, torch.device("cpu"))
    weighted, loss, n = net(ids, labels, lengths, prefix)
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids), -1)
    ours = other = 0.0
    for b, (x, y) in enumerate(batch):
        for t in range(1, len(x)):  # real positions only: padding predicts nothing
            nll = -logp[b, t - 1, x[t]].item()
            if y[t] != -100:
                ours += nll
            else:
                other += nll
    assert other > 0 and loss.item() == pytest.approx(ours, rel=1e-5)
    assert weighted.item() == pytest.approx(ours + 0.25 * other, rel=1e-5)
    assert (n.item(), sum(len(x) - 1 for x, _ in batch) - n.item()) == sft.token_counts(batch)
    alone = sum(net(*sft.collate([x], tok.pad_token_id, torch.device("cpu")))[0].item() for x in batch)
    assert weighted.item() == pytest.approx(alone, rel=1e-5)


def _one_step(tiny_dir, batches, tok, checkpointing=False, calls=None, prompt_weight=0.0, share=False):
    lm, _ = model.load(tiny_dir, "cpu")
    if checkpointing:
        model.enable_grad_checkpointing(lm)
    if calls is not None:  # counts MLP calls (a pre-hook: the recomputation in backward stops early, inside the MLP)
        for block in lm.model.layers:
            block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    net = sft.SFTModel(lm, prompt_weight, share_prefix=share)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    a = sft.Config(grad_clip=0.0)
    loss, n, _ = sft.optimizer_step(net, opt, sched, batches, tok.pad_token_id, torch.device("cpu"), a, 1)
    return loss, n, weights(lm)


@pytest.mark.parametrize("prompt_weight", [0.0, 0.5])
def test_accumulation_averages_over_all_trained_tokens(tok, tiny_dir, chats, prompt_weight):
    ex = [sft.encode_chat(tok, c) for c in chats[:3]]
    ex[0] = (ex[0][0] + ex[0][0], ex[0][1] + ex[0][1])  # one sequence with twice the trained tokens
    loss1, n1, w1 = _one_step(tiny_dir, [[ex[0]], [ex[1], ex[2]]], tok, prompt_weight=prompt_weight)
    loss2, n2, w2 = _one_step(tiny_dir, [ex], tok, prompt_weight=prompt_weight)
    assert n1 == n2 and loss1 == pytest.approx(loss2, rel=1e-5)
    w0 = weights(model.load(tiny_dir, "cpu")[0])
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prompt_weight", [0.0, 0.5])
def test_a_shared_prefix_computed_once_gives_the_same_loss_and_step(tok, tiny_dir, chats, prompt_weight):
    # every chat begins with the same system prompt; rows of different lengths and one that shares more (a copy of
    # another with its answer cut)
    ex = [sft.encode_chat(tok, c) for c in chats[:3]]
    ex.append((ex[0][0][:-3], ex[0][1][:-3]))
    P = sft.shared_prefix(ex)
    assert P == sft.shared_prefix(ex[:3]) >= len(tok.encode(SYSTEM))  # at least the system prompt, at most where
    assert any(x[P] != ex[0][0][P] for x, _ in ex[1:])                 # two rows part
    assert sft.shared_prefix([ex[0], ex[3]]) == len(ex[3][0]) - 1  # a row that is all prefix keeps one position
    lm, _ = model.load(tiny_dir, "cpu")
    calls = []
    for block in lm.model.layers:
        block.mlp.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[:2]))
    ids, labels, lengths, prefix = sft.collate(ex, tok.pad_token_id, torch.device("cpu"))
    shared = sft.SFTModel(lm, prompt_weight, share_prefix=True)(ids, labels, lengths, prefix)
    L = lm.config.num_hidden_layers  # every block: the prefix once, then each row's rest
    assert [tuple(c) for c in calls] == [(1, P)] * L + [(4, ids.shape[1] - P)] * L
    plain = sft.SFTModel(lm, prompt_weight)(ids, labels, lengths, prefix)
    for a, b in zip(shared, plain):
        assert a.item() == pytest.approx(b.item(), rel=1e-5)
    loss1, n1, w1 = _one_step(tiny_dir, [ex], tok, prompt_weight=prompt_weight, share=True)
    loss2, n2, w2 = _one_step(tiny_dir, [ex], tok, prompt_weight=prompt_weight)
    assert n1 == n2 and loss1 == pytest.approx(loss2, rel=1e-5)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_step(tok, tiny_dir, chats):
    batch = [[sft.encode_chat(tok, c) for c in chats[:2]]]
    plain_calls, ckpt_calls = [], []
    _, _, plain = _one_step(tiny_dir, batch, tok, calls=plain_calls)
    _, _, ckpt = _one_step(tiny_dir, batch, tok, checkpointing=True, calls=ckpt_calls)
    for k in plain:
        torch.testing.assert_close(plain[k], ckpt[k], rtol=1e-5, atol=1e-6)
    layers = model.load(tiny_dir, "cpu")[0].config.num_hidden_layers
    assert len(plain_calls) == layers  # one micro-batch: each block once
    assert len(ckpt_calls) == 2 * layers  # ... and once more when backward recomputes it: checkpointing is on


def test_lr_schedule_warms_up_then_decays_to_zero():
    f = [sft.lr_factor(s, 3, 20) for s in range(21)]
    assert f[0] < f[1] < f[2] < f[3] == 1.0
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[20] == pytest.approx(0.0, abs=1e-12)


def test_micro_batches_are_deterministic_length_buckets():
    lengths = [random.Random(1).randint(1, 500) for _ in range(64)] + list(range(64))
    a, b = sft.micro_batches(lengths, 4, 0, 3), sft.micro_batches(lengths, 4, 0, 3)
    assert a == b != sft.micro_batches(lengths, 4, 0, 4)
    assert sorted(i for mb in a for i in mb) == list(range(len(lengths)))
    spread = sum(max(lengths[i] for i in mb) - min(lengths[i] for i in mb) for mb in a)
    shuffled = list(range(len(lengths)))
    random.Random(0).shuffle(shuffled)
    naive = sum(max(lengths[i] for i in shuffled[j:j + 4]) - min(lengths[i] for i in shuffled[j:j + 4])
                for j in range(0, len(shuffled), 4))
    assert spread < naive / 2  # bucketing pads far less than random batches

# ------------------------------------------------------------------------------------------- training runs


def test_loss_falls_when_overfitting_and_checkpoint_reloads(tmp_path, chats, tiny_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chats[:4])
    summary, lm = sft.train(args(tmp_path, data, model=tiny_dir, epochs=40, lr=1e-2, heldout=0.0))
    log = [json.loads(line) for line in open(tmp_path / "out" / "log.jsonl")]
    assert len(log) == summary["steps"] == 40
    assert log[-1]["loss"] < 0.3 * log[0]["loss"]
    ckpt = tmp_path / "out" / f"checkpoint-{summary['steps']}"
    ids = torch.tensor([sft.encode_chat(model.load(tiny_dir)[1], chats[0])[0]])
    with torch.no_grad():
        want = lm(ids)
        for path in (ckpt, tmp_path / "out"):  # the epoch checkpoint and the final folder at --out
            got = model.load(str(path), "cpu")[0](ids)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not list((tmp_path / "out").glob("*.tmp"))  # the atomic writes left nothing behind


def test_resume_ends_with_the_uninterrupted_weights(tmp_path, chats):
    data = write_jsonl(tmp_path / "d.jsonl", chats[:12])
    full, lm_full = sft.train(args(tmp_path, data, epochs=3, out=str(tmp_path / "a"), prompt_loss_weight=0.5))
    first = sorted((tmp_path / "a").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[0]
    done = int(first.name.split("-")[1])
    again, lm_again = sft.train(args(tmp_path, data, epochs=3, out=str(tmp_path / "b"), resume=str(first)))
    log = [json.loads(line) for line in open(tmp_path / "b" / "log.jsonl")]
    assert log[0]["step"] == done + 1 and again["steps"] == full["steps"] > done
    assert again["prompt_loss_weight"] == full["prompt_loss_weight"] == 0.5  # the resume is given none: kept
    assert again["heldout_loss"] == pytest.approx(full["heldout_loss"], rel=1e-5)
    w_full, w_again = weights(lm_full), weights(lm_again)
    for k in w_full:
        torch.testing.assert_close(w_again[k], w_full[k], rtol=1e-5, atol=1e-6)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, a, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _, lm = sft.train(a)
    if not a.fsdp:  # under FSDP each rank holds shards; rank 0 wrote the gathered checkpoint
        torch.save(weights(lm), os.path.join(out, f"rank{rank}.pt"))


def test_ddp_gloo_two_processes_match_one(tmp_path, chats, tiny_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chats[:13])  # 12 train: 3 steps of 4 micro-batches, split 2 + 2
    kw = dict(model=tiny_dir, epochs=1, micro_batch=1, batch_size=4, prompt_loss_weight=0.5)  # summed over ranks
    a = args(tmp_path, data, out=str(tmp_path / "ddp"), **kw)
    mp.spawn(_ddp_worker, args=(2, _free_port(), a, str(tmp_path)), nprocs=2, join=True)
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    _, single = sft.train(args(tmp_path, data, out=str(tmp_path / "one"), **kw))
    start = weights(model.load(tiny_dir, "cpu")[0])
    ws = weights(single)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k  # DDP keeps the replicas identical
        torch.testing.assert_close(w0[k], ws[k], rtol=1e-4, atol=1e-6)  # same global batch, same update
    assert any(not torch.equal(w0[k], start[k]) for k in w0)
    assert model.load(str(tmp_path / "ddp"), "cpu")  # rank 0 wrote the checkpoint


@pytest.mark.slow
def test_fsdp_gloo_two_processes_match_one_and_resume(tmp_path, chats, tiny_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chats[:13])
    kw = dict(model=tiny_dir, epochs=2, micro_batch=1, batch_size=4)
    a = args(tmp_path, data, fsdp=True, out=str(tmp_path / "fsdp"), **kw)
    mp.spawn(_ddp_worker, args=(2, _free_port(), a, str(tmp_path)), nprocs=2, join=True)
    _, single = sft.train(args(tmp_path, data, out=str(tmp_path / "one"), **kw))
    ws = weights(single)
    resume = str(tmp_path / "fsdp" / "checkpoint-3")  # the end of epoch 1
    b = args(tmp_path, data, fsdp=True, out=str(tmp_path / "again"), resume=resume, **kw)
    mp.spawn(_ddp_worker, args=(2, _free_port(), b, str(tmp_path)), nprocs=2, join=True)
    for out in ("fsdp", "again"):  # the gathered checkpoint; the run resumed with the gathered optimizer state
        w = weights(model.load(str(tmp_path / out), "cpu")[0])
        for k in ws:
            torch.testing.assert_close(w[k], ws[k], rtol=1e-4, atol=1e-6)

# ------------------------------------------------------------------------------------------- command line


def run_cli(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "sft.py"), *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_cli_from_scratch_writes_a_checkpoint_model_py_loads(tmp_path, chats):
    data = write_jsonl(tmp_path / "d.jsonl", chats)
    out = tmp_path / "ckpt"
    r = run_cli("--data", data, "--out", str(out), "--epochs", "2", "--threads", "1", "--scratch-hidden", "32",
                "--scratch-vocab", "320", "--eval-parse", "3", "--max-new-tokens", "16", "--heldout", "0.25")
    assert r.returncode == 0, r.stderr
    assert "held-out parse rate" in r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["parse_states"] == 3 and 0 <= summary["parse_rate"] <= 1
    assert summary["lr"] == 3e-3 and summary["batch_size"] == 2  # the from-scratch defaults
    lm, tok = model.load(str(out), "cpu")
    assert lm.config.vocab_size == len(tok) and tok.im_end_id in lm.stop_token_ids
    assert len(list(out.glob("checkpoint-*"))) == 2


def test_cli_usage_errors_exit_2(tmp_path, cli):  # main(argv) here (conftest.cli), not a python + torch a case
    chat = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    data = write_jsonl(tmp_path / "ok.jsonl", [chat])
    for argv in (["--data", str(tmp_path / "missing.jsonl")], ["--batch-size", "0"], ["--bogus"],
                 ["--resume", str(tmp_path)], ["--heldout", "1.5"], ["--data", data, "--grad-clip", "-1"],
                 ["--data", data, "--warmup-ratio", "-1"], ["--data", data, "--scratch-layers", "0"],
                 ["--data", data, "--scratch-heads", "0"], ["--data", data, "--threads", "-1"],
                 ["--data", data, "--lr", "nan"], ["--data", data, "--device", "tpu9"],
                 ["--data", data, "--scratch-hidden", "30"], ["--data", data, "--decisions", "0"]):
        r = cli(sft.main, argv, cwd=tmp_path)
        assert r.returncode == 2, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr
    chat = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    good = write_jsonl(tmp_path / "d.jsonl", [chat])
    r = cli(sft.main, ["--data", str(good), "--prompt-loss-weight", "-1"], cwd=tmp_path)
    assert r.returncode == 2 and "--prompt-loss-weight: must be >= 0" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no messages"}\n')
    r = cli(sft.main, ["--data", str(bad), "--out", str(tmp_path / "o")], cwd=tmp_path)
    assert r.returncode == 2 and "expected" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_unreadable_checkpoint_a_file_and_an_out_in_use_are_refused(tmp_path, chats, cli):  # main(argv) here
    data = write_jsonl(tmp_path / "d.jsonl", chats[:6])
    out = tmp_path / "ckpt"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "trainer_state.pt").write_bytes(b"truncated")
    for extra in ([], ["--resume"]):  # a checkpoint under --out is resumed, here an unreadable one
        r = cli(sft.main, ["--data", data, "--out", str(out), "--epochs", "1", *extra], cwd=tmp_path)
        assert r.returncode == 2 and "cannot be read" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "a-file").write_text("mine")
    r = cli(sft.main, ["--data", data, "--out", str(tmp_path / "a-file")], cwd=tmp_path)
    assert r.returncode == 2 and "is a file" in r.stderr and (tmp_path / "a-file").read_text() == "mine"
    busy = tmp_path / "busy"
    busy.mkdir()
    with open(busy / ".lock", "w") as held:
        import fcntl
        fcntl.flock(held, fcntl.LOCK_EX)
        r = cli(sft.main, ["--data", data, "--out", str(busy), "--epochs", "1"], cwd=tmp_path)  # flock: here too
    assert r.returncode == 2 and "in use" in r.stderr


@pytest.mark.slow
def test_killed_run_resumes_with_each_step_logged_once_and_refuses_other_data(tmp_path, chats):
    import signal
    import time
    data = write_jsonl(tmp_path / "d.jsonl", chats[:10])
    out = tmp_path / "ckpt"
    argv = ["--data", data, "--out", str(out), "--epochs", "3", "--threads", "1", "--scratch-hidden", "32",
            "--scratch-vocab", "320", "--eval-parse", "0", "--heldout", "0.1"]
    p = subprocess.Popen([sys.executable, str(ROOT / "sft.py"), *argv], cwd=tmp_path, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    log, deadline = out / "log.jsonl", time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 6):
        time.sleep(0.02)  # epoch 1 (5 steps) is checkpointed; a step of epoch 2 is logged
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    other = write_jsonl(tmp_path / "other.jsonl", chats[10:20])
    r = run_cli("--data", other, "--out", str(out), cwd=tmp_path)  # another run's data: not trained over this one
    assert r.returncode == 2 and "--data" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli(*argv, cwd=tmp_path)  # the same command again resumes
    assert r.returncode == 0, r.stderr
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert steps == list(range(1, summary["steps"] + 1))  # every step once, none lost, none twice


@pytest.mark.parametrize("content", [b'{"messages": [{"content": "no role"}]}\n', b"\xff\xfe\n", b'{"messages": [1]}\n',
                                     b'{"messages": [{"role": "user", "content": {"a": 1}}]}\n'])
def test_bad_chat_lines_are_one_line_errors_naming_file_and_line(tmp_path, content, cli):  # main(argv) here
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"messages": [{"role": "user", "content": "ok"}]}\n' + content)
    r = cli(sft.main, ["--data", str(bad), "--out", str(tmp_path / "o")], cwd=tmp_path)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_what_a_kill_while_saving_leaves_is_recovered_at_start(tmp_path):
    """checkpoint-4 went aside (.old) before the new one came in; a half-written checkpoint-6.tmp; out/'s model
    files a mix of two checkpoints (the .publishing marker): recover_out restores checkpoint-4, deletes the rest and
    publishes checkpoint-4's files at out/ again."""
    for name, text in (("checkpoint-2", "step 2"), ("checkpoint-4.old", "step 4"), ("checkpoint-6.tmp", "half")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        (tmp_path / name / "trainer_state.pt").write_text("state")
    (tmp_path / "config.json").write_text("step 2")  # the kill came after this file of step 4 ...
    (tmp_path / "tokenizer.json").write_text("step 4")  # ... and after this one
    (tmp_path / "model-00002-of-00002.safetensors").write_text("a stale shard")
    (tmp_path / ".publishing").touch()
    sft.recover_out(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4", "config.json", "tokenizer.json"]
    assert (tmp_path / "config.json").read_text() == "step 4" and not (tmp_path / "config.json.tmp").exists()
    assert sft.latest_checkpoint(str(tmp_path)).endswith("checkpoint-4")


# ---- the CUDA paths, on CPU (issue: "The GPU node on the first try") ----

@pytest.mark.parametrize("device, env, expect", [
    (None, {}, "cuda:0"), ("cuda", {}, "cuda:0"), ("cuda:1", {}, "cuda:1"),  # one process, as `python sft.py`
    (None, {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "RANK": "0", "MASTER_ADDR": "h"}, "cuda:0"),  # torchrun, 1 process
    (None, {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1", "MASTER_ADDR": "h"}, "cuda:1"),  # rank 1 of 2
])
def test_setup_distributed_gives_cuda_an_index_and_nccl_a_long_timeout(monkeypatch, device, env, expect):
    """torch.cuda.set_device refuses a device without an index; NCCL's default 10-minute timeout would abort a rank
    waiting for another's task script or checkpoint write. CUDA is faked: set_device checks its argument as the real
    one does."""
    from torch.cuda._utils import _get_device_index
    for k in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    set_to, inits = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append(_get_device_index(d)))
    monkeypatch.setattr(model.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(model.dist, "init_process_group", lambda backend, **kw: inits.append((backend, kw)))
    monkeypatch.setattr(model.dist, "get_rank", lambda: int(env.get("RANK", 0)))
    rank, world, dev = model.setup_distributed(sft.Config(device=device))
    assert str(dev) == expect and set_to == [dev.index]
    assert world == int(env.get("WORLD_SIZE", 1)) and rank == int(env.get("RANK", 0))
    if "MASTER_ADDR" in env:  # under torchrun, even with one process (sft.py --fsdp shards over it)
        (backend, kw), = inits
        assert backend == "nccl" and kw["timeout"].total_seconds() >= 3600
    else:
        assert inits == []


def _sharded_grads_worker(rank, world, port, tiny_dir, examples, pad, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor
    cpu = torch.device("cpu")
    lm, _ = model.load(tiny_dir, "cpu", meta=True)
    net = model.shard(sft.SFTModel(lm), lm.model.layers, world, cpu)
    net.to_empty(device=cpu)
    lm.tie_weights()
    model.fill(lm, model.weight_tensors(tiny_dir))
    seen, collate = [], sft.collate

    def spy(batch, pad_id, device):  # called before each micro-batch: what the earlier backwards left
        params = list(net.parameters())
        seen.append({"sharded_grads": all(isinstance(p.grad, DTensor) for p in params),
                     "grad_bytes": sum(p.grad.to_local().nbytes for p in params if isinstance(p.grad, DTensor)),
                     "shard_bytes": sum(p.to_local().nbytes for p in params)})
        return collate(batch, pad_id, device)
    sft.collate = spy
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sft.optimizer_step(net, opt, sched, [[examples[rank]], [examples[2 + rank]]], pad, cpu, sft.Config(grad_clip=0.0),
                       world)
    sft.collate = collate
    sft.heldout_loss(net, examples, sft.Config(micro_batch=1), rank, world, pad, cpu)
    resharded = isinstance(lm.model.embed_tokens.weight, DTensor)
    full_bytes = sum(t.nbytes for _, t in model.weight_tensors(tiny_dir))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "full_bytes": full_bytes, "resharded": resharded}, f)
    torch.distributed.destroy_process_group()


def test_two_gloo_ranks_accumulate_sharded_gradients_and_reshard_after_evaluation(tmp_path, tok, tiny_dir, chats):
    """Gradient accumulation under FSDP2: after the first micro-batch's backward each rank holds only its shard of the
    gradients (reduce-scattered at once), not the whole model's unsharded fp32 gradients until the last micro-batch
    (28 GiB per GPU at 7B). The held-out loss (no backward follows) frees the gathered root unit."""
    ex = [sft.encode_chat(tok, c) for c in chats[:4]]
    mp.spawn(_sharded_grads_worker, args=(2, _free_port(), tiny_dir, ex, tok.pad_token_id, str(tmp_path)), nprocs=2,
             join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        first, second = got["seen"]
        assert not first["sharded_grads"]  # nothing before the first backward
        assert second["sharded_grads"], second  # after it: this rank's shard of every gradient
        assert second["grad_bytes"] == second["shard_bytes"] <= 0.6 * got["full_bytes"]
        assert got["resharded"]


def test_the_parse_check_loads_its_model_after_the_optimizer_is_gone(tmp_path, chats, monkeypatch):
    """The held-out parse check loads the saved checkpoint as a second model; at 7B the optimizer's moments (twice the
    fp32 model) must be gone by then, not held beside it."""
    data = write_jsonl(tmp_path / "d.jsonl", chats)
    alive, load = [], model.load

    def counting(*a, **kw):
        alive.append(sum(issubclass(type(o), torch.optim.Optimizer) for o in gc.get_objects()))
        return load(*a, **kw)
    monkeypatch.setattr(model, "load", counting)
    summary, _ = sft.train(args(tmp_path, data, epochs=1, eval_parse=2, max_new_tokens=4, heldout=0.25))
    assert summary["parse_states"] == 2 and alive == [0]


def test_torchrun_with_one_process_takes_the_fsdp2_path(tmp_path, chats, tiny_dir):
    """`torchrun --nproc_per_node 1 sft.py --fsdp` (what tests/gpu_check.py runs on one GPU) shards over a mesh of one
    and writes a checkpoint that loads."""
    data = write_jsonl(tmp_path / "d.jsonl", chats[:9])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                        str(_free_port()), str(ROOT / "sft.py"), "--data", data, "--model", tiny_dir, "--out",
                        str(tmp_path / "o"), "--fsdp", "--epochs", "1", "--batch-size", "4", "--micro-batch", "2",
                        "--eval-parse", "0", "--threads", "1", "--device", "cpu"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 rank(s) on cpu (FSDP2)" in r.stdout
    assert model.load(str(tmp_path / "o"), "cpu")[0].config.num_hidden_layers == 2


def test_a_bad_model_is_one_line_exit_2_before_out_is_made(tmp_path, no_endpoint):
    """Issue 43: a hub id not in the cache (hub offline) made --out (with its .lock) before it was fetched."""
    from conftest import assert_bad_models_refused
    chat = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
    assert_bad_models_refused(sft.main, ["--data", "{d}/d.jsonl", "--model", "{m}", "--out", "{d}/o"], tmp_path,
                              no_endpoint, {"d.jsonl": (json.dumps(chat) + "\n").encode() * 4})

