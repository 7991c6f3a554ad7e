"""Tests for orchestrator.py: the Matryoshka Agent, its monolithic baseline, Solution Refinement Trees, the ranking loss.

- branch labels R(c) = max over the subtree and the preference groups of a hand-built tree (both metric directions);
- the ranking loss equals DPO's formula for two children, a hand computation for three, skips ties;
- one gradient step on a tiny model raises the winner's log-ratio and the margin;
- a bf16 checkpoint trains in fp32 master weights (AdamW's 1e-5 steps move nearly every weight) and the trained
  checkpoint is saved back in bf16;
- a scripted run: every stand-in message goes through the real parsers, the Orchestrator's prompt grows by a bounded
  amount per attempt while the monolithic agent's grows much faster; the best attempt and its submission file are
  tracked; runs resume;
- training also collects a depth-1 tree on other held-in tasks, whose decisions ckpt-0 imitates;
- the tool calls of one round run in parallel; a Sub-Agent that always crashes stops at its iteration limit;
- tree save and resume, a tree's JSON round trip, a tree.json of the dict trees still loading; long environment
  output keeps its head and tail; SFT export; command-line errors.
"""
from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import agent
import env
import orchestrator as orc

TASK = "breast-cancer"


def cfg(**kw):
    return orc.Config(task=TASK, script_timeout=60, **kw)


# ------------------------------------------------------------------------------------------ labels and pairs

def hand_tree(higher=True):
    """0 -> (1, 2); 1 -> (3, 4); 2 -> (5, 6); 5 -> (7, 8) with 7 and 8 tied."""
    scores = {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9, 4: None, 5: 0.65, 6: 0.7, 7: 0.6, 8: 0.6}
    parents = {0: None, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2, 7: 5, 8: 5}
    sign = 1 if higher else -1
    return orc.Tree("hand", higher, 1, {}, [
        orc.Node(i, parents[i], 0, f"a{i}", [], "done", [{"role": "user", "content": f"state {i}"}]
                 if i in (0, 1, 2, 5) else None, None if s is None else sign * s) for i, s in scores.items()])


@pytest.mark.parametrize("higher", [True, False])
def test_branch_labels_and_preference_groups(higher):
    tree = hand_tree(higher)
    R = orc.branch_labels(tree)
    # labels are on the larger-is-better scale: the lower-is-better tree holds the negated scores
    assert R[1] == pytest.approx(0.9) and R[2] == pytest.approx(0.7) and R[5] == pytest.approx(0.65)
    assert R[3] == pytest.approx(0.9) and R[4] == float("-inf") and R[7] == R[8] == pytest.approx(0.6)
    groups = {g["node"]: g for g in orc.preference_groups(tree)}
    assert sorted(groups) == [0, 1, 2]  # node 5's children tie: skipped
    assert groups[0]["responses"] == ["a1", "a2"] and groups[0]["R"] == pytest.approx([0.9, 0.7])
    assert groups[1]["R"][0] == pytest.approx(0.9) and groups[1]["R"][1] == float("-inf")
    assert groups[2]["R"] == pytest.approx([0.65, 0.7])  # the second child wins at node 2
    assert groups[0]["messages"] == [{"role": "user", "content": "state 0"}]


# ------------------------------------------------------------------------------------------------ the loss

def test_ranking_loss_is_dpo_for_two_children():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        pw, pl, rw, rl = (-10 * torch.rand(4, generator=g)).tolist()
        beta = 0.1 + torch.rand(1, generator=g).item()
        dpo = -torch.nn.functional.logsigmoid(torch.tensor(beta * ((pw - rw) - (pl - rl)), dtype=torch.float64))
        scores = beta * (torch.tensor([pl, pw], dtype=torch.float64) - torch.tensor([rl, rw], dtype=torch.float64))
        assert orc.ranking_loss(scores, [0.2, 0.8]).item() == pytest.approx(dpo.item(), rel=1e-6)


def test_ranking_loss_by_hand_for_three_and_ties():
    beta, lp, ref = 0.5, [-3.0, -2.0, -4.0], [-2.5, -2.5, -3.0]
    s = [beta * (a - b) for a, b in zip(lp, ref)]  # -0.25, 0.25, -0.5
    scores = torch.tensor(s, dtype=torch.float64)
    # R ranks child 1 > child 2 > child 0: Plackett-Luce
    e = [math.exp(x) for x in s]
    hand = -math.log(e[1] / (e[0] + e[1] + e[2])) - math.log(e[2] / (e[2] + e[0]))
    assert orc.ranking_loss(scores, [1.0, 3.0, 2.0]).item() == pytest.approx(hand, rel=1e-6)
    # ties: 0 and 1 tied above 2: each is compared with 2 only, never with each other
    hand_tie = -math.log(e[0] / (e[0] + e[2])) - math.log(e[1] / (e[1] + e[2]))
    assert orc.ranking_loss(scores, [2.0, 2.0, 1.0]).item() == pytest.approx(hand_tie, rel=1e-6)
    assert orc.ranking_loss(scores[:2], [1.0, 1.0]) is None
    assert orc.ranking_loss(scores[:2], [float("-inf"), float("-inf")]) is None


