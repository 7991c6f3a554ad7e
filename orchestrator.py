"""Matryoshka Agent: a persistent Orchestrator, Tools that launch fresh Sub-Agents, the monolithic baseline, and the
Orchestrator's training on Solution Refinement Trees (Matryoshka Agent, Qiang et al., arXiv:2607.25090).

Reading order: config -> token counting and clipping -> attempts and the Orchestrator's compact memory -> the
Orchestrator's prompt and its tool calls -> the Sub-Agent (prompt, code-execute-debug loop) and the Tool -> offline
stand-ins -> the Matryoshka run and the monolithic run -> Solution Refinement Trees -> ranking loss and training ->
command line.

What the paper states and this file follows: the Orchestrator keeps only compact history (per attempt its id, parent,
instruction, score and a structured summary) and answers with tool calls choosing a parent attempt, an instruction
and reference attempts; several calls in one round run in parallel (§3.4); a Tool builds a fresh Sub-Agent context
and returns score plus summary; a Sub-Agent debugs for at most 10 iterations (App. B); environment output longer than
5k tokens keeps its first and last 2.5k; training collects binary Solution Refinement Trees sharing prefixes, labels a
branch by R(c) = max over the subtree of c of r(v) (§3.6) and trains with a ranking NCE loss on log-ratio scores
beta * log(pi_theta / pi_ref) against the previous orchestrator (Eqs. 1-4), which for two children is DPO; successful
Sub-Agent trajectories become SFT data (self-reinforcement).

Where the paper's text is silent (our choices):
- The ranking loss for K children is Plackett-Luce over the children ranked by R, with ties skipped: each child k
  contributes -log(exp(s_k) / (exp(s_k) + sum over children j with R_j < R_k of exp(s_j))), summed over k. For two
  children it is DPO's -log sigmoid(s_w - s_l) (Rafailov et al. 2023); the paper's text gives no K > 2 form.
- r(v) is the best public score of the attempts a decision launched, signed so that larger is better; a decision that
  is unparsable, finishes, or yields no valid submission has r = -inf. beta defaults to 0.1 (DPO and TRL's default).
- The Sub-Agent returns its best-scoring script of the attempt (by public score); the Tool writes the summary's
  `result` and `errors` from what it measured and keeps the Sub-Agent's `approach`, `changed` and `next`.
- Token counts: the Hugging Face style tokenizer of a local backend when there is one, else ceil(chars / 4) (OpenAI's
  rule of thumb of about 4 characters per token); every record of a prompt's size says which (`counter`, and the
  run's `token_counter`).
- The monolithic baseline (MLE-Dojo's agent, as the paper adapts it) keeps its whole history in one chat, under the
  same wall clock and at most as many executions as the Matryoshka run may spend (rounds x calls x iterations).
- Orchestrator training keeps fp32 master weights with bf16 compute on CUDA (autocast; AdamW's 1e-5 steps are below
  bf16's resolution) and saves the trained checkpoint in the checkpoint's original dtype (its torch_dtype, e.g. bf16).
- Feedback clips the run's whole log (read from RunResult.log_path; env.py's `output` holds only 4 KB of each end).
- Each attempt keeps its best script, its public and private scores and a copy of that run's submission.csv
  (env.run_script(keep=...)); the command line copies the best attempt's file to best_submission.csv, the file a
  competition takes. Matryoshka runs and trees resume from their JSON; the monolithic run does not.
- OFFLINE STAND-INS, used when no endpoint or checkpoint is configured: `ScriptedOrchestrator` (expands the best
  attempts with untried built-in recipe ideas, two calls per round; samples when temperature > 0) and `RecipeCoder`
  (a Sub-Agent that applies env.py's recipe for its instruction). They write the same JSON and ```python messages an
  LLM would, so the same parsing code runs, and read their state from the record a prompt is written from (its
  `Prompt.state`). Offline `train` collects with the scripted orchestrator (not on-policy) and trains a tiny model
  made from scratch, with a tokenizer trained on the trees' prompts.
- Trees: each iteration collects --task's tree to --depth and a depth-1 tree on --tree-tasks held-in tasks of each
  (kind, modality, metric direction) (default 2 each: 11 tasks beside breast-cancer); all their preference groups
  train the Orchestrator. The paper trains on trees of many tasks; the number here is our choice.
- OFFLINE STAND-IN for "the same model before tree training": the paper's Orchestrator before tree training is a
  pre-trained LLM that already answers in the decision format; a tiny model from scratch answers nothing parsable.
  So without --model, ckpt-0 is the tiny model after imitation (cross-entropy on the scripted orchestrator's
  decisions on the trees' states and states resampled from their attempts; never a held-out task;
  `imitation_orchestrator`), AdamW at 6e-3 for 1000 updates (the paper has no such step). The ranking loss then
  trains ckpt-0 -> ckpt-1 with ckpt-0 as the reference, as for a given checkpoint, at the paper's lr 1e-5.
  ckpt-0/imitation.json keeps the imitation's loss and the share of its greedy answers that parse.
- Larger ranking learning rates for the tiny model (3e-5 to 1e-3) were tried and not taken: they fit the preference
  groups better (a lower ranking loss after training) but decided no better (HumanRank on held-in tasks outside the
  trees: the same at 3e-5, lower from 1e-4), and at 1e-3 greedy answers stopped parsing; depth-2 trees on the other
  tasks did not help either (tests/RESULTS.md, "orchestrator.py: ranking learning rates").

Run:  python orchestrator.py run --task breast-cancer                 (scripted orchestrator + recipe sub-agent)
      python orchestrator.py run --task breast-cancer --monolithic    (the baseline)
      python orchestrator.py tree --task breast-cancer --depth 3      (a Solution Refinement Tree; resumable)
      python orchestrator.py train --task breast-cancer               (tree -> ranking loss -> tiny checkpoint)
      python orchestrator.py run --orchestrator runs/ckpt/orch --sub-agent gpt-4o-mini --sub-agent-url https://...
      (--orchestrator / --sub-agent: "scripted", a local checkpoint folder, or a model name at an endpoint)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import agent
import env
from agent import ParseError, json_object  # response parsing lives in agent.py

# torch and model.py (which imports torch) are imported inside the training functions only: a run, a tree, a usage
# error and eval.py's import of this file never need them, and importing torch takes seconds.


@dataclass
class Config:
    task: str = "breast-cancer"  # a built-in task name or a task folder
    # --- inference budgets (the paper: 12 h wall clock, up to 10 Sub-Agent iterations, App. B)
    rounds: int = 6  # Orchestrator rounds
    calls: int = 2  # tool calls per round at most (run in parallel)
    sub_iters: int = 10  # code executions per Sub-Agent at most
    time_limit: float = 1800.0  # wall clock of a whole run (or tree collection), seconds
    script_timeout: float | None = None  # seconds per script execution; None: the task's own limit
    workers: int = 2  # threads running tool calls at once
    obs_tokens: int = 5000  # environment output above this many tokens keeps its first and last obs_tokens / 2
    temperature: float = 0.0  # sampling temperature of the Orchestrator and Sub-Agents in runs
    max_tokens: int = 4096  # tokens per LLM response
    max_retries: int = 2  # re-asks of the Orchestrator after an unparsable answer
    # --- Solution Refinement Trees
    depth: int = 3  # tree depth (decisions from the starter to a leaf)
    children: int = 2  # decisions sampled per node (binary trees in the paper)
    tree_temperature: float = 1.0  # sampling temperature of those decisions
    # --- Orchestrator training
    beta: float = 0.1  # scale of the log-ratio scores (DPO's default; the paper's text gives none)
    lr: float = 1e-5  # AdamW learning rate (paper tables: 1e-5; the tiny model too: why in the docstring)
    epochs: int = 2  # passes over the preference groups per iteration (paper tables: 2)
    iterations: int = 1  # online iterations: collect, train, the trained model becomes the next reference
    max_len: int = 8192  # tokens of prompt + decision kept for log-probs (the prompt is cut from the left)
    lora_rank: int | None = None  # None: rank 16 adapters over a frozen base for a model of LARGE parameters or more
    # (a 7B Orchestrator's fp32 weights and AdamW alone would take 112 GB), every weight (0) for a smaller one
    # --- the tiny from-scratch ckpt-0 (offline, no --model): imitation of the scripted orchestrator first
    imitation_steps: int = 1000  # AdamW updates of cross-entropy on scripted decisions (one prompt's decisions each)
    imitation_lr: float = 6e-3  # peak learning rate, linear decay to 0 (a from-scratch 64-wide model, not 1e-5)
    tree_tasks: int = 2  # held-in built-in tasks per (kind, modality, metric direction) that get a tree of depth
    # OTHER_TREE_DEPTH in every iteration beside --task's: their preference groups join the ranking loss and their
    # states the imitation (0: --task's tree only)
    seed: int = 0


SUMMARY_KEYS = ("approach", "changed", "result", "errors", "next")  # the structured summary of an attempt

# ======================================================================================= tokens: count and clip


def count_tokens(text: str, tokenizer=None) -> int:
    return len(tokenizer.encode(text)) if tokenizer is not None else math.ceil(len(text) / 4)


def counter_name(tokenizer) -> str:
    return "tokenizer of the local model" if tokenizer is not None else "approx: ceil(chars / 4)"


def clip_tokens(text: str, limit: int, tokenizer=None) -> str:
    """Text over `limit` tokens keeps its first and last limit / 2 tokens (the paper: 5k -> 2.5k + 2.5k)."""
    n, keep = count_tokens(text, tokenizer), limit // 2
    if n <= limit:
        return text
    if tokenizer is not None:
        ids = tokenizer.encode(text)
        head, tail = tokenizer.decode(ids[:keep]), tokenizer.decode(ids[-keep:])
    else:
        head, tail = text[:keep * 4], text[-keep * 4:]
    return f"{head}\n[... about {n - 2 * keep} tokens cut ...]\n{tail}"


def prompt_tokens(messages, tokenizer=None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return sum(count_tokens(m["content"]) for m in messages)

# ================================================================================= attempts and compact memory


@dataclass
class Attempt:
    id: int
    parent: int | None  # None for the starter script (attempt 0)
    instruction: str
    references: list[int]
    score: float | None  # public score of its best script; None: no valid submission
    private: float | None  # private score of that script: for evaluation only, never shown to an agent
    status: str  # success | error | timeout | resource | invalid_submission | no_code
    summary: dict  # SUMMARY_KEYS -> text
    code: str  # the Sub-Agent's final script (kept out of the Orchestrator's prompt)
    messages: list = field(default_factory=list)  # the Sub-Agent's whole chat (for SFT export)
    iterations: int = 0  # code executions spent
    round: int = 0
    started: float = 0.0
    ended: float = 0.0
    submission: str = ""  # path of the copy of its best run's submission.csv ("" without a valid run)


def signed(score, higher: bool) -> float:
    """A score on a larger-is-better scale; no score is -inf."""
    return float("-inf") if score is None else (score if higher else -score)


def best_attempt(attempts, higher: bool) -> Attempt:
    return max(attempts, key=lambda a: (signed(a.score, higher), -a.id))


def _short(text, n=200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _fmt(score) -> str:
    return "none" if score is None else f"{score:.4f}"


def shown(score) -> float | None:
    """A score as a prompt shows it (_fmt's 4 decimals): what the offline stand-ins compare, as an LLM would."""
    return None if score is None else float(_fmt(score))


class Prompt(list):
    """Chat messages (all that a backend is sent) with `state`: the typed record the code that wrote them wrote them
    from, read by the offline stand-ins only. `prompt + more` keeps the record."""

    def __init__(self, messages=(), state=None):
        super().__init__(messages)
        self.state = state

    def __add__(self, more):
        return Prompt([*self, *more], self.state)


def memory_text(attempts) -> str:
    """The Orchestrator's view of the attempts: one bounded entry each, no code, no logs."""
    lines = []
    for a in attempts:
        lines.append(f"#{a.id} " + ("starter" if a.parent is None else f"parent #{a.parent}")
                     + f" | score {_fmt(a.score)} | {a.status}")
        if a.parent is not None:
            lines.append(f"  instruction: {_short(a.instruction, 300)}")
            if a.references:
                lines.append("  references: " + ", ".join(f"#{r}" for r in a.references))
        lines.append("  " + "; ".join(f"{k}: {_short(a.summary.get(k, ''))}" for k in SUMMARY_KEYS))
    return "\n".join(lines)

# ================================================================================ the Orchestrator: prompt, calls


ORCH_SYSTEM = """You are the Orchestrator of a team that solves a machine-learning task by iterative refinement.
You never see code or logs, only each attempt's score and a short structured summary. Each round you decide what
to try next by calling tools; each call is carried out by a fresh Sub-Agent, and calls in one answer run in parallel.

Tools:
- refine: {"parent": id of the attempt to start from (0 is the starter script), "instruction": the change the
  Sub-Agent must make, concrete and self-contained, "references": [ids of attempts whose code and summary the
  Sub-Agent should also see]}
- finish: {"reason": why no further attempt is worth it}

Answer with one JSON object and nothing else:
{"thought": "...", "tool_calls": [{"name": "refine", "arguments": {"parent": 0, "instruction": "...", "references": []}}]}"""


@dataclass
class OrchestratorState:
    """What an Orchestrator prompt is written from: the task, the attempts of its compact memory, the calls allowed."""
    task: env.Task
    attempts: list[Attempt]
    calls: int


def orchestrator_messages(task, attempts, rnd: int, rounds: int, calls: int, seconds_left=None) -> Prompt:
    higher = "higher" if task.higher_is_better else "lower"
    best = best_attempt(attempts, task.higher_is_better)
    clock = f", about {seconds_left:.0f} s left" if seconds_left is not None else ""
    user = (f"Task: {task.name} | metric {task.metric} ({higher} is better)\n{_short(task.description, 1500)}\n\n"
            f"Round {rnd} of {rounds}{clock}. At most {calls} tool calls this round.\n\nAttempts so far:\n"
            f"{memory_text(attempts)}\n\nBest so far: #{best.id} with public score {_fmt(best.score)}.\n"
            "Answer with one JSON object as the system message says.")
    return Prompt([{"role": "system", "content": ORCH_SYSTEM}, {"role": "user", "content": user}],
                  OrchestratorState(task, list(attempts), calls))


def parse_decision(text: str, known, max_calls: int) -> tuple[list[dict], bool]:
    """(calls, finished) of an Orchestrator answer; calls beyond max_calls are dropped, unknown references too."""
    calls = json_object(text).get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ParseError('the object needs a non-empty "tool_calls" list')
    out = []
    for c in calls:
        name, args = (c.get("name"), c.get("arguments", {})) if isinstance(c, dict) else (None, None)
        if isinstance(args, str):  # OpenAI tool calls carry their arguments as a JSON string
            args = json_object(args, "the arguments string")
        if name == "finish":
            return [], True
        if name != "refine" or not isinstance(args, dict):
            raise ParseError(f"unknown tool {name!r} or arguments not an object; the tools are refine and finish")
        try:
            parent = int(args.get("parent"))
            refs = [int(r) for r in args.get("references") or []]
        except (TypeError, ValueError):
            raise ParseError("parent and references must be attempt ids") from None
        if parent not in known:
            raise ParseError(f"no attempt #{parent}; the attempts are {sorted(known)}")
        instruction = str(args.get("instruction") or "").strip()
        if not instruction:
            raise ParseError("refine needs an instruction")
        out.append({"parent": parent, "instruction": instruction,
                    "references": [r for r in dict.fromkeys(refs) if r in known and r != parent]})
    return out[:max_calls], False


REASK = ("Your answer could not be used ({reason}). Answer with one JSON object: "
         '{{"thought": "...", "tool_calls": [{{"name": "refine", "arguments": {{...}}}}]}}')

# ===================================================================================== the Sub-Agent and the Tool


SUB_SYSTEM = """You are a Sub-Agent that implements one attempt at a machine-learning task (MLE-Dojo style).
Write the whole train.py in one ```python block; it runs in the task folder (train.csv, test.csv,
sample_submission.csv) and must write submission.csv. You then see its output and its public score; fix errors and
improve. You have at most {iters} executions. When the script is done, answer with a ```json block holding
{{"approach": ..., "changed": ..., "result": ..., "errors": ..., "next": ...}} (what the script does, what you
changed, what you got, errors met, what to try next) and no code."""

MONO_SYSTEM = SUB_SYSTEM.replace("implements one attempt at", "solves").replace(
    "When the script is done", "Decide yourself what to try next, one change at a time. When nothing is left to try")

SUMMARY_NOW = ("The execution budget is spent. Answer only with the ```json summary: approach, changed, result, "
               "errors, next.")


@dataclass
class SubAgentState:
    """What a Sub-Agent's chat is written from: its first prompt's task, script and instruction; code_loop's runs."""
    task: env.Task
    code: str  # the parent's script (the monolithic agent's: the starter)
    score: float | None  # its public score
    instruction: str | None  # None: the monolithic agent, which decides its changes itself
    runs: list = field(default_factory=list)  # (script, env.RunResult) per execution, as the feedback reports them
    tried: list = field(default_factory=list)  # the ideas the offline stand-in answered with (its own notes)


def sub_messages(task, parent: Attempt, references, instruction: str, iters: int) -> Prompt:
    """The fresh context a Tool builds: task, parent code, the references' summaries and code, the instruction."""
    refs = "".join(f"\n## Attempt #{r.id} (public score {_fmt(r.score)})\n"
                   + "; ".join(f"{k}: {r.summary.get(k, '')}" for k in SUMMARY_KEYS) + f"\n```python\n{r.code}```\n"
                   for r in references)
    user = (f"# Task\n{task.description.strip()}\n\n# Parent attempt #{parent.id} (public score {_fmt(parent.score)})"
            f"\n```python\n{parent.code}```\n" + (f"\n# Reference attempts\n{refs}" if refs else "")
            + f"\n# Instruction\n{instruction}")
    return Prompt([{"role": "system", "content": SUB_SYSTEM.format(iters=iters)}, {"role": "user", "content": user}],
                  SubAgentState(task, parent.code, parent.score, instruction))


def mono_messages(task, starter: Attempt, steps: int) -> Prompt:
    higher = "higher" if task.higher_is_better else "lower"
    user = (f"# Task\n{task.description.strip()}\nMetric: {task.metric} ({higher} is better)\n\n"
            f"# Starter script (public score {_fmt(starter.score)})\n"
            f"```python\n{starter.code}```\n\nImprove the public score.")
    return Prompt([{"role": "system", "content": MONO_SYSTEM.format(iters=steps)}, {"role": "user", "content": user}],
                  SubAgentState(task, starter.code, starter.score, None))


def parse_coder(text: str) -> tuple[str, object]:
    """("code", script) for a ```python block, else ("summary", dict) for the JSON summary."""
    blocks = re.findall(r"```(?:python|py)[ \t]*\n(.*?)```", text or "", re.S)
    if blocks:
        return "code", max(blocks, key=len)
    obj = json_object(text)
    if not any(k in obj for k in SUMMARY_KEYS):
        raise ParseError("neither a ```python block nor a JSON summary")
    return "summary", {k: str(obj.get(k, "")) for k in SUMMARY_KEYS}


def error_line(run) -> str:
    if run.status == "invalid_submission":
        return f"invalid submission: {run.error}"
    if run.status in ("timeout", "resource"):
        return f"stopped at the {'time' if run.status == 'timeout' else 'resource'} limit"
    lines = [line.strip() for line in run.output.splitlines() if line.strip()]
    return next((line for line in reversed(lines) if re.match(r"\w*(Error|Exception)\b", line)),
                lines[-1] if lines else f"exit status {run.returncode}")


def run_log(run, cap=1 << 16) -> str:
    """The run's whole output while its log is on disk (env.py hands back only 4 KB of each end), so the 5k-token
    clip applies to the real output; a log over 2 * cap bytes is read at both ends only."""
    path = Path(run.log_path or "")
    if not path.is_file():
        return run.output
    with open(path, "rb") as f:
        data = f.read(2 * cap + 1)
        if len(data) > 2 * cap:
            f.seek(-cap, os.SEEK_END)
            data = data[:cap] + b"\n" + f.read()
    return data.decode("utf-8", errors="replace")


def feedback(run, task, limit: int, tokenizer=None) -> str:
    """What the environment tells the coder after an execution (the public score, never the private one)."""
    text = f"Execution: {run.status} after {run.seconds:.1f} s."
    if run.status == "success":
        text += f"\nPublic score ({task.metric}, {'higher' if task.higher_is_better else 'lower'} is better): " \
                f"{run.score:.4f}"
    elif run.status != "error":
        text += f"\nProblem: {error_line(run)}"
    return text + "\nOutput:\n```\n" + clip_tokens(run_log(run).strip(), limit, tokenizer) + "\n```"


def code_loop(task, backend, messages, max_iters: int, cfg: Config, deadline: float, on_prompt, start_code: str,
              **fields) -> tuple[Attempt, object, list[str]]:
    """Write the whole script, execute (each run into messages.state), read the feedback, fix; until a summary,
    max_iters executions or the deadline. -> (the Attempt, with the `fields` given: its best script by public score,
    else the last one, else start_code; the best script's run or None; the errors met)."""
    tok, higher = getattr(backend, "tokenizer", None), task.higher_is_better
    best = best_run = last = summary = None
    iters, errors, status = 0, [], "no_code"
    while iters < max_iters and time.time() < deadline:
        on_prompt(messages)
        text = backend.chat(messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens).texts[0]
        messages = messages + [{"role": "assistant", "content": text}]
        try:
            kind, value = parse_coder(text)
        except ParseError as e:  # counts as an iteration, as an invalid step does in MLE-Dojo
            iters += 1
            messages.append({"role": "user", "content": f"Invalid answer ({e}). Send a ```python block or the "
                                                        "```json summary."})
            continue
        if kind == "summary":
            summary = value
            break
        iters, last = iters + 1, value
        timeout = min(cfg.script_timeout or task.time_limit, max(deadline - time.time(), 1.0))
        run = env.run_script(task, value, timeout=timeout, keep=("submission.csv",))
        messages.state.runs.append((value, run))
        status = "success" if best_run or run.status == "success" else run.status
        if run.status == "success" and (best_run is None or signed(run.score, higher) > signed(best_run.score, higher)):
            best, best_run = value, run
        elif run.status != "success":
            errors.append(error_line(run))
        messages.append({"role": "user", "content": feedback(run, task, cfg.obs_tokens, tok)})
    if summary is None:  # the budget ran out first: one request for the summary (no execution)
        messages = messages + [{"role": "user", "content": SUMMARY_NOW}]
        on_prompt(messages)
        text = backend.chat(messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens).texts[0]
        messages.append({"role": "assistant", "content": text})
        try:
            kind, summary = parse_coder(text)
            summary = summary if kind == "summary" else None
        except ParseError:
            pass
    summary = {k: (summary or {}).get(k, "") for k in SUMMARY_KEYS}
    attempt = Attempt(**fields, score=best_run.score if best_run else None,
                      private=best_run.test_score if best_run else None, status=status, summary=summary,
                      code=(best if best is not None else last) or start_code, messages=messages, iterations=iters,
                      ended=time.time(), submission=best_run.kept.get("submission.csv", "") if best_run else "")
    return attempt, best_run, list(dict.fromkeys(errors))


class Tool:
    """refine(parent, instruction, references): a fresh Sub-Agent context, the Sub-Agent's loop, score + summary."""

    def __init__(self, task, backend, cfg: Config, deadline: float, record):
        self.task, self.backend, self.cfg, self.deadline, self.record = task, backend, cfg, deadline, record

    def __call__(self, attempt_id: int, call: dict, attempts: dict, rnd: int) -> Attempt:
        started = time.time()
        parent = attempts[call["parent"]]
        messages = sub_messages(self.task, parent, [attempts[r] for r in call["references"]], call["instruction"],
                                self.cfg.sub_iters)
        tok = getattr(self.backend, "tokenizer", None)
        a, run, errors = code_loop(self.task, self.backend, messages, self.cfg.sub_iters, self.cfg, self.deadline,
                                   lambda m: self.record(rnd, "sub-agent", m, tok, attempt_id), parent.code,
                                   id=attempt_id, parent=parent.id, instruction=call["instruction"],
                                   references=call["references"], round=rnd, started=started)
        if run:  # the Tool reports what it measured, not what the Sub-Agent claims
            delta = "better than" if signed(run.score, self.task.higher_is_better) > signed(
                parent.score, self.task.higher_is_better) else "not better than"
            a.summary["result"] = f"public score {run.score:.4f}, {delta} parent #{parent.id} ({_fmt(parent.score)})"
        else:
            a.summary["result"] = f"no valid submission after {a.iterations} execution(s)"
        a.summary["errors"] = "; ".join(errors) or a.summary["errors"] or "none"
        return a


def starter_attempt(task, cfg: Config) -> Attempt:
    code = (task.public_dir / "train.py").read_text()
    run = env.run_script(task, code, timeout=cfg.script_timeout or task.time_limit, keep=("submission.csv",))
    summary = {"approach": "the task's starter script", "changed": "nothing", "result":
               f"public score {_fmt(run.score)}", "errors": "none" if run.status == "success" else error_line(run),
               "next": "improve the data, the model or the training"}
    return Attempt(0, None, "", [], run.score, run.test_score, run.status, summary, code,
                   submission=run.kept.get("submission.csv", "") if run.status == "success" else "")

# ================================================================================ offline stand-ins (clearly labelled)


def _recipe_ideas(task_name: str) -> list[str]:
    """The built-in recipes' ideas, interleaved by category (data, model, learning) for variety."""
    by_cat = {}
    for r in env.recipes_for(task_name):
        by_cat.setdefault(r.category, []).append(r.idea)
    lists = list(by_cat.values())
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


class ScriptedOrchestrator:
    """OFFLINE STAND-IN for an LLM Orchestrator: reads its prompt's OrchestratorState and expands the best attempts
    with recipe ideas not yet tried on their lineage, `calls` calls per round, the next-best attempt as reference;
    with temperature > 0 the parent and the ideas are sampled. Writes the same JSON an LLM would."""

    def __init__(self, seed=0):
        self.seed, self.rng, self.usage = seed, random.Random(seed), agent.Usage()

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None):
        c = agent.Completion([self.decide(messages.state, self.rng if temperature > 0 else None) for _ in range(n)])
        self.usage.add(c, 0.0)
        return c

    @staticmethod
    def decide(state: OrchestratorState, rng, sample_parent=True) -> str:
        """The decision at a prompt's state; rng None: greedy; sample_parent=False: only the ideas sampled."""
        # the attempts as memory_text shows them: scores to 4 decimals, instructions shortened
        nodes = {a.id: (a.parent, shown(a.score)) for a in state.attempts}
        said = {a.id: _short(a.instruction, 300) for a in state.attempts if a.parent is not None}
        ranked = sorted(nodes, key=lambda i: (-signed(nodes[i][1], state.task.higher_is_better), i))
        ranked = [i for i in ranked if nodes[i][1] is not None]
        if rng is not None and sample_parent and len(ranked) > 1:  # the best first with probability 1/2, else top 3
            first = rng.choice(ranked[:3]) if rng.random() < 0.5 else ranked[0]
            ranked = [first] + [i for i in ranked if i != first]
        ideas, out, calls = _recipe_ideas(state.task.name), [], state.calls
        for parent in ranked:
            lineage, i = set(), parent
            while i is not None:  # ideas applied on the way from the starter, and ideas already tried from here
                lineage.add(said.get(i))
                i = nodes[i][0]
            lineage |= {said.get(c) for c in nodes if nodes[c][0] == parent}
            fresh = [idea for idea in ideas if idea not in lineage]
            if rng is not None:
                rng.shuffle(fresh)
            refs = [r for r in ranked if r != parent][:1]
            for idea in fresh[:calls - len(out)]:
                out.append({"name": "refine", "arguments": {"parent": parent, "instruction": idea,
                                                            "references": refs}})
            if len(out) == calls:
                break
        if not out:
            return json.dumps({"thought": "Every recipe was tried on the best attempts.",
                               "tool_calls": [{"name": "finish", "arguments": {"reason": "no untried idea"}}]})
        parents = sorted({c["arguments"]["parent"] for c in out})
        return json.dumps({"thought": f"Refine attempt(s) {parents} with untried ideas.", "tool_calls": out})


