"""Tests for ppo.py: the PPO arithmetic against hand computations, the rollout plumbing, and a tiny end-to-end run.

- GAE (gamma 1, lambda 0.95) equals a hand-worked example and a direct loop, padding included; across the steps of an
  episode (--episodic) it equals GAE over the concatenated steps;
- the per-token KL penalty and the score on the last token match a hand computation; the KL is exactly zero when the
  policy and the reference are the same model;
- the clipped policy loss, clip fraction and clipped value loss equal hand-computed numbers; whitening gives zero mean
  and unit variance over valid tokens only;
- log-probs recomputed by a forward pass under logits / T equal generate's for left-padded prompts of different
  lengths (and differ under another temperature, so the check can fail);
- the ratio is 1 on the first minibatch of the first epoch, and not 1 afterwards;
- executing the expert's own response from a restored state reproduces the expert's outcome and reward;
- --episodic: each episode's prompts carry its history, and each row links to its episode's next step;
- LoRA adapters start at the base model, switch off to the reference, and save merged into a loadable folder;
- the reward flags reach the rollouts' rewards (--no-format-term: an unparsable response earns 0, not -1), in both
  step-wise and episode-wise rollouts; a resume with other reward flags than the checkpoint's exits 2 with one line;
- `ppo.py` as a subprocess: one iteration on a tiny model and a states pool built here from one built-in task writes a
  checkpoint model.py loads, a critic state and a log line (with the reward config, also in progress.json); a second
  call resumes, one with other reward flags stops; usage errors exit 2.
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import agent
import collect
import env
import model
import ppo
import sft
from reward import RewardConfig

ROOT = Path(ppo.__file__).resolve().parent


# ------------------------------------------------------------------------------------------------ GAE

def direct_gae(rewards, values, gamma, lam):
    """The textbook recursion on one unpadded sequence, in plain Python."""
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(values) else 0.0
        last = rewards[t] + gamma * next_v - values[t] + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_hand_worked_example_with_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.3, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9 and the 7 sit past the second response's end
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 0.95)
    # row 0: A2 = 1 - 0.4 = 0.6; A1 = (0 + 0.4 - 0.2) + 0.95 * 0.6 = 0.77; A0 = (0.2 - 0.5) + 0.95 * 0.77 = 0.4315
    # row 1: A1 = -1 - 0.3 = -1.3; A0 = (0.5 + 0.3 - 0.1) + 0.95 * -1.3 = -0.535
    want = torch.tensor([[0.4315, 0.77, 0.6], [-0.535, -1.3, 0.0]])
    assert torch.allclose(adv, want, atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.9315, 0.97, 1.0], [-0.435, -1.0, 0.0]]), atol=1e-6)


def test_gae_equals_direct_loop_on_random_rows():
    g = torch.Generator().manual_seed(0)
    B, R = 5, 9
    rewards, values = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    lengths = [9, 1, 4, 7, 3]
    mask = torch.tensor([[1.0] * n + [0.0] * (R - n) for n in lengths])
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5)):
        adv, _ = ppo.gae(rewards, values, mask, gamma, lam)
        for b, n in enumerate(lengths):
            want = direct_gae(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
            assert torch.allclose(adv[b, :n], torch.tensor(want), atol=1e-5)
            assert not adv[b, n:].any()


def test_episodic_gae_runs_across_the_steps_of_an_episode():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    nxt = [2, -1, -1]  # row 0 is step 0 of an episode whose step 1 is row 2; row 1 is a one-step episode
    adv, _ = ppo.gae_rows(rewards, values, mask, nxt, 1.0, 0.95)
    joined_r = rewards[0, :2].tolist() + rewards[2, :3].tolist()
    joined_v = values[0, :2].tolist() + values[2, :3].tolist()
    want = direct_gae(joined_r, joined_v, 1.0, 0.95)
    assert torch.allclose(torch.cat([adv[0, :2], adv[2, :3]]), torch.tensor(want), atol=1e-5)
    assert torch.allclose(adv[1], torch.tensor(direct_gae(rewards[1].tolist(), values[1].tolist(), 1.0, 0.95)),
                          atol=1e-5)
    alone, _ = ppo.gae_rows(rewards, values, mask, [-1, -1, -1], 1.0, 0.95)
    assert not torch.allclose(alone[0], adv[0])  # the bootstrap from the next step matters


# ------------------------------------------------------------------------------------------ rewards and losses

def test_token_rewards_kl_penalty_and_score_on_last_token():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards, kl = ppo.token_rewards(torch.tensor([1.0]), logprobs, ref, mask, 0.1)
    assert torch.allclose(kl, torch.tensor([[0.5, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.0, 0.0]]))  # -0.1 * 0.5; the score on token 2 of 2


def test_policy_and_value_losses_equal_hand_computed_numbers():
    old = torch.zeros(2, 3)
    new = torch.tensor([[math.log(1.5), math.log(0.5), 0.3], [math.log(1.1), 0.0, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 5.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, clipfrac, ratio = ppo.policy_loss(new, old, adv, mask, 0.2)
    # ratio 1.5, A=1: max(-1.5, -1.2) = -1.2 | ratio 0.5, A=-2: max(1.0, 1.6) = 1.6 | ratio 1.1, A=2: -2.2
    assert float(loss) == pytest.approx((-1.2 + 1.6 - 2.2) / 3, abs=1e-6)
    assert float(clipfrac) == pytest.approx(2 / 3)
    assert float(ratio[0, 0]) == pytest.approx(1.5)
    values, old_values = torch.tensor([[1.0, 0.6]]), torch.tensor([[0.5, 0.5]])
    returns, vmask = torch.tensor([[2.0, 0.0]]), torch.ones(1, 2)
    vf = ppo.value_loss(values, old_values, returns, vmask, 0.2)
    # token 1: V_clip = 0.7; max((1 - 2)^2, (0.7 - 2)^2) = 1.69 -> 0.845; token 2: V_clip = 0.6 -> 0.5 * 0.36 = 0.18
    assert float(vf) == pytest.approx((0.845 + 0.18) / 2, abs=1e-6)
    assert float(ppo.value_loss(values, old_values, returns, vmask, 10.0)) == pytest.approx((0.5 + 0.18) / 2)


def test_group_advantages_are_each_score_against_the_other_samples_of_its_state():
    scores = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.5, 0.5])  # two states, n = 3 samples each
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    kl = torch.tensor([[0.0, 0.0], [1.5, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]) * mask
    adv = ppo.group_advantages(scores, kl, mask, 3, 2.0)
    # state 1: sequence scores 1, 0 - 2 * 1.5 = -3, -1 -> 1 - (-3 - 1) / 2 = 3, -3 - (1 - 1) / 2 = -3, -1 - (1 - 3) / 2 = 0
    assert torch.equal(adv[:3], torch.tensor([[3.0, 3.0], [-3.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(adv[3:], torch.zeros(3, 2))  # equal scores: no signal, whatever the baseline


def test_episode_group_advantages_are_returns_to_go_against_the_other_episodes_of_the_start():
    # start 1: episode A two steps (scores 0.5, 1.0), episode B one step (-1); start 2: C and D one step each (0, 0)
    # rows step-major: A0, B0, C0, D0, then A1; nxt links A0 -> A1
    scores, nxt = torch.tensor([0.5, -1.0, 0.0, 0.0, 1.0]), [4, -1, -1, -1, -1]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    kl = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.25, 0.25], [0.0, 0.0], [0.0, 0.0]]) * mask
    adv = ppo.episode_group_advantages(scores, kl, mask, nxt, 2, 2.0)
    # A's return-to-go 1.5 at step 0 and 1.0 at step 1, B's -1 and then 0 (ended): A0 1.5 - (-1) = 2.5,
    # B0 -1 - 1.5 = -2.5, A1 1.0 - 0 = 1.0; C scores 0 - 2 * 0.5 = -1 against D's 0: -1 and +1
    assert torch.equal(adv, torch.tensor([[2.5, 2.5], [-2.5, 0.0], [-1.0, -1.0], [1.0, 1.0], [1.0, 0.0]]))
    # one step per episode: the same as the step-wise group baseline over the episodes of a start
    one = ppo.episode_group_advantages(scores[:4], kl[:4], mask[:4], [-1] * 4, 2, 2.0)
    assert torch.equal(one, ppo.group_advantages(scores[:4], kl[:4], mask[:4], 2, 2.0))


def test_whiten_over_valid_tokens_only():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = ppo.whiten(x, mask)
    valid = w[mask.bool()]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(valid.std()) == pytest.approx(1.0, abs=1e-4)  # unbiased, as masked_whiten
    assert w[1, 1] == 0 and w[1, 2] == 0
    assert float(w[0, 0]) == pytest.approx((1 - 2.5) / math.sqrt(5 / 3), abs=1e-4)


# ------------------------------------------------------------------------------------------ the tiny model

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = model.train_tokenizer(["Thought: list the files.\nAction: List Files\nAction Input: {}"] * 4, 300)
    lm = model.Qwen(model.tiny_config(vocab_size=len(tok))).eval()
    return lm, tok


def rollout(lm, temperature=0.7, seed=0):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # different lengths: left padding
    g = torch.Generator().manual_seed(seed)
    gen = lm.generate(prompts, max_new_tokens=6, temperature=temperature, generator=g, stop_token_ids=[3])
    return prompts, gen


def test_recomputed_logprobs_equal_generation_logprobs(tiny):
    lm, _ = tiny
    prompts, gen = rollout(lm, temperature=0.7)
    ids, lengths, mask, starts = ppo.make_batch(prompts, gen.tokens, 0, "cpu")
    with torch.no_grad():
        lp = model.response_logprobs(lm, ids, lengths, starts, 0.7, lm.sample_vocab_size)
        other = model.response_logprobs(lm, ids, lengths, starts, 1.0, lm.sample_vocab_size)
    for b, want in enumerate(gen.logprobs):
        assert torch.allclose(lp[b, :len(want)], torch.tensor(want), atol=1e-5)
        assert not torch.allclose(other[b, :len(want)], torch.tensor(want), atol=1e-3)
    assert mask.sum(1).tolist() == [len(t) for t in gen.tokens]


def test_rollouts_decode_with_one_thread_on_cpu_and_give_the_threads_back(tiny, monkeypatch):
    lm, tok = tiny
    real, seen, before = lm.generate, [], torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def spy(*a, **k):
            seen.append(torch.get_num_threads())
            if len(seen) == 2:
                raise RuntimeError("boom")
            return real(*a, **k)
        monkeypatch.setattr(lm, "generate", spy)
        msgs = [[{"role": "user", "content": "list the files"}]]
        cfg = ppo.Config(max_new_tokens=4)
        out = ppo.generate(lm, tok, msgs, cfg, torch.device("cpu"), seeds=[0], n=2)
        assert len(out[1]) == 2 and torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"):
            ppo.generate(lm, tok, msgs, cfg, torch.device("cpu"), seeds=[0])
        assert seen == [1, 1] and torch.get_num_threads() == 2  # restored after an error too
    finally:
        torch.set_num_threads(before)


def test_a_prompt_with_its_samples_in_one_row_scores_as_separate_rows(tiny):
    """make_batch(group=n) puts a prompt once and its n responses after it (each attending to the prompt and to
    itself only): log-probs, values and an update equal those of n separate rows prompt + response."""
    lm, _ = tiny
    prompts = [[5, 6, 7, 8, 9, 10, 11]] * 3 + [[12, 13]] * 3
    gen = lm.generate(prompts, max_new_tokens=6, temperature=0.7, generator=torch.Generator().manual_seed(3))
    tokens = gen.tokens[:4] + [[]] + gen.tokens[5:]  # an empty response in the middle of a row
    cfg, dev = ppo.Config(micro_batch=2, num_minibatches=1), torch.device("cpu")
    torch.manual_seed(0)
    critic = ppo.Critic(copy.deepcopy(lm))
    out, nets = {}, {}
    for group in (1, 3):
        ids, lengths, mask, starts = ppo.make_batch(prompts, tokens, 0, "cpu", group)
        assert ids.shape[0] == 6 // group
        actor, crit = ppo.Actor(copy.deepcopy(lm), 0.7), copy.deepcopy(critic)
        lp, ref_lp, values = (x * mask for x in ppo.forward_scores(actor, crit, actor, ids, lengths, starts,
                                                                   mask.shape[1], cfg, dev))
        adv = torch.linspace(-1, 1, 6)[:, None] * mask
        data = dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=lp, values=values,
                    advantages=adv, returns=adv, group=3)  # minibatches by state in both layouts
        opt_a, opt_c = (torch.optim.SGD(n.parameters(), lr=0.1) for n in (actor, crit))  # steps = gradients
        ppo.ppo_update(actor, crit, opt_a, opt_c, data, cfg, dev, torch.Generator().manual_seed(0))
        out[group], nets[group] = (lp, values, mask), (actor, crit)
    for b, want in enumerate(gen.logprobs[:4] + [[]] + gen.logprobs[5:]):
        assert torch.allclose(out[3][0][b, :len(want)], torch.tensor(want), atol=1e-5)
    for one, packed in zip(out[1], out[3]):
        assert torch.allclose(one, packed, atol=1e-5)
    for one, packed in zip(nets[1], nets[3]):
        for (name, p), q in zip(one.named_parameters(), packed.parameters()):
            assert torch.allclose(p, q, atol=1e-6), name
    assert any(not torch.equal(p, q) for p, q in zip(nets[1][0].parameters(), lm.parameters()))  # it did move
    with pytest.raises(ValueError, match="runs of 2 equal prompts"):
        ppo.make_batch(prompts[2:], tokens[2:], 0, "cpu", 2)


def test_kl_is_zero_when_policy_equals_reference(tiny):
    lm, _ = tiny
    prompts, gen = rollout(lm, seed=1)
    ids, lengths, mask, starts = ppo.make_batch(prompts, gen.tokens, 0, "cpu")
    critic = ppo.Critic(copy.deepcopy(lm))
    cfg = ppo.Config(micro_batch=2, temperature=0.7)
    lp, ref_lp, values = ppo.forward_scores(ppo.Actor(lm, 0.7), critic, ppo.Actor(copy.deepcopy(lm), 0.7), ids,
                                            lengths, starts, mask.shape[1], cfg, torch.device("cpu"))
    _, kl = ppo.token_rewards(torch.zeros(3), lp * mask, ref_lp * mask, mask, 0.05)
    assert (kl == 0).all() and (lp * mask).abs().sum() > 0 and values.shape == mask.shape


def test_kept_generation_logprobs_skip_the_actors_forward(tiny):
    """ppo.py on CPU passes the generation's log-probs as the old ones: the actor is not run, the reference and the
    critic are, and what comes back equals the full forward within 1e-5."""
    lm, _ = tiny
    prompts, gen = rollout(lm, seed=3, temperature=0.7)
    ids, lengths, mask, starts = ppo.make_batch(prompts, gen.tokens, 0, "cpu")
    kept = torch.zeros(mask.shape)
    for row, lps in enumerate(gen.logprobs):
        kept[row, :len(lps)] = torch.tensor(lps)
    actor, calls = ppo.Actor(lm, 0.7), []
    actor.register_forward_hook(lambda *_: calls.append(1))
    ref, critic, cfg = ppo.Actor(copy.deepcopy(lm), 0.7), ppo.Critic(copy.deepcopy(lm)), ppo.Config(micro_batch=2)
    full = ppo.forward_scores(actor, critic, ref, ids, lengths, starts, mask.shape[1], cfg, torch.device("cpu"))
    n = len(calls)
    assert n > 0
    reused = ppo.forward_scores(actor, critic, ref, ids, lengths, starts, mask.shape[1], cfg, torch.device("cpu"),
                                logprobs=kept)
    assert len(calls) == n and torch.equal(reused[0], kept)
    torch.testing.assert_close(reused[0] * mask, full[0] * mask, rtol=0, atol=1e-5)
    for a, b in zip(reused[1:], full[1:]):
        assert torch.equal(a, b)


def test_ratio_is_one_on_the_first_minibatch_only(tiny):
    lm, _ = tiny
    cfg = ppo.Config(micro_batch=2, num_minibatches=3, update_epochs=2, actor_lr=1e-2, critic_lr=1e-2)
    actor, ref = ppo.Actor(copy.deepcopy(lm), cfg.temperature), ppo.Actor(copy.deepcopy(lm), cfg.temperature)
    critic = ppo.Critic(copy.deepcopy(lm))
    prompts, gen = rollout(actor.lm, seed=2)
    ids, lengths, mask, starts = ppo.make_batch(prompts * 2, gen.tokens * 2, 0, "cpu")
    dev = torch.device("cpu")
    scores = ppo.forward_scores(actor, critic, ref, ids, lengths, starts, mask.shape[1], cfg, dev)
    lp, ref_lp, values = (x * mask for x in scores)
    rewards, _ = ppo.token_rewards(torch.tensor([1.0, -1.0, 0.0] * 2), lp, ref_lp, mask, cfg.kl_coef)
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 0.95)
    data = dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=lp, values=values,
                advantages=ppo.whiten(adv, mask), returns=ret)
    opt_a = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
    stats = ppo.ppo_update(actor, critic, opt_a, opt_c, data, cfg, dev, torch.Generator().manual_seed(0))
    assert stats["ratio_first_minibatch_max_dev"] < 1e-5
    assert stats["approx_kl"] > 0  # later minibatches see a moved policy: the ratio is not 1 there
    with torch.no_grad():
        after = actor(ids, lengths, starts)
    assert ((after - lp).abs() * mask).max() > 1e-3


@pytest.mark.parametrize("target_kl", [0.0, 1e-6])
def test_target_kl_stops_the_actor_once_it_has_moved_and_the_critic_goes_on(tiny, target_kl):
    """6 minibatch steps (3 minibatches x 2 epochs) at lr 1e-2: without a target the actor takes all 6; with a tiny
    target it takes the first (its KL is 0: nothing has moved yet) and stops at the second. The critic takes all 6."""
    lm, _ = tiny
    cfg = ppo.Config(micro_batch=2, num_minibatches=3, update_epochs=2, target_kl=target_kl)
    actor, ref = ppo.Actor(copy.deepcopy(lm), cfg.temperature), ppo.Actor(copy.deepcopy(lm), cfg.temperature)
    critic = ppo.Critic(copy.deepcopy(lm))
    prompts, gen = rollout(actor.lm, seed=2)
    ids, lengths, mask, starts = ppo.make_batch(prompts * 2, gen.tokens * 2, 0, "cpu")
    dev = torch.device("cpu")
    lp, ref_lp, values = (x * mask for x in ppo.forward_scores(actor, critic, ref, ids, lengths, starts, mask.shape[1],
                                                               cfg, dev))
    rewards, _ = ppo.token_rewards(torch.tensor([1.0, -1.0, 0.0] * 2), lp, ref_lp, mask, cfg.kl_coef)
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 0.95)
    data = dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=lp, values=values,
                advantages=ppo.whiten(adv, mask), returns=ret)
    opt_a, opt_c = torch.optim.AdamW(actor.parameters(), lr=1e-2), torch.optim.AdamW(critic.parameters(), lr=1e-2)
    stats = ppo.ppo_update(actor, critic, opt_a, opt_c, data, cfg, dev, torch.Generator().manual_seed(0))
    assert stats["actor_steps"] == (6 if target_kl == 0 else 1)
    assert opt_c.state[critic.head.weight]["step"] == 6 and opt_a.state[next(actor.parameters())]["step"] == \
        stats["actor_steps"]
    assert all(p.grad is None for p in actor.parameters())  # the skipped steps leave no gradient behind


def test_the_critic_carries_no_lm_head():
    """Issue 44: the critic's untied lm_head was gathered in every critic forward and saved in every trainer state,
    never used; its values come from the hidden states."""
    lm = model.Qwen(model.tiny_config(tie_word_embeddings=False))
    critic = ppo.Critic(lm)
    assert not [n for n, _ in critic.named_parameters() if "lm_head" in n] and critic.backbone.lm_head is None
    assert critic(torch.randint(0, 512, (1, 8)), torch.tensor([8]), torch.tensor([4])).shape == (1, 4)

def test_critic_warmup_leaves_the_actor_and_fits_the_critic(tiny):
    lm, _ = tiny
    cfg = ppo.Config(micro_batch=2, actor_lr=1e-2, critic_lr=1e-2)
    actor, ref = ppo.Actor(copy.deepcopy(lm), cfg.temperature), ppo.Actor(copy.deepcopy(lm), cfg.temperature)
    critic = ppo.Critic(copy.deepcopy(lm))
    prompts, gen = rollout(actor.lm, seed=2)
    ids, lengths, mask, starts = ppo.make_batch(prompts, gen.tokens, 0, "cpu")
    dev = torch.device("cpu")
    lp, ref_lp, values = (x * mask for x in ppo.forward_scores(actor, critic, ref, ids, lengths, starts, mask.shape[1],
                                                               cfg, dev))
    rewards, _ = ppo.token_rewards(torch.tensor([1.0, -1.0, 0.0]), lp, ref_lp, mask, cfg.kl_coef)
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 0.95)
    data = dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=lp, values=values,
                advantages=ppo.whiten(adv, mask), returns=ret)
    before_a, before_c = copy.deepcopy(actor.state_dict()), copy.deepcopy(critic.state_dict())
    opt_a, opt_c = torch.optim.AdamW(actor.parameters(), lr=1e-2), torch.optim.AdamW(critic.parameters(), lr=1e-2)
    ppo.ppo_update(actor, critic, opt_a, opt_c, data, cfg, dev, torch.Generator().manual_seed(0), step_actor=False)
    assert all(torch.equal(v, before_a[k]) for k, v in actor.state_dict().items())  # the policy did not move
    assert all(p.grad is None for p in actor.parameters())  # and no stale gradient waits for the next step
    assert not torch.equal(critic.head.weight, before_c["head.weight"])  # the critic did


def test_group_advantage_update_needs_no_critic_and_moves_each_action_its_way(tiny):
    lm, _ = tiny
    cfg = ppo.Config(micro_batch=2, num_minibatches=1, actor_lr=1e-3, advantage="group", samples_per_state=3)
    actor, ref = ppo.Actor(copy.deepcopy(lm), cfg.temperature), ppo.Actor(copy.deepcopy(lm), cfg.temperature)
    prompts = [[5, 6, 7, 8]] * 3  # one state, three sampled actions
    gen = lm.generate(prompts, max_new_tokens=6, temperature=0.7, generator=torch.Generator().manual_seed(1))
    ids, lengths, mask, starts = ppo.make_batch(prompts, gen.tokens, 0, "cpu")
    dev = torch.device("cpu")
    lp, ref_lp, values = (x * mask for x in ppo.forward_scores(actor, None, ref, ids, lengths, starts, mask.shape[1],
                                                               cfg, dev))
    assert torch.equal(values, torch.zeros_like(values))  # no critic, no values
    _, kl = ppo.token_rewards(torch.zeros(3), lp, ref_lp, mask, cfg.kl_coef)
    adv = ppo.group_advantages(torch.tensor([1.0, -1.0, 0.0]), kl, mask, 3, cfg.kl_coef)
    data = dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=lp, values=values, advantages=adv,
                returns=adv)
    opt_a = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    for _ in range(2):
        ppo.ppo_update(actor, None, opt_a, None, data, cfg, dev, torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = actor(ids, lengths, starts) * mask
    gain = (after - lp).sum(1)  # the change of each action's log-probability
    assert gain[0] > 0 > gain[1]  # the best action became likelier, the worst less likely


def test_tiny_policies_get_their_own_learning_rates_and_pretrained_ones_the_papers():
    cfg = ppo.Config()
    tiny, big = ppo.resolve_defaults(cfg, 700_000), ppo.resolve_defaults(cfg, 7_615_616_512)
    assert (big.actor_lr, big.critic_lr, big.critic_warmup) == (1e-6, 1e-5, 0)  # ML-Agent, "Training"
    assert (big.advantage, big.samples_per_state) == ("gae", 1)  # the paper's PPO: a critic, one action per state
    assert (tiny.actor_lr, tiny.critic_lr) == (ppo.TINY["actor_lr"], ppo.TINY["critic_lr"])
    assert (tiny.advantage, tiny.samples_per_state, tiny.critic_warmup) == ("group", ppo.GROUP_SAMPLES, 0)
    assert ppo.resolve_defaults(ppo.Config(actor_lr=5e-5), 700_000).actor_lr == 5e-5  # a flag always wins
    # the tiny model with the critic: its warm-up comes back; one sample per state keeps the critic, episodes do not
    gae = ppo.resolve_defaults(ppo.Config(advantage="gae"), 700_000)
    assert (gae.samples_per_state, gae.critic_warmup) == (1, ppo.TINY["critic_warmup"])
    assert ppo.resolve_defaults(ppo.Config(samples_per_state=1), 700_000).advantage == "gae"
    episodic = ppo.resolve_defaults(ppo.Config(episodic=True), 700_000)
    assert (episodic.advantage, episodic.samples_per_state) == ("group", ppo.GROUP_SAMPLES)  # episodes per start
    assert ppo.resolve_defaults(ppo.Config(episodic=True), 7_615_616_512).advantage == "gae"
    assert ppo.resolve_defaults(ppo.Config(advantage="group"), 7_615_616_512).samples_per_state == ppo.GROUP_SAMPLES
    with pytest.raises(ValueError, match="--critic-warmup"):  # the group baseline has no critic to warm up
        ppo.resolve_defaults(ppo.Config(critic_warmup=2), 700_000)


def test_pick_tasks_keeps_every_state_of_n_tasks_the_same_for_a_seed():
    states = [{"task": t, "step": i} for t in ("a", "b", "c", "d", "e") for i in range(3)]
    two = ppo.pick_tasks(states, 2, seed=0)
    assert len({s["task"] for s in two}) == 2 and len(two) == 6  # every state of the two tasks drawn
    assert two == ppo.pick_tasks(states, 2, seed=0)  # the same draw for the same seed
    assert ppo.pick_tasks(states, 9, seed=0) == states  # more tasks than the pool has: all of them
    assert any({s["task"] for s in ppo.pick_tasks(states, 2, seed=k)} != {s["task"] for s in two} for k in range(1, 9))


def test_lora_starts_at_the_base_switches_off_to_it_and_saves_merged(tiny, tmp_path):
    lm, tok = tiny
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        base = lm(ids)
        lora = copy.deepcopy(lm)
        model.add_lora(lora, rank=2, alpha=4.0)
        assert torch.equal(lora(ids), base)  # B = 0: training starts at the base model
        trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
        assert trainable and all(n.endswith((".A", ".B")) for n in trainable)
        for m in lora.modules():
            if isinstance(m, model.LoRALinear):
                m.B.normal_(std=0.1)
        moved = lora(ids)
        assert not torch.allclose(moved, base, atol=1e-4)
        model.set_lora(lora, False)  # the reference policy under --lora-rank
        assert torch.equal(lora(ids), base)
        model.set_lora(lora, True)
        model.save(lora, tok, tmp_path / "merged")
        loaded, _ = model.load(tmp_path / "merged", "cpu")
        assert torch.allclose(loaded(ids), moved, atol=1e-4)


def test_lora_rollouts_run_a_merged_copy_sharing_the_frozen_weights(tiny):
    """A LoRA actor rolls out with its adapters merged (issue 44): the same logits and greedy tokens, no adapter
    matmuls in a decode step, the base's tensors shared (not copied) and left as they were."""
    from torch.utils._python_dispatch import TorchDispatchMode
    lm, _ = tiny
    lora = copy.deepcopy(lm)
    model.add_lora(lora, rank=2, alpha=4.0)
    with torch.no_grad():
        for m in lora.modules():
            if isinstance(m, model.LoRALinear):
                m.B.normal_(std=0.1)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    merged = model.rollout_copy(lora, torch.device("cpu"))
    assert not model.has_lora(merged) and model.has_lora(lora)
    assert merged.model.embed_tokens.weight.data_ptr() == lora.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n = getattr(self, "n", 0) + 1
            return func(*args, **(kwargs or {}))
    with torch.no_grad():
        assert torch.allclose(merged(ids), lora(ids), atol=1e-5)
        counts = []
        for net in (lora, merged):
            with Ops() as ops:
                net(ids[:, :1])
            counts.append(ops.n)
    assert counts[1] < counts[0] * 0.8, counts  # 4 ops a wrapped layer fewer
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    assert merged.generate(prompts, 8).tokens == lora.generate(prompts, 8).tokens
    assert all(torch.equal(v, before[k]) for k, v in lora.state_dict().items())