def test_one_gradient_step_raises_the_winners_log_ratio():
    messages = [{"role": "system", "content": "You are the Orchestrator."},
                {"role": "user", "content": "Attempts so far: #0 starter | score 0.8"}]
    win = '{"tool_calls": [{"name": "refine", "arguments": {"parent": 0, "instruction": "use a forest"}}]}'
    lose = '{"tool_calls": [{"name": "finish", "arguments": {"reason": "done"}}]}'
    policy, tok = orc.tiny_orchestrator([m["content"] for m in messages] + [win, lose], vocab_size=320)
    ref = copy.deepcopy(policy)
    group = {"messages": messages, "responses": [win, lose], "R": [1.0, 0.0]}
    with torch.no_grad():
        before = orc.decision_logprobs(policy, tok, messages, [win, lose], 4096)
        ref_lp = orc.decision_logprobs(ref, tok, messages, [win, lose], 4096)
    assert torch.allclose(before, ref_lp)  # policy == reference: log-ratios are 0
    stats = orc.train_orchestrator(policy, ref, tok, [group], orc.Config(lr=1e-3, beta=0.1, epochs=1), log=lambda *_: 0)
    assert stats["steps"] == 1 and stats["loss_first"] == pytest.approx(math.log(2), rel=1e-5)
    with torch.no_grad():
        after = orc.decision_logprobs(policy, tok, messages, [win, lose], 4096)
    ratio = after - ref_lp
    assert ratio[0] > 0 and ratio[0] - ratio[1] > 0


# ------------------------------------------------------------------------------------------ runs and tools

def test_scripted_run_bounded_orchestrator_vs_growing_monolith_and_resume(tmp_path):
    c = cfg(rounds=2, calls=2, sub_iters=1)
    res = orc.run_matryoshka(c, orc.ScriptedOrchestrator(), orc.RecipeCoder(), tmp_path, log=lambda *_: 0)
    attempts = res["attempts"]
    assert len(attempts) == 5 and res["round"] == 2
    assert all(a["status"] == "success" and a["iterations"] == 1 for a in attempts[1:])
    best = max(attempts, key=lambda a: a["score"])
    assert res["best"]["public"] == best["score"] and res["best"]["private"] == best["private"] is not None
    assert res["best"]["code"] == best["code"] and "Starter script" in best["code"]
    for a in attempts:  # each attempt keeps its best run's submission.csv, which grades to the scores it reports
        g = env.grade(TASK, a["submission"])
        assert g.valid and (g.public, g.private) == pytest.approx((a["score"], a["private"]))
    assert res["best"]["submission"] == best["submission"]
    orch = [r["tokens"] for r in res["records"] if r["role"] == "orchestrator"]
    assert len(orch) == 2 and 0 < orch[1] - orch[0] <= 2 * 150  # at most ~150 tokens per attempt, no code or logs
    for a in attempts[1:]:  # the Orchestrator's prompt never holds code
        assert set(a["summary"]) == set(orc.SUMMARY_KEYS) and "public score" in a["summary"]["result"]
    mono = orc.run_monolithic(c, orc.RecipeCoder(), tmp_path, log=lambda *_: 0)
    grow = [r["tokens"] for r in mono["records"]]
    assert len(grow) >= 4 and all(b > a for a, b in zip(grow, grow[1:]))
    per_attempt = (orch[1] - orch[0]) / 2  # round 2's prompt holds two attempts more
    assert (grow[-1] - grow[0]) / (len(grow) - 1) > 2 * per_attempt
    assert grow[-1] > orch[-1]
    # resume: a third round continues from run.json, the first five attempts unchanged
    more = orc.run_matryoshka(orc.Config(**{**c.__dict__, "rounds": 3}), orc.ScriptedOrchestrator(), orc.RecipeCoder(),
                              tmp_path, log=lambda *_: 0)
    assert more["round"] == 3 and len(more["attempts"]) == 7 and more["attempts"][:5] == attempts


def test_stand_in_messages_parse_like_llm_messages():
    task = env.load_task(TASK)
    starter = orc.Attempt(0, None, "", [], 0.9, 0.9, "success", dict.fromkeys(orc.SUMMARY_KEYS, "x"),
                          (task.public_dir / "train.py").read_text())
    text = orc.ScriptedOrchestrator().chat(orc.orchestrator_messages(task, [starter], 1, 3, 2)).texts[0]
    calls, finished = orc.parse_decision(text, {0}, 2)
    assert not finished and len(calls) == 2 and calls[0]["instruction"] != calls[1]["instruction"]
    msgs = orc.sub_messages(task, starter, [], calls[0]["instruction"], 3)
    kind, code = orc.parse_coder(orc.RecipeCoder().chat(msgs).texts[0])
    assert kind == "code" and code != starter.code


def tiny_tree():
    """A finished depth-1 tree on TASK: the starter and two scripted decisions of two calls each, the second
    decision's attempts scoring higher (one preference group)."""
    task = env.load_task(TASK)
    starter = orc.starter_attempt(task, cfg())
    prompt = orc.orchestrator_messages(task, [starter], 1, 1, 2)
    orch = orc.ScriptedOrchestrator(0)
    orch.rng.seed("0:0")
    tree = orc.Tree(task.name, True, 1, {0: starter}, [orc.Node(0, None, 0, None, [], "done", prompt, starter.score)])
    for k, text in enumerate(orch.chat(prompt, n=2, temperature=1.0).texts):
        calls, _ = orc.parse_decision(text, {0}, 2)
        node = orc.Node(k + 1, 0, 1, text, [], "done", None, None)
        for c in calls:
            a = orc.Attempt(tree.next_id, 0, c["instruction"], [], starter.score + 0.01 * (k + 1), None, "success",
                            dict(starter.summary, result="public score 0.9, better than parent #0 (0.8)"),
                            starter.code)
            tree.attempts[a.id] = a
            node.calls.append({**c, "attempt": a.id})
            tree.next_id += 1
        node.score = max(tree.attempts[c["attempt"]].score for c in node.calls)
        tree.nodes.append(node)
    return tree