class RecipeCoder:
    """OFFLINE STAND-IN for an LLM Sub-Agent: applies env.py's recipe for its instruction to the parent script
    (env.recipe_editor) and writes the whole script in a ```python block; after the run it answers with the JSON
    summary. Without an instruction (the monolithic baseline) it tries the next untried recipe on its best script.
    Its state: its prompt's SubAgentState."""

    def __init__(self):
        self.usage = agent.Usage()

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None):
        c = agent.Completion([self.respond(messages)] * n)
        self.usage.add(c, 0.0)
        return c

    def respond(self, messages) -> str:
        s, higher = messages.state, messages.state.task.higher_is_better
        if messages[-1]["content"] == SUMMARY_NOW or (s.instruction and s.runs):  # it ran its script: the summary
            ran = any(run.status == "success" for _, run in s.runs)
            return self._summary(s.instruction or "built-in recipes, one at a time, kept when better",
                                 "applied the recipe" if ran else "no script scored", "another recipe on top of it")
        if s.instruction:  # a Sub-Agent: the recipe its instruction names, on the parent script
            try:
                return f"Idea: {s.instruction}\n```python\n{env.recipe_editor(s.instruction, s.code)}```"
            except env.EditError as e:
                return self._summary(s.instruction, f"nothing: {e}", "an instruction naming a built-in recipe")
        # the monolithic baseline: the best script of its whole history, then the next untried recipe on it
        best, code = shown(s.score), s.code
        for script, run in s.runs:
            if run.status == "success" and signed(shown(run.score), higher) > signed(best, higher):
                best, code = shown(run.score), script
        for idea in (i for i in _recipe_ideas(s.task.name) if i not in s.tried):
            try:
                answer = f"Idea: {idea}\n```python\n{env.recipe_editor(idea, code)}```"
            except env.EditError:
                continue
            s.tried.append(idea)
            return answer
        return self._summary("every built-in recipe, one at a time, kept when better", f"best public score {best}",
                             "nothing left to try offline")

    @staticmethod
    def _summary(approach, changed, nxt) -> str:
        return "```json\n" + json.dumps({"approach": approach, "changed": changed, "result": "see the last run",
                                         "errors": "none", "next": nxt}) + "\n```"