# ------------------------------------------------------------------------------------------ states and the CLI

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A states pool from one short scripted trajectory on a built-in task, and a tiny checkpoint trained on it."""
    out = tmp_path_factory.mktemp("ppo")
    traj = collect.rollout({"id": "digits-0000", "task": "digits", "ideas": [["model", "Use a random forest."]],
                            "expert": "scripted", "base_url": None, "prices": (0.0, 0.0), "max_steps": 3,
                            "time_limit": 600.0})
    states = list(collect.state_rows([traj]))
    agent.write_atomic(out / "states.jsonl", (json.dumps(s) + "\n" for s in states))
    tok = model.train_tokenizer([m["content"] for s in states for m in s["messages"]], 512)
    torch.manual_seed(0)
    model.save(model.Qwen(model.tiny_config(vocab_size=len(tok))), tok, out / "tiny")
    return out, traj, states


def test_expert_response_from_restored_state_reproduces_its_reward(pool):
    _, traj, states = pool
    for step, state in zip(traj["steps"], states):
        e = ppo.make_env(state["task"], state["task_dir"], env.recipe_editor)
        e.restore(state["snapshot"])
        got = ppo.execute(e, step["response"], ppo.RewardConfig())
        assert (got["kind"], got["reward"]) == (step["kind"], pytest.approx(step["reward"]))
        assert got["action"] == step["action"]  # and an edit's instruction is kept (the agent's diversity, C5)
        assert got["edit"] == (step["action_input"]["edit_instruction"] if step["action"] == "Edit Script (AI)"
                               else None)
    assert any(s["action"] == "Edit Script (AI)" for s in traj["steps"])  # the check above met an edit
    e = ppo.make_env(states[0]["task"], states[0]["task_dir"], env.recipe_editor)
    e.restore(states[0]["snapshot"])
    bad = ppo.execute(e, "no format at all", ppo.RewardConfig())
    assert (bad["kind"], bad["reward"]) == ("invalid", -1.0)
    e.restore(states[0]["snapshot"])  # the expert's own first action, cut at max_new_tokens: invalid, nothing runs
    cut = ppo.execute(e, traj["steps"][0]["response"], ppo.RewardConfig(), finished=False)
    assert (cut["kind"], cut["reward"]) == ("invalid", -1.0) and "max_new_tokens" in cut["observation"]


LIST = ("Reflection: none\nResearch Plan and Status: 1. look [in progress]\nFact Check: none\nThought: look\n"
        "Action: List Files\nAction Input: {\"dir_path\": \".\"}")


def test_episodic_rollout_links_the_steps_of_each_episode(pool, monkeypatch):
    _, _, states = pool
    seen = []

    def fake_generate(lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None):  # the policy always lists the files
        seen.append(messages)
        return [[1, 2]] * len(messages), [[4, 5, 6]] * len(messages), [[-0.1] * 3] * len(messages), \
            [LIST] * len(messages), [True] * len(messages)

    monkeypatch.setattr(ppo, "generate", fake_generate)
    cfg = ppo.Config(episode_steps=2)
    with ppo.ThreadPoolExecutor(2) as pool_:
        _, tokens, _, outcomes, nxt = ppo.episode_rollout([states[0], states[0]], None, None, cfg, pool_,
                                                          env.recipe_editor, "cpu", lambda name: None)
    assert nxt == [2, 3, -1, -1] and len(tokens) == 4  # rows in step order: episode 0 and 1 at step 0, then step 1
    assert [o["kind"] for o in outcomes] == ["neutral"] * 4 and all(o["reward"] == 0 for o in outcomes)
    assert "Now let's start" in seen[0][0][1]["content"]  # the task start, with the expert's first-step ideas
    assert states[0]["ideas"][0][1] in seen[0][0][1]["content"]
    assert "Step 0:" in seen[1][0][1]["content"] and "train.py" in seen[1][0][1]["content"]  # the observation


class RunAtOnce:
    """A pool running each job where it is submitted."""

    def submit(self, fn, *args):
        done = concurrent.futures.Future()
        done.set_result(fn(*args))
        return done


@pytest.mark.parametrize("gpu, device, order", [("3", "cuda:0", ["generated", "freed", "run"]),
                                                ("", "cuda:0", ["run", "generated"]), (None, "cpu", ["run", "generated"])])
def test_scripts_that_see_the_gpu_start_after_generation_has_freed_its_cache(monkeypatch, gpu, device, order):
    """Issue 44: with --script-gpu a rank's scripts share its GPU; started as each response completed, they ran during
    generation, the memory plan's peak. Now they start after it, the KV cache freed; without a GPU, as before."""
    events = []

    def fake_generate(lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None):
        if on_done:
            on_done(0, LIST, True)
        events.append("generated")
        return [[1]], [[4]], [[-0.1]], [LIST], [True]
    monkeypatch.setattr(ppo, "generate", fake_generate)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("freed"))
    monkeypatch.setattr(env, "SCRIPT_GPU", gpu)
    ppo.generate_and_run(None, None, [[]], ppo.Config(), RunAtOnce(), torch.device(device), lambda part: None,
                         lambda i, text, ended: events.append("run"))
    assert events == order