def test_a_from_scratch_ckpt0_imitates_the_decision_format(tmp_path, monkeypatch):
    """Without --model, ckpt-0 is the tiny model after imitation of the scripted decisions (the stand-in for a
    pre-trained model's format): its greedy answers on the tree's prompts parse, imitation.json says so, and the
    ranking loss then writes ckpt-1. The resampled states are renumbered 0, 1, 2, ... with their parents in."""
    tree = tiny_tree()
    for state in orc.resampled_states(tree, 5, orc.random.Random(0)):
        assert [a.id for a in state] == list(range(len(state))) and state[0].parent is None
        assert all(a.parent is not None and a.parent < a.id for a in state[1:])
    shuffled = copy.deepcopy(tree)  # attempts in another order (parallel runs end in any order): the same states
    shuffled.attempts = dict(reversed(list(tree.attempts.items())))
    states = orc.resampled_states(tree, 5, orc.random.Random(0))
    assert orc.resampled_states(shuffled, 5, orc.random.Random(0)) == states
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "tree-0.json").write_text(json.dumps(tree.to_json()))
    monkeypatch.setattr(orc, "IMITATION_RESAMPLED", 2)
    c = cfg(depth=1, iterations=1, tree_tasks=0, imitation_steps=400)
    final = orc.train_loop(c, None, "scripted", orc.RecipeCoder(), tmp_path / "train", log=lambda *_: 0)
    notes = json.loads((tmp_path / "train" / "ckpt-0" / "imitation.json").read_text())
    assert final.name == "ckpt-1" and notes["steps"] == 400 and notes["loss_last_pass"] < notes["loss_first"]
    assert notes["parse_rate_tree_prompts"] >= 2 / 3, notes  # the tree's 3 states (root, 2 leaves): greedy answers
    import model
    lm, tok = model.load(str(tmp_path / "train" / "ckpt-0"))
    text = agent.LocalBackend(lm=lm, tokenizer=tok).chat(tree.nodes[0].prompt, max_tokens=600).texts[0]
    calls, finished = orc.parse_decision(text, {0}, 2)
    assert calls and not finished


def test_training_collects_a_tree_on_other_held_in_tasks_for_ranking_and_imitation(tmp_path, monkeypatch):
    """--tree-tasks: besides --task's tree, each iteration collects a depth-1 tree on held-in tasks of every kind
    (never a held-out task, never --task); their decisions are the imitation's answers on their prompts and their
    groups join the ranking loss (the log counts the trees)."""
    others = orc.other_tasks(TASK, 1)
    assert TASK not in others and all(env.BUILTIN_TASKS[n].split == "held-in" for n in orc.other_tasks(TASK, 9))
    held_in = {(s.kind, s.modality) for s in env.BUILTIN_TASKS.values() if s.split == "held-in"}
    assert {(env.BUILTIN_TASKS[n].kind, env.BUILTIN_TASKS[n].modality) for n in others + [TASK]} == held_in
    assert orc.other_tasks(TASK, 0) == []
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "tree-0.json").write_text(json.dumps(tiny_tree().to_json()))
    monkeypatch.setattr(orc, "other_tasks", lambda task, n: ["wine"][:n])
    monkeypatch.setattr(orc, "IMITATION_RESAMPLED", 4)
    seen, real = [], orc.imitation_examples
    monkeypatch.setattr(orc, "imitation_examples", lambda trees, c: seen.append(real(trees, c)) or seen[-1])
    logs = []
    orc.train_loop(cfg(depth=1, iterations=1, tree_tasks=1, imitation_steps=2), None, "scripted", orc.RecipeCoder(),
                   tmp_path / "train", log=logs.append)
    wine = orc.Tree.load(tmp_path / "train" / "tree-0-wine.json")
    assert wine.task == "wine" and len(wine.nodes) == 3 and max(n.depth for n in wine.nodes) == 1
    own = [e for e in seen[0]
           if e["tree"] and e["known"] == [0] and e["messages"][1]["content"].startswith("Task: wine")]
    assert len(own) == 1 and own[0]["responses"] == list(dict.fromkeys(k.decision for k in wine.children(0)))
    assert any("of 2 tree(s)" in line for line in logs), logs


class SlowSummary:
    """A Sub-Agent backend that thinks for 0.5 s and answers with a summary only."""
    def __init__(self):
        self.usage = agent.Usage()

    def chat(self, messages, **kw):
        time.sleep(0.5)
        return agent.Completion(['```json\n{"approach": "a", "changed": "b", "result": "c", "errors": "none", '
                                 '"next": "d"}\n```'])


class FixedOrchestrator:
    def __init__(self, text):
        self.text, self.usage, self.calls = text, agent.Usage(), 0

    def chat(self, messages, n=1, **kw):
        self.calls += 1
        return agent.Completion([self.text] * n)