def make_backend(name: str | None, base_url: str | None, role: str, seed=0):
    """agent.make_backend with the role's offline stand-in for "scripted" (eval.py calls it too)."""
    return agent.make_backend(name, base_url, stand_in=lambda: ScriptedOrchestrator(seed) if role == "orchestrator"
                              else RecipeCoder())

# ===================================================================================== the runs: Matryoshka, monolithic


def write_text(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic: readers see the old file or the new one


def save_json(path: Path, obj):
    write_text(path, json.dumps(obj))


def load_json(path: Path, shape=None):
    """The object saved at path, None when there is none; not JSON, or without the keys of `shape` ({key: type}),
    is a one-line ValueError naming the file."""
    if not path or not path.exists():
        return None
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}); delete it or give another --out") from None
    bad = [k for k, t in (shape or {}).items() if not isinstance(obj, dict) or not isinstance(obj.get(k), t)]
    if bad:
        raise ValueError(f"{path}: not a file of orchestrator.py (bad or missing {', '.join(bad)}); delete it or give "
                         "another --out")
    return obj


def attempts_of(path: Path, rows) -> list[Attempt]:
    try:
        return [Attempt(**a) for a in rows]
    except TypeError:
        raise ValueError(f"{path}: an attempt is not an orchestrator.py attempt; delete it or give another --out") \
            from None


