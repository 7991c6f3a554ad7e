"""Step-wise PPO of ML-Agent (arXiv:2505.23723, §"Step-wise RL paradigm"): an actor, a critic and a frozen reference,
trained on states sampled from the expert's state distribution d^{pi_e} (runs/data/states.jsonl, from collect.py).

J_step(theta) = E_{s ~ d^{pi_e}, a ~ pi_theta(.|s)} [R(s, a)]: each iteration samples expert states, the policy takes
ONE action in each, the state's environment is restored, the action executed in the sandbox and scored by reward.py
(agent.act), and PPO updates; `train` numbers the six steps. The PPO details follow "The N Implementation Details of
RLHF with PPO" (Huang et al. 2024) and CleanRL: left-padded generation, log-probs under temperature-scaled logits, a
per-token KL penalty to the reference inside the reward, the score on the last token, GAE (gamma 1, lambda 0.95),
whitened advantages, clipped policy and value losses, no dropout. Departures (each explained where it is coded):
1. Rates: a pre-trained policy keeps the paper's (actor 1e-6, critic 1e-5); the offline tiny model gets TINY's and
   the group baseline. Batch, temperature, KL and clip settings (the paper is silent) are the N-details' (`Config`).
2. `--samples-per-state n` (OpenRLHF's n_samples_per_prompt; the paper samples one) shares each prompt's prefill and
   forward pass; `--advantage group` replaces the critic by the other samples of the state (RLOO, arXiv:2402.14740).
3. The critic is a copy of the policy with a scalar head (as OpenRLHF's), not initialised from a reward model.
4. Masks come from lengths, so pad may equal EOS. Generation stops where agent.run_episode's does; each action starts
   executing as soon as its response is complete (`Executions`); a response cut at --max-new-tokens is invalid.
5. On CPU the old log-probs are the generation's (the rollout ran on the actor's fp32 weights); CUDA recomputes them.
6. `--episodic` is the paper's episode-wise ablation; `--tasks N` trains on N tasks (ML-Agent Figure 5); `--lora-rank`
   trains adapters (arXiv:2106.09685), the reference being the actor with them off; `Edit Script (AI)` runs env.py's
   offline recipe editor unless --editor names an endpoint model.
7. One GPU node: torchrun ranks share each batch (every state sampled with its own seed, so any world size samples
   alike); FSDP2 shards actor, critic and reference, and each rank generates from a gathered bf16 copy (VeRL's "hybrid
   engine") rather than a separate inference engine, to keep generation in model.py. tests/bench_memory.py plans it.

Run:  python collect.py && python sft.py && python ppo.py               (tiny model, offline, minutes)
      torchrun --nproc_per_node 8 ppo.py --model runs/ckpt/sft --batch-size 256 --max-new-tokens 1024   (GPU node)
      python ppo.py --model runs/ckpt/sft --lora-rank 16 --batch-size 256 --max-new-tokens 1024      (one GPU)
      python ppo.py --episodic;  python ppo.py --binary-performance     (ablations: episode-wise RL, ML-Agent Table 3)
Outputs: runs/ckpt/ppo (the actor's Hugging Face folder, trainer_state/ for resume) and runs/ppo/log.jsonl (a line an
iteration); both record the reward flags, and a resume with other flags stops rather than mix two rewards.
"""
import argparse
import dataclasses
import json
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

import agent
import env
import model
from reward import RewardConfig, add_flags as add_reward_flags, from_flags as reward_from_flags, from_record

ROOT = env.ROOT  # default paths live under the project's runs/, wherever ppo.py is started from


@dataclasses.dataclass
class Config:
    model: str = str(ROOT / "runs/ckpt/sft")  # the policy to start from, folder or hub id (ML-Agent: the SFT model)
    states: str = str(ROOT / "runs/data/states.jsonl")  # the states pool d^{pi_e} (collect.py)
    out: str = str(ROOT / "runs/ckpt/ppo")    # the actor (Hugging Face folder) + trainer_state/; resume point
    log_file: str = str(ROOT / "runs/ppo/log.jsonl")  # a JSON line per iteration (--log would clash with torchrun's)
    seed: int = 0                            # seeds the state order, sampling and the value head
    tasks: int = 0                           # > 0: the states of this many tasks, a seeded draw (ML-Agent Figure 5)
    epochs: float = 1.0                      # passes over the states pool (paper: 1 epoch)
    iterations: int = 0                      # if > 0, stop after this many iterations instead
    batch_size: int = 16                     # states per iteration (paper ~256: 10k states / 39 steps)
    samples_per_state: int | None = None     # actions per state (--episodic: episodes per task start), sharing the
                                             # prompt's prefill; None: 1 (the paper), GROUP_SAMPLES with the group
    num_minibatches: int = 2                 # PPO minibatches per iteration (N-details: 1)
    micro_batch: int = 4                     # at most this many rows per forward pass (gradient accumulation)
    micro_tokens: int = 16384                # and at most this many tokens (rows x the longest; a longer row alone)
    logits_chunk: int = 1024                 # response tokens whose logits (tokens x vocab, fp32) exist at once
    gen_batch: int = 16                      # prompts per generate call: their KV cache bounds the rollout's memory
    grad_checkpointing: bool = False         # recompute each block in backward; always on for models past TINY_PARAMS
    update_epochs: int = 1                   # PPO epochs over each batch (OpenRLHF examples: 1; N-details: 4)
    target_kl: float = 0.0                   # > 0: the actor stops for the iteration once a minibatch's approx KL
                                             # to the rollout policy passes 1.5 x this (Spinning Up: 0.01)
    actor_lr: float | None = None            # None: 1e-6 (ML-Agent §Experiments "Training"); the tiny model: TINY
    critic_lr: float | None = None           # None: 1e-5 (ML-Agent §Experiments "Training"); the tiny model: TINY
    critic_warmup: int | None = None         # first iterations that update only the critic; None: 0, tiny: TINY
    adam_eps: float = 1e-5                   # N-details (TF Adam's 1e-5)
    max_grad_norm: float = 1.0               # OpenRLHF default
    max_new_tokens: int = 400                # tokens per action (the scripted expert's longest responses fit)
    max_prompt_len: int = 15000              # a longer prompt loses its oldest tokens (as sft.py --max-len; ML-Agent)
    temperature: float = 0.7                 # N-details (summarize_from_feedback_details): 0.7
    kl_coef: float = 0.05                    # N-details: per-token KL penalty coefficient 0.05
    gamma: float = 1.0                       # N-details: no discount
    lam: float = 0.95                        # GAE lambda (N-details)
    advantage: str | None = None             # "gae": the critic's GAE (the paper's PPO); "group": no critic, the
                                             # other samples of the state (RLOO). None: gae; tiny: TINY
    clip_coef: float = 0.2                   # PPO ratio clip (Schulman et al. 2017; N-details)
    vf_clip: float = 0.2                     # value clip around the rollout values (N-details cliprange_value)
    unfinished_invalid: bool = True          # no stop token within max_new_tokens: invalid (N-details: score -1)
    workers: int = 4                         # sandboxes executing actions in parallel (threads over subprocesses)
    script_gpu: bool = True                  # on CUDA a rank's scripts see its GPU; --no-script-gpu hides them all
    episodic: bool = False                   # the ablation: whole episodes from task starts
    episode_steps: int = 4                   # steps per episode in --episodic (paper's trajectories: 15)
    save_every: int = 5                      # checkpoint every N iterations (and at the end)
    editor: str = "recipes"                  # "recipes" (offline stand-in) or an endpoint model for Edit Script (AI)
    device: str | None = None                # default: cuda if available
    lora_rank: int = 0                       # > 0: train rank-r adapters instead of all weights
    lora_alpha: float = 16.0                 # adapter scale alpha / r (Hu et al. 2021)
    save_dtype: str = "auto"                 # the actor folder's: auto = bfloat16 from CUDA (fp32 master weights in
                                             # trainer_state/), float32 on CPU; or float32
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)  # reward.py's flags (ML-Agent Table 3)