def test_tool_calls_of_one_round_run_in_parallel(tmp_path):
    calls = [{"name": "refine", "arguments": {"parent": 0, "instruction": f"idea {i}"}} for i in range(2)]
    orch = FixedOrchestrator(json.dumps({"thought": "two at once", "tool_calls": calls}))
    res = orc.run_matryoshka(cfg(rounds=1, calls=2, workers=2), orch, SlowSummary(), tmp_path, log=lambda *_: 0)
    a1, a2 = res["attempts"][1:]
    assert [a1["instruction"], a2["instruction"]] == ["idea 0", "idea 1"] and a1["status"] == a2["status"] == "no_code"
    assert a1["started"] < a2["ended"] and a2["started"] < a1["ended"]  # the two intervals overlap
    assert len([r for r in res["records"] if r["role"] == "sub-agent"]) == 2


class Crasher:
    """A Sub-Agent backend that always writes a crashing script (and never a summary)."""
    def __init__(self):
        self.usage, self.calls = agent.Usage(), 0
        self.lock = threading.Lock()

    def chat(self, messages, **kw):
        with self.lock:
            self.calls += 1
        return agent.Completion(["Let me try.\n```python\nraise RuntimeError('boom')\n```"])


def test_sub_agent_stops_at_its_iteration_limit():
    task, c = env.load_task(TASK), cfg(sub_iters=3)
    starter = orc.starter_attempt(task, c)
    coder, records = Crasher(), []
    a = orc.refine(task, coder, c, time.time() + 300, records, 1,
                   {"parent": 0, "instruction": "anything", "references": []}, {0: starter}, 1)
    assert a.iterations == 3 and coder.calls == 4  # three executions, then one request for the summary
    assert a.status == "error" and a.score is None and a.private is None
    assert "RuntimeError: boom" in a.summary["errors"] and "no valid submission" in a.summary["result"]
    assert sum("Execution: error" in m["content"] for m in a.messages if m["role"] == "user") == 3
    assert len(records) == 4


def test_orchestrator_reasks_then_wastes_the_round(tmp_path):
    orch = FixedOrchestrator("I would try a random forest.")
    res = orc.run_matryoshka(cfg(rounds=1, max_retries=1), orch, SlowSummary(), tmp_path, log=lambda *_: 0)
    assert orch.calls == 2 and len(res["attempts"]) == 1


def tiny_checkpoint(path):
    import model
    lm, tok = orc.tiny_orchestrator(["#0 starter | score 0.9", '{"tool_calls": []}'], vocab_size=300)
    model.save(lm, tok, str(path))
    return path


def test_a_local_checkpoint_orchestrator_runs_through_the_llm_path(tmp_path):
    """A tiny random model as Orchestrator: unparsable answers are re-asked, the round is wasted, nothing crashes;
    its prompts are counted with its own tokenizer."""
    orch = agent.LocalBackend(str(tiny_checkpoint(tmp_path / "ckpt")))
    res = orc.run_matryoshka(cfg(rounds=1, max_tokens=8, max_retries=1), orch, SlowSummary(), tmp_path,
                             log=lambda *_: 0)
    recs = [r for r in res["records"] if r["role"] == "orchestrator"]
    assert len(res["attempts"]) == 1 and len(recs) == 2 and recs[1]["tokens"] > recs[0]["tokens"]
    assert recs[0]["counter"] == "tokenizer of the local model"
    assert res["token_counter"] == "orchestrator: tokenizer of the local model"  # the sub-agent made no prompt here
    approx = orc.prompt_tokens(orc.orchestrator_messages(env.load_task(TASK), [orc.Attempt(**res["attempts"][0])],
                                                         1, 1, 2))  # chars / 4
    assert recs[0]["tokens"] > 2 * approx  # a 300-token vocabulary is close to one token per byte