RUN_SHAPE = {"attempts": list, "records": list, "round": int, "seconds": (int, float), "finished": bool}


def _recorder(records: list):
    """record(round, role, prompt messages, tokenizer, attempt): the prompt's token count, thread-safe."""
    lock = threading.Lock()

    def record(rnd, role, messages, tokenizer=None, attempt=None):
        n = prompt_tokens(messages, tokenizer)
        with lock:
            records.append({"round": rnd, "role": role, "tokens": n, "attempt": attempt,
                            "counter": counter_name(tokenizer)})
    return record


def decide(orch, messages, known, cfg: Config, record, rnd) -> tuple[list[dict], bool, str]:
    """Ask the Orchestrator, re-asking on an unparsable answer (MLAB's max_retries); a round with no usable answer
    launches nothing."""
    ask, tok = messages, getattr(orch, "tokenizer", None)  # ask + [...]: new Prompts, the same state
    for _ in range(cfg.max_retries + 1):
        record(rnd, "orchestrator", ask, tok)
        text = orch.chat(ask, temperature=cfg.temperature, max_tokens=cfg.max_tokens).texts[0]
        try:
            calls, finished = parse_decision(text, known, cfg.calls)
            return calls, finished, text
        except ParseError as e:
            ask = ask + [{"role": "assistant", "content": text},
                         {"role": "user", "content": REASK.format(reason=e)}]
    return [], False, text


def _result(task, attempts, records, finished, seconds) -> dict:
    best = best_attempt(attempts, task.higher_is_better)
    counters = "; ".join(sorted({f"{r['role']}: {r['counter']}" for r in records}))  # how tokens were counted
    return {"task": task.name, "attempts": [asdict(a) for a in attempts], "records": records, "finished": finished,
            "seconds": seconds, "token_counter": counters, "best": {"id": best.id, "public": best.score,
                                                                    "private": best.private, "code": best.code,
                                                                    "submission": best.submission}}


def run_matryoshka(cfg: Config, orch, sub, out: Path | None = None, resume=True, log=print) -> dict:
    """Rounds of: the Orchestrator's tool calls from compact memory -> Tools in parallel -> attempts appended.
    The state is saved after every round to out/run.json (atomic) and resumed from it."""
    task = env.load_task(cfg.task)
    state = load_json(out / "run.json", RUN_SHAPE) if out and resume else None
    if state:
        attempts, records = attempts_of(out / "run.json", state["attempts"]), state["records"]
        rnd, spent, finished = state["round"], state["seconds"], state["finished"]
        log(f"resumed {out / 'run.json'} at round {rnd}")
    else:
        attempts, records, rnd, spent, finished = [starter_attempt(task, cfg)], [], 0, 0.0, False
    start = time.time()
    deadline, record = start + cfg.time_limit - spent, _recorder(records)
    tool = Tool(task, sub, cfg, deadline, record)
    while not finished and rnd < cfg.rounds and time.time() < deadline:
        rnd += 1
        messages = orchestrator_messages(task, attempts, rnd, cfg.rounds, cfg.calls, deadline - time.time())
        calls, finished, _ = decide(orch, messages, {a.id for a in attempts}, cfg, record, rnd)
        by_id = {a.id: a for a in attempts}
        jobs = list(zip(range(len(attempts), len(attempts) + len(calls)), calls))
        with ThreadPoolExecutor(max(1, cfg.workers)) as pool:  # the calls of one round run in parallel (Matryoshka §3.4)
            attempts += list(pool.map(lambda job: tool(job[0], job[1], by_id, rnd), jobs))
        best = best_attempt(attempts, task.higher_is_better)
        log(f"round {rnd}: " + (", ".join(f"#{a.id}<-#{a.parent} {_fmt(a.score)} ({a.status}, {a.iterations} it)"
                                          for a in attempts[-len(jobs):]) if jobs else "no call")
            + (" | finish" if finished else "") + f" | best #{best.id} {_fmt(best.score)}")
        state = {**_result(task, attempts, records, finished, spent + time.time() - start), "round": rnd}
        if out:
            save_json(out / "run.json", state)
    return state or {**_result(task, attempts, records, finished, spent), "round": rnd}