def test_n_samples_per_state_are_state_major_each_from_the_restored_state(pool, monkeypatch):
    _, _, states = pool
    edit = ("Reflection: none\nResearch Plan and Status: 1. edit [in progress]\nFact Check: none\nThought: edit\n"
            "Action: Edit Script (AI)\nAction Input: {\"script_name\": \"train.py\", \"edit_instruction\": "
            "\"Use a random forest.\", \"save_name\": \"train.py\"}")
    def fake_generate(lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None):
        texts = [t for _ in messages for t in ([LIST, edit] * n)[:n]]
        for i in (3, 0):  # rows reported complete early (model.generate's on_done), out of order; 1 and 2 not at all
            on_done(i, texts[i], True)
        return [[1]] * len(texts), [[4]] * len(texts), [[-0.1]] * len(texts), texts, [True] * len(texts)

    monkeypatch.setattr(ppo, "generate", fake_generate)
    calls, execute = [], ppo.execute
    monkeypatch.setattr(ppo, "execute", lambda *a, **k: calls.append(1) or execute(*a, **k))
    with ppo.ThreadPoolExecutor(2) as pool_:
        outcomes, nxt = ppo.step_rollout([states[0], states[0]], None, None, ppo.Config(), pool_,
                                         env.recipe_editor, "cpu", lambda name: None, n=2)[3:]
    # each edit runs in its own restored copy: both start from the state's metric and are paid the same
    assert [o["kind"] for o in outcomes] == ["neutral", "edit", "neutral", "edit"] and nxt == [-1] * 4
    assert outcomes[1]["m_prev"] == outcomes[3]["m_prev"] == states[0]["m_t"]
    assert outcomes[1]["reward"] == outcomes[3]["reward"] != 0
    assert len(calls) == 4  # each action executed once, whether reported early or not


