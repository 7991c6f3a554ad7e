"""Matryoshka Agent (Qiang et al., arXiv:2607.25090): an Orchestrator on compact history whose tool calls launch fresh
Sub-Agents in parallel (§3.4), the monolithic baseline, and Orchestrator training on Solution Refinement Trees: branch
labels R(c) = max of r(v) over c's subtree, a ranking (NCE) loss on beta * log(pi_theta / pi_ref) against the previous
orchestrator (§3.6, Eqs. 1-4), successful Sub-Agent trajectories as SFT data.

Departures, and choices where the paper is silent:
1. K > 2 children: Plackett-Luce over the children ranked by R, ties skipped; for two, DPO's loss.
2. r(v): a decision's attempts' best public score, larger-is-better; -inf when unparsable, finishing or without a
   valid submission. beta = 0.1 (DPO's and TRL's default).
3. A Sub-Agent returns its best script by public score; the Tool writes the summary's result and errors itself.
4. Tokens: the local model's tokenizer, else ceil(chars / 4); each record names its counter.
5. The monolithic baseline (MLE-Dojo's agent) keeps one chat: the same clock, at most rounds x calls x sub_iters runs.
6. Training keeps fp32 master weights (bf16 autocast on CUDA) and saves in the checkpoint's dtype; models of >= LARGE
   parameters train LoRA adapters, the frozen base the reference.
7. Each iteration trains on --task's tree and on depth-1 trees of --tree-tasks held-in tasks of each kind.
8. OFFLINE STAND-INS without an endpoint or checkpoint: ScriptedOrchestrator and RecipeCoder, reading Prompt.state;
   offline `train` collects with the former (not on-policy).
9. OFFLINE STAND-IN for the pre-trained Orchestrator: without --model, ckpt-0 is a tiny model from scratch imitating
   scripted decisions (sft.py's loss and step), then the ranking loss trains it at the paper's lr.
Run:  python orchestrator.py run --task breast-cancer  (scripted orchestrator + recipe sub-agent)
      python orchestrator.py run --task breast-cancer --monolithic  (the baseline)
      python orchestrator.py tree --task breast-cancer --depth 3  (a Solution Refinement Tree; resumable)
      python orchestrator.py train --task breast-cancer  (trees -> ranking loss -> checkpoints)
      python orchestrator.py run --orchestrator runs/ckpt/orch --sub-agent gpt-4o-mini --sub-agent-url https://...
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
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import zip_longest
from pathlib import Path
from types import SimpleNamespace

import agent
import env
from agent import ParseError, json_object

# torch, model.py, sft.py: imported in training only, never by runs, trees or eval.py


@dataclass
class Config:
    task: str = "breast-cancer"  # a built-in task name or a task folder
    # --- inference budgets (the paper: 12 h, up to 10 Sub-Agent iterations, App. B)
    rounds: int = 6  # Orchestrator rounds
    calls: int = 2  # tool calls per round at most
    sub_iters: int = 10  # code executions per Sub-Agent at most
    time_limit: float = 1800.0  # seconds of a whole run (or tree collection)
    script_timeout: float | None = None  # per script execution; None: the task's limit
    workers: int = 2  # threads running tool calls at once
    obs_tokens: int = 5000  # longer output keeps its first and last half
    temperature: float = 0.0  # in runs
    max_tokens: int = 4096  # per LLM response
    max_retries: int = 2  # re-asks after an unparsable answer
    # --- Solution Refinement Trees
    depth: int = 3  # decisions from the starter to a leaf
    children: int = 2  # decisions sampled per node (binary trees in the paper)
    tree_temperature: float = 1.0  # of the Orchestrator's sampled decisions
    # --- Orchestrator training
    beta: float = 0.1  # scale of the log-ratio scores (DPO's default; the paper gives none)
    lr: float = 1e-5  # AdamW (the paper's tables; the tiny model too: tests/RESULTS.md)
    epochs: int = 2  # passes over the groups per iteration (the paper's tables)
    iterations: int = 1  # online: collect, train, the trained model is the next reference
    max_len: int = 8192  # tokens of prompt + decision kept (the prompt's oldest are cut)
    lora_rank: int | None = None  # None: 16 from 10M parameters (LARGE), else 0 (every weight)
    imitation_steps: int = 1000  # updates of the tiny ckpt-0 imitating scripted decisions
    imitation_lr: float = 6e-3  # peak, decaying linearly to 0 (from scratch: not 1e-5)
    tree_tasks: int = 2  # held-in tasks per (kind, modality, metric direction) with a depth-1 tree
    seed: int = 0  # of the stand-ins and of training


SUMMARY_KEYS = ("approach", "changed", "result", "errors", "next")  # an attempt's structured summary

# ==== tokens: count and clip


def count_tokens(text: str, tokenizer=None) -> int:
    return len(tokenizer.encode(text)) if tokenizer is not None else math.ceil(len(text) / 4)


def prompt_tokens(messages, tokenizer=None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return sum(count_tokens(m["content"]) for m in messages)


def record(records: list, rnd, role, messages, backend, attempt=None):  # list.append is thread-safe
    tok = getattr(backend, "tokenizer", None)
    records.append({"round": rnd, "role": role, "tokens": prompt_tokens(messages, tok), "attempt": attempt,
                    "counter": "tokenizer of the local model" if tok is not None else "approx: ceil(chars / 4)"})


def clip_tokens(text: str, limit: int, tokenizer=None) -> str:
    """Text over `limit` tokens keeps its first and last limit / 2 (App. B: 5k -> 2.5k + 2.5k)."""
    n, keep = count_tokens(text, tokenizer), limit // 2
    if n <= limit:
        return text
    if tokenizer is not None:
        ids = tokenizer.encode(text)
        head, tail = tokenizer.decode(ids[:keep]), tokenizer.decode(ids[-keep:])
    else:
        head, tail = text[:keep * 4], text[-keep * 4:]
    return f"{head}\n[... about {n - 2 * keep} tokens cut ...]\n{tail}"

# ==== attempts and compact memory


@dataclass
class Attempt:
    id: int
    parent: int | None  # None for the starter script (attempt 0)
    instruction: str
    references: list[int]
    score: float | None  # public score of its best script; None: no valid submission
    private: float | None  # for evaluation, never shown to an agent
    status: str  # success | error | timeout | resource | invalid_submission | no_code
    summary: dict  # SUMMARY_KEYS -> text
    code: str  # its best script (never in the Orchestrator's prompt)
    messages: list = field(default_factory=list)  # the Sub-Agent's whole chat
    iterations: int = 0  # code executions
    round: int = 0
    started: float = 0.0
    ended: float = 0.0
    submission: str = ""  # a copy of its best run's submission.csv


def signed(score, higher: bool) -> float:
    return float("-inf") if score is None else (score if higher else -score)


def best_attempt(attempts, higher: bool) -> Attempt:
    return max(attempts, key=lambda a: (signed(a.score, higher), -a.id))


def _short(text, n=200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _fmt(score) -> str:
    return "none" if score is None else f"{score:.4f}"


def shown(score) -> float | None:
    """A score as prompts show it: what the offline stand-ins compare, as an LLM would."""
    return None if score is None else float(_fmt(score))


class Prompt(list):
    """Chat messages with `state`, what they were written from (departure 8)."""

    def __init__(self, messages=(), state=None):
        super().__init__(messages)
        self.state = state

    def __add__(self, more):
        return Prompt([*self, *more], self.state)


def memory_text(attempts) -> str:
    """The Orchestrator's view: one bounded entry per attempt, no code, no logs."""
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