def test_online_iteration_with_the_policy_as_collector(tmp_path):
    """collector=policy: the checkpoint samples the tree's decisions; its unparsable ones are leaves with r = -inf
    (all tied: no group), and the next checkpoint is still written."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    c = cfg(depth=1, max_tokens=8, iterations=1)
    final = orc.train_loop(c, str(ckpt), "policy", orc.RecipeCoder(), tmp_path / "train", log=lambda *_: 0)
    tree = json.loads((tmp_path / "train" / "tree-0.json").read_text())
    assert final == tmp_path / "train" / "ckpt-1" and (final / "model.safetensors").exists()
    assert len(tree["nodes"]) == 3 and all(n.get("error") for n in tree["nodes"][1:])
    assert orc.preference_groups(orc.Tree.load(tmp_path / "train" / "tree-0.json")) == []


def test_bf16_checkpoint_trains_fp32_master_weights_and_is_saved_in_bf16(tmp_path, monkeypatch):
    """When the checkpoint is bf16, the orchestrator's master weights are fp32. model.load's default dtype on CUDA is
    the checkpoint's torch_dtype, imitated here on CPU; at lr 1e-5 AdamW's steps are below bf16's resolution, so in
    bf16 weights most of them round away. The trained checkpoint is written back in bf16."""
    import model
    messages = [{"role": "user", "content": "Attempts so far: #0 starter | score 0.8"}]
    win = '{"tool_calls": [{"name": "refine", "arguments": {"parent": 0, "instruction": "use a forest"}}]}'
    lose = '{"tool_calls": [{"name": "finish", "arguments": {"reason": "done"}}]}'
    lm, tok = orc.tiny_orchestrator([messages[0]["content"], win, lose], vocab_size=300)
    model.save(lm, tok, str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    starter = orc.Attempt(0, None, "", [], 0.8, None, "success", {}, "")
    tree = orc.Tree(TASK, True, 1, {0: starter}, [  # a finished tree: train_loop collects nothing
        orc.Node(0, None, 0, None, [], "done", messages, 0.8), orc.Node(1, 0, 1, win, [], "done", None, 0.9),
        orc.Node(2, 0, 1, lose, [], "done", None, None, True)])
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "tree-0.json").write_text(json.dumps(tree.to_json()))

    load = model.load
    monkeypatch.setattr(model, "load", lambda path, device=None, dtype=None, **kw: load(  # CUDA's default, on CPU
        path, device, dtype or json.loads((Path(path) / "config.json").read_text())["torch_dtype"], **kw))
    trained, before, dtypes = [], [], set()

    class SpyAdamW(torch.optim.AdamW):
        def __init__(self, params, **kw):
            trained.extend(params)
            before.extend(p.detach().float().clone() for p in trained)
            super().__init__(trained, **kw)

        def step(self, closure=None):
            dtypes.update(p.dtype for g in self.param_groups for p in g["params"] if p.requires_grad)
            return super().step(closure)
    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    c = cfg(depth=1, iterations=1, epochs=4)  # the config's lr (1e-5): 4 steps on the one preference group
    final = orc.train_loop(c, str(tmp_path / "ckpt"), "scripted", orc.RecipeCoder(), tmp_path / "train",
                           log=lambda *_: 0)
    # (a) the policy's trainable parameters are fp32 master weights while it trains
    assert len(trained) == len(list(lm.parameters()))
    assert dtypes == {torch.float32}, dtypes
    # (c) the updates land: nearly every element of every weight matrix moved (bf16 weights: about 15%)
    moved = [(p.detach().float() != b).float().mean().item() for p, b in zip(trained, before) if p.dim() == 2]
    assert moved and min(moved) > 0.9, moved
    # (b) the trained checkpoint is stored in the dtype the run started from
    assert json.loads((final / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in model.read_safetensors(str(final / "model.safetensors")).values()} == {torch.bfloat16}


def test_a_large_orchestrator_trains_lora_adapters_against_its_own_base(tmp_path, monkeypatch):
    """A 7B Orchestrator's fp32 weights and AdamW alone would take 112 GB: past orc.LARGE parameters (lowered here so
    the tiny model counts) it trains rank-16 adapters over its frozen base, the base with its adapters off is the
    reference (no second copy), blocks are recomputed in backward, and the saved checkpoint has the adapters merged."""
    import model
    messages = [{"role": "user", "content": "Attempts so far: #0 starter | score 0.8"}]
    win = '{"tool_calls": [{"name": "refine", "arguments": {"parent": 0, "instruction": "use a forest"}}]}'
    lose = '{"tool_calls": [{"name": "finish", "arguments": {"reason": "done"}}]}'
    lm, tok = orc.tiny_orchestrator([messages[0]["content"], win, lose], vocab_size=300)
    model.save(lm, tok, str(tmp_path / "ckpt"))
    monkeypatch.setattr(orc, "LARGE", 1)
    policy, tok, ref = orc.load_for_training(tmp_path / "ckpt", orc.Config())
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert ref is None and trainable and all(n.endswith((".A", ".B")) for n in trainable)
    assert all("forward" in vars(block) for block in policy.model.layers)  # sft.py's checkpointing wraps them
    assert not any(p.requires_grad for n, p in policy.named_parameters() if n not in trainable)
    group = {"messages": messages, "responses": [win, lose], "R": [1.0, 0.0]}
    stats = orc.train_orchestrator(policy, None, tok, [group], orc.Config(lr=1e-2, beta=0.1, epochs=3),
                                   log=lambda *_: 0)
    assert stats["loss_first"] == pytest.approx(math.log(2), rel=1e-5)  # B = 0: the policy starts at the reference
    with torch.no_grad():
        after = orc.decision_logprobs(policy, tok, messages, [win, lose], 4096)
        model.set_lora(policy, False)
        base = orc.decision_logprobs(policy, tok, messages, [win, lose], 4096)
        model.set_lora(policy, True)
    ratio = after - base
    assert ratio[0] - ratio[1] > 0  # the winner's log-ratio rose against the loser's
    orc.save_checkpoint(policy, tok, tmp_path / "next")
    merged, _ = model.load(str(tmp_path / "next"), "cpu")
    with torch.no_grad():
        torch.testing.assert_close(orc.decision_logprobs(merged, tok, messages, [win, lose], 4096), after,
                                   rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------------- trees

class Counting(orc.RecipeCoder):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def chat(self, messages, **kw):
        self.calls += 1
        return super().chat(messages, **kw)


def test_tree_save_and_resume(tmp_path):
    path = tmp_path / "tree.json"
    c = cfg(depth=1, calls=1, sub_iters=1)
    orch = FixedOrchestrator("")
    scripted = orc.ScriptedOrchestrator(seed=1)
    orch.chat = lambda messages, n=1, **kw: (setattr(orch, "calls", orch.calls + 1), scripted.chat(messages, n, **kw))[1]
    tree = orc.collect_tree(c, orch, orc.RecipeCoder(), path, log=lambda *_: 0).to_json()
    assert [n["depth"] for n in tree["nodes"]] == [0, 1, 1] and orch.calls == 1
    assert all(n["status"] == "done" and len(n["calls"]) == 1 for n in tree["nodes"][1:])
    assert json.loads(path.read_text()) == tree
    # an interruption after node 2's decision, before its attempt: resume runs only that attempt
    saved = json.loads(path.read_text())
    lost = saved["nodes"][2]["calls"][0]["attempt"]
    del saved["attempts"][str(lost)]
    saved["nodes"][2]["status"] = "pending"
    path.write_text(json.dumps(saved))
    coder = Counting()
    again = orc.collect_tree(c, orch, coder, path, log=lambda *_: 0).to_json()
    assert coder.calls == 2 and orch.calls == 1  # one Sub-Agent (code, summary), no new decision
    assert again["attempts"][str(lost)]["score"] == tree["attempts"][str(lost)]["score"]
    # deeper: the two existing children keep their decisions, each gets two children
    deeper = orc.collect_tree(orc.Config(**{**c.__dict__, "depth": 2}), orch, orc.RecipeCoder(), path,
                              log=lambda *_: 0).to_json()
    assert [n["depth"] for n in deeper["nodes"]] == [0, 1, 1, 2, 2, 2, 2] and orch.calls == 3
    assert [n["decision"] for n in deeper["nodes"][:3]] == [n["decision"] for n in tree["nodes"]]
    for n in deeper["nodes"][3:]:  # each grandchild's prompt state is its parent's path: the shared prefix
        parent = deeper["nodes"][n["parent"]]
        assert f"#{parent['calls'][0]['attempt']} parent #0" in parent["prompt"][1]["content"]


def test_a_tree_round_trips_through_its_json():
    """Tree -> to_json -> JSON text -> from_json is the same tree: int attempt ids, a pending node (calls not parsed
    yet), a finishing one and an unparsable one (finished and error written only once set)."""
    a = orc.Attempt(0, None, "", [], 0.5, 0.4, "success", dict.fromkeys(orc.SUMMARY_KEYS, "x"), "print(0)\n")
    b = orc.Attempt(1, 0, "use a forest", [], None, None, "error", dict.fromkeys(orc.SUMMARY_KEYS, "y"), "raise\n",
                    [{"role": "user", "content": "go"}], iterations=1, round=1)
    prompt = [{"role": "user", "content": "state 0"}]
    tree = orc.Tree(TASK, False, 2, {0: a, 1: b}, [
        orc.Node(0, None, 0, None, [], "done", prompt, 0.5),
        orc.Node(1, 0, 1, "d1", [{"parent": 0, "instruction": "use a forest", "references": [], "attempt": 1}],
                 "done", None, None, finished=False),
        orc.Node(2, 0, 1, "d2", [], "done", None, None, error="no JSON"),
        orc.Node(3, 0, 1, "d3", None, "pending", None, None)])
    obj = json.loads(json.dumps(tree.to_json()))
    assert sorted(obj["attempts"]) == ["0", "1"] and "finished" not in obj["nodes"][0]
    assert obj["nodes"][1]["finished"] is False and "error" not in obj["nodes"][1] and obj["nodes"][2]["error"]
    again = orc.Tree.from_json(obj)
    assert again == tree and isinstance(again.attempts[1], orc.Attempt) and isinstance(again.nodes[3], orc.Node)
    assert [n.id for n in again.children(0)] == [1, 2, 3] and [x.id for x in again.state(1)] == [0, 1]


OLD_TREE = {  # a finished depth-1 tree.json as orchestrator.py wrote it when trees were dicts
    "task": TASK, "higher_is_better": True, "next_id": 2,
    "attempts": {str(i): {"id": i, "parent": None if i == 0 else 0, "instruction": "" if i == 0 else "use a forest",
                          "references": [], "score": 0.98 + 0.01 * i, "private": 0.97, "status": "success",
                          "summary": dict.fromkeys(orc.SUMMARY_KEYS, "s"), "code": "print(1)\n",
                          "messages": [] if i == 0 else [{"role": "user", "content": "go"}],
                          "iterations": i, "round": i, "started": 1.0, "ended": 2.0, "submission": ""}
                 for i in (0, 1)},
    "nodes": [{"id": 0, "parent": None, "depth": 0, "decision": None, "calls": [], "status": "done",
               "prompt": [{"role": "user", "content": "state 0"}], "score": 0.98},
              {"id": 1, "parent": 0, "depth": 1, "decision": "d1",
               "calls": [{"parent": 0, "instruction": "use a forest", "references": [], "attempt": 1}],
               "status": "done", "prompt": None, "score": 0.99, "finished": False},
              {"id": 2, "parent": 0, "depth": 1, "decision": "no json", "calls": [], "status": "done", "prompt": None,
               "score": None, "error": "no JSON object in the answer"}]}


def test_a_tree_json_of_the_dict_trees_still_loads(tmp_path, capsys):
    """The same JSON back, key for key; `orchestrator.py tree` resumes it (nothing left to run at depth 1); a node
    that is not one is a one-line error naming the file."""
    tree = orc.Tree.from_json(copy.deepcopy(OLD_TREE))
    assert json.dumps(tree.to_json()) == json.dumps(OLD_TREE)
    (tmp_path / "tree.json").write_text(json.dumps(OLD_TREE))
    orc.main(["tree", "--task", TASK, "--depth", "1", "--out", str(tmp_path)])
    assert "1 preference group(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "tree.json").read_text()) == OLD_TREE
    assert [json.loads(r) for r in (tmp_path / "sft.jsonl").read_text().splitlines()] == [
        {"messages": [{"role": "user", "content": "go"}]}]
    bad = copy.deepcopy(OLD_TREE)
    del bad["nodes"][1]["depth"]
    (tmp_path / "tree.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="tree.json: not a run or tree of orchestrator.py") as e:
        orc.Tree.load(tmp_path / "tree.json")
    assert len(str(e.value).splitlines()) == 1


SLOW_SANDBOX = ("import sys, time, env, orchestrator; run = env.run_script; "  # each script run 0.3 s longer
                "env.run_script = lambda *a, **k: (time.sleep(0.3), run(*a, **k))[1]; orchestrator.main(sys.argv[1:])")


def test_killed_tree_resumes_to_the_uninterrupted_tree(tmp_path):
    """SIGKILL of the process group after the root's decisions, before its children's; the same command again
    makes the tree the uninterrupted run made (each decision is sampled from (seed, node), not one running stream)."""
    argv = ["tree", "--task", TASK, "--depth", "2", "--sub-iters", "1", "--calls", "1"]
    run = lambda *extra: subprocess.run([sys.executable, "orchestrator.py", *argv, *extra], cwd=env.ROOT,  # noqa
                                        capture_output=True, text=True)
    assert run("--out", str(tmp_path / "whole")).returncode == 0
    p = subprocess.Popen([sys.executable, "-c", SLOW_SANDBOX, *argv, "--out", str(tmp_path / "killed")], cwd=env.ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    path, nodes, deadline = tmp_path / "killed" / "tree.json", 0, time.time() + 60
    while nodes < 3 and time.time() < deadline:
        try:
            nodes = len(json.loads(path.read_text())["nodes"])
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert 3 <= nodes < 7  # killed between the root's decisions and its children's
    r = run("--out", str(tmp_path / "killed"))
    assert r.returncode == 0, r.stderr
    whole, resumed = (json.loads((tmp_path / d / "tree.json").read_text()) for d in ("whole", "killed"))
    shape = lambda t: [(n["parent"], n["decision"], n["score"]) for n in t["nodes"]]  # noqa: E731
    assert len(whole["nodes"]) == 7 and shape(resumed) == shape(whole)


def test_a_second_command_on_an_out_in_use_is_refused(tmp_path):
    with agent.claim_folder(tmp_path):
        r = subprocess.run([sys.executable, "orchestrator.py", "tree", "--task", TASK, "--out", str(tmp_path)],
                           cwd=env.ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "in use" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_kill_between_the_checkpoint_renames_is_recovered(tmp_path):
    new, old = tmp_path / "ckpt-1.tmp", tmp_path / "ckpt-1.old"  # what model.save_checkpoint_folder writes
    for folder, text in ((new, "half-written"), (old, "complete")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    def resume():  # train_loop, iteration 0 done
        return orc.train_loop(cfg(), None, "scripted", orc.RecipeCoder(), tmp_path, log=lambda *_: 0)
    assert resume() == tmp_path / "ckpt-1"  # killed after ckpt-1 went aside: the old one comes back
    assert (tmp_path / "ckpt-1" / "config.json").read_text() == "complete" and not new.exists() and not old.exists()
    new.mkdir()
    (new / "config.json").write_text("newer")
    agent.swap_folder(new, tmp_path / "ckpt-1")
    assert (tmp_path / "ckpt-1" / "config.json").read_text() == "newer"
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1", "sft.jsonl"]
    old.mkdir()  # killed after the new one came in, before the old one was deleted
    resume()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1", "sft.jsonl"]


# ------------------------------------------------------------------------------------------- small pieces

def test_clip_keeps_first_and_last_tokens():
    text = "".join(f"line {i}\n" for i in range(5000))  # ~ 39k characters, ~ 9.7k approximate tokens
    clipped = orc.clip_tokens(text, 5000)
    assert clipped.startswith(text[:10000]) and clipped.endswith(text[-10000:]) and "tokens cut" in clipped
    assert orc.clip_tokens("short", 5000) == "short"
    _, tok = orc.tiny_orchestrator([text[:3000]], vocab_size=300)
    clipped = orc.clip_tokens(text, 200, tok)
    head, tail = clipped.split("\n[... ")[0], clipped.rsplit("tokens cut ...]\n", 1)[1]
    assert len(tok.encode(head)) <= 101 and len(tok.encode(tail)) <= 101 and text.startswith(head)


def test_feedback_clips_the_whole_log_to_5k_tokens():
    task = env.load_task(TASK)
    run = env.run_script(task, "for i in range(8000):\n    print(f'line {i:05d}')\n", timeout=60)
    assert len(run.output) < 10000  # env.py returns 4 KB of each end only
    text = orc.feedback(run, task, 5000)
    assert "line 00000" in text and "line 07999" in text and "tokens cut" in text
    assert "line 00800" in text and "line 04000" not in text  # 2.5k tokens ~ 10k characters ~ 830 lines at each end
    assert orc.count_tokens(text) < 5200


def test_parse_decision():
    ok = {"tool_calls": [{"name": "refine", "arguments": json.dumps({"parent": 1, "instruction": "x",
                                                                     "references": [0, 1, 7]})}] * 3}
    calls, finished = orc.parse_decision("```json\n" + json.dumps(ok) + "\n```", {0, 1}, 2)
    assert not finished and calls == [{"parent": 1, "instruction": "x", "references": [0]}] * 2
    assert orc.parse_decision('{"tool_calls": [{"name": "finish", "arguments": {}}]}', {0}, 2) == ([], True)
    for bad, why in [("no json", "no JSON"), ('{"tool_calls": []}', "non-empty"),
                     ('{"tool_calls": [{"name": "refine", "arguments": {"parent": 5, "instruction": "x"}}]}', "#5"),
                     ('{"tool_calls": [{"name": "refine", "arguments": {"parent": 0}}]}', "instruction"),
                     ('{"tool_calls": [{"name": "delete", "arguments": {}}]}', "unknown tool")]:
        with pytest.raises(orc.ParseError, match=why):
            orc.parse_decision(bad, {0}, 2)


def test_sft_rows_keep_improving_attempts_only():
    attempts = [{"id": 0, "parent": None, "score": 0.5, "messages": []},
                {"id": 1, "parent": 0, "score": 0.4, "messages": [{"role": "user", "content": "1"}]},
                {"id": 2, "parent": 0, "score": 0.6, "messages": [{"role": "user", "content": "2"}]},
                {"id": 3, "parent": 2, "score": None, "messages": [{"role": "user", "content": "3"}]}]
    assert orc.sft_rows(attempts, True) == [{"messages": [{"role": "user", "content": "2"}]}]
    assert orc.sft_rows(attempts, False) == [{"messages": [{"role": "user", "content": "1"}]}]


def test_cli_usage_errors_exit_2(capsys):
    for argv in (["run", "--task", "no-such-task"], ["train", "--collector", "policy"],
                 ["train", "--model", "/no/such/folder"], ["run", "--rounds", "x"]):
        with pytest.raises(SystemExit) as e:
            orc.main(argv)
        assert e.value.code == 2
    assert capsys.readouterr().err.count("error:") == 4


@pytest.mark.slow
def test_cli_train_offline_end_to_end(tmp_path):
    import model
    orc.main(["train", "--task", TASK, "--depth", "1", "--sub-iters", "1", "--out", str(tmp_path), "--lr", "1e-3",
              "--imitation-steps", "20", "--tree-tasks", "0"])
    lm, tok = model.load(str(tmp_path / "train" / "ckpt-1"))
    assert lm.config.num_hidden_layers == 2 and len(tok) > 256
    tree = json.loads((tmp_path / "train" / "tree-0.json").read_text())
    assert len(tree["nodes"]) == 3 and (tmp_path / "train" / "sft.jsonl").exists()
    rows = [json.loads(line) for line in (tmp_path / "train" / "sft.jsonl").read_text().splitlines()]
    assert all(r["messages"][0]["role"] == "system" and r["messages"][-1]["role"] == "assistant" for r in rows)


def test_cli_run_writes_the_best_script_and_its_submission(tmp_path, capsys):
    orc.main(["run", "--task", TASK, "--rounds", "1", "--sub-iters", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "run.json").read_text())
    assert (tmp_path / "best_train.py").read_text() == res["best"]["code"]
    g = env.grade(TASK, tmp_path / "best_submission.csv")
    assert g.valid and (g.public, g.private) == pytest.approx((res["best"]["public"], res["best"]["private"]))
    assert "best attempt #" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["run", "--rounds", "0"], ["run", "--calls", "-2"], ["tree", "--depth", "-1"],
                                  ["run", "--time-limit", "nan"], ["train", "--lr", "0"],
                                  ["train", "--imitation-steps", "-1"], ["train", "--imitation-lr", "0"]])
def test_bad_numbers_are_one_line_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        orc.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "error" in err


@pytest.mark.parametrize("argv", [["run", "--orchestrator", "{m}"], ["tree", "--sub-agent", "{m}"],
                                  ["run", "--monolithic", "--sub-agent", "{m}"], ["train", "--model", "{m}"]])
def test_a_bad_model_name_is_one_line_exit_2_and_leaves_no_lock(argv, tmp_path, no_endpoint):
    """Issue 43: was a BackendError traceback, exit 1, and a .lock left under --out."""
    from conftest import assert_bad_models_refused
    assert_bad_models_refused(orc.main, [*argv, "--task", "wine", "--out", "{d}/o"], tmp_path, no_endpoint)


def test_an_endpoint_name_goes_to_the_role_s_endpoint(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    b = orc.make_backend("Qwen/Qwen2.5-0.5B-Instruct", None, "orchestrator")  # not a checkpoint: an endpoint is set
    assert isinstance(b, agent.OpenAIBackend) and b.base_url == "http://127.0.0.1:9/v1"
    assert isinstance(orc.make_backend("scripted", None, "orchestrator"), orc.ScriptedOrchestrator)
