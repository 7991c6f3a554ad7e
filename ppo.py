"""Step-wise PPO of ML-Agent (arXiv:2505.23723, §"Step-wise RL paradigm"): an actor, a critic and a frozen reference,
trained on states from the expert's distribution d^{pi_e} (runs/data/states.jsonl, collect.py).

J_step(theta) = E_{s ~ d^{pi_e}, a ~ pi_theta(.|s)} [R(s, a)]: in each sampled expert state the policy takes ONE action,
run from the restored state and scored (agent.act); PPO (`train`'s six steps) as in "The N Implementation Details of
RLHF with PPO" (Huang et al. 2024) and CleanRL: left padding, log-probs of temperature-scaled logits, per-token KL
penalty to the reference, score on the last token, GAE (gamma 1, lambda 0.95), whitened advantages, clipped policy and
value losses, no dropout. Departures:
1. Rates: a pre-trained policy keeps the paper's (actor 1e-6, critic 1e-5), the offline tiny model gets TINY's and the
   group baseline. Batch, temperature, KL, clip (the paper is silent): N-details' (`Config`).
2. `--samples-per-state n` (OpenRLHF's n_samples_per_prompt; the paper samples one) shares each prompt's prefill;
   `--advantage group` replaces the critic by the state's other samples (RLOO, arXiv:2402.14740).
3. The critic is the policy with a scalar head (as OpenRLHF's), not initialised from a reward model.
4. Masks come from lengths (pad may equal EOS). Generation stops where agent.run_episode's does; an action runs once its
   response is complete; one cut at --max-new-tokens is invalid.
5. On CPU the old log-probs are the generation's (the rollout ran on the actor's fp32 weights); CUDA recomputes them.
6. `--episodic`: the paper's episode-wise ablation; `--tasks N`: N tasks (ML-Agent Figure 5); `--lora-rank`: adapters
   (arXiv:2106.09685), the reference the actor with them off; `Edit Script (AI)` by the recipe stand-in (--editor).
7. torchrun ranks share each batch (each state its own seed: any world size samples alike); FSDP2 shards the three
   models; each rank generates from a gathered bf16 copy (VeRL's "hybrid engine").

Run:  python collect.py && python sft.py && python ppo.py  (tiny model, offline, minutes)
      python ppo.py --episodic;  python ppo.py --binary-performance  (ablations: episode-wise RL, ML-Agent Table 3)
      GPU node (torchrun, FSDP2) or one GPU (--lora-rank 16): README, "On a GPU node with a real model and endpoint"
Outputs: runs/ckpt/ppo (actor folder + trainer_state/), runs/ppo/log.jsonl; a resume with other reward flags stops.
"""
import dataclasses
import json
import math
import os
import random
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

import agent
import env
import model
from reward import (RewardConfig, add_flags as add_reward_flags, from_flags as reward_from_flags, from_record, mismatch,
                    reward)

ROOT = env.ROOT  # default paths: the project's runs/, from any cwd


@dataclasses.dataclass
class Config:
    model: str = str(ROOT / "runs/ckpt/sft")  # the policy to start from, folder or hub id (ML-Agent: the SFT model)
    states: str = str(ROOT / "runs/data/states.jsonl")  # the states pool d^{pi_e} (collect.py)
    out: str = str(ROOT / "runs/ckpt/ppo")  # the actor (Hugging Face folder) + trainer_state/; resume point
    log_file: str = str(ROOT / "runs/ppo/log.jsonl")  # a JSON line per iteration (--log would clash with torchrun's)
    seed: int = 0  # the state order, sampling, the value head
    tasks: int = 0  # > 0: the states of this many tasks, a seeded draw (ML-Agent Figure 5)
    epochs: float = 1.0  # passes over the states pool (paper: 1)
    iterations: int = 0  # > 0: stop after this many iterations instead (0, tiny: at most 15)
    batch_size: int = 16  # states per iteration (paper ~256: 10k states / 39 steps)
    samples_per_state: int | None = None  # actions per state (--episodic: per start); None: 1, group: 4
    num_minibatches: int = 2  # per iteration (N-details: 1)
    micro_batch: int = 4  # at most this many rows per forward (gradient accumulation)
    micro_tokens: int = 16384  # and tokens (rows x the longest; a longer row alone)
    logits_chunk: int = 1024  # response tokens whose fp32 logits exist at once
    gen_batch: int = 16  # prompts per generate call (their KV cache bounds the memory)
    grad_checkpointing: bool = False  # always on from 10M parameters (TINY_PARAMS)
    update_epochs: int = 1  # PPO epochs over each batch (OpenRLHF examples: 1; N-details: 4)
    target_kl: float = 0.0  # > 0: the actor stops for the iteration past 1.5 x this (Spinning Up)
    actor_lr: float | None = None  # None: 1e-6 (ML-Agent §Experiments "Training"), tiny: 1e-4
    critic_lr: float | None = None  # None: 1e-5 (ML-Agent §Experiments "Training"), tiny: 3e-3
    critic_warmup: int | None = None  # first iterations that update only the critic; None: 0, tiny: 2
    adam_eps: float = 1e-5  # N-details (TF Adam's)
    max_grad_norm: float = 1.0  # OpenRLHF default
    max_new_tokens: int = 400  # tokens per action (the scripted expert's longest fit)
    max_prompt_len: int = 15000  # a longer prompt loses its oldest tokens (as sft.py --max-len)
    temperature: float = 0.7  # N-details
    kl_coef: float = 0.05  # N-details: per-token KL penalty
    gamma: float = 1.0  # N-details: no discount
    lam: float = 0.95  # GAE lambda (N-details)
    advantage: str | None = None  # "gae" (the paper's critic) or "group" (RLOO); None: gae, tiny: group
    clip_coef: float = 0.2  # PPO ratio clip (Schulman et al. 2017; N-details)
    vf_clip: float = 0.2  # value clip around the rollout values (N-details)
    unfinished_invalid: bool = True  # no stop token within max_new_tokens: invalid (N-details: score -1)
    workers: int = 4  # sandboxes executing actions in parallel
    script_gpu: bool = True  # on CUDA a rank's scripts see its GPU; --no-script-gpu: none
    episodic: bool = False  # the ablation: episodes from task starts
    episode_steps: int = 4  # steps per episode in --episodic (paper's trajectories: 15)
    save_every: int = 5  # checkpoint every N iterations (and at the end)
    editor: str = "recipes"  # "recipes" (offline stand-in) or an endpoint model for Edit Script (AI)
    device: str | None = None  # default: cuda if available
    lora_rank: int = 0  # > 0: train rank-r adapters instead of all weights (not tiny: 10x actor_lr)
    lora_alpha: float = 16.0  # adapter scale alpha / r (Hu et al. 2021)
    save_dtype: str = "auto"  # auto: bfloat16 from CUDA, float32 on CPU; or float32
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)  # reward.py's flags (ML-Agent Table 3)

    def __post_init__(self):
        if self.advantage == "group" and ((self.samples_per_state or 2) < 2 or self.critic_warmup):
            raise ValueError("--advantage group needs --samples-per-state >= 2 (its baseline is the other samples, or "
                             "the other episodes in --episodic) and has no critic to warm up (--critic-warmup)")