PAPER = dict(actor_lr=1e-6, critic_lr=1e-5, critic_warmup=0, advantage="gae")  # ML-Agent's, for a pre-trained 7B
# The offline miniature (sft.py's tiny model from scratch; any policy under TINY_PARAMS): at the paper's rates its
# weights do not move, so it takes larger ones; with the critic its advantages did not raise J_step at any setting
# tried, with the group baseline over 4 samples per state they did (tests/RESULTS.md, "PPO on the tiny model";
# tests/bench_ppo.py). Our choice, not the paper's. --advantage gae brings back the critic, fitted alone for the
# first critic_warmup iterations (OpenRLHF's --freezing_actor_steps).
TINY = dict(actor_lr=1e-4, critic_lr=3e-3, critic_warmup=2, advantage="group")
TINY_PARAMS = 10_000_000
LORA_LR_FACTOR = 10
GROUP_SAMPLES = 4  # samples per state of --advantage group unless --samples-per-state says otherwise


def resolve_defaults(cfg, n_params):
    """cfg with its None fields filled in: the paper's values, or TINY for a policy under TINY_PARAMS. The group
    baseline needs several samples (of a state, or episodes of a task start), so --samples-per-state 1 keeps the
    critic."""
    chosen = dict(TINY if n_params < TINY_PARAMS else PAPER)
    if cfg.lora_rank and n_params >= TINY_PARAMS:  # adapters that start at B = 0 need about 10x the full fine-tuning
        chosen["actor_lr"] *= LORA_LR_FACTOR       # rate ("LoRA Without Regret", Schulman et al., Thinking Machines
                                                   # 2025, which finds the factor close to 10 across model sizes)
    if cfg.samples_per_state == 1:
        chosen["advantage"] = "gae"
    cfg = dataclasses.replace(cfg, advantage=cfg.advantage or chosen["advantage"])
    if cfg.advantage == "group":  # no critic to warm up
        if cfg.critic_warmup:
            raise ValueError("--critic-warmup needs the critic (--advantage gae)")
        chosen.update(critic_warmup=0)
    chosen["samples_per_state"] = GROUP_SAMPLES if cfg.advantage == "group" else 1
    return dataclasses.replace(cfg, **{k: v for k, v in chosen.items() if getattr(cfg, k) is None})


# ----------------------------------------------------------------------------------------------------------------
# Models: the actor is a model.Qwen; the critic a Qwen with a scalar value head

class Actor(nn.Module):
    """The policy (a model.Qwen, `.lm`) as one module whose forward is the log-probs of the response tokens, so that
    FSDP2 gathers its root unit (embeddings, final norm, lm_head) for exactly that call. The reference is one too."""

    def __init__(self, lm, temperature=1.0, logits_chunk=1024):
        super().__init__()
        self.lm, self.temperature, self.logits_chunk = lm, temperature, logits_chunk

    def forward(self, ids, lengths, starts):  # right-padded rows (B, W) -> log pi of each response token (B, R)
        return model.response_logprobs(self.lm, ids, lengths, starts, self.temperature, self.lm.sample_vocab_size,
                                       self.logits_chunk).clone()  # FSDP2 hooks the output: no internal view