# ==== the Orchestrator: prompt, calls


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
REASK = ("Your answer could not be used ({reason}). Answer with one JSON object: "
         '{{"thought": "...", "tool_calls": [{{"name": "refine", "arguments": {{...}}}}]}}')


def orchestrator_messages(task, attempts, rnd: int, rounds: int, calls: int, seconds_left=None) -> Prompt:
    higher, best = ("higher" if task.higher_is_better else "lower"), best_attempt(attempts, task.higher_is_better)
    clock = f", about {seconds_left:.0f} s left" if seconds_left is not None else ""
    user = (f"Task: {task.name} | metric {task.metric} ({higher} is better)\n{_short(task.description, 1500)}\n\n"
            f"Round {rnd} of {rounds}{clock}. At most {calls} tool calls this round.\n\nAttempts so far:\n"
            f"{memory_text(attempts)}\n\nBest so far: #{best.id} with public score {_fmt(best.score)}.\n"
            "Answer with one JSON object as the system message says.")
    return Prompt([{"role": "system", "content": ORCH_SYSTEM}, {"role": "user", "content": user}],
                  SimpleNamespace(task=task, attempts=list(attempts), calls=calls))


def parse_decision(text: str, known, max_calls: int) -> tuple[list[dict], bool]:
    """(calls, finished); calls past max_calls and unknown references dropped."""
    calls = json_object(text).get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ParseError('the object needs a non-empty "tool_calls" list')
    out = []
    for c in calls:
        name, args = (c.get("name"), c.get("arguments", {})) if isinstance(c, dict) else (None, None)
        if isinstance(args, str):  # as OpenAI tool calls carry them
            args = json_object(args, "the arguments string")
        if name == "finish":
            return [], True
        if name != "refine" or not isinstance(args, dict):
            raise ParseError(f"unknown tool {name!r} or arguments not an object; the tools are refine and finish")
        try:
            parent, refs = int(args.get("parent")), [int(r) for r in args.get("references") or []]
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

# ==== the Sub-Agent and the Tool


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


def sub_messages(task, parent: Attempt, references, instruction: str | None, iters: int) -> Prompt:
    """A Tool's fresh context (instruction None: the monolithic agent's prompt)."""
    if instruction is None:
        higher = "higher" if task.higher_is_better else "lower"
        user = (f"# Task\n{task.description.strip()}\nMetric: {task.metric} ({higher} is better)\n\n"
                f"# Starter script (public score {_fmt(parent.score)})\n"
                f"```python\n{parent.code}```\n\nImprove the public score.")
    else:
        refs = "".join(f"\n## Attempt #{r.id} (public score {_fmt(r.score)})\n"
                       + "; ".join(f"{k}: {r.summary.get(k, '')}" for k in SUMMARY_KEYS)
                       + f"\n```python\n{r.code}```\n" for r in references)
        user = (f"# Task\n{task.description.strip()}\n\n# Parent attempt #{parent.id} (public score "
                f"{_fmt(parent.score)})\n```python\n{parent.code}```\n"
                + (f"\n# Reference attempts\n{refs}" if refs else "") + f"\n# Instruction\n{instruction}")
    system = (MONO_SYSTEM if instruction is None else SUB_SYSTEM).format(iters=iters)
    return Prompt([{"role": "system", "content": system}, {"role": "user", "content": user}], SimpleNamespace(
        task=task, code=parent.code, score=parent.score, instruction=instruction, runs=[], tried=[]))


def parse_coder(text: str) -> tuple[str, object]:
    """("code", script) for a ```python block, else ("summary", dict)."""
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


def feedback(run, task, limit: int, tokenizer=None, cap=1 << 16) -> str:
    """The coder's feedback: public score (never private), the log clipped to `limit` tokens (env.py keeps 4 KB of
    each end; a log over 2 * cap bytes is read at both ends)."""
    text = f"Execution: {run.status} after {run.seconds:.1f} s."
    if run.status == "success":
        higher = "higher" if task.higher_is_better else "lower"
        text += f"\nPublic score ({task.metric}, {higher} is better): {run.score:.4f}"
    elif run.status != "error":
        text += f"\nProblem: {error_line(run)}"
    output = run.output
    if Path(run.log_path or "").is_file():
        with open(run.log_path, "rb") as f:
            data = f.read(2 * cap + 1)
            if len(data) > 2 * cap:
                f.seek(-cap, os.SEEK_END)
                data = data[:cap] + b"\n" + f.read()
        output = data.decode("utf-8", errors="replace")
    return text + "\nOutput:\n```\n" + clip_tokens(output.strip(), limit, tokenizer) + "\n```"