PAPER = dict(actor_lr=1e-6, critic_lr=1e-5, critic_warmup=0, advantage="gae")  # ML-Agent's, for a pre-trained 7B
# The tiny model does not move at the paper's rates; only the group baseline raised its J_step (our choice;
# tests/RESULTS.md, "PPO on the tiny model").
TINY = dict(actor_lr=1e-4, critic_lr=3e-3, critic_warmup=2, advantage="group")
TINY_PARAMS = 10_000_000
TINY_ITERATIONS = 15  # a tiny model's most iterations per epoch: the quick pipeline's time
GROUP_SAMPLES = 4  # --advantage group's default --samples-per-state


def resolve_defaults(cfg, n_params):
    """cfg's None fields from PAPER, or TINY under TINY_PARAMS (checkpointing past it); --samples-per-state 1: gae."""
    chosen = dict(TINY if n_params < TINY_PARAMS else PAPER)
    if cfg.lora_rank and n_params >= TINY_PARAMS:
        chosen["actor_lr"] *= 10  # adapters: ~10x the rate ("LoRA Without Regret", Schulman 2025)
    group = (cfg.advantage or ("gae" if cfg.samples_per_state == 1 else chosen["advantage"])) == "group"
    chosen.update(advantage="group" if group else "gae", samples_per_state=GROUP_SAMPLES if group else 1,
                  critic_warmup=0 if group else chosen["critic_warmup"])
    cfg = dataclasses.replace(cfg, grad_checkpointing=cfg.grad_checkpointing or n_params >= TINY_PARAMS)
    return dataclasses.replace(cfg, **{k: v for k, v in chosen.items() if getattr(cfg, k) is None})


# ==== Models

class Actor(nn.Module):
    """The policy (`.lm`); forward: response log-probs (FSDP2 gathers its root unit for the call)."""

    def __init__(self, lm, temperature=1.0, logits_chunk=1024):
        super().__init__()
        self.lm, self.temperature, self.logits_chunk = lm, temperature, logits_chunk

    def forward(self, ids, lengths, starts):  # (B, W) -> (B, R)
        return model.response_logprobs(self.lm, ids, lengths, starts, self.temperature, self.lm.sample_vocab_size,
                                       self.logits_chunk).clone()  # FSDP2 hooks the output: no internal view


class Critic(nn.Module):
    """V(s_t) per response token: a Qwen copy of the policy (lm_head dropped) and a linear head."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone, backbone.lm_head, C = backbone, None, backbone.config.hidden_size
        self.head = nn.Linear(C, 1, device=backbone.model.norm.weight.device, dtype=torch.float32)

    def head_init(self, seed):
        """N-details layer_init, from its own seed (CPU)."""
        C = self.head.in_features
        weight = torch.randn(1, C, generator=torch.Generator().manual_seed(seed)) / math.sqrt(C + 1)
        return [("weight", weight), ("bias", torch.zeros(1))]

    def forward(self, ids, lengths, starts):  # (B, W) -> (B, R), V before each token
        h, _ = model.response_hidden(self.backbone, ids, lengths, starts)
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).clone()


# ==== PPO arithmetic: pure functions, each checked by hand in tests/test_ppo.py

def token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef):
    """N-details reward: a KL penalty on every token, plus the score (B,) on the last."""
    kl = (logprobs - ref_logprobs) * mask
    rewards, last = -kl_coef * kl, (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards, kl


def gae(rewards, values, mask, gamma, lam, next_value=None, next_adv=None):
    """GAE (Schulman et al. 2016) over response tokens; next_value, next_adv (B,): V, A after them (0: episode end)."""
    B, R = rewards.shape
    nv = torch.zeros(B, device=rewards.device) if next_value is None else next_value.clone()
    last = torch.zeros(B, device=rewards.device) if next_adv is None else next_adv.clone()
    adv = torch.zeros_like(rewards)
    for t in reversed(range(R)):
        m = mask[:, t].bool()
        delta = rewards[:, t] + gamma * nv - values[:, t]
        last = torch.where(m, delta + gamma * lam * last, last)
        nv = torch.where(m, values[:, t], nv)
        adv[:, t] = last * m
    return adv, (adv + values) * mask


def gae_rows(rewards, values, mask, nxt, gamma, lam):
    """GAE where row r continues in row nxt[r] (its episode's next step; -1: none)."""
    depth = [0] * len(nxt)
    for r in reversed(range(len(nxt))):  # successors come later; rows by steps to go
        depth[r] = 0 if nxt[r] < 0 else depth[nxt[r]] + 1
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for d in range(max(depth) + 1):
        idx = [r for r in range(len(nxt)) if depth[r] == d]
        succ = torch.tensor([max(nxt[r], 0) for r in idx], device=rewards.device)
        has = torch.tensor([nxt[r] >= 0 for r in idx], device=rewards.device)
        nv, na = (torch.where(has, x[succ, 0], 0.0) for x in (values, adv))  # V and A of the next step's first token
        adv[idx], ret[idx] = gae(rewards[idx], values[idx], mask[idx], gamma, lam, nv, na)
    return adv, ret


def group_advantages(scores, kl, mask, n, kl_coef):
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740, eq. 9): each row minus the mean of its state's other n - 1."""
    g = (scores - kl_coef * kl.sum(1)).view(-1, n)
    loo = g - (g.sum(1, keepdim=True) - g) / (n - 1)
    return loo.view(-1, 1) * mask