class Critic(nn.Module):
    """V(s_t) for every response token: a Qwen backbone (initialised from the policy) and a linear value head."""

    def __init__(self, backbone, seed=0):
        super().__init__()
        self.backbone = backbone
        C = backbone.config.hidden_size
        self.head = nn.Linear(C, 1, device=backbone.lm_head.weight.device, dtype=torch.float32)
        if not self.head.weight.is_meta:  # on the meta device (FSDP2) the sharded head is filled from head_init
            with torch.no_grad():
                for p, v in zip(self.head.parameters(), self.head_init(C, seed)):
                    p.copy_(v)

    @staticmethod
    def head_init(C, seed):
        """N-details layer_init of the scalar head: weight ~ N(0, 1/(C + 1)) from its own seed, bias 0 (CPU)."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(1, C, generator=g) / math.sqrt(C + 1), torch.zeros(1)

    def forward(self, ids, lengths, starts):  # right-padded rows (B, W) -> the value before each response token (B, R)
        h, _ = model.response_hidden(self.backbone, ids, lengths, starts)
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).clone()


# ----------------------------------------------------------------------------------------------------------------
# PPO arithmetic (pure functions on tensors; tests/test_ppo.py checks each against a hand computation)

def token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef):
    """The N-details reward: -kl_coef * (log pi - log pi_ref) on every response token, plus the scalar score on the
    last one. scores (B,); logprobs, ref_logprobs, mask (B, R) -> rewards (B, R), kl (B, R)."""
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)  # index of each response's last token
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards, kl


def gae(rewards, values, mask, gamma, lam, next_value=None, next_adv=None):
    """Generalised advantage estimation (Schulman et al. 2016) along the response tokens, right to left.
    rewards, values, mask (B, R); next_value, next_adv (B,): V and A of the state after the response (0 when the
    step ends the episode; in --episodic the next step's first token). Positions past a response's end are skipped,
    carrying the bootstrap through them. -> advantages, returns (B, R)."""
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
    """GAE for a batch whose row r continues in row nxt[r] (the same episode's next step; -1: the episode ends
    there). Rows are processed by the number of steps after them, so each bootstrap is known when needed; with
    every nxt = -1 (step-wise) this is one call of `gae`. -> advantages, returns (B, R)."""
    depth = [0] * len(nxt)
    for r in sorted(range(len(nxt)), key=lambda r: -r):  # a successor always comes later in the batch
        depth[r] = 0 if nxt[r] < 0 else depth[nxt[r]] + 1
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for d in range(max(depth) + 1):
        idx = [r for r in range(len(nxt)) if depth[r] == d]
        succ = torch.tensor([max(nxt[r], 0) for r in idx], device=rewards.device)
        has = torch.tensor([nxt[r] >= 0 for r in idx], device=rewards.device)
        nv = torch.where(has, values[succ, 0], 0.0)  # V and A of the next step's first token
        na = torch.where(has, adv[succ, 0], 0.0)
        adv[idx], ret[idx] = gae(rewards[idx], values[idx], mask[idx], gamma, lam, nv, na)
    return adv, ret


def group_advantages(scores, kl, mask, n, kl_coef):
    """--advantage group (RLOO, Ahmadian et al. 2024, arXiv:2402.14740, eq. 9): each action's score (reward minus
    kl_coef times its summed KL) minus the mean score of the other n - 1 actions of its state, on every token; tokens
    the samples share get gradients that cancel exactly, which a critic only approximates.
    scores (B,), kl and mask (B, R), rows state-major in groups of n -> advantages (B, R)."""
    g = (scores - kl_coef * kl.sum(1)).view(-1, n)
    loo = g - (g.sum(1, keepdim=True) - g) / (n - 1)
    return loo.view(-1, 1) * mask


def episode_group_advantages(scores, kl, mask, nxt, n, kl_coef):
    """--advantage group in --episodic: a step's return-to-go (its score as in group_advantages plus its episode's
    later ones, gamma 1) minus the mean return-to-go of the other n - 1 episodes of its task start at the same step (0
    past an episode's end); other episodes do not depend on this one's actions, so the baseline adds no bias. Rows as
    episode_rollout gives them (nxt links an episode's steps, episodes start-major in groups of n).
    scores (B,), kl and mask (B, R) -> advantages (B, R), every token of a step the same."""
    g = (scores - kl_coef * kl.sum(1)).tolist()
    togo = list(g)
    for r in reversed(range(len(nxt))):  # a successor always comes later in the batch
        if nxt[r] >= 0:
            togo[r] += togo[nxt[r]]
    chains = []  # each episode's rows in step order; the first steps are the rows no row links to, in episode order
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


def masked_mean(x, mask, ranks=model.Ranks()):  # over the valid tokens of every rank
    return ranks.sum((x * mask).sum()) / ranks.sum(mask.sum()).clamp(min=1)


def whiten(x, mask, eps=1e-8, ranks=model.Ranks()):
    """Zero mean, unit variance over the valid tokens only (as TRL's masked_whiten, with the unbiased variance), of
    the whole batch: under torchrun the sums run over every rank's rows."""
    mean = masked_mean(x, mask, ranks)
    n = ranks.sum(mask.sum())
    var = ranks.sum(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_coef, denom=None):
    """The clipped surrogate (PPO, Schulman et al. 2017, eq. 7): max(-A r, -A clip(r, 1-eps, 1+eps)) summed over
    valid tokens / denom (default: their number). -> loss, clip fraction, ratio (B, R)."""
    ratio = torch.exp(logprobs - old_logprobs)
    losses = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef))
    denom = mask.sum() if denom is None else denom
    clipped = ((ratio - 1).abs() > clip_coef).float()
    return (losses * mask).sum() / denom, (clipped * mask).sum() / denom, ratio


def value_loss(values, old_values, returns, mask, vf_clip, denom=None):
    """0.5 * max((V - G)^2, (V_clipped - G)^2), V_clipped = V_old + clip(V - V_old, -c, c) (N-details)."""
    clipped = old_values + (values - old_values).clamp(-vf_clip, vf_clip)
    losses = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    denom = mask.sum() if denom is None else denom
    return (losses * mask).sum() / denom


def explained_variance(values, returns, mask, ranks=model.Ranks()):
    var = lambda x: masked_mean((x - masked_mean(x, mask, ranks)) ** 2, mask, ranks)
    return float(1 - var(returns - values) / var(returns).clamp(min=1e-12))


# ----------------------------------------------------------------------------------------------------------------
# Batches: right-padded rows of ids (one per response, or a prompt with its responses), per response its start and
# end column; the response mask (B, R) lines the responses up

def make_batch(prompts, responses, pad, device, group=1):
    """B responses (each prompt repeated for its `group` responses in a row) -> ids (B / group, W), a right-padded row
    per prompt: the prompt once, then its responses (computed once, as generation prefilled it; model.response_hidden);
    per response the column where it ends and where it begins (lengths, starts, (B,)); the mask (B, R)."""
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
    ids = torch.full((len(packed), max(map(len, packed))), pad, dtype=torch.long)
    for g, row in enumerate(packed):
        ids[g, :len(row)] = torch.tensor(row, dtype=torch.long)
    return (ids.to(device), torch.tensor(lengths, device=device), mask.to(device),
            torch.tensor(starts, device=device))


def rows(ids, lengths, starts, idx, shared=1):
    """The responses idx (whole groups) with their rows of ids, the columns that are padding in all of them cut
    away -> ids, lengths, starts."""
    W = max(int(lengths[idx].max()), int(starts[idx].max()) + 1)
    return ids[idx[::shared] // shared, :W], lengths[idx], starts[idx]


def micro_batches(idx, lengths, cfg, shared=1):
    """Responses idx in whole groups of `shared` (one prompt's, in one row of ids: make_batch), rows sorted by length
    (as little padding as possible), cut into at most cfg.micro_batch rows and cfg.micro_tokens tokens (rows x the
    longest) -> the responses of each micro-batch."""
    groups = idx.view(-1, shared)
    row_len = lengths[groups].max(1).values  # a row ends where its last response does
    out, cur = [], []
    for g in torch.argsort(row_len, stable=True).tolist():
        if cur and (len(cur) == cfg.micro_batch or (len(cur) + 1) * int(row_len[g]) > cfg.micro_tokens):
            out.append(cur)
            cur = []
        cur.append(g)
    return [groups[torch.tensor(c, device=idx.device)].reshape(-1) for c in out + ([cur] if cur else [])]


def in_step(groups, ranks, filler):
    """The micro-batches of this rank padded, with (filler, weight 0), to the most any rank has: under FSDP every
    forward is a collective, so every rank runs as many. -> [(rows, weight)]"""
    n = int(ranks.max(len(groups))) if ranks.world > 1 else len(groups)
    return [(g, 1.0) for g in groups] + [(filler, 0.0)] * (n - len(groups))


# ----------------------------------------------------------------------------------------------------------------
# Acting: generation (step 2) and execution in the sandboxes (step 3)

def generate(lm, tokenizer, messages, cfg, device, seeds=None, n=1, on_done=None):
    """n sampled responses per prompt (prompt-major, sharing one prefill) -> prompt ids, token ids, their log-probs,
    texts, and whether each ended with a stop token (not cut at max_new_tokens). seeds: one per prompt (each row its
    own generator: what a rank holds does not change its samples); on_done(i, text, ended) as response i completes."""
    context = min(lm.config.max_position_embeddings, cfg.max_prompt_len + cfg.max_new_tokens)
    prompts = [model.keep_end(tokenizer.encode(tokenizer.apply_chat_template(m)), context, cfg.max_new_tokens)
               for m in messages]
    text = lambda t: agent.cut_at_stop(tokenizer.decode(t, skip_special_tokens=True), agent.STOP)  # noqa: E731
    done = None if on_done is None else lambda i, t, reason: on_done(i, text(t), reason == "stop")  # noqa: E731
    threads = torch.get_num_threads()
    if device.type == "cpu":  # one thread: the sandboxes run the finished rows' scripts on the same cores meanwhile,
        torch.set_num_threads(1)  # and OpenMP threads that wait on each other at every small op then crawl
    try:                          # (tests/RESULTS.md, "ppo.py: generation threads")
        with model.autocast(device):  # continuous batching: at most gen_batch rows (and their KV cache) at a time
            g = lm.generate(prompts, cfg.max_new_tokens, cfg.temperature, stop_token_ids=model.stop_ids(lm, tokenizer),
                            seeds=seeds, max_batch=cfg.gen_batch, n=n,
                            stop_fn=model.stop_strings(tokenizer, agent.STOP), on_done=done)
    finally:
        torch.set_num_threads(threads)
    tokens, logprobs = g.tokens, g.logprobs  # a stop string's tokens stay in the action: the policy chose to stop
    return ([p for p in prompts for _ in range(n)], tokens, logprobs, [text(t) for t in tokens],
            [r == "stop" for r in g.finish_reasons])


def execute(e, text, reward_config, finished=True, unfinished_invalid=True):
    """Parse and run one action in env `e` (in its state; agent.act executes and scores it, as in collection and
    evaluation) -> {kind, reward, m_prev, m_new, done, observation, finished, action, edit (of Edit Script (AI))}.
    A response cut at max_new_tokens (finished=False) is invalid unless --no-unfinished-invalid: a policy paid for a
    valid action it never ended drifts toward never ending (tests/RESULTS.md, "PPO on the tiny model")."""
    action = action_input = reason = None
    try:
        if not finished and unfinished_invalid:
            raise agent.ParseError("it did not end within max_new_tokens")
        action, action_input = agent.parse_response(text)
    except agent.ParseError as err:  # unparsable, unknown action or bad JSON: invalid (R_format)
        reason = str(err)
    result, r = agent.act(e, action, action_input, reason, reward_config)
    edit = action_input.get("edit_instruction") if action == "Edit Script (AI)" and isinstance(action_input, dict) \
        else None
    edit = edit if isinstance(edit, str) else None if edit is None else json.dumps(edit)  # hashable, for C5
    return {"kind": result.kind, "reward": r, "m_prev": result.metric_prev, "m_new": result.metric_new,
            "done": result.done, "observation": result.observation, "finished": finished, "action": action,
            "edit": edit}


def make_env(task, task_dir, editor):
    return env.Env(task if task in env.BUILTIN_TASKS else task_dir, editor=editor)


class Executions:
    """Each action runs in the pool as soon as `generate` reports it complete (on_done), its sandbox in another
    process while this one decodes the other rows; `outcomes` starts any row not reported, -> outcomes in row order."""

    def __init__(self, pool, run):  # run(row, text, ended) -> outcome
        self.pool, self.run, self.running = pool, run, {}

    def on_done(self, i, text, ended):
        if i not in self.running:  # each row runs once
            self.running[i] = self.pool.submit(self.run, i, text, ended)

    def outcomes(self, texts, ended):
        for i, (text, end) in enumerate(zip(texts, ended)):
            self.on_done(i, text, end)
        return [self.running[i].result() for i in range(len(texts))]


def step_rollout(states, lm, tokenizer, cfg, pool, editor, device, timer, seeds=None, n=1):
    """Steps 2-3, step-wise: n actions per expert state (rows state-major), each executed from the restored state as
    soon as it is complete -> prompts, tokens, log-probs, outcomes, nxt (all -1: no row continues in another)."""
    def run(i, text, ended):
        s = states[i // n]
        e = make_env(s["task"], s["task_dir"], editor)
        e.restore(s["snapshot"])  # the environment exactly as the expert found it at s_t
        return execute(e, text, cfg.reward, ended, cfg.unfinished_invalid)

    runs = Executions(pool, run)
    prompts, tokens, gen_lp, texts, ended = generate(lm, tokenizer, [s["messages"] for s in states], cfg, device,
                                                     seeds=seeds, n=n, on_done=runs.on_done)
    timer("generate")
    outcomes = runs.outcomes(texts, ended)
    timer("execute")
    return prompts, tokens, gen_lp, outcomes, [-1] * len(texts)


def episode_rollout(starts, lm, tokenizer, cfg, pool, editor, device, timer, seeds=None):
    """Steps 2-3, episode-wise (--episodic): whole episodes from task starts (the ideas of an expert's first step), all
    acting in one batch per step -> rows in step order, nxt: the row of the episode's next step (-1 at its end)."""
    envs = [make_env(s["task"], s["task_dir"], editor) for s in starts]
    problems = list(pool.map(lambda e: e.reset(), envs))  # reset runs the starter script (cached)
    timer("execute")
    histories, alive = [[] for _ in starts], list(range(len(starts)))
    prompts, tokens, gen_lp, outcomes, episode = [], [], [], [], []
    for _ in range(cfg.episode_steps):
        if not alive:
            break
        msgs = [agent.build_messages(problems[i], histories[i], [tuple(x) for x in starts[i]["ideas"]])
                for i in alive]
        step_seeds = None if seeds is None else [seeds[i] * 1000 + len(histories[i]) for i in alive]
        runs = Executions(pool, lambda j, text, end, envs_=[envs[i] for i in alive]: execute(
            envs_[j], text, cfg.reward, end, cfg.unfinished_invalid))
        p, t, lp, texts, ended = generate(lm, tokenizer, msgs, cfg, device, seeds=step_seeds, on_done=runs.on_done)
        timer("generate")
        res = runs.outcomes(texts, ended)
        timer("execute")
        for j, i in enumerate(alive):
            histories[i].append((texts[j], res[j]["observation"]))
        prompts, tokens, gen_lp, outcomes, episode = (prompts + p, tokens + t, gen_lp + lp, outcomes + res,
                                                       episode + alive)
        alive = [i for j, i in enumerate(alive) if not res[j]["done"]]
    nxt = [next((k for k in range(r + 1, len(episode)) if episode[k] == episode[r]), -1) for r in range(len(episode))]
    return prompts, tokens, gen_lp, outcomes, nxt


# ----------------------------------------------------------------------------------------------------------------
# Scoring the rollout (step 4) and the update (step 6): micro-batches of similar lengths; under FSDP every rank
# runs as many forwards

def forward_scores(actor, critic, ref, ids, lengths, starts, R, cfg, device, ranks=model.Ranks(), logprobs=None):
    """No-grad forwards in micro-batches -> logprobs, ref_logprobs, values (B, R); ref None with LoRA (the actor with
    its adapters off), ids as make_batch gives them; logprobs given (the generation's): the actor's forward skipped."""
    out = [torch.zeros(lengths.shape[0], R, device=device) for _ in range(3)]
    if logprobs is not None:
        out[0] = logprobs
    everyone, shared = torch.arange(lengths.shape[0], device=device), lengths.shape[0] // ids.shape[0]
    with torch.no_grad(), model.autocast(device):
        for idx, weight in in_step(micro_batches(everyone, lengths, cfg, shared), ranks, everyone[:shared]):
            i, ln, st = rows(ids, lengths, starts, idx, shared)
            lp = actor(i, ln, st) if logprobs is None else None
            if ref is None:  # LoRA: the reference is the actor without its adapters
                model.set_lora(actor, False)
                ref_lp = actor(i, ln, st)
                model.set_lora(actor, True)
            else:
                ref_lp = ref(i, ln, st)
            v = critic(i, ln, st).float() if critic is not None else torch.zeros_like(ref_lp)
            if weight:  # a filler micro-batch (FSDP: as many forwards as the other ranks) is not kept
                n = ref_lp.shape[1]
                out[1][idx, :n], out[2][idx, :n] = ref_lp, v
                if lp is not None:
                    out[0][idx, :n] = lp
    model.reshard(actor, critic, ref)  # no backward follows these forwards: FSDP2's gathered roots are freed now
    return out


def ppo_update(actor, critic, opt_a, opt_c, data, cfg, device, gen, step_actor=True, ranks=model.Ranks()):
    """Clipped policy and value losses over minibatches and epochs -> mean statistics, max|ratio - 1| of the first
    minibatch. data: this rank's ids, lengths, starts, mask, logprobs, values, advantages, returns; "rows": their
    places in the whole batch (default rank, rank + world, ...); "group": samples per state, kept in one minibatch.
    step_actor=False (critic warm-up): only the critic learns. Every rank draws the same permutation of the whole
    batch and takes its rows of each minibatch, each loss divided by the minibatch's tokens on all ranks: the summed
    gradient is one process's. FSDP averages gradients (hence the factor world); LoRA's are all-reduced here."""
    ids, lengths, starts, mask, group = data["ids"], data["lengths"], data["starts"], data["mask"], data.get("group", 1)
    shared = lengths.shape[0] // ids.shape[0]  # responses per row of ids: 1, or a state's `group` (make_batch)
    W = ranks.world
    places = data.get("rows") or [ranks.rank + k * W for k in range(lengths.shape[0])]
    local = {g: k for k, g in enumerate(places)}
    B = int(ranks.sum(torch.tensor(len(places), device=device)))
    sharded = model.is_sharded(actor)
    scale = W if sharded else 1.0
    mb_size = max(B // group // cfg.num_minibatches, 1)  # in states
    stats, first_ratio, actor_steps = [], None, 0
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(B // group, generator=gen)
        for mb in perm.split(mb_size):
            mb = (mb[:, None] * group + torch.arange(group)).view(-1)  # the states' responses
            mine = torch.tensor([local[g] for g in mb.tolist() if g in local], dtype=torch.long, device=device)
            denom = ranks.sum(mask[mine].sum()).clamp(min=1)  # the masked mean over the whole minibatch
            s = dict(pg_loss=0.0, vf_loss=0.0, clipfrac=0.0, approx_kl=0.0)
            for idx, weight in in_step(micro_batches(mine, lengths, cfg, shared), ranks,
                                       torch.arange(shared, device=device)):
                i, ln, st = rows(ids, lengths, starts, idx, shared)
                with model.autocast(device):
                    lp = actor(i, ln, st)
                    n = lp.shape[1]
                    m = mask[idx, :n] * weight
                    pg, cf, ratio = policy_loss(lp, data["logprobs"][idx, :n], data["advantages"][idx, :n], m,
                                                cfg.clip_coef, denom)
                    if step_actor:  # in the warm-up the policy's backward would be thrown away
                        (pg * scale).backward()
                    vf = torch.zeros(())
                    if critic is not None:  # --advantage group has no critic
                        v = critic(i, ln, st).float()
                        vf = value_loss(v, data["values"][idx, :n], data["returns"][idx, :n], m, cfg.vf_clip, denom)
                        (vf * scale).backward()
                if not stats and weight:  # the first minibatch of the first epoch: the policy has not moved yet
                    dev = float(((ratio.detach() - 1).abs() * m).max())
                    first_ratio = dev if first_ratio is None else max(first_ratio, dev)
                s["pg_loss"] += float(pg.detach())
                s["vf_loss"] += float(vf.detach())
                s["clipfrac"] += float(cf)
                s["approx_kl"] += float((0.5 * (lp.detach() - data["logprobs"][idx, :n]) ** 2 * m).sum() / denom)
            kl = float(ranks.sum(torch.tensor(s["approx_kl"], device=device)))  # this minibatch, every rank's rows
            if step_actor and cfg.target_kl and kl > 1.5 * cfg.target_kl:  # early stop (Spinning Up's PPO, CleanRL
                step_actor = False  # --target-kl): the policy has moved far enough this iteration; the critic goes on
                actor.zero_grad(set_to_none=True)
            actor_steps += step_actor
            for net, opt in [(net, opt) for net, opt in ((actor, opt_a), (critic, opt_c))[0 if step_actor else 1:]
                             if net is not None]:
                trained = [q for q in net.parameters() if q.requires_grad]
                if W > 1 and not sharded:  # LoRA over several ranks: sum the adapters' gradients (data parallel)
                    for q in trained:
                        q.grad = ranks.sum(q.grad if q.grad is not None else torch.zeros_like(q))
                nn.utils.clip_grad_norm_(trained, cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            stats.append({k: float(ranks.sum(torch.tensor(v, device=device))) for k, v in s.items()})
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
    return {**mean, "ratio_first_minibatch_max_dev": ranks.max(first_ratio or 0.0), "actor_steps": actor_steps}


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: the actor as a Hugging Face folder; trainer_state/ beside it (vLLM globs *.safetensors of the folder
# only, so the critic's file does not confuse it); written to <out>.tmp, then swapped in

def save_checkpoint(cfg, actor, tokenizer, critic, opt_a, opt_c, progress, ranks):
    """Every rank calls this (under FSDP the full states are gathered to rank 0, on CPU); rank 0 writes. The actor
    folder is in bf16 from CUDA runs (what vLLM and transformers serve); the fp32 master weights, the critic and both
    optimizers go to trainer_state/state.pt for resume."""
    adapters = lambda net: {k: v for k, v in model.full_state(net).items()  # noqa: E731
                            if not cfg.lora_rank or k.startswith("head.") or ".A" in k or ".B" in k}
    actor_state = model.full_state(actor)
    state = {"critic": adapters(critic), "actor_lora": adapters(actor) if cfg.lora_rank else None,
             "opt_actor": model.optim_state(actor, opt_a), "opt_critic": model.optim_state(critic, opt_c),
             "progress": progress}
    if ranks.rank != 0:
        return
    dtype = model.save_dtype(cfg.save_dtype, ranks.device)
    tmp, master = model.save_checkpoint_folder(actor.lm, tokenizer, cfg.out, dtype, actor_state)
    if master:  # the master weights, which the bf16 folder rounds
        state["actor"] = master
    os.makedirs(os.path.join(tmp, "trainer_state"))
    torch.save(state, os.path.join(tmp, "trainer_state", "state.pt"))
    with open(os.path.join(tmp, "trainer_state", "progress.json"), "w") as f:
        json.dump({**progress, "config": dataclasses.asdict(cfg), "world_size": ranks.world}, f, indent=1)
    agent.swap_folder(tmp, cfg.out)  # no moment without a checkpoint; a kill inside is repaired by claim_out


def find_resume(out):
    """The folder of the last complete checkpoint (a kill between the two renames leaves it at <out>.old)."""
    for folder in (out, out + ".old"):
        if os.path.exists(os.path.join(folder, "trainer_state", "state.pt")):
            return folder
    return None


def claim_out(cfg, model_path):
    """Refuse an --out this run does not own (a file, the model, or a folder that is not a ppo.py checkpoint: saving
    replaces the folder), and lock it against a second ppo.py on the same --out. -> the open lock file."""
    out = os.path.abspath(cfg.out)
    if os.path.isfile(out):
        raise ValueError(f"--out {cfg.out} is a file; give a folder")
    if os.path.isdir(model_path) and os.path.abspath(model_path) == out:
        raise ValueError(f"--out {cfg.out} is the --model folder; ppo.py would replace it")
    if os.path.isdir(out) and os.listdir(out) and not find_resume(out):
        raise ValueError(f"--out {cfg.out} holds something that is not a ppo.py checkpoint; give another folder")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    lock = agent.lock_file(out + ".lock", f"--out {cfg.out}")  # beside the folder: saving replaces the folder
    agent.recover_folder(out, out + ".tmp")  # what a kill while saving left: <out>.old back in place, no .tmp
    return lock


def check_resume_reward(folder, cfg):
    """ValueError (one line) when the checkpoint in `folder` was trained with another reward config than cfg.reward:
    one run, one reward. A checkpoint that recorded none (older than the field) is accepted."""
    path, recorded = os.path.join(folder, "trainer_state", "progress.json"), {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f).get("config", {})
    if recorded.get("reward") is not None and from_record(recorded["reward"]) != cfg.reward:
        raise ValueError(f"{folder} was trained with {from_record(recorded['reward'])}, the flags give {cfg.reward}; "
                         f"pass the same reward flags or another --out")
    if recorded.get("unfinished_invalid", cfg.unfinished_invalid) != cfg.unfinished_invalid:  # a rule of the reward too
        raise ValueError(f"{folder} was trained with unfinished_invalid={recorded['unfinished_invalid']}, the flags "
                         f"give {cfg.unfinished_invalid}; pass the same flag or another --out")


# ----------------------------------------------------------------------------------------------------------------
# Training: `setup` once (with the resume point), then per iteration the six steps, each one call, and a log line

STATE_KEYS = ("task", "task_dir", "step", "messages", "snapshot", "m_init", "m_best", "higher_is_better")


def load_states(path):
    """The states pool (collect.py's states.jsonl); a bad line is a one-line error naming the file and line."""
    states = agent.read_jsonl(path, STATE_KEYS, "a state of collect.py")
    if not states:
        raise ValueError(f"{path} holds no states; run collect.py first")
    return states


def pick_tasks(states, n, seed):
    """The states of n of the pool's tasks, a seeded draw (the same n tasks for every run with this seed)."""
    names = sorted({s["task"] for s in states})
    chosen = set(random.Random(f"tasks:{seed}").sample(names, min(n, len(names))))
    return [s for s in states if s["task"] in chosen]


def build(cfg, init, resume, st, ranks):
    """The actor (trainable, fp32 master weights), the critic initialised from the policy and the frozen reference,
    as Actor / Critic modules on this rank; with LoRA a frozen base (bf16 on CUDA) with fp32 adapters and no third
    copy. Over several ranks without LoRA each is sharded by FSDP2 before any weight is read, and every rank reads the
    checkpoint tensor by tensor, keeping only its shard. -> actor, critic, ref (None with LoRA), tokenizer"""
    device, W = ranks.device, ranks.world
    lm, tokenizer = model.load(init, device, torch.float32, meta=True)
    checkpointing = cfg.grad_checkpointing or sum(p.numel() for p in lm.parameters()) >= TINY_PARAMS
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # weights that are never updated
    policy = lambda lm: Actor(lm, cfg.temperature, cfg.logits_chunk)

    def make(kind, source, dtype, meta):
        lm = model.load(source, device, dtype, meta=meta)[0]
        if kind != "ref" and checkpointing:
            model.enable_grad_checkpointing(lm)
        if kind != "ref" and cfg.lora_rank:
            model.add_lora(lm, cfg.lora_rank, cfg.lora_alpha)
        return Critic(lm, cfg.seed) if kind == "critic" else policy(lm)

    if cfg.lora_rank or W == 1:  # every rank holds the whole model (LoRA: all-reduce of the adapters' gradients)
        base = low if cfg.lora_rank else torch.float32
        actor = make("actor", init if cfg.lora_rank or not resume else resume, base, False)
        critic = make("critic", init, base, False)
        ref = None if cfg.lora_rank else make("ref", init, low, False).requires_grad_(False)  # bf16 on CUDA
        if st:
            critic.load_state_dict(st["critic"], strict=not cfg.lora_rank)
            if cfg.lora_rank:
                actor.load_state_dict(st["actor_lora"], strict=False)
            elif st.get("actor"):  # the fp32 master weights of a folder saved in bf16
                actor.lm.load_state_dict(st["actor"])
        return actor, critic, ref, tokenizer

    def sharded(kind, dtype, tensors):
        net = make(kind, init, dtype, True)
        lm = net.backbone if kind == "critic" else net.lm
        net = model.shard(net, lm.model.layers, W, device)
        net.to_empty(device=device)
        model.fill(lm, tensors)
        return net

    actor = sharded("actor", torch.float32, st["actor"].items() if st and st.get("actor") else
                    model.weight_tensors(resume or init))
    critic = sharded("critic", torch.float32, model.weight_tensors(init) if not st else
                     ((k.removeprefix("backbone."), v) for k, v in st["critic"].items() if k.startswith("backbone.")))
    head = zip(("weight", "bias"), Critic.head_init(critic.backbone.config.hidden_size, cfg.seed)) if not st else \
        ((k.removeprefix("head."), v) for k, v in st["critic"].items() if k.startswith("head."))
    model.fill(critic.head, head)
    ref = sharded("ref", low, model.weight_tensors(init)).requires_grad_(False)
    return actor, critic, ref, tokenizer


@dataclasses.dataclass
class Run:
    """What `setup` makes once for every iteration."""
    cfg: Config                 # its None fields resolved for the policy's size
    ranks: model.Ranks
    states: list                # the states pool (of the --tasks drawn)
    actor: Actor
    critic: Critic              # built and saved with either advantage: checkpoints keep one layout
    ref: Actor | None           # None with LoRA: the actor with its adapters off
    tokenizer: object
    opt_a: torch.optim.Optimizer
    opt_c: torch.optim.Optimizer
    progress: dict              # iterations done and the starting model, saved in each checkpoint
    editor: object              # what executes `Edit Script (AI)`
    total: int                  # the run's iterations
    checkpointing: bool         # blocks recomputed in backward (as `build` decided)
    lock: object                # rank 0's lock on --out
    say: object                 # print, on rank 0

    @property
    def value_net(self):  # --advantage group neither runs nor trains the critic
        return self.critic if self.cfg.advantage == "gae" else None


def setup(cfg):
    """This rank, the states pool, --out (claimed and repaired by rank 0), the resume point, the actor, critic and
    reference with their optimizers, the task folders, the editor and the schedule -> Run."""
    rank, world, device = model.setup_distributed(cfg)
    if device.type == "cuda":  # each rank's sandboxed scripts on its own GPU (not all on GPU 0), or on none
        env.set_script_gpu(device.index if cfg.script_gpu else None)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    torch.manual_seed(cfg.seed)  # the adapters' initialisation
    states = load_states(cfg.states)
    if cfg.tasks:
        states = pick_tasks(states, cfg.tasks, cfg.seed)
        say(f"ppo.py: training on the {len(states)} states of {len({s['task'] for s in states})} task(s): "
            f"{' '.join(sorted({s['task'] for s in states}))}")
    if (max(cfg.batch_size // cfg.episode_steps, 1) if cfg.episodic else cfg.batch_size) < world:
        raise ValueError(f"--batch-size {cfg.batch_size} gives {'task starts' if cfg.episodic else 'states'} to fewer "
                         f"than the {world} ranks")
    if not cfg.episodic and len(states) < world:  # every rank needs a state of a batch; each rank decides this alike,
        # before any collective, so none is left waiting for a rank that stopped
        raise ValueError(f"{cfg.states}: {len(states)} state(s){' of the chosen tasks' if cfg.tasks else ''} for "
                         f"{world} ranks; every rank needs at least one state per batch")
    lock = claim_out(cfg, cfg.model) if rank == 0 else None  # rank 0 owns --out and the log
    if world > 1:
        dist.barrier()  # the other ranks look for the checkpoint once rank 0 has repaired --out
    resume, st, progress = resume_point(cfg, say)
    ranks = model.Ranks(rank, world, device)
    actor, critic, ref, tokenizer = build(cfg, progress["init_model"], resume, st, ranks)
    n_params = sum(p.numel() for p in actor.lm.parameters())
    cfg = resolve_defaults(cfg, n_params)
    say(f"ppo.py: actor lr {cfg.actor_lr:g}, " + (f"group baseline over {cfg.samples_per_state} "
        f"{'episodes per task start' if cfg.episodic else 'samples per state'}, no "
        "critic" if cfg.advantage == "group" else f"critic lr {cfg.critic_lr:g}, critic alone for the first "
        f"{cfg.critic_warmup} iteration(s)") + f"; {world} rank(s) on {device}"
        f"{' (FSDP2)' if model.is_sharded(actor) else ' (LoRA, data parallel)' if world > 1 else ''}")
    opt_a, opt_c = (torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, eps=cfg.adam_eps,
                                      weight_decay=0.0) for net, lr in ((actor, cfg.actor_lr), (critic, cfg.critic_lr)))
    for net, opt, key in ((actor, opt_a, "opt_actor"), (critic, opt_c, "opt_critic")) if st else ():
        model.set_optim_state(net, opt, st[key])
    if rank == 0:  # built-in tasks are prepared here, not racing in threads or ranks; the log trimmed to the checkpoint
        for s in {s["task"]: s for s in states}.values():
            make_env(s["task"], s["task_dir"], None)
        os.makedirs(os.path.dirname(cfg.log_file) or ".", exist_ok=True)
        agent.trim_log(cfg.log_file, "iteration", progress["iteration"], cfg.out)
    if world > 1:
        dist.barrier()
    editor = env.recipe_editor if cfg.editor == "recipes" else agent.LLMEditor(agent.make_backend(cfg.editor))
    total = cfg.iterations or max(math.ceil(cfg.epochs * max(len(states) // cfg.batch_size, 1)), 1)
    return Run(cfg, ranks, states, actor, critic, ref, tokenizer, opt_a, opt_c, progress, editor, total,
               cfg.grad_checkpointing or n_params >= TINY_PARAMS, lock, say)


def resume_point(cfg, say):
    """The last checkpoint under --out (trained with this reward, or a one-line error), its trainer state and
    progress; or None, None and a fresh progress."""
    resume = find_resume(cfg.out)
    if not resume:
        return None, None, {"iteration": 0, "init_model": cfg.model}
    check_resume_reward(resume, cfg)
    st = model.load_trainer_state(os.path.join(resume, "trainer_state", "state.pt"), ("progress",), "ppo.py",
                                  "pass another --out")
    say(f"ppo.py: resuming from {resume} at iteration {st['progress']['iteration']}")
    return resume, st, dict(st["progress"])


class Timer:
    """timer(part) adds the seconds since its last call to `part`. The actions run while the other rows decode, so
    "generate" includes executions under way and "execute" is the wait after the last response."""

    def __init__(self):
        self.start = self.last = time.time()
        self.times = {"generate": 0.0, "execute": 0.0, "update": 0.0}

    def __call__(self, part):
        self.times[part] += time.time() - self.last
        self.last = time.time()


def sample_states(run, it):
    """Step 1: iteration it's batch of d^{pi_e}, the next batch_size states of the pool shuffled per epoch (seeded, so
    a resumed run agrees); in --episodic batch_size / episode_steps task starts drawn. -> this rank's share (every
    world-th), each state's seed (whatever the world size) and its index in the batch."""
    cfg, states, ranks = run.cfg, run.states, run.ranks
    epoch, k = divmod(it, max(len(states) // cfg.batch_size, 1))
    if cfg.episodic:
        starts = [s for s in states if s["step"] == 0] or states
        rng = random.Random(f"{cfg.seed}:{it}")
        batch = [rng.choice(starts) for _ in range(max(cfg.batch_size // cfg.episode_steps, 1))]
    else:
        order = list(range(len(states)))
        random.Random(f"{cfg.seed}:{epoch}").shuffle(order)
        batch = [states[i] for i in order[k * cfg.batch_size:(k + 1) * cfg.batch_size]]
    mine = list(range(ranks.rank, len(batch), ranks.world))
    return [batch[g] for g in mine], [(cfg.seed * 100003 + it) * 100003 + g for g in mine], mine


def rollout(run, batch, seeds, index, pool, timer):
    """Steps 2-3 on this rank's states, samples_per_state actions each (in --episodic, episodes from each start) ->
    prompts, tokens, log-probs, outcomes, nxt (as step_rollout) and each row's place in the whole batch."""
    cfg, ranks, n = run.cfg, run.ranks, run.cfg.samples_per_state
    policy = model.rollout_copy(run.actor.lm, ranks.device)  # under FSDP a gathered (bf16 on CUDA) copy, freed after
    if cfg.episodic:
        out = episode_rollout([s for s in batch for _ in range(n)], policy, run.tokenizer, cfg, pool, run.editor,
                              ranks.device, timer, seeds=[s * n + j for s in seeds for j in range(n)])
        sizes = ranks.gather([len(out[3])])  # episodes end at different steps: the rows rank by rank
        places = [sum(sizes[:ranks.rank]) + j for j in range(len(out[3]))]
    else:
        out = step_rollout(batch, policy, run.tokenizer, cfg, pool, run.editor, ranks.device, timer, seeds=seeds, n=n)
        places = [g * n + j for g in index for j in range(n)]
    del policy
    if model.is_sharded(run.actor) and ranks.device.type == "cuda":
        torch.cuda.empty_cache()
    return (*out, places)


def score(run, prompts, tokens, gen_lp, outcomes):
    """Step 4: the rollout as one batch (make_batch), the old log-probs, the reference's and the critic's values
    (forward_scores), reward.py's score on the last token and the KL penalty on every token (token_rewards) -> the
    batch as ppo_update reads it, with scores, rewards, kl and the generation's log-prob gap."""
    cfg, ranks, device = run.cfg, run.ranks, run.ranks.device
    # a state's samples share its prompt's row, except where a recomputed block (gradient checkpointing) would
    # write the prompt's KV cache twice, or where FSDP needs as many block calls on every rank
    group = 1 if cfg.episodic else cfg.samples_per_state
    ids, lengths, mask, starts = make_batch(prompts, tokens, run.tokenizer.pad_token_id, device,
                                            1 if run.checkpointing or model.is_sharded(run.actor) else group)
    # the old log-probs: on CPU the rollout ran on the actor's own fp32 weights, so the generation's are kept (the
    # first minibatch's ratio, logged, shows the gap) and a forward pass is saved; on CUDA the rollout's bf16 weights
    # and kernels differ from the update's autocast forward, so they are recomputed, as VeRL and OpenRLHF do
    kept = None
    if device.type == "cpu":
        kept = torch.zeros(mask.shape, device=device)
        for row, lps in enumerate(gen_lp):
            kept[row, :len(lps)] = torch.tensor(lps, device=device)
    logprobs, ref_logprobs, values = (x * mask for x in forward_scores(
        run.actor, run.value_net, run.ref, ids, lengths, starts, mask.shape[1], cfg, device, ranks, logprobs=kept))
    gen_gap = None if kept is not None else ranks.max(max(  # generate vs forward
        (abs(a - b) for row, lps in enumerate(gen_lp) for a, b in zip(lps, logprobs[row, :len(lps)].tolist())),
        default=0.0))
    scores = torch.tensor([o["reward"] for o in outcomes], device=device)
    rewards, kl = token_rewards(scores, logprobs, ref_logprobs, mask, cfg.kl_coef)
    return dict(ids=ids, lengths=lengths, starts=starts, mask=mask, logprobs=logprobs, values=values, group=group,
                scores=scores, rewards=rewards, kl=kl, gen_gap=gen_gap)


def estimate_advantages(run, data, nxt):
    """Step 5: GAE over the critic's values (in --episodic across an episode's steps), whitened over the valid tokens
    of the whole batch; or --advantage group's baseline, not whitened -> advantages, returns, explained variance."""
    cfg, mask = run.cfg, data["mask"]
    if run.value_net is None:
        adv = episode_group_advantages(data["scores"], data["kl"], mask, nxt, cfg.samples_per_state, cfg.kl_coef) \
            if cfg.episodic else group_advantages(data["scores"], data["kl"], mask, cfg.samples_per_state, cfg.kl_coef)
        return adv, adv, None
    adv, returns = gae_rows(data["rewards"], data["values"], mask, nxt, cfg.gamma, cfg.lam)
    return whiten(adv, mask, ranks=run.ranks), returns, explained_variance(data["values"], returns, mask, run.ranks)


def log_iteration(run, it, outcomes, places, data, ev, upd, timer):
    """The whole batch's log line (gathered from the ranks; the times rank 0's): reward and its breakdown, metric
    change, KL, PPO statistics, time split; printed and appended to --log-file by rank 0."""
    ranks, times = run.ranks, timer.times
    outcomes = [o for _, o in sorted(zip(ranks.gather(places), ranks.gather(outcomes)), key=lambda x: x[0])]
    kinds, n = [o["kind"] for o in outcomes], len(outcomes)
    edits = [o for o in outcomes if o["kind"] == "edit" and o["m_new"] is not None and o["m_prev"] is not None]
    log = {"iteration": it + 1, "states": n, "reward": sum(o["reward"] for o in outcomes) / n,
           "rewards": [o["reward"] for o in outcomes],
           **{f"frac_{k}": kinds.count(k) / n for k in ("invalid", "error", "corner", "neutral", "edit", "final")},
           "frac_unfinished": sum(not o.get("finished", True) for o in outcomes) / n,  # cut responses
           "frac_improved": sum(o["reward"] > 0 for o in edits) / n,
           "metric_change": sum(o["m_new"] - o["m_prev"] for o in edits) / len(edits) if edits else 0.0,
           "kl": float(ranks.sum(data["kl"].sum())) / n, "response_tokens": float(ranks.sum(data["mask"].sum())) / n,
           "explained_variance": ev, "generate_vs_forward_logprob_gap": data["gen_gap"], **upd,
           **{f"time_{k}": v for k, v in times.items()}, "time_total": time.time() - timer.start,
           "world_size": ranks.world, "out": os.path.abspath(run.cfg.out),
           "actor_updated": it >= run.cfg.critic_warmup, "reward_config": dataclasses.asdict(run.cfg.reward)}
    shares = " ".join(f"{k} {log['frac_' + k]:.2f}" for k in ("invalid", "error", "corner", "neutral", "edit"))
    run.say(f"it {it + 1}/{run.total} reward {log['reward']:+.3f} ({shares} improved {log['frac_improved']:.2f}) "
            f"dmetric {log['metric_change']:+.4f} kl {log['kl']:.4f} clip {log['clipfrac']:.3f} vf "
            f"{log['vf_loss']:.4f} ev {'-' if ev is None else f'{ev:+.2f}'} | gen {times['generate']:.1f}s exec "
            f"{times['execute']:.1f}s update {times['update']:.1f}s")
    if ranks.rank == 0:
        agent.append_jsonl(run.cfg.log_file, log)


def train(cfg):
    """The whole run -> its progress: setup (with the resume point) once, then per iteration the six steps, a log
    line, and a checkpoint every save_every iterations and at the end."""
    run = setup(cfg)
    cfg, pool = run.cfg, ThreadPoolExecutor(run.cfg.workers)
    for it in range(run.progress["iteration"], run.total):
        timer = Timer()
        # 1. sample a batch of states from d^{pi_e}; this rank takes every world-th, each with its own seed
        batch, seeds, index = sample_states(run, it)
        # 2. the policy generates actions (batched, left-padded, KV cache, log-probs kept)
        # 3. each environment restores its state and executes its action, several sandboxes in parallel
        prompts, tokens, gen_lp, outcomes, nxt, places = rollout(run, batch, seeds, index, pool, timer)
        # 4. reward.py's score on the last token, the KL penalty to the frozen reference on every token
        data = score(run, prompts, tokens, gen_lp, outcomes)
        # 5. advantages: the critic's GAE, whitened, or the group baseline
        data["advantages"], data["returns"], ev = estimate_advantages(run, data, nxt)
        # 6. clipped policy and value losses over minibatches and epochs (in the warm-up the critic's only)
        upd = ppo_update(run.actor, run.value_net, run.opt_a, run.opt_c, {**data, "rows": places}, cfg,
                         run.ranks.device, torch.Generator().manual_seed(cfg.seed * 100003 + it),
                         step_actor=it >= cfg.critic_warmup, ranks=run.ranks)
        timer("update")
        log_iteration(run, it, outcomes, places, data, ev, upd, timer)
        run.progress["iteration"] = it + 1
        if (it + 1) % cfg.save_every == 0 or it + 1 == run.total:
            save_checkpoint(cfg, run.actor, run.tokenizer, run.critic, run.opt_a, run.opt_c, run.progress, run.ranks)
    pool.shutdown()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if run.lock:
        run.lock.close()
    return run.progress


# ----------------------------------------------------------------------------------------------------------------
# Command line: a flag per Config field, its value checked by its argparse type (one line, exit 2)

TYPES = {**dict.fromkeys(("batch_size", "samples_per_state", "num_minibatches", "micro_batch", "micro_tokens",
                          "logits_chunk", "gen_batch", "update_epochs", "max_new_tokens", "max_prompt_len", "workers",
                          "episode_steps", "save_every"), agent.POSITIVE_INT),
         **dict.fromkeys(("tasks", "iterations", "critic_warmup", "lora_rank"), agent.COUNT),
         **dict.fromkeys(("epochs", "actor_lr", "critic_lr", "adam_eps", "max_grad_norm", "temperature", "clip_coef",
                          "vf_clip", "lora_alpha"), agent.POSITIVE),
         **dict.fromkeys(("target_kl", "kl_coef"), agent.NONNEGATIVE),
         **dict.fromkeys(("gamma", "lam"), agent.FRACTION), "seed": int}
CHOICES = {"advantage": ("gae", "group"), "save_dtype": ("auto", "float32")}


def parser():
    p = agent.Parser(prog="ppo.py", description="Step-wise PPO (ML-Agent) over the expert states pool.")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:  # --flag / --no-flag
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name != "reward":  # reward.py's own flags, below
            p.add_argument(flag, type=TYPES.get(f.name, str), choices=CHOICES.get(f.name), default=f.default)
    add_reward_flags(p)
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    try:
        rc = reward_from_flags(args)
    except ValueError as e:
        p.error(str(e))
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name != "reward"}, reward=rc)
    if model.bad_device(cfg.device):
        p.error(model.bad_device(cfg.device))
    if cfg.advantage == "group" and ((cfg.samples_per_state or 2) < 2 or cfg.critic_warmup):
        p.error("--advantage group needs --samples-per-state >= 2 (its baseline is the other samples, or the other "
                "episodes in --episodic) and has no critic to warm up (--critic-warmup)")
    if not os.path.exists(cfg.states):
        p.error(f"no states pool at {cfg.states}; run collect.py first or pass --states")
    if not find_resume(cfg.out) and not os.path.isdir(cfg.model):
        if cfg.model == Config.model:
            p.error(f"no model at {cfg.model}; run sft.py first or pass --model")
        try:
            model.resolve(cfg.model)
        except (OSError, ValueError) as e:
            p.error(str(e))
    model.run_main("ppo.py", train, cfg, (OSError, ValueError, env.TaskError))


if __name__ == "__main__":
    main()