def code_loop(task, backend, messages, max_iters: int, cfg: Config, deadline: float, on_prompt,
              **fields) -> tuple[Attempt, object, list[str]]:
    """Write, run, read feedback, fix until a summary, max_iters runs or the deadline (then ask once for the
    summary) -> (Attempt(**fields) with the best script (departure 3), its run, errors)."""
    tok, runs, iters, summary = getattr(backend, "tokenizer", None), messages.state.runs, 0, None

    def ask(prompt):
        on_prompt(prompt)
        text = backend.chat(prompt, temperature=cfg.temperature, max_tokens=cfg.max_tokens).texts[0]
        return prompt + [{"role": "assistant", "content": text}], text
    while iters < max_iters and time.time() < deadline:
        messages, text = ask(messages)
        try:
            kind, value = parse_coder(text)
        except ParseError as e:  # an iteration, as an invalid step is in MLE-Dojo
            iters += 1
            messages.append({"role": "user", "content": f"Invalid answer ({e}). Send a ```python block or the "
                                                        "```json summary."})
            continue
        if kind == "summary":
            summary = value
            break
        iters += 1
        timeout = min(cfg.script_timeout or task.time_limit, max(deadline - time.time(), 1.0))
        run = env.run_script(task, value, timeout=timeout, keep=("submission.csv",))
        runs.append((value, run))
        messages.append({"role": "user", "content": feedback(run, task, cfg.obs_tokens, tok)})
    if summary is None:
        messages, text = ask(messages + [{"role": "user", "content": SUMMARY_NOW}])
        try:
            kind, value = parse_coder(text)
            summary = value if kind == "summary" else None
        except ParseError:
            pass
    scored = [(code, run) for code, run in runs if run.status == "success"]  # ties: the first
    code, best = max(scored, key=lambda r: signed(r[1].score, task.higher_is_better)) if scored else \
        (runs[-1][0] if runs else "", None)
    attempt = Attempt(**fields, score=best.score if best else None, private=best.test_score if best else None,
                      status="success" if best else (runs[-1][1].status if runs else "no_code"),
                      summary={k: (summary or {}).get(k, "") for k in SUMMARY_KEYS},
                      code=code or messages.state.code, messages=messages, iterations=iters, ended=time.time(),
                      submission=best.kept.get("submission.csv", "") if best else "")
    return attempt, best, list(dict.fromkeys(error_line(r) for _, r in runs if r.status != "success"))


def refine(task, sub, cfg: Config, deadline: float, records, attempt_id: int, call: dict, attempts: dict, rnd: int):
    """The Tool refine(parent, instruction, references): a fresh Sub-Agent -> score + summary."""
    started, parent, higher = time.time(), attempts[call["parent"]], task.higher_is_better
    messages = sub_messages(task, parent, [attempts[r] for r in call["references"]], call["instruction"], cfg.sub_iters)
    on_prompt = lambda m: record(records, rnd, "sub-agent", m, sub, attempt_id)  # noqa: E731
    a, run, errors = code_loop(task, sub, messages, cfg.sub_iters, cfg, deadline, on_prompt, id=attempt_id,
                               parent=parent.id, instruction=call["instruction"], references=call["references"],
                               round=rnd, started=started)
    if run:  # what the Tool measured, not what the Sub-Agent claims
        delta = "better" if signed(run.score, higher) > signed(parent.score, higher) else "not better"
        a.summary["result"] = f"public score {run.score:.4f}, {delta} than parent #{parent.id} ({_fmt(parent.score)})"
    else:
        a.summary["result"] = f"no valid submission after {a.iterations} execution(s)"
    a.summary["errors"] = "; ".join(errors) or a.summary["errors"] or "none"
    return a


def starter_attempt(task, cfg: Config) -> Attempt:
    code = (task.public_dir / "train.py").read_text()
    run = env.run_script(task, code, timeout=cfg.script_timeout or task.time_limit, keep=("submission.csv",))
    ok = run.status == "success"
    summary = {"approach": "the task's starter script", "changed": "nothing",
               "result": f"public score {_fmt(run.score)}", "errors": "none" if ok else error_line(run),
               "next": "improve the data, the model or the training"}
    return Attempt(0, None, "", [], run.score, run.test_score, run.status, summary, code,
                   submission=run.kept.get("submission.csv", "") if ok else "")

# ==== offline stand-ins


def _recipe_ideas(task_name: str) -> list[str]:
    by_cat = {}
    for r in env.recipes_for(task_name):
        by_cat.setdefault(r.category, []).append(r.idea)
    return [idea for row in zip_longest(*by_cat.values()) for idea in row if idea is not None]


class StandIn:
    """A backend's chat() from answer(messages, temperature)."""

    def __init__(self):
        self.usage = agent.Usage()

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None):
        return self.usage.add(agent.Completion([self.answer(messages, temperature) for _ in range(n)]), 0.0)


class ScriptedOrchestrator(StandIn):
    """OFFLINE STAND-IN Orchestrator: refines the best attempts with recipe ideas untried on their lineage, the
    next-best as reference; temperature > 0 samples parent and ideas."""

    def __init__(self, seed=0):
        super().__init__()
        self.seed, self.rng = seed, random.Random(seed)

    def answer(self, messages, temperature):
        return self.decide(messages.state, self.rng if temperature > 0 else None)

    @staticmethod
    def decide(state, rng, sample_parent=True) -> str:
        """rng None: greedy; sample_parent=False: only the ideas sampled."""
        nodes = {a.id: (a.parent, shown(a.score)) for a in state.attempts}  # the attempts as memory_text shows them
        said = {a.id: _short(a.instruction, 300) for a in state.attempts if a.parent is not None}
        ranked = sorted((i for i in nodes if nodes[i][1] is not None),
                        key=lambda i: (-signed(nodes[i][1], state.task.higher_is_better), i))
        if rng is not None and sample_parent and len(ranked) > 1:  # the best first with p = 1/2, else top 3
            first = rng.choice(ranked[:3]) if rng.random() < 0.5 else ranked[0]
            ranked = [first] + [i for i in ranked if i != first]
        ideas, out = _recipe_ideas(state.task.name), []
        for parent in ranked:
            tried, i = {said.get(c) for c in nodes if nodes[c][0] == parent}, parent  # tried from here
            while i is not None:  # and on the way from the starter
                tried.add(said.get(i))
                i = nodes[i][0]
            fresh = [idea for idea in ideas if idea not in tried]
            if rng is not None:
                rng.shuffle(fresh)
            refs = [r for r in ranked if r != parent][:1]
            out += [{"name": "refine", "arguments": {"parent": parent, "instruction": idea, "references": refs}}
                    for idea in fresh[:state.calls - len(out)]]
            if len(out) == state.calls:
                break
        if not out:
            return json.dumps({"thought": "Every recipe was tried on the best attempts.",
                               "tool_calls": [{"name": "finish", "arguments": {"reason": "no untried idea"}}]})
        parents = sorted({c["arguments"]["parent"] for c in out})
        return json.dumps({"thought": f"Refine attempt(s) {parents} with untried ideas.", "tool_calls": out})