def run_monolithic(cfg: Config, coder, out: Path | None = None, log=print) -> dict:
    """MLE-Dojo's single agent: one chat that keeps every script and every output; the same wall clock and at most
    as many executions as a Matryoshka run may spend (rounds x calls x sub_iters)."""
    task = env.load_task(cfg.task)
    steps = cfg.rounds * cfg.calls * cfg.sub_iters
    starter, records = starter_attempt(task, cfg), []
    tok = getattr(coder, "tokenizer", None)
    record = _recorder(records)
    started = time.time()
    mono, _, _ = code_loop(task, coder, mono_messages(task, starter, steps), steps, cfg, started + cfg.time_limit,
                           lambda m: record(len(records) + 1, "monolithic", m, tok), starter.code, id=1, parent=0,
                           instruction="monolithic", references=[], round=1, started=started)
    result = _result(task, [starter, mono], records, True, time.time() - started)
    log(f"monolithic: {mono.iterations} executions, best {_fmt(result['best']['public'])}, last prompt "
        f"{records[-1]['tokens'] if records else 0} tokens")
    if out:
        save_json(out / "monolithic.json", result)
    return result

# ============================================================================= Solution Refinement Trees (Matryoshka §3.6)


@dataclass
class Node:
    """One node of a tree: a decision sampled at its parent's state, the attempts its tool calls launched, r(v)."""
    id: int  # its index in Tree.nodes
    parent: int | None  # None for the root (the starter's state)
    depth: int
    decision: str | None  # the Orchestrator's answer at the parent's state (None for the root)
    calls: list[dict] | None  # its parsed tool calls, each with the id of the attempt it launched; None: not parsed yet
    status: str  # pending (its calls not all run) | done
    prompt: list | None  # the prompt its children's decisions answer, once they are sampled
    score: float | None  # the best public score of its attempts, r(v) once signed; None: none valid
    finished: bool | None = None  # the decision called finish; None: not parsed yet, or unparsable
    error: str | None = None  # why the decision is unparsable


TREE_SHAPE = {"task": str, "attempts": dict, "nodes": list, "next_id": int, "higher_is_better": bool}


@dataclass
class Tree:
    """A Solution Refinement Tree: cfg.children decisions per node (binary in Matryoshka §3.6), each node's state its
    path's attempts (the shared prefix, run once); tree.json holds to_json()."""
    task: str
    higher_is_better: bool
    next_id: int  # the id of the next attempt
    attempts: dict[int, Attempt]
    nodes: list[Node]

    def children(self, node_id) -> list[Node]:
        return [n for n in self.nodes if n.parent == node_id]

    def state(self, node_id) -> list[Attempt]:
        """The state of a node: the starter and the attempts its path launched (those that exist yet)."""
        ids = []
        while node_id is not None:  # up to the root, each node's calls before its children's
            ids[:0] = [c["attempt"] for c in self.nodes[node_id].calls or []]
            node_id = self.nodes[node_id].parent
        return [self.attempts[i] for i in [0] + ids if i in self.attempts]

    def to_json(self) -> dict:
        """tree.json's object: attempts keyed by str(id); a node's finished and error only once set."""
        return {"task": self.task, "higher_is_better": self.higher_is_better, "next_id": self.next_id,
                "attempts": {str(i): asdict(a) for i, a in self.attempts.items()},
                "nodes": [{k: v for k, v in asdict(n).items() if v is not None or k not in ("finished", "error")}
                          for n in self.nodes]}

    @classmethod
    def from_json(cls, obj: dict, path="tree.json") -> Tree:
        """The tree of a to_json object (tree.json); anything else is a one-line ValueError naming path."""
        try:
            return cls(obj["task"], obj["higher_is_better"], obj["next_id"],
                       {int(i): Attempt(**a) for i, a in obj["attempts"].items()}, [Node(**n) for n in obj["nodes"]])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"{path}: a node or attempt is not orchestrator.py's; delete it or give another --out") \
                from None

    @classmethod
    def load(cls, path: Path) -> Tree | None:
        """The tree saved at path, None when there is none."""
        obj = load_json(path, TREE_SHAPE)
        return None if obj is None else cls.from_json(obj, path)


def collect_tree(cfg: Config, orch, sub, path: Path, log=print) -> Tree:
    """Expand every node with cfg.children decisions sampled from the same state (its path's attempts: the shared
    prefix, run once), to cfg.depth; run the decisions' tool calls; r(v) from the environment. Saved after every
    decision and attempt, so an interrupted collection resumes where it stopped."""
    task = env.load_task(cfg.task)
    tree = Tree.load(path)
    if tree is None:
        starter = starter_attempt(task, cfg)
        tree = Tree(task.name, task.higher_is_better, 1, {0: starter},
                    [Node(0, None, 0, None, [], "done", None, starter.score)])
    lock, save = threading.Lock(), lambda: save_json(path, tree.to_json())
    tool = Tool(task, sub, cfg, time.time() + cfg.time_limit, lambda *a, **k: None)
    while True:
        # 1. decisions: every finished node above the depth limit, with no children yet, gets cfg.children samples
        for node in list(tree.nodes):
            if node.status != "done" or node.depth >= cfg.depth or tree.children(node.id) or node.finished \
                    or node.error:  # a finishing or unparsable decision is a leaf
                continue
            node.prompt = orchestrator_messages(task, tree.state(node.id), node.depth + 1, cfg.depth, cfg.calls)
            if isinstance(orch, ScriptedOrchestrator):  # each node's samples from (seed, node): a resume makes the same
                orch.rng.seed(f"{orch.seed}:{node.id}")
            for text in orch.chat(node.prompt, n=cfg.children, temperature=cfg.tree_temperature,
                                  max_tokens=cfg.max_tokens).texts:
                tree.nodes.append(Node(len(tree.nodes), node.id, node.depth + 1, text, None, "pending", None, None))
            save()
        pending = [n for n in tree.nodes if n.status == "pending"]
        if not pending:
            return tree
        # 2. parse each pending decision once and give its calls attempt ids; then run the calls not yet run
        jobs = []
        for node in pending:
            by_id = {a.id: a for a in tree.state(node.parent)}
            if node.calls is None:
                try:
                    calls, node.finished = parse_decision(node.decision, set(by_id), cfg.calls)
                except ParseError as e:
                    calls, node.error = [], str(e)
                node.calls = [{**c, "attempt": tree.next_id + i} for i, c in enumerate(calls)]
                tree.next_id += len(calls)
            jobs += [(node, c, by_id) for c in node.calls if c["attempt"] not in tree.attempts]
        save()

        def run(job):
            node, call, by_id = job
            a = tool(call["attempt"], call, by_id, node.depth)
            with lock:
                tree.attempts[a.id] = a
                save()
            return a
        with ThreadPoolExecutor(max(1, cfg.workers)) as pool:
            list(pool.map(run, jobs))
        for node in pending:
            valid = [s for c in node.calls if (s := tree.attempts[c["attempt"]].score) is not None]
            node.score = (max(valid) if task.higher_is_better else min(valid)) if valid else None
            node.status = "done"
        log(f"tree: {len(tree.nodes)} nodes, {len(tree.attempts)} attempts, depth {max(n.depth for n in tree.nodes)}")
        save()


def branch_labels(tree: Tree) -> dict[int, float]:
    """R(c) = max over the subtree of c of r(v), r the node's signed score (Matryoshka §3.6, Preference Construction)."""
    R = {}

    def label(i):
        R[i] = max([signed(tree.nodes[i].score, tree.higher_is_better)] + [label(c.id) for c in tree.children(i)])
        return R[i]
    label(0)
    return R


def preference_groups(tree: Tree) -> list[dict]:
    """Per node with children: its prompt, the children's decisions and their labels R; all-tied groups dropped."""
    R, groups = branch_labels(tree), []
    for node in tree.nodes:
        kids = tree.children(node.id)
        labels = [R[k.id] for k in kids]
        if len(kids) >= 2 and node.prompt and len(set(labels)) > 1:
            groups.append({"node": node.id, "messages": node.prompt, "responses": [k.decision for k in kids],
                           "R": labels})
    return groups