def episode_group_advantages(scores, kl, mask, nxt, n, kl_coef):
    """--advantage group, --episodic: a step's return-to-go (gamma 1) minus the mean of the other n - 1 episodes' from
    its task start at that step (0 past an end), which its actions do not move: no bias."""
    togo = (scores - kl_coef * kl.sum(1)).tolist()  # each step's score, then + later ones
    for r in reversed(range(len(nxt))):
        if nxt[r] >= 0:
            togo[r] += togo[nxt[r]]
    chains = []  # each episode's rows in step order, from its first
    for r in sorted(set(range(len(nxt))) - set(nxt)):
        chains.append([])
        while r >= 0:
            chains[-1].append(r)
            r = nxt[r]
    adv = [0.0] * len(nxt)
    for e, chain in enumerate(chains):
        others = [chains[f] for f in range(e - e % n, e - e % n + n) if f != e]
        for t, r in enumerate(chain):
            adv[r] = togo[r] - sum(togo[c[t]] if t < len(c) else 0.0 for c in others) / (n - 1)
    return torch.tensor(adv, dtype=scores.dtype, device=scores.device)[:, None] * mask


def masked_mean(x, mask, ranks=model.Ranks()):  # over every rank's valid tokens
    return ranks.sum((x * mask).sum()) / ranks.sum(mask.sum()).clamp(min=1)