class RecipeCoder(StandIn):
    """OFFLINE STAND-IN Sub-Agent: env.recipe_editor's script for its instruction, then the summary; without one
    (monolithic) the next untried recipe on its best script."""

    def answer(self, messages, temperature=0.0) -> str:
        s, higher = messages.state, messages.state.task.higher_is_better
        if messages[-1]["content"] == SUMMARY_NOW or (s.instruction and s.runs):  # it ran its script
            ran = any(run.status == "success" for _, run in s.runs)
            return self._summary(s.instruction or "built-in recipes, one at a time, kept when better",
                                 "applied the recipe" if ran else "no script scored", "another recipe on top of it")
        if s.instruction:
            try:
                return f"Idea: {s.instruction}\n```python\n{env.recipe_editor(s.instruction, s.code)}```"
            except env.EditError as e:
                return self._summary(s.instruction, f"nothing: {e}", "an instruction naming a built-in recipe")
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
    """agent.make_backend; "scripted": the role's offline stand-in."""
    return agent.make_backend(name, base_url, stand_in={"orchestrator": lambda: ScriptedOrchestrator(seed),
                                                        "sub-agent": RecipeCoder}.get(role, agent.ScriptedExpert))

# ==== the runs: Matryoshka, monolithic


def save_json(path: Path, obj, lines=False):  # lines: a list as JSONL
    path.parent.mkdir(parents=True, exist_ok=True)
    agent.write_atomic(path, [json.dumps(r) + "\n" for r in obj] if lines else json.dumps(obj))


def load_json(path: Path, build):
    """build(the JSON at path), None without a file; one build cannot take is a one-line ValueError naming it."""
    if not path.exists():
        return None
    try:
        return build(json.loads(path.read_bytes().decode("utf-8")))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a run or tree of orchestrator.py ({type(e).__name__}); delete it or give "
                         "another --out") from None


def decide(orch, messages, known, cfg: Config, records, rnd) -> tuple[list[dict], bool]:
    """Ask, re-asking after an unparsable answer (MLAB's max_retries); none usable: no call."""
    for _ in range(cfg.max_retries + 1):
        record(records, rnd, "orchestrator", messages, orch)
        text = orch.chat(messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens).texts[0]
        try:
            return parse_decision(text, known, cfg.calls)
        except ParseError as e:
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": REASK.format(reason=e)}]
    return [], False


def _result(task, attempts, records, finished, seconds, **more) -> dict:
    best = best_attempt(attempts, task.higher_is_better)
    return {"task": task.name, "attempts": [asdict(a) for a in attempts], "records": records, "finished": finished,
            "seconds": seconds, **more,
            "token_counter": "; ".join(sorted({f"{r['role']}: {r['counter']}" for r in records})),
            "best": {"id": best.id, "public": best.score, "private": best.private, "code": best.code,
                     "submission": best.submission}}


def run_matryoshka(cfg: Config, orch, sub, out: Path | None = None, resume=True, log=print) -> dict:
    """Rounds: Orchestrator calls from compact memory -> Tools in parallel -> attempts; saved, resumed: run.json."""
    task = env.load_task(cfg.task)
    saved = load_json(out / "run.json", lambda o: ([Attempt(**a) for a in o["attempts"]], list(o["records"]),
                      int(o["round"]), float(o["seconds"]), bool(o["finished"]))) if out and resume else None
    attempts, records, rnd, spent, finished = saved or ([starter_attempt(task, cfg)], [], 0, 0.0, False)
    if saved:
        log(f"resumed {out / 'run.json'} at round {rnd}")
    deadline = (start := time.time()) + cfg.time_limit - spent
    tool = partial(refine, task, sub, cfg, deadline, records)
    result = lambda: _result(task, attempts, records, finished, spent + time.time() - start, round=rnd)  # noqa: E731
    while not finished and rnd < cfg.rounds and time.time() < deadline:
        rnd += 1
        messages = orchestrator_messages(task, attempts, rnd, cfg.rounds, cfg.calls, deadline - time.time())
        calls, finished = decide(orch, messages, {a.id for a in attempts}, cfg, records, rnd)
        by_id, first = {a.id: a for a in attempts}, len(attempts)
        with ThreadPoolExecutor(cfg.workers) as pool:  # §3.4: in parallel
            attempts += list(pool.map(lambda k: tool(first + k, calls[k], by_id, rnd), range(len(calls))))
        best = best_attempt(attempts, task.higher_is_better)
        log(f"round {rnd}: " + (", ".join(f"#{a.id}<-#{a.parent} {_fmt(a.score)} ({a.status}, {a.iterations} it)"
                                          for a in attempts[first:]) or "no call")
            + (" | finish" if finished else "") + f" | best #{best.id} {_fmt(best.score)}")
        if out:
            save_json(out / "run.json", result())
    return result()


def run_monolithic(cfg: Config, coder, out: Path | None = None, log=print) -> dict:
    """Departure 5: one chat of every script and output. Not resumed."""
    task = env.load_task(cfg.task)
    steps, started = cfg.rounds * cfg.calls * cfg.sub_iters, time.time()
    starter, records = starter_attempt(task, cfg), []
    on_prompt = lambda m: record(records, len(records) + 1, "monolithic", m, coder)  # noqa: E731
    mono, _, _ = code_loop(task, coder, sub_messages(task, starter, [], None, steps), steps, cfg,
                           started + cfg.time_limit, on_prompt, id=1, parent=0, instruction="monolithic",
                           references=[], round=1, started=started)
    result = _result(task, [starter, mono], records, True, time.time() - started)
    log(f"monolithic: {mono.iterations} executions, best {_fmt(result['best']['public'])}, last prompt "
        f"{records[-1]['tokens'] if records else 0} tokens")
    if out:
        save_json(out / "monolithic.json", result)
    return result

# ==== Solution Refinement Trees (Matryoshka §3.6)