def sft_rows(attempts, higher: bool) -> list[dict]:
    """Successful Sub-Agent trajectories (a valid score better than the parent's) as chat rows for sft.py."""
    by_id = {a["id"]: a for a in attempts}
    return [{"messages": a["messages"]} for a in attempts if a["parent"] is not None and a["messages"]
            and signed(a["score"], higher) > signed(by_id[a["parent"]]["score"], higher)]


def write_jsonl(path: Path, rows):
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))

# ========================================================================================= ranking loss and training


def ranking_loss(scores, R):
    """Plackett-Luce ranking NCE over children ranked by R, ties skipped (see the docstring); scores (K,) are
    beta * log(pi_theta / pi_ref). Two children: DPO. None when every child is tied."""
    import torch  # lazy: see the imports
    terms = []
    for k in range(len(R)):
        worse = [j for j in range(len(R)) if R[j] < R[k]]
        if worse:  # -log softmax of child k against the children strictly below it
            terms.append(torch.logsumexp(scores[[k] + worse], 0) - scores[k])
    return torch.stack(terms).sum() if terms else None


def decision_logprobs(lm, tok, messages, responses, max_len: int):
    """Sum of log pi(decision token | prompt, earlier decision tokens) per response: (K,). model.response_logprobs
    (ppo.py's per-token log-probs) at temperature 1 over the whole vocabulary, summed over each response; the rows
    right-padded, each prompt cut to its end so that prompt + response fit max_len. On CUDA under bf16 autocast (bf16
    matmuls over fp32 master weights), in the weights' own dtype elsewhere."""
    import model  # lazy: see the imports
    import torch
    prompt = tok.encode(tok.apply_chat_template(messages))
    seqs, starts = [], []
    for r in responses:
        resp = tok.encode(r) + ([tok.im_end_id] if tok.im_end_id is not None else [])  # the turn ends at <|im_end|>
        p = model.keep_end(prompt, max_len, len(resp))
        seqs.append(p + resp)
        starts.append(len(p))
    dev, pad = lm.lm_head.weight.device, tok.pad_token_id or 0
    L = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs], device=dev)  # (K, L)
    lengths, starts = torch.tensor(list(map(len, seqs)), device=dev), torch.tensor(starts, device=dev)
    with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):  # as ppo.autocast; none on CPU
        lp = model.response_logprobs(lm, ids, lengths, starts)  # (K, R)
    mine = torch.arange(lp.shape[1], device=dev) < (lengths - starts)[:, None]  # (K, R): the response's own tokens
    return torch.where(mine, lp, 0.0).sum(-1)


def adamw_passes(lm, n: int, steps: int, lr: float, seed, rng, loss_of, decay=False) -> list[float]:
    """`steps` AdamW updates (no weight decay, gradient norm clipped at 1) of loss_of(i), one item i of n each, every
    pass over the n items in a new order drawn from rng; decay: the learning rate falls linearly to 0; torch seeded
    with `seed` first. -> the losses."""
    import torch  # lazy: see the imports
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / max(steps, 1)) if decay else None
    order, losses = list(range(n)), []
    lm.train()
    for step in range(steps if n else 0):
        if step % n == 0:  # a new pass, in a new order
            rng.shuffle(order)
        loss = loss_of(order[step % n])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    lm.eval()
    return losses


def train_orchestrator(policy, ref, tok, groups, cfg: Config, steps=None, log=print) -> dict:
    """AdamW on the ranking loss over the groups, cfg.epochs passes (or `steps` updates); ref stays frozen. ref None:
    policy has LoRA adapters (model.add_lora, B = 0, so it starts at the reference) and the reference is the policy
    with its adapters off."""
    import model  # lazy: see the imports
    import torch
    with torch.no_grad():
        if ref is None:
            model.set_lora(policy, False)
        ref_lp = [decision_logprobs(ref or policy, tok, g["messages"], g["responses"], cfg.max_len) for g in groups]
        model.set_lora(policy, True)

    def scores(i):  # (K,) log-ratio scores of group i's decisions
        g = groups[i]
        return cfg.beta * (decision_logprobs(policy, tok, g["messages"], g["responses"], cfg.max_len) - ref_lp[i])
    losses = adamw_passes(policy, len(groups), cfg.epochs * len(groups) if steps is None else steps, cfg.lr,
                          cfg.seed, random.Random(cfg.seed), lambda i: ranking_loss(scores(i), groups[i]["R"]))
    with torch.no_grad():  # how often the top-ranked child now has the highest score
        after = [scores(i) for i in range(len(groups))]
        top = [int(torch.argmax(s)) == g["R"].index(max(g["R"])) for s, g in zip(after, groups)]
        mean = sum(ranking_loss(s, g["R"]).item() for s, g in zip(after, groups)) / len(groups) if groups else None
    stats = {"steps": len(losses), "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
             "loss_after": mean, "top_accuracy": sum(top) / len(top) if top else None}
    log(f"train: {stats}")
    return stats


def tiny_orchestrator(texts, vocab_size=1024, seed=0):
    """A tiny Qwen made from scratch with a BPE tokenizer trained on `texts` (offline, no checkpoint given)."""
    import model  # lazy: see the imports
    tok = model.train_tokenizer(texts, vocab_size)
    model.torch.manual_seed(seed)
    lm = model.Qwen(model.tiny_config(vocab_size=len(tok), max_position_embeddings=16384,
                                      eos_token_id=tok.im_end_id))
    return lm.eval(), tok

# ------------------------------------------------------------- the from-scratch ckpt-0 imitates the decision format
# OFFLINE STAND-IN (see the docstring at the top), one idea: ckpt-0 is cloned from the scripted orchestrator's decisions
# with the best attempt as parent, on prompts as trees and runs show them: the states (imitation_examples), each state
# as a few prompts, each prompt with its answers; then `imitate` trains on them and greedy_parse_rate measures it.


def other_tasks(tree_task: str, per_group: int) -> list[str]:
    """Held-in built-in tasks: the first `per_group` of each (kind, modality, metric direction), the tree's own task
    left out (it has its own tree). Never a held-out task."""
    groups: dict = {}
    for name, spec in env.BUILTIN_TASKS.items():
        if spec.split == "held-in" and name != tree_task:
            groups.setdefault((spec.kind, spec.modality, env.METRICS[spec.metric].higher_is_better), []).append(name)
    return [n for names in groups.values() for n in names[:per_group]]


IMITATION_VIEWS = 3  # prompts per state: the tree's own header, then two with another round count and a clock
IMITATION_RESAMPLED = 24  # further states made of --task's tree's attempts (resampled_states); a quarter as many
# from each other task's tree


def resampled_states(tree, n: int, rng) -> list[list[Attempt]]:
    """n states as a run would hold them, made of the tree's attempts: a random ancestor-closed subset (from the
    starter, each next attempt one whose parent is in already), numbered 0, 1, 2, ... in that order, with parents,
    references and the "parent #k" of each summary renumbered. Their best attempt, the parent a greedy decision
    picks, varies far more than along the tree's own paths."""
    pool = tree.attempts
    states = []
    for _ in range(n if len(pool) > 1 else 0):
        order = [0]
        for _ in range(rng.randint(1, len(pool) - 1)):
            ready = [i for i in sorted(pool) if i not in order and pool[i].parent in order]  # by id: the JSON
            # holds the attempts in the order their parallel runs ended
            if not ready:
                break
            order.append(rng.choice(ready))
        new = {old: k for k, old in enumerate(order)}
        renumber = lambda m: f"parent #{new.get(int(m.group(1)), 0)}"  # noqa: E731
        states.append([dataclasses.replace(
            a, id=new[a.id], parent=None if a.parent is None else new[a.parent],
            references=[new[r] for r in a.references if r in new],
            summary={k: re.sub(r"parent #(\d+)", renumber, str(v)) for k, v in a.summary.items()})
            for a in (pool[i] for i in order)])
    return states