@pytest.mark.parametrize("episodic", [False, True])
def test_reward_config_reaches_the_rollouts(pool, monkeypatch, episodic):
    _, _, states = pool
    monkeypatch.setattr(ppo, "generate", lambda lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None: (
        [[1, 2]] * len(messages), [[4, 5]] * len(messages), [[-0.1] * 2] * len(messages),
        ["no format at all"] * len(messages), [True] * len(messages)))
    rollout_ = ppo.episode_rollout if episodic else ppo.step_rollout
    got = {}
    for name, rc in (("default", RewardConfig()), ("no format term", RewardConfig(format_term=False))):
        cfg = ppo.Config(episode_steps=1, reward=rc)
        with ppo.ThreadPoolExecutor(1) as pool_:
            outcomes = rollout_([states[0]], None, None, cfg, pool_, env.recipe_editor, "cpu", lambda n: None)[3]
        got[name] = [(o["kind"], o["reward"]) for o in outcomes]
    assert got == {"default": [("invalid", -1.0)], "no format term": [("invalid", 0.0)]}  # R_format on and off


EXECUTE = LIST.replace("List Files", "Execute Script").replace('"dir_path": "."', '"script_name": "train.py"')


@pytest.mark.parametrize("episodic", [False, True])
def test_a_rows_failing_environment_is_its_error_outcome_and_the_others_go_on(pool, monkeypatch, capsys, episodic):
    """Issue 42: an OSError out of one row's env (its step; its construction) ends that row, not the iteration."""
    _, _, states = pool
    monkeypatch.setattr(ppo, "generate", lambda lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None: (
        [[1]] * len(messages), [[4]] * len(messages), [[-0.1]] * len(messages),
        [EXECUTE if i == 1 else LIST for i in range(len(messages))], [True] * len(messages)))
    step = env.Env.step

    def failing_step(e, action, action_input):
        if action == "Execute Script":
            raise OSError(36, "File name too long")
        return step(e, action, action_input)

    monkeypatch.setattr(env.Env, "step", failing_step)
    broken = {**states[0], "id": "broken/0", "task": "gone", "task_dir": "/nonexistent/gone"}
    rollout_ = ppo.episode_rollout if episodic else ppo.step_rollout
    batch = [states[0], states[0]] + ([] if episodic else [broken, states[0]])  # an episode's env is built by reset
    with ppo.ThreadPoolExecutor(2) as pool_:
        outcomes, nxt = rollout_(batch, None, None, ppo.Config(episode_steps=2), pool_, env.recipe_editor, "cpu",
                                 lambda name: None)[3:]
    kinds = [o["kind"] for o in outcomes]
    assert kinds == (["neutral", "error", "neutral"] if episodic else ["neutral", "error", "error", "neutral"])
    assert nxt == ([2, -1, -1] if episodic else [-1] * 4)  # the failed episode ends there
    assert all(o.keys() == outcomes[0].keys() for o in outcomes)
    assert [o["reward"] for o in outcomes if o["kind"] == "error"] == [-1.0] * kinds.count("error")
    assert outcomes[1]["observation"] == "EnvError: OSError: [Errno 36] File name too long"
    assert outcomes[1]["action"] == "Execute Script"
    err = capsys.readouterr().err
    assert f"ppo.py: {states[0]['task']} at step " in err and "OSError: [Errno 36] File name too long" in err
    assert episodic or "ppo.py: state broken/0 of gone:" in err