@dataclass
class Node:
    id: int  # its index in Tree.nodes
    parent: int | None  # None for the root (the starter's state)
    depth: int
    decision: str | None  # the Orchestrator's answer at the parent's state
    calls: list[dict] | None  # parsed tool calls, each with its attempt's id; None: not parsed yet
    status: str  # pending (its calls not all run) | done
    prompt: list | None  # what its children's decisions answer, once sampled
    score: float | None  # r(v) before signing (departure 2); None: none valid
    finished: bool | None = None  # it called finish; None: not parsed yet or unparsable
    error: str | None = None  # why it is unparsable


@dataclass
class Tree:
    """A Solution Refinement Tree: cfg.children decisions a node; its state: its path's attempts (prefix run once)."""
    task: str
    higher_is_better: bool
    next_id: int
    attempts: dict[int, Attempt]
    nodes: list[Node]

    def children(self, node_id) -> list[Node]:
        return [n for n in self.nodes if n.parent == node_id]

    def state(self, node_id) -> list[Attempt]:
        ids = []
        while node_id is not None:  # up to the root, a node's calls before its children's
            ids[:0] = [c["attempt"] for c in self.nodes[node_id].calls or []]
            node_id = self.nodes[node_id].parent
        return [self.attempts[i] for i in [0] + ids if i in self.attempts]

    def to_json(self) -> dict:  # a node's finished and error only once set
        return {"task": self.task, "higher_is_better": self.higher_is_better, "next_id": self.next_id,
                "attempts": {str(i): asdict(a) for i, a in self.attempts.items()},
                "nodes": [{k: v for k, v in asdict(n).items() if v is not None or k not in ("finished", "error")}
                          for n in self.nodes]}

    @classmethod
    def from_json(cls, obj: dict) -> Tree:
        return cls(obj["task"], obj["higher_is_better"], obj["next_id"],
                   {int(i): Attempt(**a) for i, a in obj["attempts"].items()}, [Node(**n) for n in obj["nodes"]])

    @classmethod
    def load(cls, path: Path) -> Tree | None:
        return load_json(path, cls.from_json)


def collect_tree(cfg: Config, orch, sub, path: Path, log=print) -> Tree:
    """Grow to cfg.depth (cfg.children decisions a node, r(v) from the environment), saved per decision and attempt."""
    task = env.load_task(cfg.task)
    if (tree := Tree.load(path)) is None:
        starter = starter_attempt(task, cfg)
        tree = Tree(task.name, task.higher_is_better, 1, {0: starter},
                    [Node(0, None, 0, None, [], "done", None, starter.score)])
    save = lambda: save_json(path, tree.to_json())  # noqa: E731
    tool = partial(refine, task, sub, cfg, time.time() + cfg.time_limit, [])  # no records
    while True:
        # 1. decisions at childless done nodes above the depth limit
        for node in list(tree.nodes):
            if node.status != "done" or node.depth >= cfg.depth or tree.children(node.id) or node.finished \
                    or node.error:  # a leaf
                continue
            node.prompt = orchestrator_messages(task, tree.state(node.id), node.depth + 1, cfg.depth, cfg.calls)
            if isinstance(orch, ScriptedOrchestrator):  # seeded by (seed, node): a resume decides the same
                orch.rng.seed(f"{orch.seed}:{node.id}")
            for text in orch.chat(node.prompt, n=cfg.children, temperature=cfg.tree_temperature,
                                  max_tokens=cfg.max_tokens).texts:
                tree.nodes.append(Node(len(tree.nodes), node.id, node.depth + 1, text, None, "pending", None, None))
            save()
        pending = [n for n in tree.nodes if n.status == "pending"]
        if not pending:
            return tree
        # 2. parse pending decisions once, number their calls' attempts, run the new ones
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
            jobs += [(c["attempt"], c, by_id, node.depth) for c in node.calls if c["attempt"] not in tree.attempts]
        save()
        with ThreadPoolExecutor(cfg.workers) as pool:
            for done in as_completed([pool.submit(tool, *job) for job in jobs]):
                tree.attempts[done.result().id] = done.result()
                save()
        for node in pending:
            made = [tree.attempts[c["attempt"]] for c in node.calls]
            node.score = best_attempt(made, tree.higher_is_better).score if made else None  # r(v)
            node.status = "done"
        log(f"tree: {len(tree.nodes)} nodes, {len(tree.attempts)} attempts, depth {max(n.depth for n in tree.nodes)}")
        save()


def branch_labels(tree: Tree) -> dict[int, float]:
    """R(c) (§3.6, Preference Construction) with r the node's signed score."""
    R = {n.id: signed(n.score, tree.higher_is_better) for n in tree.nodes}
    for n in reversed(tree.nodes[1:]):  # not the root; children (larger ids) first
        R[n.parent] = max(R[n.parent], R[n.id])
    return R


def preference_groups(tree: Tree) -> list[dict]:
    """Per node: its prompt, its children's decisions and labels R; all-tied groups dropped."""
    R, groups = branch_labels(tree), []
    for node in tree.nodes:
        kids = tree.children(node.id)
        labels = [R[k.id] for k in kids]
        if len(kids) >= 2 and node.prompt and len(set(labels)) > 1:
            groups.append({"node": node.id, "messages": node.prompt, "responses": [k.decision for k in kids],
                           "R": labels})
    return groups


def sft_rows(attempts, higher: bool) -> list[dict]:
    by_id = {a["id"]: a for a in attempts}
    return [{"messages": a["messages"]} for a in attempts if a["parent"] is not None and a["messages"]
            and signed(a["score"], higher) > signed(by_id[a["parent"]]["score"], higher)]

# ==== ranking loss and training


def ranking_loss(scores, R):
    """Plackett-Luce ranking NCE (§3.6, Eqs. 1-4; departure 1) on scores (K,) = beta * log(pi_theta / pi_ref): child k
    adds -log(exp(s_k) / (exp(s_k) + sum of exp(s_j) with R_j < R_k)); for two, DPO's -log sigmoid(s_w - s_l)
    (Rafailov et al. 2023). None if all are tied."""
    import torch
    terms = [torch.logsumexp(scores[[k] + worse], 0) - scores[k] for k in range(len(R))
             if (worse := [j for j in range(len(R)) if R[j] < R[k]])]
    return torch.stack(terms).sum() if terms else None