def imitation_examples(trees, cfg: Config) -> list[dict]:
    """What the tiny ckpt-0 imitates, from the iteration's trees (--task's first, then the other tasks').
    - States: every done node of each tree (its path's attempts) and resampled_states of each tree's attempts.
    - Prompts: each state IMITATION_VIEWS times, first as collect_tree asks it (round depth + 1 of the tree's depth,
      no clock), then with another "Round r of R, about s left" header, as runs ask it; a prompt met before is
      skipped.
    - Answers: a node's own prompt keeps the tree's decisions (its children, sampled at cfg.tree_temperature: the texts
      the ranking loss then compares); every other prompt gets cfg.children decisions of ScriptedOrchestrator.decide
      with the best attempt as parent and its untried ideas sampled (sample_parent=False).
    Why: the parent is then a function of the prompt that a 64-wide model can learn to copy (with sampled parents its
    answers on runs' prompts named attempts that do not exist), while the ideas keep a spread for the ranking loss to
    reshape (with greedy ideas ckpt-0 answered every held-out prompt with one decision, and no trained ckpt-1 answered
    otherwise). With --task's tree alone, ckpt-0's answers on other tasks parsed in round 1 only (one attempt in
    memory), never later. -> [{"messages", "responses", "known": the state's ids, "tree": whether the prompt is a
    tree's own}]"""
    rng, states = random.Random(f"{cfg.seed}:imitation"), []  # (task, state, node, its tree, the tree's depth)
    for i, tree in enumerate(trees):
        task, depth = env.load_task(cfg.task if i == 0 else tree.task), cfg.depth if i == 0 else OTHER_TREE_DEPTH
        states += [(task, tree.state(n.id), n, tree, depth) for n in tree.nodes if n.status == "done"]
        states += [(task, attempts, None, tree, depth) for attempts in
                   resampled_states(tree, IMITATION_RESAMPLED if i == 0 else IMITATION_RESAMPLED // 4, rng)]
    out, seen = [], set()
    for t, attempts, node, tree, tree_depth in states:
        depth = node.depth if node else min(len(attempts) - 1, 1)  # a run's round 1 sees the starter only
        for view in range(IMITATION_VIEWS):
            if view == 0:  # as collect_tree asks it
                rnd, rounds, clock = depth + 1, max(tree_depth, depth + 1), None
            else:  # as a run asks it
                rounds = rng.randint(max(2, depth + 1), 8)
                rnd, clock = rng.randint(depth + 1, rounds), rng.uniform(60.0, cfg.time_limit)
            messages = orchestrator_messages(t, attempts, rnd, rounds, cfg.calls, clock)
            key = json.dumps(messages)
            if key in seen:  # an unparsable or finishing decision leaves its parent's state: the same prompt
                continue
            seen.add(key)
            own = view == 0 and node is not None
            if own and node.prompt == messages and tree.children(node.id):
                responses = [k.decision for k in tree.children(node.id)]
            else:
                ideas = random.Random(f"{cfg.seed}:imitation:{rng.random()}")
                responses = [ScriptedOrchestrator.decide(messages.state, ideas, sample_parent=False)
                             for _ in range(cfg.children)]
            out.append({"messages": messages, "responses": list(dict.fromkeys(responses)),
                        "known": sorted(a.id for a in attempts), "tree": own})
    return out


def imitate(lm, tok, examples, cfg: Config, log=print) -> dict:
    """Behaviour cloning: the mean over decision tokens of -log pi(token | prompt, earlier tokens) (the sums of
    decision_logprobs over the example's decisions, divided by their token count); adamw_passes from
    cfg.imitation_lr decaying linearly to 0 over cfg.imitation_steps updates, one example per update."""
    sizes = [sum(len(tok.encode(r)) + (tok.im_end_id is not None) for r in e["responses"]) for e in examples]
    nll = lambda i: -decision_logprobs(lm, tok, examples[i]["messages"], examples[i]["responses"],  # noqa: E731
                                       cfg.max_len).sum() / sizes[i]
    start = time.time()
    losses = adamw_passes(lm, len(examples), cfg.imitation_steps, cfg.imitation_lr, cfg.seed,
                          random.Random(f"{cfg.seed}:imitate"), nll, decay=True)
    last = losses[-len(examples):]
    stats = {"examples": len(examples), "steps": len(losses), "lr": cfg.imitation_lr,
             "loss_first": losses[0] if losses else None, "loss_last_pass": sum(last) / len(last) if last else None,
             "seconds": round(time.time() - start, 1)}
    log(f"imitation: {stats}")
    return stats


def greedy_parse_rate(lm, tok, examples, cfg: Config) -> float | None:
    """The share of examples whose greedy decision parses (parse_decision against the state's attempt ids); each
    answer at most twice the longest imitated decision's tokens."""
    backend, ok = agent.LocalBackend(lm=lm, tokenizer=tok), 0
    for e in examples:
        n = 2 * max(len(tok.encode(r)) for r in e["responses"]) + 16
        try:
            parse_decision(backend.chat(e["messages"], temperature=0.0, max_tokens=n).texts[0], set(e["known"]),
                           cfg.calls)
            ok += 1
        except ParseError:
            pass
    return ok / len(examples) if examples else None


def imitation_orchestrator(trees, groups, cfg: Config, log=print):
    """OFFLINE STAND-IN for "the same model before tree training" (Matryoshka's pre-trained LLM, which already
    answers in the Orchestrator's format): a tiny Qwen from scratch, its tokenizer fit on the imitation prompts and
    decisions and the preference groups, then `imitate`d on imitation_examples. -> (lm, tok, stats); stats holds the
    greedy parse rate on the tree's own prompts and on the other tasks' prompts."""
    examples = imitation_examples(trees, cfg)
    texts = [m["content"] for e in examples for m in e["messages"]] + [r for e in examples for r in e["responses"]] \
        + [m["content"] for g in groups for m in g["messages"]] + [r for g in groups for r in g["responses"]]
    lm, tok = tiny_orchestrator(texts or ["{}"], seed=cfg.seed)
    stats = imitate(lm, tok, examples, cfg, log) if cfg.imitation_steps > 0 else {"steps": 0}
    stats["parse_rate_tree_prompts"] = greedy_parse_rate(lm, tok, [e for e in examples if e["tree"]], cfg)
    stats["parse_rate_other_prompts"] = greedy_parse_rate(lm, tok, [e for e in examples if not e["tree"]], cfg)
    log(f"ckpt-0 greedy decisions that parse: {stats['parse_rate_tree_prompts']} of the tree's prompts, "
        f"{stats['parse_rate_other_prompts']} of the other imitation prompts")
    return lm, tok, stats


def save_checkpoint(lm, tok, path: Path, dtype=None, notes: dict | None = None):
    """A model folder written atomically (LoRA adapters merged in); dtype: the stored dtype (default: the model's);
    notes: {file name: JSON object} written beside the weights."""
    import model  # lazy: see the imports
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_merged(lm, tok, str(tmp), dtype=dtype)
    for name, obj in (notes or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=1))
    agent.swap_folder(tmp, path)  # never a moment without ckpt-<i>; a kill in between: train_loop recovers


def recover_checkpoints(out: Path):
    """At start, what a kill inside save_checkpoint left: ckpt-<i>.old back or gone, half-written .ckpt-<i>.tmp."""
    for old in out.glob("ckpt-*.old"):
        agent.recover_folder(str(old)[:-len(".old")])
    for tmp in out.glob(".ckpt-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


OTHER_TREE_DEPTH = 1  # the other tasks' trees (cfg.tree_tasks): one decision pair from the starter, one group each


LARGE = 10_000_000  # parameters: ppo.py's TINY_PARAMS, past which a model trains as on a GPU (LoRA, checkpointing)


def load_for_training(path: Path, cfg: Config):
    """(policy, tokenizer, reference) for one iteration of training. The previous orchestrator is the reference
    (Matryoshka §3.6). A small model: fp32 master weights, and a frozen copy in the checkpoint's dtype (the load
    default: torch_dtype, e.g. bf16, on CUDA; fp32 on CPU) as the reference. A large one (or --lora-rank): a frozen
    base in the checkpoint's dtype with fp32 adapters, the base itself as the reference (no second copy), blocks
    recomputed in backward (model.enable_grad_checkpointing)."""
    import model  # lazy: see the imports
    policy, tok = model.load(str(path), meta=True)
    n = sum(p.numel() for p in policy.parameters())
    rank = cfg.lora_rank if cfg.lora_rank is not None else (16 if n >= LARGE else 0)
    if not rank:
        policy, _ = model.load(str(path), dtype="float32")  # fp32 master weights, whatever the checkpoint's dtype
        ref, _ = model.load(str(path))
        return policy, tok, ref.requires_grad_(False)
    policy, _ = model.load(str(path))
    model.add_lora(policy, rank, 16.0)  # alpha as ppo.py's --lora-alpha default
    if n >= LARGE:
        model.enable_grad_checkpointing(policy)
    return policy, tok, None


def train_loop(cfg: Config, model_path: str | None, collector: str, sub, out: Path, log=print) -> Path:
    """Online iterations: collect trees with the current orchestrator (--task's to cfg.depth, out/tree-<i>.json, and
    one of depth OTHER_TREE_DEPTH on each of other_tasks, out/tree-<i>-<task>.json: Matryoshka trains on the trees of
    many tasks), train on their groups against the current orchestrator as reference, the trained one becomes the
    next. Resumes from out/ckpt-<i> and the trees' JSON."""
    import model  # lazy: see the imports
    recover_checkpoints(out)
    current = Path(model_path) if model_path else out / "ckpt-0"
    for it in range(cfg.iterations):
        nxt = out / f"ckpt-{it + 1}"
        if nxt.exists():
            current = nxt
            continue
        orch = ScriptedOrchestrator(cfg.seed + it) if collector == "scripted" else agent.LocalBackend(str(current))
        if collector == "scripted":
            log("collecting with the scripted orchestrator (OFFLINE STAND-IN: decisions are not the policy's)")
        trees = [collect_tree(dataclasses.replace(cfg, seed=cfg.seed + it), orch, sub, out / f"tree-{it}.json", log)]
        for name in other_tasks(trees[0].task, cfg.tree_tasks):
            trees.append(collect_tree(dataclasses.replace(cfg, task=name, depth=OTHER_TREE_DEPTH, seed=cfg.seed + it),
                                      orch, sub, out / f"tree-{it}-{name}.json", log))
        groups = [g for tree in trees for g in preference_groups(tree)]
        if not current.exists():  # no checkpoint given: a tiny model from scratch that first imitates the format
            lm, tok, stats = imitation_orchestrator(trees, groups, cfg, log)
            save_checkpoint(lm, tok, current, notes={"imitation.json": stats})
        policy, tok, ref = load_for_training(current, cfg)
        log(f"iteration {it}: {len(groups)} preference group(s) from {sum(len(t.nodes) for t in trees)} nodes of "
            f"{len(trees)} tree(s)")
        if groups:
            train_orchestrator(policy, ref, tok, groups, cfg, log=log)
        save_checkpoint(policy, tok, nxt, dtype=getattr(model.torch, policy.config.torch_dtype))  # as it came (bf16)
        del policy, ref
        current = nxt
    rows = [r for t in map(Tree.load, sorted(out.glob("tree-*.json")))
            for r in sft_rows([asdict(a) for a in t.attempts.values()], t.higher_is_better)]
    write_jsonl(out / "sft.jsonl", rows)
    log(f"orchestrator checkpoint: {current}; {len(rows)} successful Sub-Agent trajectories -> {out / 'sft.jsonl'}")
    return current

# ======================================================================================================= command line


def _config(args) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def token_table(records) -> str:
    """Mean prompt tokens per round and role (the paper's Figure 2, as numbers)."""
    rows = {}
    for r in records:
        rows.setdefault((r["round"], r["role"]), []).append(r["tokens"])
    return "\n".join(f"round {rnd:3d} {role:12s} prompt tokens {sum(v) / len(v):8.0f} (x{len(v)})"
                     for (rnd, role), v in sorted(rows.items()))


LEAST = {**dict.fromkeys(("rounds", "calls", "sub_iters", "workers", "max_tokens", "depth", "children", "iterations",
                          "epochs"), 1), "imitation_steps": 0, "tree_tasks": 0, "lora_rank": 0}  # the least of each
POSITIVE = ("time_limit", "script_timeout", "lr", "beta", "imitation_lr")  # the numbers that must be > 0


def main(argv=None):
    p = agent.Parser(prog="orchestrator.py", description="Matryoshka Agent: run, tree collection, orchestrator training.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=agent.Parser)
    common = agent.Parser(add_help=False)
    common.add_argument("--task", default=Config.task, help="a built-in task name or a task folder")
    common.add_argument("--orchestrator", default="scripted", help="'scripted', a checkpoint folder, or a model name")
    common.add_argument("--orchestrator-url", help="OpenAI-compatible endpoint of the Orchestrator")
    common.add_argument("--sub-agent", default="scripted", help="'scripted', a checkpoint folder, or a model name")
    common.add_argument("--sub-agent-url", help="OpenAI-compatible endpoint of the Sub-Agents")
    for flag, typ in [("calls", int), ("sub-iters", int), ("time-limit", float), ("script-timeout", float),
                      ("workers", int), ("max-tokens", int), ("seed", int)]:
        common.add_argument(f"--{flag}", type=typ)
    common.add_argument("--out", help="output folder (default: the project's runs/matryoshka/<task>)")
    r = sub.add_parser("run", parents=[common], help="a Matryoshka run (or --monolithic) on one task")
    r.add_argument("--rounds", type=int)
    r.add_argument("--monolithic", action="store_true", help="the single-agent baseline instead")
    r.add_argument("--fresh", action="store_true", help="start over instead of resuming out/run.json")
    for name in ("tree", "train"):
        t = sub.add_parser(name, parents=[common], help="collect a Solution Refinement Tree" if name == "tree"
                           else "train the Orchestrator with the ranking loss on trees (online iterations)")
        t.add_argument("--depth", type=int, default=3 if name == "tree" else 2)
        t.add_argument("--children", type=int)
        t.add_argument("--tree-temperature", type=float)
        if name == "train":
            t.add_argument("--model", help="orchestrator checkpoint (default: a tiny model from scratch)")
            t.add_argument("--collector", choices=("auto", "policy", "scripted"), default="auto")
            for flag, typ in [("iterations", int), ("beta", float), ("lr", float), ("epochs", int),
                              ("imitation-steps", int), ("imitation-lr", float), ("tree-tasks", int),
                              ("lora-rank", int)]:
                t.add_argument(f"--{flag}", type=typ)
    args = p.parse_args(argv)
    for name, v in vars(args).items():  # every number given must be usable: one line, exit 2, before any work
        flag = "--" + name.replace("_", "-")
        if isinstance(v, float) and not math.isfinite(v):
            p.error(f"{flag} must be finite, not {v}")
        if isinstance(v, int) and not isinstance(v, bool) and v < LEAST.get(name, v):
            p.error(f"{flag} must be at least {LEAST[name]}, not {v}")
        if isinstance(v, float) and name in POSITIVE and v <= 0:
            p.error(f"{flag} must be > 0, not {v}")
        if isinstance(v, float) and name == "tree_temperature" and v < 0:
            p.error(f"{flag} must be >= 0, not {v}")
    cfg = _config(args)
    out = Path(args.out or env.ROOT / "runs" / "matryoshka" / Path(args.task).name)  # the project's runs/
    if args.cmd == "train" and args.collector == "policy" and not args.model:
        p.error("--collector policy needs --model (the orchestrator checkpoint that collects)")
    if args.cmd == "train" and args.model and not os.path.isdir(args.model):
        p.error(f"--model {args.model!r} is not a folder; pass a local Qwen2/Qwen3 checkpoint folder (config.json, "
                "*.safetensors, tokenizer.json), or no --model for a tiny model from scratch")
    for flag, name, url in (("--orchestrator", args.orchestrator, args.orchestrator_url),
                            ("--sub-agent", args.sub_agent, args.sub_agent_url),
                            ("--model", getattr(args, "model", None), None)):
        if name and os.path.isdir(name) and not url:  # a broken checkpoint: one line now, before any work
            try:
                agent.check_checkpoint(name)
            except ValueError as err:
                p.error(f"{flag} {err}")
    try:
        env.load_task(cfg.task)
        lock = agent.claim_folder(out)  # one command per --out: run.json, tree.json, train/, sft.jsonl resume
        orch = make_backend(args.orchestrator, args.orchestrator_url, "orchestrator", cfg.seed)
        coder = make_backend(args.sub_agent, args.sub_agent_url, "sub-agent")
    except (env.TaskError, OSError, ValueError) as err:
        p.error(str(err))
    for role, b in (("orchestrator", orch), ("sub-agent", coder)):
        if isinstance(b, (ScriptedOrchestrator, RecipeCoder)):
            print(f"{role}: OFFLINE STAND-IN ({type(b).__name__})")
    with lock:
        try:
            command(args, cfg, orch, coder, out)
        except agent.BackendError as err:
            sys.exit(f"orchestrator.py: {err}")
        except (ValueError, OSError) as err:  # a bad run.json or tree.json: one line
            p.error(str(err))


def command(args, cfg: Config, orch, coder, out: Path):
    """run, tree or train, with what each writes under out."""
    if args.cmd == "tree":
        tree = collect_tree(cfg, orch, coder, out / "tree.json")
        write_jsonl(out / "sft.jsonl", sft_rows([asdict(a) for a in tree.attempts.values()], tree.higher_is_better))
        print(f"{len(preference_groups(tree))} preference group(s); saved {out / 'tree.json'}, {out / 'sft.jsonl'}")
        return
    if args.cmd == "train":
        collector = args.collector if args.collector != "auto" else ("policy" if args.model else "scripted")
        train_loop(cfg, args.model, collector, coder, out / "train")
        return
    res = run_monolithic(cfg, coder, out) if args.monolithic else \
        run_matryoshka(cfg, orch, coder, out, resume=not args.fresh)
    print(token_table(res["records"]) + f"\ntoken counts: {res['token_counter']}")
    best = res["best"]
    print(f"best attempt #{best['id']}: public {_fmt(best['public'])}, private {_fmt(best['private'])}; "
          f"{len(res['attempts'])} attempts in {res['seconds']:.0f} s; saved under {out}")
    (out / ("best_monolithic.py" if args.monolithic else "best_train.py")).write_text(best["code"])
    if best.get("submission") and os.path.exists(best["submission"]):  # what a competition takes
        shutil.copyfile(best["submission"], out / ("best_monolithic_submission.csv" if args.monolithic
                                                   else "best_submission.csv"))
    if not args.monolithic:  # the Sub-Agents' successful trajectories, for sft.py
        write_jsonl(out / "sft.jsonl", sft_rows(res["attempts"], env.load_task(cfg.task).higher_is_better))

if __name__ == "__main__":
    main()