def test_reward_flags_reach_the_config(pool, monkeypatch, tmp_path):
    out, _, _ = pool
    seen = []
    monkeypatch.setattr(ppo, "train", seen.append)
    common = ["--model", str(out / "tiny"), "--states", str(out / "states.jsonl"), "--out", str(tmp_path / "o")]
    ppo.main(common)
    ppo.main(common + ["--no-format-term", "--binary-performance", "--reward-alpha", "2"])
    assert [c.reward for c in seen] == [RewardConfig(), RewardConfig(alpha=2.0, binary_performance=True,
                                                                      format_term=False)]
    assert json.loads(json.dumps(dataclasses.asdict(seen[1])))["reward"]["format_term"] is False  # progress.json


def test_resume_with_other_reward_flags_exits_2_with_one_line(pool, tmp_path, capsys):
    out, _, _ = pool
    ckpt = tmp_path / "o"
    (ckpt / "trainer_state").mkdir(parents=True)
    (ckpt / "trainer_state" / "state.pt").write_bytes(b"")  # never read: the check comes first
    progress = ckpt / "trainer_state" / "progress.json"
    progress.write_text(json.dumps({"iteration": 1}))  # a checkpoint older than the reward config: accepted
    ppo.check_resume_reward(str(ckpt), ppo.Config(reward=RewardConfig(corner_term=False)))
    progress.write_text(json.dumps({"iteration": 1, "config": dataclasses.asdict(ppo.Config(
        reward=RewardConfig(binary_performance=True)))}))
    ppo.check_resume_reward(str(ckpt), ppo.Config(reward=RewardConfig(binary_performance=True)))  # the same: fine
    with pytest.raises(SystemExit) as exit_:
        ppo.main(["--model", str(out / "tiny"), "--states", str(out / "states.jsonl"), "--out", str(ckpt)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "binary_performance=True" in err and "binary_performance=False" in err  # both configs named


def run_ppo(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "ppo.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.slow
def test_ppo_end_to_end_writes_a_loadable_checkpoint_and_resumes(pool):
    out, _, states = pool
    common = ["--model", out / "tiny", "--states", out / "states.jsonl", "--out", out / "ckpt", "--log-file",
              out / "log.jsonl", "--batch-size", 2, "--num-minibatches", 2, "--micro-batch", 1, "--max-new-tokens",
              8, "--workers", 2, "--actor-lr", 1e-3, "--advantage", "gae", "--critic-warmup", 0]  # the critic's path;
    # no warm-up: the actor steps at once
    r = run_ppo(*common, "--iterations", 1, cwd=out)
    assert r.returncode == 0, r.stderr
    lines = (out / "log.jsonl").read_text().splitlines()
    log = json.loads(lines[-1])
    assert len(lines) == 1 and log["iteration"] == 1 and log["actions"] == 2 and -1 <= log["reward"] <= 1
    # on CPU the old log-probs are the generation's: the first minibatch's ratio is generate against forward
    assert log["generate_vs_forward_logprob_gap"] is None and log["ratio_first_minibatch_max_dev"] < 1e-4
    assert "it 1/1 reward" in r.stdout and log["reward_config"] == dataclasses.asdict(RewardConfig())
    assert log["actor_updated"] is True
    # beside the reward, the expert's recorded reward on the same 2 states (a mean of two of the pool's)
    pool_rewards = [json.loads(line)["expert"]["reward"] for line in (out / "states.jsonl").read_text().splitlines()]
    pairs = {round((a + b) / 2, 9) for i, a in enumerate(pool_rewards) for b in pool_rewards[i + 1:]}
    assert round(log["expert_reward"], 9) in pairs
    assert log["reward_vs_expert"] == pytest.approx(log["reward"] - log["expert_reward"])
    progress = json.loads((out / "ckpt" / "trainer_state" / "progress.json").read_text())
    assert progress["config"]["reward"] == log["reward_config"]  # the nested dataclass serialises
    lm, _ = model.load(out / "ckpt", "cpu")
    base, _ = model.load(out / "tiny", "cpu")
    assert any((a - b).abs().max() > 0 for a, b in zip(lm.parameters(), base.parameters()))  # the actor moved
    state = torch.load(out / "ckpt" / "trainer_state" / "state.pt", weights_only=False)
    assert "head.weight" in state["critic"] and state["progress"]["iteration"] == 1
    r = run_ppo(*common, "--iterations", 2, cwd=out)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "it 2/2" in r.stdout and "it 1/2" not in r.stdout
    assert [json.loads(x)["iteration"] for x in (out / "log.jsonl").read_text().splitlines()] == [1, 2]
    r = run_ppo(*common, "--iterations", 3, "--no-corner-term", cwd=out)  # another reward: not in this run
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "corner_term=False" in r.stderr
    assert len((out / "log.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("advantage,actions", [("group", 16), ("gae", 4)])
def test_episodic_run_of_two_iterations_in_one_process(pool, tmp_path, advantage, actions):
    out, _, _ = pool
    r = run_ppo("--model", out / "tiny", "--states", out / "states.jsonl", "--out", tmp_path / "ckpt", "--log-file",
                tmp_path / "log.jsonl", "--episodic", "--episode-steps", 2, "--batch-size", 4, "--micro-batch", 2,
                "--max-new-tokens", 8, "--workers", 2, "--iterations", 2, "--advantage", advantage, cwd=out)
    assert r.returncode == 0, r.stderr
    # 2 task starts x 2 steps (responses cut at 8 tokens are invalid, which ends no episode), x 4 episodes per start
    # with the group baseline
    logs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in logs] == [1, 2] and all(x["actions"] == actions for x in logs)
    assert ("group baseline over 4 episodes per task start" if advantage == "group" else "critic lr") in r.stdout
    assert all(x["generate_vs_forward_logprob_gap"] is None and x["ratio_first_minibatch_max_dev"] < 1e-4 for x in logs)


@pytest.mark.parametrize("args", [["--model", "/no/such/folder"], ["--states", "/no/such/states.jsonl"],
                                  ["--batch-size", "0"], ["--temperature", "0"], ["--bogus", "1"],
                                  ["--reward-clip", "-1"], ["--reward-alpha", "0"], ["--kl-coef", "-1"],
                                  ["--temperature", "nan"], ["--actor-lr", "inf"], ["--lam", "2"],
                                  ["--device", "tpu9"], ["--max-grad-norm", "0"], ["--save-dtype", "fp8"],
                                  ["--micro-tokens", "0"], ["--samples-per-state", "0"], ["--target-kl", "-1"],
                                  ["--advantage", "vtrace"], ["--advantage", "group", "--samples-per-state", "1"],
                                  ["--advantage", "group", "--samples-per-state", "2", "--critic-warmup", "1"]])
def test_usage_errors_exit_2_with_one_line(args, pool, tmp_path, capsys):
    out, _, _ = pool
    base = {"--model": str(out / "tiny"), "--states": str(out / "states.jsonl"), "--out": str(tmp_path / "o")}
    base.update(dict(zip(args[::2], args[1::2])))
    with pytest.raises(SystemExit) as exit_:
        ppo.main([x for kv in base.items() for x in kv])  # each is caught before any model is loaded
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "ppo.py: error" in err


# ------------------------------------------------------------------------------- torchrun: 2 gloo processes on CPU

def torchrun(cfg, nproc=2):
    """ppo.py under torchrun (as the README runs it), every field of cfg as its flag; -> the completed process."""
    flags = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name == "reward" or v is None or v is False:
            continue
        flags += [f"--{f.name.replace('_', '-')}"] + ([] if v is True else [str(v)])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", str(_free_port()), str(ROOT / "ppo.py"), *flags], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[:6000] + "\n...\n" + r.stderr[-3000:]
    return r


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(folder):
    return {k: v.float() for k, v in model.load(folder, "cpu")[0].state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("lora, n", [(0, 2), (2, 1)])
def test_two_gloo_ranks_match_one_process(pool, tmp_path, lora, n):
    """The batch of 3 states split over 2 ranks (2 + 1 states, each with n sampled actions; FSDP2 without LoRA,
    data-parallel adapters with it) gives the same rewards and, after one iteration, the same weights as one process
    on the whole batch. Tolerance: 1e-5 absolute, 1% of one Adam step at lr 1e-3 (the sums run in another order)."""
    out, _, _ = pool
    cfg = lambda name, **kw: ppo.Config(
        model=str(out / "tiny"), states=str(out / "states.jsonl"), out=str(tmp_path / name),
        log_file=str(tmp_path / f"{name}.jsonl"), batch_size=3, num_minibatches=2, micro_batch=1, max_new_tokens=8,
        workers=1, iterations=1, actor_lr=1e-3, critic_lr=1e-3, critic_warmup=0, lora_rank=lora, advantage="gae",
        grad_checkpointing=True, device="cpu", max_grad_norm=1e9, samples_per_state=n, **kw)  # no clipping: Adam's
    # moments keep |g|
    ppo.train(cfg("one"))
    torchrun(cfg("two"))
    one, two = (json.loads((tmp_path / f"{n}.jsonl").read_text().splitlines()[-1]) for n in ("one", "two"))
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["actions"] == one["actions"] == 3 * n
    assert two["rewards"] == one["rewards"]  # each state sampled with its own seed, on whichever rank
    assert two["response_tokens"] == one["response_tokens"]
    assert two["pg_loss"] == pytest.approx(one["pg_loss"], abs=1e-5)
    assert two["vf_loss"] == pytest.approx(one["vf_loss"], rel=1e-4)
    w1, w2, w0 = _weights(tmp_path / "one"), _weights(tmp_path / "two"), _weights(out / "tiny")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w1) > 1e-4  # the update did move the actor
    s1, s2 = (torch.load(tmp_path / n / "trainer_state" / "state.pt", weights_only=False) for n in ("one", "two"))
    for k in s1["critic"]:
        torch.testing.assert_close(s2["critic"][k].float(), s1["critic"][k].float(), rtol=0, atol=1e-5)
    for key in ("opt_actor", "opt_critic"):  # the first moments are 0.1 g: the gradients themselves agree
        m1, m2 = (torch.cat([o["state"][i]["exp_avg"].flatten() for i in o["param_groups"][0]["params"]])
                  for o in (s1[key], s2[key]))
        torch.testing.assert_close(m2, m1, rtol=1e-3, atol=1e-7)
        assert m1.abs().max() > 1e-5


@pytest.mark.slow
def test_two_gloo_ranks_resume_and_write_what_transformers_loads(pool, tmp_path):
    transformers = pytest.importorskip("transformers")
    out, _, _ = pool
    cfg = lambda n: ppo.Config(model=str(out / "tiny"), states=str(out / "states.jsonl"), out=str(tmp_path / "ckpt"),
                               log_file=str(tmp_path / "log.jsonl"), batch_size=2, num_minibatches=1, micro_batch=1,
                               max_new_tokens=6, workers=1, iterations=n, critic_warmup=0, device="cpu")
    torchrun(cfg(1))
    state = torch.load(tmp_path / "ckpt" / "trainer_state" / "state.pt", weights_only=False)
    assert state["progress"]["iteration"] == 1 and "head.weight" in state["critic"]
    assert state["opt_actor"]["state"]  # the gathered optimizer state, to resume from
    again = torchrun(cfg(2)).stdout
    assert "resuming from" in again and "it 2/2" in again and "it 1/2" not in again
    assert [json.loads(x)["iteration"] for x in (tmp_path / "log.jsonl").read_text().splitlines()] == [1, 2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    ours, _ = model.load(tmp_path / "ckpt", "cpu")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), ours(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_an_error_on_one_rank_is_its_line_not_an_abort(pool, tmp_path):
    """Rank 0 refuses an --out that is a file: one line naming the rank, and no rank is aborted by the C++ runtime
    for exiting with its gloo group alive (which hid the line: CI once saw only "terminate called without an active
    exception")."""
    out, _, _ = pool
    (tmp_path / "ckpt").write_text("not a folder")
    cfg = ppo.Config(model=str(out / "tiny"), states=str(out / "states.jsonl"), out=str(tmp_path / "ckpt"),
                     log_file=str(tmp_path / "log.jsonl"), batch_size=2, max_new_tokens=6, workers=1, iterations=1,
                     device="cpu")
    with pytest.raises(AssertionError) as failed:
        torchrun(cfg)
    err = str(failed.value)
    assert "ppo.py: error (rank 0): --out" in err and "is a file" in err
    assert "terminate called" not in err and "SIGABRT" not in err


@pytest.mark.parametrize("script", [ppo, sft])
def test_every_flag_passes_through_torchrun_unchanged(script):
    """torchrun's own parser matches abbreviations of its options anywhere on the line: a script flag that is a
    prefix of two of them (ppo.py's old --log: --log-dir, --logs-specs) stopped the launch with "ambiguous option"."""
    from torch.distributed.run import get_args_parser
    flags = [s for a in script.parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert len(flags) > 20
    for flag in flags:
        for form in ([flag, "1"], [f"{flag}=1"]):
            args = get_args_parser().parse_args(["--nproc_per_node", "2", f"{script.__name__}.py", *form])
            assert args.training_script_args == form, flag


def readme_torchrun_lines():
    lines = [line.split("#")[0].split() for line in (ROOT / "README.md").read_text().splitlines()]
    return [line for line in lines if line[:1] == ["torchrun"]]


@pytest.mark.slow
def test_the_readmes_torchrun_lines_run_with_their_flags(pool, tmp_path):
    """Each torchrun line of the README, on 2 CPU processes with the tiny model in place of the 7B one and paths under
    tmp_path; the line's own flags are all passed, and a few appended ones (the last wins) keep it to seconds."""
    out, _, states = pool
    chats = tmp_path / "sft.jsonl"
    chats.write_text("".join(json.dumps({"messages": s["messages"] + [{"role": "assistant", "content": LIST}]}) + "\n"
                             for s in states * 4))
    lines = readme_torchrun_lines()
    assert {line[3] for line in lines} == {"sft.py", "ppo.py"}
    for line in lines:
        line = [str(out / "tiny") if x.startswith(("Qwen/", "runs/ckpt/")) else x for x in line]
        line[line.index("--nproc_per_node") + 1] = "2"
        script = line[3]
        extra = (["--data", str(chats), "--out", str(tmp_path / "sft"), "--epochs", "1", "--eval-parse", "2",
                  "--max-new-tokens", "4"] if script == "sft.py" else
                 ["--states", str(out / "states.jsonl"), "--out", str(tmp_path / "ppo"), "--iterations", "1",
                  "--max-new-tokens", "8", "--workers", "1", "--log-file", str(tmp_path / "ppo.jsonl")])
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--master_port", str(_free_port()),
                            *line[1:3], str(ROOT / script), *line[4:], *extra], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, (line, r.stderr[-3000:])
        assert "2 rank(s)" in r.stdout, line


def test_out_that_is_not_ours_or_in_use_is_refused_with_one_line(pool, tmp_path, capsys):
    out, _, _ = pool
    base = ["--model", str(out / "tiny"), "--states", str(out / "states.jsonl"), "--iterations", "1"]
    (tmp_path / "file").write_text("mine")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine too")
    for target, says in ((out / "tiny", "is the --model folder"), (tmp_path / "file", "is a file"),
                         (tmp_path / "other", "not a ppo.py checkpoint")):
        with pytest.raises(SystemExit) as e:
            ppo.main(base + ["--out", str(target)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "other" / "notes.txt").exists()
    assert (out / "tiny" / "config.json").exists()
    busy = tmp_path / "busy"
    with open(str(busy) + ".lock", "w") as held:  # another ppo.py holds this --out
        import fcntl
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SystemExit) as e:
            ppo.main(base + ["--out", str(busy)])
    assert e.value.code == 2 and "in use" in capsys.readouterr().err


@pytest.mark.parametrize("killed_after", ["aside", "renamed in"])
def test_a_kill_inside_the_checkpoint_swap_is_repaired_at_start(tmp_path, killed_after):
    """save_checkpoint moves <out> aside to <out>.old, renames <out>.tmp in, deletes <out>.old; a kill after the
    first rename leaves only <out>.old, after the second both. The next start puts the checkpoint back at <out>."""
    out = tmp_path / "ckpt"
    old, tmp = tmp_path / "ckpt.old", tmp_path / "ckpt.tmp"
    (old / "trainer_state").mkdir(parents=True)
    (old / "trainer_state" / "state.pt").write_text("previous")
    (tmp / "trainer_state").mkdir(parents=True)  # a half-written next checkpoint
    if killed_after == "renamed in":
        (out / "trainer_state").mkdir(parents=True)
        (out / "trainer_state" / "state.pt").write_text("new")
    lock = ppo.claim_out(ppo.Config(model=str(tmp_path / "model"), out=str(out)))
    lock.close()
    want = "new" if killed_after == "renamed in" else "previous"
    assert (out / "trainer_state" / "state.pt").read_text() == want and not old.exists() and not tmp.exists()
    assert ppo.find_resume(str(out)) == str(out)


def test_log_is_trimmed_to_the_checkpoint_and_another_runs_log_is_refused(tmp_path):
    log, out = tmp_path / "log.jsonl", str(tmp_path / "ckpt")
    log.write_text("".join(json.dumps({"iteration": i, "out": out}) + "\n" for i in (1, 2, 3)) + '{"iterat')
    agent.trim_log(str(log), "iteration", 2, out)  # the kill came after iteration 3's line, before its checkpoint
    assert [json.loads(x)["iteration"] for x in log.read_text().splitlines()] == [1, 2]
    with pytest.raises(ValueError, match="another run"):
        agent.trim_log(str(log), "iteration", 2, str(tmp_path / "elsewhere"))


@pytest.mark.slow
def test_killed_run_resumes_without_losing_or_duplicating_log_lines(pool, tmp_path):
    import signal
    import time
    out, _, _ = pool
    args = [sys.executable, str(ROOT / "ppo.py"), "--model", str(out / "tiny"), "--states", str(out / "states.jsonl"),
            "--out", str(tmp_path / "ckpt"), "--log-file", str(tmp_path / "log.jsonl"), "--batch-size", "2",
            "--micro-batch", "1", "--max-new-tokens", "6", "--workers", "1", "--iterations", "4", "--save-every",
            "2", "--critic-warmup", "0"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = tmp_path / "log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and log.read_text().strip()):
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGKILL)  # after iteration 1's log line, most likely before the checkpoint at 2
    p.wait()
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["iteration"] for x in log.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.parametrize("content, says", [(b'{"task": "digits"}\n', "not a state"), (b"\xff\xfe\n", "not a JSON"),
                                           (b'[1, 2]\n', "not a state"), (b'{"task": \n', "not a JSON")])
def test_bad_states_lines_name_the_file_and_line(tmp_path, content, says):
    path = tmp_path / "states.jsonl"
    path.write_bytes(b"\n" + content)
    with pytest.raises(ValueError, match=f"states.jsonl:2: {says}"):
        ppo.load_states(str(path))


@pytest.mark.parametrize("episodic", [False, True])
def test_a_response_cut_at_max_new_tokens_is_invalid_unless_switched_off(pool, monkeypatch, episodic):
    _, _, states = pool
    monkeypatch.setattr(ppo, "generate", lambda lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None: (
        [[1]] * len(messages), [[4]] * len(messages), [[-0.1]] * len(messages), [LIST] * len(messages),
        [False] * len(messages)))  # a valid List Files action, but no stop token came
    rollout_ = ppo.episode_rollout if episodic else ppo.step_rollout
    got = []
    for unfinished_invalid in (True, False):
        cfg = ppo.Config(episode_steps=1, unfinished_invalid=unfinished_invalid)
        with ppo.ThreadPoolExecutor(1) as pool_:
            outcomes = rollout_([states[0]], None, None, cfg, pool_, env.recipe_editor, "cpu", lambda n: None)[3]
        got.append([(o["kind"], o["reward"]) for o in outcomes])
    assert got == [[("invalid", -1.0)], [("neutral", 0.0)]]


def test_resume_with_the_other_unfinished_rule_exits_2_with_one_line(pool, tmp_path, capsys):
    out, _, _ = pool
    ckpt = tmp_path / "o"
    (ckpt / "trainer_state").mkdir(parents=True)
    (ckpt / "trainer_state" / "state.pt").write_bytes(b"")  # never read: the check comes first
    (ckpt / "trainer_state" / "progress.json").write_text(json.dumps({"iteration": 1, "config": dataclasses.asdict(
        ppo.Config(unfinished_invalid=False))}))
    ppo.check_resume_reward(str(ckpt), ppo.Config(unfinished_invalid=False))  # the same rule: fine
    with pytest.raises(SystemExit) as exit_:
        ppo.main(["--model", str(out / "tiny"), "--states", str(out / "states.jsonl"), "--out", str(ckpt)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "unfinished_invalid=False" in err


# ---- the CUDA paths, on CPU (issue: "The GPU node on the first try") ----

def test_lora_gets_about_ten_times_the_full_fine_tuning_rate():
    """Adapters that start at B = 0 barely move at the full fine-tuning rate ("LoRA Without Regret": ~10x)."""
    big = 7_615_616_512
    assert ppo.resolve_defaults(ppo.Config(lora_rank=16), big).actor_lr == pytest.approx(1e-5)
    assert ppo.resolve_defaults(ppo.Config(), big).actor_lr == 1e-6  # full fine-tuning keeps the paper's
    assert ppo.resolve_defaults(ppo.Config(lora_rank=16, actor_lr=2e-6), big).actor_lr == 2e-6  # a flag wins
    assert ppo.resolve_defaults(ppo.Config(lora_rank=2), 700_000).actor_lr == ppo.TINY["actor_lr"]


def test_prompts_are_cut_to_max_prompt_len_keeping_their_end(tiny):
    """The rollout's KV cache is planned for --max-prompt-len tokens: a longer prompt loses its oldest tokens."""
    lm, tok = tiny
    messages = [[{"role": "user", "content": "list the files " * 40}], [{"role": "user", "content": "hi"}]]
    cfg = ppo.Config(max_new_tokens=3, max_prompt_len=20)
    prompts, *_ = ppo.generate(lm, tok, messages, cfg, torch.device("cpu"))
    full = [tok.encode(tok.apply_chat_template(m)) for m in messages]
    assert len(full[0]) > 20 and prompts[0] == full[0][-20:]
    assert prompts[1] == full[1]  # a short prompt is left whole


def test_a_pool_smaller_than_the_ranks_is_refused_before_any_collective(pool, tmp_path, monkeypatch):
    """A rank with no state of a batch crashed in make_batch and left the others waiting in a collective; now every
    rank refuses the run alike, naming the pool, before any collective (here a second rank is only pretended)."""
    out, _, states = pool
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(states[0]) + "\n")
    monkeypatch.setattr(model, "setup_distributed", lambda cfg, timeout: (0, 2, torch.device("cpu")))
    cfg = ppo.Config(model=str(out / "tiny"), states=str(one), out=str(tmp_path / "o"), batch_size=4,
                     log_file=str(tmp_path / "log.jsonl"), device="cpu")
    with pytest.raises(ValueError, match=r"one\.jsonl: 1 state\(s\) for 2 ranks"):
        ppo.train(cfg)
    assert not (tmp_path / "o").exists()


def test_full_fine_tuning_too_big_for_one_gpu_is_one_line_naming_what_fits(pool, tmp_path, monkeypatch):
    """Issue 44: one process fine-tuning every weight of a 7B model ran out of memory with a traceback; now one line
    (here the GPU is faked, with too little memory for the tiny model's 34 B a parameter)."""
    out, _, _ = pool
    monkeypatch.setattr(env, "SCRIPT_GPU", None)  # (setup sets it on CUDA)
    monkeypatch.setattr(model, "setup_distributed", lambda cfg, timeout: (0, 1, torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=2**20))
    cfg = ppo.Config(model=str(out / "tiny"), states=str(out / "states.jsonl"), out=str(tmp_path / "o"),
                     log_file=str(tmp_path / "log.jsonl"))
    with pytest.raises(ValueError, match=r"this GPU has 0: pass --lora-rank 16, or shard over GPUs") as e:
        ppo.train(cfg)
    assert "\n" not in str(e.value)
    model.check_fits(10**12, 34, torch.device("cpu"), "")  # a CPU: no limit known

def test_the_collective_timeout_outlasts_the_longest_rollout(monkeypatch):
    """Issue 44: NCCL's 2-hour timeout could be shorter than one rollout (--advantage group at the README's batch: 128
    actions a rank, 4 workers, MLE-bench's 600 s: 32 waves). Now twice the rollout's waves at the longest limit."""
    monkeypatch.setattr(env, "load_task", lambda folder: SimpleNamespace(time_limit=600.0))  # a prepared competition
    comp, digits = {"task": "comp", "task_dir": "/data/comp"}, {"task": "digits", "task_dir": "tasks/digits"}
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = ppo.Config(batch_size=256, samples_per_state=4, advantage="group", workers=4)
    assert ppo.collective_timeout(cfg, [digits, comp]) == 2 * 32 * 600
    assert ppo.collective_timeout(dataclasses.replace(cfg, episodic=True), [comp]) == 2 * (32 + 4) * 600
    monkeypatch.setenv("WORLD_SIZE", "1")  # the built-in tasks' 60 s: the 2-hour floor
    assert ppo.collective_timeout(ppo.Config(), [digits]) == 2 * 3600

def _fsdp_paths_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    full = model.Qwen(model.tiny_config(vocab_size=64))
    cpu = torch.device("cpu")

    def sharded():
        with torch.device("meta"):
            lm = model.Qwen(full.config)
        net = model.shard(ppo.Actor(lm), lm.model.layers, world, cpu)
        net.to_empty(device=cpu)
        lm.tie_weights()
        model.fill(lm, full.state_dict().items())
        return net
    actor, ref = sharded(), sharded().requires_grad_(False)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):  # the largest plain tensor a copy or cast makes or fills, in elements
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and type(out) is torch.Tensor:
                Copies.most = max(Copies.most, out.numel())
            return out
    with torch.device("meta"):
        lm64 = model.Qwen(full.config)
    model.shard(ppo.Actor(lm64), lm64.model.layers, world, cpu).to_empty(device=cpu)
    lm64.tie_weights()
    checkpoint = [(k, v.double()) for k, v in full.state_dict().items()]
    with Copies():  # a float64 checkpoint into fp32 shards: each rank casts and copies only its rows
        model.fill(lm64, checkpoint)
    rows_only = Copies.most <= max(-(-len(v) // world) * v[0].numel() for v in full.state_dict().values())
    roots = lambda: [isinstance(n.lm.model.embed_tokens.weight, DTensor) for n in (actor, ref)]  # noqa: E731
    before = roots()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ppo.forward_scores(actor, None, ref, ids, torch.tensor([12, 10]), torch.tensor([6, 6]), 6, ppo.Config(), cpu,
                       model.Ranks(rank, world, cpu))
    after = roots()
    gathered, full_tensor = [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: gathered.append(str(self.dtype)) or full_tensor(self, **kw)
    copy = model.rollout_copy(actor.lm, cpu, torch.bfloat16)
    DTensor.full_tensor = full_tensor
    same = all(torch.equal(p, full.state_dict()[k].to(torch.bfloat16)) for k, p in copy.state_dict().items())
    data = dict(ids=ids[rank:rank + 1], lengths=torch.tensor([12]), starts=torch.tensor([6]), mask=torch.ones(1, 6),
                logprobs=torch.zeros(1, 6), advantages=torch.ones(1, 6))
    ppo.ppo_update(actor, None, None, None, data, ppo.Config(), cpu, torch.Generator().manual_seed(0), False,
                   model.Ranks(rank, world, cpu))  # the actor does not step (critic warm-up, a target-KL stop)
    idle = roots()[0] and all(p.grad is None for p in actor.parameters())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"before": before, "after": after, "gathered": sorted(set(gathered)), "n": len(gathered),
                   "same": same, "idle": idle, "rows_only": rows_only, "most": Copies.most}, f)
    torch.distributed.destroy_process_group()


def test_two_gloo_ranks_free_gathered_roots_and_gather_the_rollout_copy_in_bf16(tmp_path):
    """FSDP2 keeps the root unit (embeddings, lm_head) gathered after a forward for the backward that follows; after
    the no-grad scoring forward none follows, so it must be resharded (the reference would otherwise hold it for the
    whole run). The rollout copy casts each shard before the all-gather: bf16 crosses the wire, not fp32. An update
    in which the actor does not step leaves it sharded, with no gradient. Loading cuts each rank's rows before they
    are cast or copied: no rank makes a full tensor on its device (issue 44)."""
    import torch.multiprocessing as mp
    mp.spawn(_fsdp_paths_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["before"] == [True, True] and got["after"] == [True, True], got
        assert got["gathered"] == ["torch.bfloat16"] and got["n"] > 0 and got["same"] and got["idle"], got
        assert got["rows_only"], {k: got[k] for k in ("rows_only", "most")}


def test_a_bad_model_is_one_line_exit_2_naming_it(tmp_path, no_endpoint):
    """Issue 43: ppo.py's --model is always a checkpoint (a folder or a hub id); an endpoint's name is no model."""
    from conftest import assert_bad_models_refused
    state = {"task": "digits", "task_dir": "tasks/digits", "step": 0, "messages": [], "snapshot": {}, "m_init": 0.9,
             "m_best": 1.0, "higher_is_better": True}
    assert_bad_models_refused(ppo.main, ["--model", "{m}", "--states", "{d}/states.jsonl", "--out", "{d}/o"],
                              tmp_path, no_endpoint, {"states.jsonl": (json.dumps(state) + "\n").encode()})
    # --editor (Edit Script (AI)): a model name under the same rule, checked before --out is claimed
    assert_bad_models_refused(ppo.main, ["--model", "{d}", "--editor", "{m}", "--states", "{d}/states.jsonl", "--out",
                                         "{d}/o"], tmp_path, no_endpoint)