def chat_rows(tok, messages, responses, max_len: int) -> list:
    import sft
    return [sft.encode_chat(tok, [*messages, {"role": "assistant", "content": r}], max_len) for r in responses]


def decision_logprobs(lm, tok, messages, responses, max_len: int):
    """(K,) log pi(decision | prompt) at temperature 1: minus sft.py's masked loss."""
    import model
    import sft
    import torch
    net, dev, pad = sft.SFTModel(lm), lm.lm_head.weight.device, tok.pad_token_id or 0
    with model.autocast(dev):
        return -torch.stack([net(*sft.collate([row], pad, dev))[0]
                             for row in chat_rows(tok, messages, responses, max_len)])


def passes(n: int, steps: int, rng):  # passes over range(n), each in a new order
    order = list(range(n))
    for step in range(steps if n else 0):
        if step % n == 0:
            rng.shuffle(order)
        yield order[step % n]


def train_orchestrator(policy, ref, tok, groups, cfg: Config, log=print) -> dict:
    """A group per update, cfg.epochs passes, no weight decay (sft.py's default). ref None: the reference is the
    policy with LoRA off (B = 0: it starts there)."""
    import model
    import torch
    with torch.no_grad():
        model.set_lora(policy, ref is not None)
        ref_lp = [decision_logprobs(ref or policy, tok, g["messages"], g["responses"], cfg.max_len) for g in groups]
        model.set_lora(policy, True)

    def scores(i):
        g = groups[i]
        return cfg.beta * (decision_logprobs(policy, tok, g["messages"], g["responses"], cfg.max_len) - ref_lp[i])
    opt, losses = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0), []
    policy.train()
    for i in passes(len(groups), cfg.epochs * len(groups), random.Random(cfg.seed)):
        loss = ranking_loss(scores(i), groups[i]["R"])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    policy.eval()
    with torch.no_grad():  # does the top-ranked child now score highest
        after = [scores(i) for i in range(len(groups))]
        top = [int(torch.argmax(s)) == g["R"].index(max(g["R"])) for s, g in zip(after, groups)]
        mean = sum(ranking_loss(s, g["R"]).item() for s, g in zip(after, groups)) / len(groups) if groups else None
    stats = {"steps": len(losses), "loss_first": losses[0] if losses else None, "loss_after": mean,
             "loss_last": losses[-1] if losses else None, "top_accuracy": sum(top) / len(top) if top else None}
    log(f"train: {stats}")
    return stats


def tiny_orchestrator(texts, vocab_size=1024, seed=0):
    import model
    tok = model.train_tokenizer(texts, vocab_size)
    model.torch.manual_seed(seed)
    lm = model.Qwen(model.tiny_config(vocab_size=len(tok), max_position_embeddings=16384, eos_token_id=tok.im_end_id))
    return lm.eval(), tok

# ---- the from-scratch ckpt-0 imitates the decision format


OTHER_TREE_DEPTH = 1  # cfg.tree_tasks' trees: one decision pair from the starter, one group each
IMITATION_VIEWS = 3  # prompts per state: the tree's own, then two with other round counts and a clock
IMITATION_RESAMPLED = 24  # resampled_states of --task's tree; a quarter as many of each other tree


def other_tasks(tree_task: str, per_group: int) -> list[str]:
    groups: dict = {}
    for name, spec in env.BUILTIN_TASKS.items():
        if spec.split == "held-in" and name != tree_task:
            groups.setdefault((spec.kind, spec.modality, env.METRICS[spec.metric].higher_is_better), []).append(name)
    return [n for names in groups.values() for n in names[:per_group]]


def resampled_states(tree, n: int, rng) -> list[list[Attempt]]:
    """n run-like states: random ancestor-closed subsets of the tree's attempts, renumbered 0, 1, ... in order of
    addition (parents, references, summaries' "parent #k"); their best varies more than along tree paths."""
    pool, states = tree.attempts, []
    for _ in range(n if len(pool) > 1 else 0):
        order = [0]
        for _ in range(rng.randint(1, len(pool) - 1)):
            # sorted: the JSON has them in the order their parallel runs ended
            ready = [i for i in sorted(pool) if i not in order and pool[i].parent in order]
            if not ready:
                break
            order.append(rng.choice(ready))
        new = {old: k for k, old in enumerate(order)}
        renumber = lambda m: f"parent #{new.get(int(m.group(1)), 0)}"  # noqa: E731
        states.append([dataclasses.replace(
            a, id=new[a.id], parent=new.get(a.parent), references=[new[r] for r in a.references if r in new],
            summary={k: re.sub(r"parent #(\d+)", renumber, str(v)) for k, v in a.summary.items()})
            for a in (pool[i] for i in order)])
    return states