def whiten(x, mask, eps=1e-8, ranks=model.Ranks()):
    """Zero mean, unit (unbiased) variance over every rank's valid tokens (TRL's masked_whiten)."""
    mean, n = masked_mean(x, mask, ranks), ranks.sum(mask.sum())
    var = ranks.sum(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_coef, denom=None):
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) summed over valid tokens / denom (default: their count)."""
    ratio = torch.exp(logprobs - old_logprobs)
    losses = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef))
    denom, clipped = (mask.sum() if denom is None else denom), ((ratio - 1).abs() > clip_coef).float()
    return (losses * mask).sum() / denom, (clipped * mask).sum() / denom, ratio


def value_loss(values, old_values, returns, mask, vf_clip, denom=None):
    """Clipped value loss (N-details)."""
    clipped = old_values + (values - old_values).clamp(-vf_clip, vf_clip)
    losses = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    denom = mask.sum() if denom is None else denom
    return (losses * mask).sum() / denom


def explained_variance(values, returns, mask, ranks=model.Ranks()):
    var = lambda x: masked_mean((x - masked_mean(x, mask, ranks)) ** 2, mask, ranks)
    return float(1 - var(returns - values) / var(returns).clamp(min=1e-12))


# ==== Batches: a right-padded row per prompt and its responses

def make_batch(prompts, responses, pad, device, group=1):
    """Runs of `group` equal prompts -> ids (B / group, W): each once, then its responses (model.response_hidden)."""
    B, R = len(prompts), max(max(map(len, responses)), 1)
    if B % group or any(prompts[b] != prompts[b - b % group] for b in range(B)):
        raise ValueError(f"the {B} prompts are not runs of {group} equal prompts")
    packed, lengths, starts, mask = [], [], [], torch.zeros(B, R)
    for g in range(0, B, group):
        row = list(prompts[g])
        for b in range(g, g + group):
            starts.append(len(row))
            row += responses[b]
            lengths.append(len(row))
            mask[b, :len(responses[b])] = 1
        packed.append(row)
    ids = nn.utils.rnn.pad_sequence([torch.tensor(row) for row in packed], batch_first=True, padding_value=pad)
    return ids.to(device), torch.tensor(lengths, device=device), mask.to(device), torch.tensor(starts, device=device)


def micro_batches(ids, lengths, starts, idx, cfg, ranks=model.Ranks()):
    """Micro-batches of idx by length (<= micro_batch rows, micro_tokens tokens); fillers to any rank's most (FSDP)."""
    shared = lengths.shape[0] // ids.shape[0]  # responses per ids row (make_batch's group)
    groups = idx.view(-1, shared)
    row_len, out = lengths[groups].max(1).values, []
    for g in torch.argsort(row_len, stable=True).tolist():
        if not out or len(out[-1]) == cfg.micro_batch or (len(out[-1]) + 1) * int(row_len[g]) > cfg.micro_tokens:
            out.append([])
        out[-1].append(g)
    out = [groups[torch.tensor(c, device=idx.device)].reshape(-1) for c in out]
    n = int(ranks.max(len(out))) if ranks.world > 1 else len(out)
    for r, weight in [(g, 1.0) for g in out] + [(torch.arange(shared, device=idx.device), 0.0)] * (n - len(out)):
        W = max(int(lengths[r].max()), int(starts[r].max()) + 1)
        yield r, weight, (ids[r[::shared] // shared, :W], lengths[r], starts[r])


# ==== Acting: generation (step 2), execution in sandboxes (step 3)

def generate(lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None):
    """n responses per prompt (one prefill); on_done(i, text, ended) as response i completes."""
    context = min(lm.config.max_position_embeddings, cfg.max_prompt_len + cfg.max_new_tokens)
    prompts = [model.keep_end(tokenizer.encode(tokenizer.apply_chat_template(m)), context, cfg.max_new_tokens)
               for m in messages]
    text = lambda t: agent.cut_at_stop(tokenizer.decode(t, skip_special_tokens=True), agent.STOP)  # noqa: E731
    done = None if on_done is None else lambda i, t, reason: on_done(i, text(t), reason == "stop")  # noqa: E731
    threads = torch.get_num_threads()  # CPU: 1, scripts share the cores (waiting OpenMP threads crawl)
    torch.set_num_threads(1 if device.type == "cpu" else threads)  # (tests/RESULTS.md, "ppo.py: generation threads")
    try:
        with model.autocast(device):
            g = lm.generate(prompts, cfg.max_new_tokens, cfg.temperature, stop_token_ids=model.stop_ids(lm, tokenizer),
                            seeds=seeds, max_batch=cfg.gen_batch, n=n,
                            stop_fn=model.stop_strings(tokenizer, agent.STOP), on_done=done)
    finally:
        torch.set_num_threads(threads)
    return ([p for p in prompts for _ in range(n)], g.tokens, g.logprobs, [text(t) for t in g.tokens],
            [r == "stop" for r in g.finish_reasons])  # a stop string's tokens stay: the policy chose them


def execute(e, text, reward_config, finished=True, unfinished_invalid=True):
    """Run agent.act; cut responses are invalid (paid for, they grew: tests/RESULTS.md, "PPO on the tiny model")."""
    action = action_input = reason = None
    try:
        if not finished and unfinished_invalid:
            raise agent.ParseError("it did not end within max_new_tokens")
        action, action_input = agent.parse_response(text)
    except agent.ParseError as err:  # invalid (R_format)
        reason = str(err)
    edit = action_input.get("edit_instruction") if action == "Edit Script (AI)" else None
    edit = edit if edit is None or isinstance(edit, str) else json.dumps(edit)  # hashable (C5)
    try:
        result, r = agent.act(e, action, action_input, reason, reward_config)
    except Exception as err:  # noqa: BLE001 - fails the row, not the run
        return error_outcome(f"{e.task.name} at step {e.step_count}", err, reward_config, finished, action, edit,
                             e.metric)
    return {"kind": result.kind, "reward": r, "m_prev": result.metric_prev, "m_new": result.metric_new, "edit": edit,
            "done": result.done, "observation": result.observation, "finished": finished, "action": action}


def error_outcome(where, err, reward_config, finished, action=None, edit=None, metric=None):
    """A row's env raised: an "error" outcome ending its episode, told on stderr (as collect's rollouts)."""
    why = env._short(f"{type(err).__name__}: {err}")
    print(f"ppo.py: {where}: the environment failed, an error outcome: {why}", file=sys.stderr, flush=True)
    return {"kind": "error", "reward": reward("error", config=reward_config), "m_prev": metric, "m_new": metric,
            "done": True, "observation": f"EnvError: {why}", "finished": finished, "action": action, "edit": edit}


def make_env(task, task_dir, editor):
    return env.Env(task if task in env.BUILTIN_TASKS else task_dir, editor=editor)


def generate_and_run(lm, tokenizer, messages, cfg, pool, device, timer, run, seeds=None, n=1):
    """generate; run(row, text, ended) in the pool as a response ends, or (--script-gpu) after the KV cache is freed."""
    running, gpu = {}, str(device).startswith("cuda") and bool(env.SCRIPT_GPU)

    def start(i, text, ended):  # once per row -> its future
        if i not in running:
            running[i] = pool.submit(run, i, text, ended)
        return running[i]

    prompts, tokens, gen_lp, texts, ended = generate(lm, tokenizer, messages, cfg, device, seeds, n,
                                                     None if gpu else start)
    if gpu:
        torch.cuda.empty_cache()
    timer("generate")  # executions under way
    futures = [start(i, text, end) for i, (text, end) in enumerate(zip(texts, ended))]
    outcomes = [f.result() for f in futures]
    timer("execute")
    return prompts, tokens, gen_lp, texts, outcomes


def step_rollout(states, lm, tokenizer, cfg, pool, editor, device, timer, seeds=None, n=1):
    """Steps 2-3: n actions per expert state (rows state-major), each from the restored state."""
    def run(i, text, ended):
        s = states[i // n]
        try:
            e = make_env(s["task"], s["task_dir"], editor)
            e.restore(s["snapshot"])  # as the expert found s_t
        except Exception as err:  # noqa: BLE001 - fails the row, not the run
            return error_outcome(f"state {s.get('id')} of {s['task']}", err, cfg.reward, ended)
        return execute(e, text, cfg.reward, ended, cfg.unfinished_invalid)

    prompts, tokens, gen_lp, _, outcomes = generate_and_run(lm, tokenizer, [s["messages"] for s in states], cfg,
                                                            pool, device, timer, run, seeds, n)
    return prompts, tokens, gen_lp, outcomes, [-1] * len(outcomes)


def episode_rollout(starts, lm, tokenizer, cfg, pool, editor, device, timer, seeds=None):
    """Steps 2-3, --episodic: episodes from task starts, a batch a step -> rows in step order, nxt (-1: none)."""
    envs = [make_env(s["task"], s["task_dir"], editor) for s in starts]
    problems = list(pool.map(lambda e: e.reset(), envs))  # runs the starter script (cached)
    timer("execute")
    histories, alive, rows = [[] for _ in starts], list(range(len(starts))), []
    for _ in range(cfg.episode_steps):
        if not alive:
            break
        msgs = [agent.build_messages(problems[i], histories[i], [tuple(x) for x in starts[i]["ideas"]]) for i in alive]
        step_seeds = None if seeds is None else [seeds[i] * 1000 + len(histories[i]) for i in alive]
        run = lambda j, text, end: execute(envs[alive[j]], text, cfg.reward, end, cfg.unfinished_invalid)  # noqa: E731
        p, t, lp, texts, res = generate_and_run(lm, tokenizer, msgs, cfg, pool, device, timer, run, step_seeds)
        for j, i in enumerate(alive):
            histories[i].append((texts[j], res[j]["observation"]))
        rows += zip(p, t, lp, res, alive)  # prompt, tokens, log-probs, outcome, episode
        alive = [i for j, i in enumerate(alive) if not res[j]["done"]]
    prompts, tokens, gen_lp, outcomes, episode = map(list, zip(*rows))
    nxt = [next((k for k in range(r + 1, len(episode)) if episode[k] == episode[r]), -1) for r in range(len(episode))]
    return prompts, tokens, gen_lp, outcomes, nxt


# ==== Scoring (step 4) and the update (step 6), in micro-batches of similar lengths

def forward_scores(actor, critic, ref, ids, lengths, starts, R, cfg, device, ranks=model.Ranks(), logprobs=None):
    """No-grad forwards -> logprobs, ref_logprobs, values (B, R); given logprobs, no actor forward."""
    B = lengths.shape[0]
    out = [torch.zeros(B, R, device=device) if x is None else x for x in (logprobs, None, None)]
    with torch.no_grad(), model.autocast(device):
        for idx, weight, (i, ln, st) in micro_batches(ids, lengths, starts, torch.arange(B, device=device), cfg, ranks):
            lp = actor(i, ln, st) if logprobs is None else None
            model.set_lora(actor, ref is not None)  # LoRA: reference = actor, adapters off
            ref_lp = (actor if ref is None else ref)(i, ln, st)
            model.set_lora(actor, True)
            v = critic(i, ln, st).float() if critic is not None else None
            for k, x in enumerate((lp, ref_lp, v) if weight else ()):  # a filler (weight 0): none
                if x is not None:
                    out[k][idx, :x.shape[1]] = x
    model.reshard(actor, critic, ref)  # no backward follows: free FSDP2's gathered roots
    return out


def ppo_update(actor, critic, opt_a, opt_c, data, cfg, device, gen, step_actor=True, ranks=model.Ranks()):
    """Clipped losses over minibatches (a state's "group" in one) and epochs on this rank's rows; all ranks draw one
    permutation, divide by the minibatch's tokens: the summed gradient is one process's (FSDP averages: * world)."""
    ids, lengths, starts, mask, group = data["ids"], data["lengths"], data["starts"], data["mask"], data.get("group", 1)
    places = data.get("rows") or [ranks.rank + k * ranks.world for k in range(lengths.shape[0])]
    local, B = {g: k for k, g in enumerate(places)}, int(ranks.sum(torch.tensor(len(places), device=device)))
    sharded = model.is_sharded(actor)
    stats, first_ratio, actor_steps, scale = [], 0.0, 0, ranks.world if sharded else 1.0
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(B // group, generator=gen)
        for mb in perm.split(max(B // group // cfg.num_minibatches, 1)):  # of states
            mb = (mb[:, None] * group + torch.arange(group)).view(-1)  # their responses
            mine = torch.tensor([local[g] for g in mb.tolist() if g in local], dtype=torch.long, device=device)
            denom = ranks.sum(mask[mine].sum()).clamp(min=1)  # whole minibatch's
            s = torch.zeros(4, device=device)  # pg_loss, vf_loss, clipfrac, approx_kl
            for idx, weight, (i, ln, st) in micro_batches(ids, lengths, starts, mine, cfg, ranks):
                with model.autocast(device):
                    with torch.set_grad_enabled(step_actor):  # no step, no graph (FSDP2 keeps its root for one)
                        lp = actor(i, ln, st)
                    n = lp.shape[1]
                    m, old = mask[idx, :n] * weight, data["logprobs"][idx, :n]
                    pg, cf, ratio = policy_loss(lp, old, data["advantages"][idx, :n], m, cfg.clip_coef, denom)
                    if step_actor:
                        (pg * scale).backward()
                    vf = torch.zeros(())
                    if critic is not None:  # --advantage group
                        v = critic(i, ln, st).float()
                        vf = value_loss(v, data["values"][idx, :n], data["returns"][idx, :n], m, cfg.vf_clip, denom)
                        (vf * scale).backward()
                if not stats and weight:  # first minibatch: policy not moved yet
                    first_ratio = max(first_ratio, float(((ratio.detach() - 1).abs() * m).max()))
                kl = (0.5 * (lp.detach() - old) ** 2 * m).sum() / denom
                s += torch.tensor([float(pg.detach()), float(vf.detach()), float(cf), float(kl)], device=device)
            s = ranks.sum(s)  # every rank's rows
            if step_actor and cfg.target_kl and s[3] > 1.5 * cfg.target_kl:  # early stop (Spinning Up, CleanRL)
                step_actor = False  # the critic goes on
                actor.zero_grad(set_to_none=True)
            actor_steps += step_actor
            for net, opt in ((actor, opt_a),) * step_actor + ((critic, opt_c),) * (critic is not None):
                trained = [q for q in net.parameters() if q.requires_grad]
                if ranks.world > 1 and not sharded:  # LoRA: sum adapter gradients
                    for q in trained:
                        q.grad = ranks.sum(q.grad if q.grad is not None else torch.zeros_like(q))
                nn.utils.clip_grad_norm_(trained, cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            stats.append(s)
    model.reshard(actor)  # gathered by its no-grad forwards if it did not step
    mean = dict(zip(("pg_loss", "vf_loss", "clipfrac", "approx_kl"), torch.stack(stats).mean(0).tolist()))
    return {**mean, "ratio_first_minibatch_max_dev": ranks.max(first_ratio), "actor_steps": actor_steps}


# ==== Checkpoints: the actor's Hugging Face folder with trainer_state/ in it

def save_checkpoint(run):
    """Every rank (FSDP gathers); rank 0 writes <out>.tmp and swaps it in."""
    cfg, actor, critic = run.cfg, run.actor, run.critic
    adapters = lambda net: {k: v for k, v in model.full_state(net).items()  # noqa: E731
                            if not cfg.lora_rank or k.startswith("head.") or ".A" in k or ".B" in k}
    actor_state = model.full_state(actor)
    state = {"critic": adapters(critic), "actor_lora": adapters(actor) if cfg.lora_rank else None,
             "opt_actor": model.optim_state(actor, run.opt_a), "opt_critic": model.optim_state(critic, run.opt_c),
             "progress": run.progress}
    if run.ranks.rank != 0:
        return
    dtype = model.save_dtype(cfg.save_dtype, run.ranks.device)
    tmp, master = model.save_checkpoint_folder(actor.lm, run.tokenizer, cfg.out, dtype, actor_state)
    state["actor"] = master  # fp32 masters if bf16 rounds them, else None
    os.makedirs(os.path.join(tmp, "trainer_state"))
    torch.save(state, os.path.join(tmp, "trainer_state", "state.pt"))
    agent.write_atomic(os.path.join(tmp, "trainer_state", "progress.json"), json.dumps(
        {**run.progress, "config": dataclasses.asdict(cfg), "world_size": run.ranks.world}, indent=1))
    agent.swap_folder(tmp, cfg.out)  # claim_out repairs a kill inside


def find_resume(out):
    """The last complete checkpoint's folder (a kill between the two renames leaves it at <out>.old)."""
    return next((f for f in (out, out + ".old") if os.path.exists(os.path.join(f, "trainer_state", "state.pt"))), None)


def claim_out(cfg):
    """Refuse an --out this run does not own (saving replaces it); lock it against a second ppo.py."""
    out = os.path.abspath(cfg.out)
    if os.path.isfile(out):
        raise ValueError(f"--out {cfg.out} is a file; give a folder")
    if os.path.isdir(cfg.model) and os.path.abspath(cfg.model) == out:
        raise ValueError(f"--out {cfg.out} is the --model folder; ppo.py would replace it")
    if os.path.isdir(out) and os.listdir(out) and not find_resume(out):
        raise ValueError(f"--out {cfg.out} holds something that is not a ppo.py checkpoint; give another folder")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    lock = agent.lock_file(out + ".lock", f"--out {cfg.out}")  # beside the folder
    agent.recover_folder(out, out + ".tmp")  # what a kill while saving left
    return lock


def check_resume_reward(folder, cfg):
    """ValueError if `folder`'s checkpoint recorded another reward than cfg (reward.py's, --unfinished-invalid)."""
    path = os.path.join(folder, "trainer_state", "progress.json")
    recorded = model.read_json(path).get("config", {}) if os.path.exists(path) else {}
    theirs = {"reward": from_record(recorded["reward"]) if recorded.get("reward") is not None else cfg.reward,
              "unfinished_invalid": recorded.get("unfinished_invalid", cfg.unfinished_invalid)}
    for key, value in theirs.items():
        if value != getattr(cfg, key):
            said = mismatch(value, cfg.reward) if key == "reward" else \
                f"{key}={value}, the flags give {getattr(cfg, key)}"
            raise ValueError(f"{folder} was trained with {said}; pass the same flags or another --out")


# ==== Training: `setup` once, then per iteration the six steps

def load_states(path):
    need = ("task", "task_dir", "step", "messages", "snapshot", "m_init", "m_best", "higher_is_better")
    states = agent.read_jsonl(path, need, "a state of collect.py")
    if not states:
        raise ValueError(f"no states in {path}; run collect.py first or pass --states")
    return states


def pick_tasks(states, n, seed):
    names = sorted({s["task"] for s in states})
    chosen = set(random.Random(f"tasks:{seed}").sample(names, min(n, len(names))))
    return [s for s in states if s["task"] in chosen]


def build(cfg, init, resume, st, ranks):
    """fp32 actor, critic, frozen reference (ranks: FSDP2), or LoRA: fp32 adapters on a frozen base (CUDA: bf16)."""
    device, lora = ranks.device, cfg.lora_rank
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # weights never updated
    world = ranks.world if ranks.world > 1 and not lora else 0  # LoRA: whole models
    saved = st["critic"] if st else {}
    part = lambda prefix: ((k.removeprefix(prefix), v) for k, v in saved.items() if k.startswith(prefix))  # noqa: E731

    def make(kind, dtype, tensors):
        lm = model.load(init, device, dtype, meta=True)[0]
        if kind != "ref" and cfg.grad_checkpointing:
            model.enable_grad_checkpointing(lm)
        net = Critic(lm) if kind == "critic" else Actor(lm, cfg.temperature, cfg.logits_chunk)
        net = model.place(net, lm, tensors, device, world)
        if kind != "ref" and lora:
            model.add_lora(lm, lora, cfg.lora_alpha)
        return net

    base = low if lora else torch.float32
    actor = make("actor", base, st["actor"].items() if st and st.get("actor") else  # a bf16 folder's master weights
                 model.weight_tensors(init if lora else resume or init))
    critic = make("critic", base, part("backbone.") if st and not lora else model.weight_tensors(init))
    model.fill(critic.head, part("head.") if st else critic.head_init(cfg.seed))
    if st and lora:
        actor.load_state_dict(st["actor_lora"], strict=False)
        critic.load_state_dict(saved, strict=False)
    ref = None if lora else make("ref", low, model.weight_tensors(init)).requires_grad_(False)
    return actor, critic, ref


def collective_timeout(cfg, states):
    """Seconds a collective waits: 2 h, or twice this rank's rollout (waves of --workers scripts, longest limit)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    limit = max(env.BUILTIN_TASKS[t].time_limit if t in env.BUILTIN_TASKS else env.load_task(d).time_limit
                for t, d in {(s["task"], s["task_dir"]) for s in states})
    actions = math.ceil(cfg.batch_size / world) * (cfg.samples_per_state or GROUP_SAMPLES)
    return max(2 * 3600, 2 * limit * (math.ceil(actions / cfg.workers) + cfg.episodic * cfg.episode_steps))


def setup(cfg):
    """Rank, states (--tasks' draw), --out, resume point, models, optimizers -> run. The critic exists under either
    advantage (one checkpoint layout); value_net: None if --advantage group leaves it unused; ref: None with LoRA."""
    states = load_states(cfg.states)  # first: the process group's timeout is a rollout's
    rank, world, device = model.setup_distributed(cfg, collective_timeout(cfg, states))
    if device.type == "cuda":  # each rank's scripts on its own GPU or none
        env.set_script_gpu(device.index if cfg.script_gpu else None)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    torch.manual_seed(cfg.seed)  # the adapters' init
    if cfg.tasks:
        states = pick_tasks(states, cfg.tasks, cfg.seed)
        say(f"ppo.py: training on the {len(states)} states of {len({s['task'] for s in states})} task(s): "
            f"{' '.join(sorted({s['task'] for s in states}))}")
    if (max(cfg.batch_size // cfg.episode_steps, 1) if cfg.episodic else cfg.batch_size) < world:
        raise ValueError(f"--batch-size {cfg.batch_size} gives {'task starts' if cfg.episodic else 'states'} to fewer "
                         f"than the {world} ranks")
    if not cfg.episodic and len(states) < world:  # every rank alike, before any collective
        raise ValueError(f"{cfg.states}: {len(states)} state(s){' of the chosen tasks' if cfg.tasks else ''} for "
                         f"{world} ranks; every rank needs at least one state per batch")
    lock = claim_out(cfg) if rank == 0 else None  # rank 0 owns --out and the log
    if world > 1:
        dist.barrier()  # rank 0 has repaired --out
    resume, st = find_resume(cfg.out), None
    if resume:
        check_resume_reward(resume, cfg)
        st = model.load_trainer_state(os.path.join(resume, "trainer_state", "state.pt"), ("progress",), "ppo.py",
                                      "pass another --out")
        say(f"ppo.py: resuming from {resume} at iteration {st['progress']['iteration']}")
    progress = dict(st["progress"]) if st else {"iteration": 0, "init_model": cfg.model}
    lm, tokenizer = model.load(progress["init_model"], device, torch.float32, meta=True)
    cfg = resolve_defaults(cfg, n_params := sum(p.numel() for p in lm.parameters()))
    if world == 1 and not cfg.lora_rank:  # actor, critic 16 B a parameter, reference 2
        model.check_fits(n_params, 34, device, "pass --lora-rank 16, or shard over GPUs (torchrun --nproc_per_node 8)")
    actor, critic, ref = build(cfg, progress["init_model"], resume, st, ranks := model.Ranks(rank, world, device))
    say(f"ppo.py: actor lr {cfg.actor_lr:g}, " + (f"group baseline over {cfg.samples_per_state} "
        f"{'episodes per task start' if cfg.episodic else 'samples per state'}, no "
        "critic" if cfg.advantage == "group" else f"critic lr {cfg.critic_lr:g}, critic alone for the first "
        f"{cfg.critic_warmup} iteration(s)") + f"; {world} rank(s) on {device}"
        f"{' (FSDP2)' if model.is_sharded(actor) else ' (LoRA, data parallel)' if world > 1 else ''}")
    opt_a, opt_c = (torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, eps=cfg.adam_eps,
                                      weight_decay=0.0) for net, lr in ((actor, cfg.actor_lr), (critic, cfg.critic_lr)))
    for net, opt, key in ((actor, opt_a, "opt_actor"), (critic, opt_c, "opt_critic")) if st else ():
        model.set_optim_state(net, opt, st[key])
    if rank == 0:  # built-in tasks prepared once (no race); log cut to the checkpoint
        for s in {s["task"]: s for s in states}.values():
            make_env(s["task"], s["task_dir"], None)
        os.makedirs(os.path.dirname(cfg.log_file) or ".", exist_ok=True)
        agent.trim_log(cfg.log_file, "iteration", progress["iteration"], cfg.out)
    if world > 1:
        dist.barrier()
    editor = env.recipe_editor if cfg.editor == "recipes" else agent.LLMEditor(agent.make_backend(cfg.editor))
    total = cfg.iterations or min(max(math.ceil(cfg.epochs * max(len(states) // cfg.batch_size, 1)), 1),
                                  TINY_ITERATIONS if n_params < TINY_PARAMS else math.inf)  # --iterations: more
    return types.SimpleNamespace(cfg=cfg, ranks=ranks, states=states, actor=actor, critic=critic,
                                 ref=ref, value_net=critic if cfg.advantage == "gae" else None,
                                 tokenizer=tokenizer, opt_a=opt_a, opt_c=opt_c, progress=progress,
                                 editor=editor, total=total, lock=lock, say=say, expert_comparable=not cfg.episodic
                                 and all(from_record(s.get("reward_config")) == cfg.reward for s in states))  # unmixed


class Timer:
    """timer(part) adds the seconds since its last call to `part`."""

    def __init__(self):
        self.start = self.last = time.time()
        self.times = {"generate": 0.0, "execute": 0.0, "update": 0.0}

    def __call__(self, part):
        self.times[part] += time.time() - self.last
        self.last = time.time()


def sample_states(run, it):
    """Step 1: batch_size states (seeded shuffle per epoch) or task starts -> this rank's share, seeds, places."""
    cfg, states, ranks = run.cfg, run.states, run.ranks
    epoch, k = divmod(it, max(len(states) // cfg.batch_size, 1))
    if cfg.episodic:
        starts, rng = ([s for s in states if s["step"] == 0] or states), random.Random(f"{cfg.seed}:{it}")
        batch = [rng.choice(starts) for _ in range(max(cfg.batch_size // cfg.episode_steps, 1))]
    else:
        order = list(range(len(states)))
        random.Random(f"{cfg.seed}:{epoch}").shuffle(order)
        batch = [states[i] for i in order[k * cfg.batch_size:(k + 1) * cfg.batch_size]]
    mine = list(range(ranks.rank, len(batch), ranks.world))
    return [batch[g] for g in mine], [(cfg.seed * 100003 + it) * 100003 + g for g in mine], mine


def rollout(run, batch, seeds, index, pool, timer):
    """Steps 2-3 on this rank's states (--episodic: episodes from each), and each row's place in the batch."""
    cfg, ranks, n = run.cfg, run.ranks, run.cfg.samples_per_state
    policy = model.rollout_copy(run.actor.lm, ranks.device)  # FSDP: a gathered copy (bf16 on CUDA); LoRA: merged
    if cfg.episodic:
        out = episode_rollout([s for s in batch for _ in range(n)], policy, run.tokenizer, cfg, pool, run.editor,
                              ranks.device, timer, seeds=[s * n + j for s in seeds for j in range(n)])
        sizes = ranks.gather([len(out[3])])  # episodes end at different steps
        places = [sum(sizes[:ranks.rank]) + j for j in range(len(out[3]))]
    else:
        out = step_rollout(batch, policy, run.tokenizer, cfg, pool, run.editor, ranks.device, timer, seeds=seeds, n=n)
        places = [g * n + j for g in index for j in range(n)]
    del policy
    if model.is_sharded(run.actor) and ranks.device.type == "cuda":
        torch.cuda.empty_cache()
    return (*out, places)


def score(run, prompts, tokens, gen_lp, outcomes):
    """Step 4: the rollout as one batch with log-probs (old, reference), values, token rewards."""
    cfg, ranks, device = run.cfg, run.ranks, run.ranks.device
    # a state's samples share a row unless gradient checkpointing (KV cache written twice) or FSDP
    group = 1 if cfg.episodic else cfg.samples_per_state
    ids, lengths, mask, starts = make_batch(prompts, tokens, run.tokenizer.pad_token_id, device,
                                            1 if cfg.grad_checkpointing or model.is_sharded(run.actor) else group)
    # old log-probs: departure 5 (CUDA's bf16 rollout differs: recomputed, as VeRL, OpenRLHF)
    generated = torch.zeros(mask.shape, device=device)
    generated[mask.bool()] = torch.tensor([x for lps in gen_lp for x in lps], device=device)
    kept = generated if device.type == "cpu" else None
    logprobs, ref_logprobs, values = (x * mask for x in forward_scores(
        run.actor, run.value_net, run.ref, ids, lengths, starts, mask.shape[1], cfg, device, ranks, logprobs=kept))
    gen_gap = None if kept is not None else ranks.max((generated - logprobs).abs().max())
    scores = torch.tensor([o["reward"] for o in outcomes], device=device)
    rewards, kl = token_rewards(scores, logprobs, ref_logprobs, mask, cfg.kl_coef)
    return dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=logprobs, values=values, group=group,
                scores=scores, rewards=rewards, kl=kl, gen_gap=gen_gap)


def estimate_advantages(run, data, nxt):
    """Step 5: GAE (--episodic: across steps) whitened over the batch, or the group baseline."""
    cfg, mask = run.cfg, data["mask"]
    if run.value_net is None:
        adv = episode_group_advantages(data["scores"], data["kl"], mask, nxt, cfg.samples_per_state, cfg.kl_coef) \
            if cfg.episodic else group_advantages(data["scores"], data["kl"], mask, cfg.samples_per_state, cfg.kl_coef)
        return adv, adv, None
    adv, returns = gae_rows(data["rewards"], data["values"], mask, nxt, cfg.gamma, cfg.lam)
    return whiten(adv, mask, ranks=run.ranks), returns, explained_variance(data["values"], returns, mask, run.ranks)


def log_iteration(run, it, batch, outcomes, places, data, ev, upd, timer):
    """Log line (rank 0's times); beside the reward (it moves with the states drawn) the expert's (tests/RESULTS.md)."""
    ranks, times = run.ranks, timer.times
    expert = [batch[k // run.cfg.samples_per_state]["expert"]["reward"] if run.expert_comparable else None
              for k in range(len(outcomes))]  # step-wise rows are state-major
    rows = sorted(zip(ranks.gather(places), ranks.gather(outcomes), ranks.gather(expert)), key=lambda x: x[0])
    outcomes, expert = [o for _, o, _ in rows], [x for _, _, x in rows]
    kinds, n = [o["kind"] for o in outcomes], len(outcomes)
    reward_mean, expert_reward = sum(o["reward"] for o in outcomes) / n, None if None in expert else sum(expert) / n
    edits = [o for o in outcomes if o["kind"] == "edit" and o["m_new"] is not None and o["m_prev"] is not None]
    log = {"iteration": it + 1, "actions": n, "reward": reward_mean, "expert_reward": expert_reward,
           "reward_vs_expert": None if expert_reward is None else reward_mean - expert_reward,
           "rewards": [o["reward"] for o in outcomes],
           **{f"frac_{k}": kinds.count(k) / n for k in ("invalid", "error", "corner", "neutral", "edit", "final")},
           "frac_unfinished": sum(not o.get("finished", True) for o in outcomes) / n,
           "frac_improved": sum(o["reward"] > 0 for o in edits) / n,
           "metric_change": sum(o["m_new"] - o["m_prev"] for o in edits) / len(edits) if edits else 0.0,
           "kl": float(ranks.sum(data["kl"].sum())) / n, "response_tokens": float(ranks.sum(data["mask"].sum())) / n,
           "explained_variance": ev, "generate_vs_forward_logprob_gap": data["gen_gap"], **upd,
           **{f"time_{k}": v for k, v in times.items()}, "time_total": time.time() - timer.start,
           "world_size": ranks.world, "out": os.path.abspath(run.cfg.out),
           "actor_updated": it >= run.cfg.critic_warmup, "reward_config": dataclasses.asdict(run.cfg.reward)}
    shares = " ".join(f"{k} {log['frac_' + k]:.2f}" for k in ("invalid", "error", "corner", "neutral", "edit"))
    vs = "" if expert_reward is None else f" (expert {expert_reward:+.3f})"
    run.say(f"it {it + 1}/{run.total} reward {log['reward']:+.3f}{vs} ({shares} improved {log['frac_improved']:.2f}) "
            f"dmetric {log['metric_change']:+.4f} kl {log['kl']:.4f} clip {log['clipfrac']:.3f} vf "
            f"{log['vf_loss']:.4f} ev {'-' if ev is None else f'{ev:+.2f}'} | gen {times['generate']:.1f}s exec "
            f"{times['execute']:.1f}s update {times['update']:.1f}s")
    if ranks.rank == 0:
        agent.append_jsonl(run.cfg.log_file, log)


def train(cfg):
    """The whole run -> its progress."""
    cfg, pool = (run := setup(cfg)).cfg, ThreadPoolExecutor(run.cfg.workers)
    for it in range(run.progress["iteration"], run.total):
        timer = Timer()
        # 1. sample a batch of states from d^{pi_e}; this rank takes every world-th, each with its seed
        batch, seeds, index = sample_states(run, it)
        # 2. the policy generates actions (batched, left-padded, KV cache, log-probs kept)
        # 3. each environment restores its state and executes its action, sandboxes in parallel
        prompts, tokens, gen_lp, outcomes, nxt, places = rollout(run, batch, seeds, index, pool, timer)
        # 4. reward.py's score on the last token, the KL penalty to the frozen reference on every token
        data = score(run, prompts, tokens, gen_lp, outcomes)
        # 5. advantages: the critic's GAE, whitened, or the group baseline
        data["advantages"], data["returns"], ev = estimate_advantages(run, data, nxt)
        # 6. clipped policy and value losses over minibatches and epochs (in the warm-up the critic's)
        upd = ppo_update(run.actor, run.value_net, run.opt_a, run.opt_c, {**data, "rows": places}, cfg,
                         run.ranks.device, torch.Generator().manual_seed(cfg.seed * 100003 + it),
                         step_actor=it >= cfg.critic_warmup, ranks=run.ranks)
        timer("update")
        log_iteration(run, it, batch, outcomes, places, data, ev, upd, timer)
        run.progress["iteration"] = it + 1
        if (it + 1) % cfg.save_every == 0 or it + 1 == run.total:
            save_checkpoint(run)
    pool.shutdown()
    if dist.is_initialized():
        dist.barrier()  # rank 0 has saved
    if run.lock:
        run.lock.close()
    return run.progress


# ==== Command line: a flag per Config field, checked by its type (exit 2)

TYPES = {**dict.fromkeys(("tasks", "iterations", "critic_warmup", "lora_rank"), agent.COUNT), "seed": int,
         **dict.fromkeys(("target_kl", "kl_coef"), agent.NONNEGATIVE), "gamma": agent.FRACTION, "lam": agent.FRACTION,
         "device": model.refusing(str, model.bad_device)}


def parser():
    p = agent.Parser(prog="ppo.py", description="Step-wise PPO (ML-Agent) over the expert states pool (tiny: under "
                     f"{TINY_PARAMS:,} parameters).")
    agent.add_fields(p, Config, TYPES, {"advantage": ("gae", "group"), "save_dtype": ("auto", "float32")})
    add_reward_flags(p)
    return p


def main(argv=None):
    args = (p := parser()).parse_args(argv)
    try:  # reward.py's flags, what Config refuses, a --model found nowhere (unless resuming)
        cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name != "reward"},
                     reward=reward_from_flags(args))
        if not find_resume(cfg.out):
            model.resolve(cfg.model)
        agent.check_model(p, "--editor", None if cfg.editor == "recipes" else cfg.editor, None, "set OPENAI_BASE_URL")
    except (OSError, ValueError) as e:
        hint = "; run sft.py first or pass --model" * (args.model == Config.model)  # default, not made yet
        p.error(f"--model: {e}{hint}" if isinstance(e, OSError) else str(e))
    model.run_main("ppo.py", train, cfg, (OSError, ValueError, env.TaskError))


if __name__ == "__main__":
    main()