def imitation_examples(trees, cfg: Config) -> list[dict]:
    """ckpt-0's examples (tests/RESULTS.md, "what the tiny ckpt-0 imitates"): done nodes and resampled_states of each
    tree, IMITATION_VIEWS each; a node's own prompt keeps its decisions, others get greedy parents, sampled ideas."""
    rng, states = random.Random(f"{cfg.seed}:imitation"), []
    for i, tree in enumerate(trees):
        task, depth = env.load_task(cfg.task if i == 0 else tree.task), cfg.depth if i == 0 else OTHER_TREE_DEPTH
        states += [(task, tree.state(n.id), n, tree, depth) for n in tree.nodes if n.status == "done"]
        states += [(task, attempts, None, tree, depth) for attempts in
                   resampled_states(tree, IMITATION_RESAMPLED if i == 0 else IMITATION_RESAMPLED // 4, rng)]
    out, seen = [], set()
    for t, attempts, node, tree, tree_depth in states:
        depth = node.depth if node else min(len(attempts) - 1, 1)  # round 1 sees the starter only
        for view in range(IMITATION_VIEWS):
            if view == 0:  # as collect_tree asks
                rnd, rounds, clock = depth + 1, max(tree_depth, depth + 1), None
            else:  # as a run asks
                rounds = rng.randint(max(2, depth + 1), 8)
                rnd, clock = rng.randint(depth + 1, rounds), rng.uniform(60.0, cfg.time_limit)
            messages = orchestrator_messages(t, attempts, rnd, rounds, cfg.calls, clock)
            key = json.dumps(messages)
            if key in seen:  # an unparsable or finishing decision leaves its parent's state
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
    """Behaviour cloning with sft.py's loss and step, an example (decisions of one prompt) per update."""
    import sft
    import torch
    rows = [chat_rows(tok, e["messages"], e["responses"], cfg.max_len) for e in examples]
    net, dev, pad = sft.SFTModel(lm, 0.0, share_prefix=True), lm.lm_head.weight.device, tok.pad_token_id or 0
    opt = torch.optim.AdamW(lm.parameters(), lr=cfg.imitation_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / cfg.imitation_steps)
    start = time.time()
    lm.train()
    losses = [sft.optimizer_step(net, opt, sched, [rows[i]], pad, dev, sft.Config(), 1)[0]
              for i in passes(len(rows), cfg.imitation_steps, random.Random(f"{cfg.seed}:imitate"))]
    lm.eval()
    last = losses[-len(rows):]
    stats = {"examples": len(rows), "steps": len(losses), "lr": cfg.imitation_lr,
             "loss_first": losses[0] if losses else None, "loss_last_pass": sum(last) / len(last) if last else None,
             "seconds": round(time.time() - start, 1)}
    log(f"imitation: {stats}")
    return stats


def greedy_parse_rate(lm, tok, examples, cfg: Config) -> float | None:
    backend, ok = agent.LocalBackend(lm=lm, tokenizer=tok), 0
    for e in examples:
        n = 2 * max(len(tok.encode(r)) for r in e["responses"]) + 16
        try:
            parse_decision(backend.chat(e["messages"], max_tokens=n).texts[0], set(e["known"]), cfg.calls)
            ok += 1
        except ParseError:
            pass
    return ok / len(examples) if examples else None


def imitation_orchestrator(trees, groups, cfg: Config, log=print):
    """OFFLINE STAND-IN (departure 9) for "the same model before tree training" -> (lm, tok, stats with parse rates)."""
    examples, texts = imitation_examples(trees, cfg), []
    for src in (examples, groups):
        texts += [m["content"] for e in src for m in e["messages"]] + [r for e in src for r in e["responses"]]
    lm, tok = tiny_orchestrator(texts or ["{}"], seed=cfg.seed)
    stats = imitate(lm, tok, examples, cfg, log) if cfg.imitation_steps > 0 else {"steps": 0}
    for kind in ("tree", "other"):
        stats[f"parse_rate_{kind}_prompts"] = greedy_parse_rate(
            lm, tok, [e for e in examples if e["tree"] == (kind == "tree")], cfg)
    log(f"ckpt-0 greedy decisions that parse: {stats['parse_rate_tree_prompts']} of the tree's prompts, "
        f"{stats['parse_rate_other_prompts']} of the other imitation prompts")
    return lm, tok, stats

# ---- checkpoints and iterations


def save_checkpoint(lm, tok, path: Path, dtype=None, notes: dict | None = None):
    """model.save_checkpoint_folder (LoRA merged; dtype None: the model's) plus `notes` files, via agent.swap_folder."""
    import model
    tmp, _ = model.save_checkpoint_folder(lm, tok, str(path), dtype, {})
    for name, obj in (notes or {}).items():
        Path(tmp, name).write_text(json.dumps(obj, indent=1))
    agent.swap_folder(tmp, path)


LARGE = 10_000_000  # parameters (ppo.py's TINY_PARAMS) from which LoRA and checkpointing (7B: 112 GB of fp32 + AdamW)


def load_for_training(path: Path, cfg: Config):
    """(policy, tokenizer, reference), the previous orchestrator the reference (§3.6; departure 6): small, a frozen
    copy; large (or --lora-rank), None (LoRA off), blocks recomputed."""
    import model
    policy, tok = model.load(str(path), meta=True)
    n = sum(p.numel() for p in policy.parameters())
    rank = cfg.lora_rank if cfg.lora_rank is not None else (16 if n >= LARGE else 0)
    if not rank:
        policy, _ = model.load(str(path), dtype="float32")
        return policy, tok, model.load(str(path))[0].requires_grad_(False)
    policy, _ = model.load(str(path))
    model.add_lora(policy, rank, 16.0)  # ppo.py's --lora-alpha default
    if n >= LARGE:
        model.enable_grad_checkpointing(policy)
    return policy, tok, None


def train_loop(cfg: Config, model_path: str | None, collector: str, sub, out: Path, log=print) -> Path:
    """Online iterations: the current orchestrator's trees (out/tree-<i>.json, other_tasks' tree-<i>-<task>.json),
    ranking loss on their groups against it; the trained one is next. Resumes from out/ckpt-<i> and the trees."""
    import model
    for folder in list(out.glob("ckpt-*.*")):  # a kill in save_checkpoint: .old back, .tmp gone
        agent.recover_folder(folder.with_suffix(""), folder.with_suffix(".tmp"))
    current = Path(model_path) if model_path else out / "ckpt-0"
    for it in range(cfg.iterations):
        nxt, c = out / f"ckpt-{it + 1}", dataclasses.replace(cfg, seed=cfg.seed + it)
        if nxt.exists():
            current = nxt
            continue
        orch = ScriptedOrchestrator(c.seed) if collector == "scripted" else agent.LocalBackend(str(current))
        if collector == "scripted":
            log("collecting with the scripted orchestrator (OFFLINE STAND-IN: decisions are not the policy's)")
        trees = [collect_tree(c, orch, sub, out / f"tree-{it}.json", log)]
        trees += [collect_tree(dataclasses.replace(c, task=name, depth=OTHER_TREE_DEPTH), orch, sub,
                               out / f"tree-{it}-{name}.json", log)
                  for name in other_tasks(trees[0].task, c.tree_tasks)]
        groups = [g for tree in trees for g in preference_groups(tree)]
        if not current.exists():  # no --model: departure 9
            lm, tok, stats = imitation_orchestrator(trees, groups, cfg, log)
            save_checkpoint(lm, tok, current, notes={"imitation.json": stats})
        policy, tok, ref = load_for_training(current, cfg)
        log(f"iteration {it}: {len(groups)} preference group(s) from {sum(len(t.nodes) for t in trees)} nodes of "
            f"{len(trees)} tree(s)")
        if groups:
            train_orchestrator(policy, ref, tok, groups, cfg, log=log)
        save_checkpoint(policy, tok, nxt, dtype=getattr(model.torch, policy.config.torch_dtype))
        del policy, ref
        current = nxt
    rows = [r for t in map(Tree.load, sorted(out.glob("tree-*.json")))
            for r in sft_rows([asdict(a) for a in t.attempts.values()], t.higher_is_better)]
    save_json(out / "sft.jsonl", rows, lines=True)
    log(f"orchestrator checkpoint: {current}; {len(rows)} successful Sub-Agent trajectories -> {out / 'sft.jsonl'}")
    return current

# ==== command line


TREE = "depth children tree_temperature"
FLAGS = {"common": "task calls sub_iters time_limit script_timeout workers max_tokens seed", "run": "rounds",
         "tree": TREE, "train": TREE + " iterations beta lr epochs imitation_steps imitation_lr tree_tasks lora_rank"}
TYPES = {"seed": agent.checked(int), "tree_temperature": agent.NONNEGATIVE,
         **dict.fromkeys(("imitation_steps", "tree_tasks", "lora_rank"), agent.COUNT)}


def token_table(records) -> str:
    """Mean prompt tokens per round and role (Fig. 2)."""
    rows = {}
    for r in records:
        rows.setdefault((r["round"], r["role"]), []).append(r["tokens"])
    return "\n".join(f"round {rnd:3d} {role:12s} prompt tokens {sum(v) / len(v):8.0f} (x{len(v)})"
                     for (rnd, role), v in sorted(rows.items()))


def main(argv=None):
    p = agent.Parser(prog="orchestrator.py", description="Matryoshka Agent: runs, trees, orchestrator training.")
    sub, common = p.add_subparsers(dest="cmd", required=True, parser_class=agent.Parser), agent.Parser(add_help=False)
    for role in ("orchestrator", "sub-agent"):
        common.add_argument(f"--{role}", default="scripted", help="'scripted', a checkpoint folder, or a model name")
        common.add_argument(f"--{role}-url", help=f"OpenAI-compatible endpoint of the {role}; None: $OPENAI_BASE_URL")
    common.add_argument("--out", help="output folder (default: the project's runs/matryoshka/<task>)")
    cmds = {c: sub.add_parser(c, parents=[common], help=h) for c, h in (
        ("run", "a Matryoshka run (or --monolithic) on one task"), ("tree", "collect a Solution Refinement Tree"),
        ("train", "train the Orchestrator with the ranking loss on trees (online iterations)"))}
    for c, parser in cmds.items():
        agent.add_fields(parser, Config, TYPES, names=f"{FLAGS['common']} {FLAGS[c]}".split())
    cmds["run"].add_argument("--monolithic", action="store_true", help="the single-agent baseline instead")
    cmds["run"].add_argument("--fresh", action="store_true", help="start over instead of resuming out/run.json")
    cmds["train"].add_argument("--model", help="orchestrator checkpoint (default: a tiny model from scratch)")
    cmds["train"].add_argument("--collector", choices=("auto", "policy", "scripted"), default="auto",
                               help="who collects the trees; auto: policy with --model, else scripted")
    cmds["train"].set_defaults(depth=2)
    args = p.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                    if getattr(args, f.name, None) is not None})
    out = Path(args.out or env.ROOT / "runs" / "matryoshka" / Path(args.task).name)
    args.model = agent.check_model(p, "--model", vars(args).get("model"), endpoint=None)
    if args.cmd == "train" and args.collector == "policy" and not args.model:
        p.error("--collector policy needs --model (the orchestrator checkpoint that collects)")
    for r, flag in (("orchestrator", "--orchestrator"), ("sub_agent", "--sub-agent")):
        setattr(args, r, agent.check_model(p, flag, getattr(args, r), getattr(args, r + "_url"),
                                           f"pass {flag}-url or set OPENAI_BASE_URL"))
    try:
        env.load_task(cfg.task)
        lock = agent.claim_folder(out)  # one command per --out
        orch = make_backend(args.orchestrator, args.orchestrator_url, "orchestrator", cfg.seed)
        coder = make_backend(args.sub_agent, args.sub_agent_url, "sub-agent")
    except (OSError, ValueError) as err:  # env.TaskError too
        p.error(str(err))
    for role, b in (("orchestrator", orch), ("sub-agent", coder)):
        if isinstance(b, StandIn):
            print(f"{role}: OFFLINE STAND-IN ({type(b).__name__})")
    with lock:
        try:
            command(args, cfg, orch, coder, out)
        except agent.BackendError as err:
            sys.exit(f"orchestrator.py: {err}")
        except (ValueError, OSError) as err:  # a bad run.json or tree.json
            p.error(str(err))


def command(args, cfg: Config, orch, coder, out: Path):
    """run, tree or train under out: a run's best script and submission.csv, successful Sub-Agent chats as sft.jsonl."""
    if args.cmd == "tree":
        tree = collect_tree(cfg, orch, coder, out / "tree.json")
        save_json(out / "sft.jsonl", sft_rows([asdict(a) for a in tree.attempts.values()], tree.higher_is_better),
                  lines=True)
        print(f"{len(preference_groups(tree))} preference group(s); saved {out / 'tree.json'}, {out / 'sft.jsonl'}")
    elif args.cmd == "train":
        collector = args.collector if args.collector != "auto" else ("policy" if args.model else "scripted")
        train_loop(cfg, args.model, collector, coder, out / "train")
    else:
        res = run_monolithic(cfg, coder, out) if args.monolithic else \
            run_matryoshka(cfg, orch, coder, out, resume=not args.fresh)
        print(token_table(res["records"]) + f"\ntoken counts: {res['token_counter']}")
        best, name = res["best"], "monolithic" if args.monolithic else "train"
        print(f"best attempt #{best['id']}: public {_fmt(best['public'])}, private {_fmt(best['private'])}; "
              f"{len(res['attempts'])} attempts in {res['seconds']:.0f} s; saved under {out}")
        (out / f"best_{name}.py").write_text(best["code"])
        if best.get("submission") and os.path.exists(best["submission"]):
            shutil.copyfile(best["submission"], out / f"best{'_monolithic' * args.monolithic}_submission.csv")
        if not args.monolithic:
            save_json(out / "sft.jsonl", sft_rows(res["attempts"], env.load_task(cfg.task).higher_is_better),
                      lines=True)


if __name__ == "__main__":
    main()
