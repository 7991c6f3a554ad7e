"""The agents: chat backends (an OpenAI-compatible endpoint; a `model.py` checkpoint in-process), the MLAgentBench
research agent, the LLM editor and the offline scripted expert, run by `run_episode` (`act` scores a step); the
run-folder plumbing every command shares (locks, atomic writes, JSONL, folder swaps).

ML-Agent (arXiv:2505.23723, §Experiments "Training") collects expert trajectories with a GPT-4o-mini agent in the
MLAgentBench (MLAB) scaffold (Huang et al., 2023, `MLAgentBench/agents/agent_research.py`), 15 steps and 30 minutes per
trajectory. We rebuild that agent in our words (what runs, is asked again, is shown: section "parsing"). Departures:
1. Chat prompt: a system message and a user message (the last three steps and observations, as MLAB; at first "let's
   start" and the injected ideas): each SFT row has one assistant turn, the expert's answer.
2. MLAB has an LLM call summarise an observation over 5,000 characters; we keep its first and last 2,500 (as
   Matryoshka, 5k-token limit): a prompt is a pure function of the history.
3. MLAB stops after `max_retries` (5) unreadable responses; we mark the step "invalid" after 2 re-asks (reward -1,
   ML-Agent's format term) and go on: a weak policy still yields a full trajectory. An unreadable Action Input is one
   of the 15 steps (MLAB's environment never sees it); MLAB's fallback reads values JSON-escaped, ours as written.
4. Without an endpoint, `ScriptedExpert` is an offline STAND-IN for the paper's GPT-4o-mini expert: rule-based,
   following its first prompt's idea plan, not a model of it.

Run one episode:  python agent.py --task digits  (scripted expert, offline)
                  OPENAI_BASE_URL=... OPENAI_API_KEY=... python agent.py --task digits --model gpt-4o-mini
                  python agent.py --task digits --model runs/ckpt/sft  (a local checkpoint through model.py)
"""
import argparse
import fcntl
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field, fields

import requests
import urllib3

import env
from reward import RewardConfig, reward

# ==== Chat backends: .chat(messages, n, temperature, max_tokens, stop) -> Completion; .usage


@dataclass
class Completion:
    texts: list[str]
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Usage:
    """Token counts; prices in dollars per million tokens."""
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    price_in: float = 0.0
    price_out: float = 0.0

    def add(self, c: Completion, seconds: float) -> Completion:
        self.calls, self.seconds = self.calls + 1, self.seconds + seconds
        self.prompt_tokens += c.prompt_tokens
        self.completion_tokens += c.completion_tokens
        return c

    @property
    def cost(self) -> float:
        return (self.prompt_tokens * self.price_in + self.completion_tokens * self.price_out) / 1e6


class BackendError(RuntimeError):
    """The endpoint cannot serve us (bad key, wrong URL or model, unreachable): one line says why."""


RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)
HINTS = {401: " (check OPENAI_API_KEY)", 403: " (check OPENAI_API_KEY and the model's access)",
         404: " (check OPENAI_BASE_URL and the model name)"}


class OpenAIBackend:
    """An OpenAI-compatible endpoint (OpenAI, vLLM, `transformers serve`) over `requests`."""

    def __init__(self, model=None, base_url=None, api_key=None, timeout=None, max_retries=5, backoff=1.0,
                 price_in=0.0, price_out=0.0):
        url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        self.base_url = url if re.search(r"/v\d+$", url) else url + "/v1"
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.model = model or os.environ.get("OPENAI_MODEL")  # None: the endpoint's first
        self.embedding_model = os.environ.get("OPENAI_EMBEDDING_MODEL", "text-embedding-3-small")
        self.timeout = float(timeout or os.environ.get("OPENAI_TIMEOUT") or 600.0)  # a whole answer's
        self.max_retries, self.backoff, self.usage = max_retries, backoff, Usage(price_in=price_in, price_out=price_out)

    def _request(self, method: str, path: str, payload=None, read=lambda out: out):
        """read(answer JSON); its None, rate limits, server trouble, broken answers: retried with backoff."""
        url, headers = self.base_url + path, ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                r = self._send(method, url, payload, headers)
            except requests.ConnectionError as e:  # refused, dropped, connect timeout
                why = f"cannot reach {url} ({type(e).__name__}); check OPENAI_BASE_URL"
            except (TimeoutError, requests.Timeout, urllib3.exceptions.ReadTimeoutError):
                why = f"{url} did not answer within {self.timeout:g} s (OPENAI_TIMEOUT sets the limit)"
            except urllib3.exceptions.HTTPError as e:  # socket errors, wrapped
                why = f"{url} broke off its answer ({type(e).__name__})"
            except requests.RequestException as e:  # a malformed URL
                raise BackendError(f"bad endpoint URL {url!r}: {e}") from None
            else:
                out = None
                try:
                    out = json.loads(r.content)
                    message = out["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text[:200].replace("\n", " ")
                if r.status_code == 200 and not isinstance(out, dict):
                    raise BackendError(f"{url} answered with something that is not a JSON object: "
                                       f"{r.content[:120]!r}; is {self.base_url} an OpenAI-compatible endpoint?")
                if r.status_code == 200 and (got := read(out)) is not None:
                    return got
                why = f"{method} {url}: HTTP {r.status_code}: {message}"
                if r.status_code not in RETRY_STATUS + (200,):
                    raise BackendError(why + HINTS.get(r.status_code, ""))
                retry_after = r.headers.get("Retry-After")
            if attempt == self.max_retries:
                raise BackendError(f"{why} (gave up after {self.max_retries} retries)")
            # exponential backoff, jitter (AWS architecture blog; as the openai client)
            delay = self.backoff * 2 ** attempt * random.uniform(0.5, 1.5)
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                delay = max(delay, float(retry_after))
            time.sleep(min(delay, 60.0))

    def _send(self, method, url, payload, headers):
        """One HTTP exchange, self.timeout seconds in all (a trickling server times out too)."""
        deadline = time.monotonic() + self.timeout
        r = requests.request(method, url, json=payload, headers=headers, timeout=self.timeout, stream=True)
        read, body = getattr(r.raw, "read1", r.raw.read), bytearray()  # urllib3 2's read1: what has arrived
        with r:
            while piece := read(65536, decode_content=True):
                body += piece
                if time.monotonic() > deadline:
                    raise TimeoutError
        r._content = bytes(body)  # requests' slot: .json() and .text work
        return r

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None) -> Completion:
        """n completions; a server giving fewer (transformers serve ignores n) is asked for the rest."""
        start, c = time.time(), Completion([])
        if self.model is None:
            try:
                self.model = self._request("GET", "/models")["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise BackendError(f"{self.base_url}/models lists no model; pass --model") from None
        while len(c.texts) < n:
            payload = {"model": self.model, "messages": messages, "n": n - len(c.texts), "temperature": temperature,
                       "max_tokens": max_tokens, **({"stop": stop} if stop else {})}
            texts, usage = self._request("POST", "/chat/completions", payload, read_choices)
            c.texts += texts[:n - len(c.texts)]
            c.prompt_tokens += usage.get("prompt_tokens", 0)
            c.completion_tokens += usage.get("completion_tokens", 0)
        return self.usage.add(c, time.time() - start)

    def embeddings(self, texts: list[str], batch=256):
        """(N, D) numpy array from `/v1/embeddings`."""
        import numpy as np
        rows = []
        for i in range(0, len(texts), batch):
            part = texts[i:i + batch]
            out = self._request("POST", "/embeddings", {"model": self.embedding_model, "input": part})
            try:
                got = [[float(x) for x in d["embedding"]] for d in sorted(out["data"], key=lambda d: d.get("index", 0))]
                assert len(got) == len(part) and len({len(g) for g in got}) == 1
            except (KeyError, TypeError, ValueError, AttributeError, AssertionError):
                raise BackendError(f"{self.base_url}/embeddings answered in an unexpected shape for {len(part)} "
                                   f"inputs: {str(out)[:160]}") from None
            rows += got
            self.usage.prompt_tokens += (out.get("usage") or {}).get("prompt_tokens", 0)
        return np.asarray(rows, dtype=np.float64)


def read_choices(out: dict):
    """(texts, usage): choices' message content (or legacy text) by index, or None."""
    choices = out.get("choices") if isinstance(out.get("choices"), list) else []
    texts = [(c["message"].get("content") or "") if isinstance(c.get("message"), dict) else c.get("text")
             for c in sorted((c for c in choices if isinstance(c, dict)), key=lambda c: c.get("index", 0))]
    texts = [t for t in texts if isinstance(t, str)]
    return (texts, out.get("usage") if isinstance(out.get("usage"), dict) else {}) if texts else None


def cut_at_stop(text: str, stop) -> str:  # as an endpoint returns it
    cuts = [i for i in (text.find(s) for s in (stop or []) if s) if i >= 0]
    return text[:min(cuts)] if cuts else text


class LocalBackend:
    """A checkpoint in-process via model.py: chat template, batched KV-cache generation."""

    def __init__(self, path_or_id=None, lm=None, tokenizer=None):
        import model  # torch only when used
        if lm is None:
            lm, tokenizer = model.load(path_or_id)
        self.lm, self.tokenizer, self.model, self.usage = lm, tokenizer, model, Usage()

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None) -> Completion:
        start, tok, model = time.time(), self.tokenizer, self.model
        ids = model.keep_end(tok.encode(tok.apply_chat_template(messages)), self.lm.config.max_position_embeddings,
                             max_tokens)
        # n samples, one prefill; a stop string ends generation at once
        gen = self.lm.generate([ids], max_new_tokens=max_tokens, temperature=temperature, n=n,
                               stop_token_ids=model.stop_ids(self.lm, tok), stop_fn=model.stop_strings(tok, stop))
        texts = [cut_at_stop(tok.decode(t, skip_special_tokens=True), stop) for t in gen.tokens]
        return self.usage.add(Completion(texts, len(ids) * n, sum(map(len, gen.tokens))), time.time() - start)

# ==== The prompt: MLAB's research agent (agent_research.py: initial_prompt, format_prompt_dict), reworded


FORMAT = {  # in order
    "Reflection": "What the last observation means; if it shows an error, what caused it and how to fix it.",
    "Research Plan and Status": "The whole high-level plan, each step marked with its status and, when done, its "
                                "confirmed result. Keep the plan from your previous response unless you revise it "
                                "on purpose, and put what changed since then in double asterisks **like this**; with "
                                "no change, copy it. Only record progress that an observation has confirmed.",
    "Fact Check": "Each new statement in Research Plan and Status, marked as confirmed by an observation or guessed. "
                  "Performance numbers are confirmed only by running code.",
    "Thought": "What you will do now and why.", "Action": "The name of one tool.",
    "Action Input": "The tool's arguments as one valid JSON object.",
}
STOP = ["Observation:"]  # MLAB's stop string (MLAgentBench/LLM.py complete_text), anywhere in a line

SYSTEM = """You are a research assistant who improves machine-learning code. You can use these tools:

{tools}

Research problem:
{problem}

So far you know nothing about this problem beyond what is written above.

Follow these instructions throughout:
- Begin with a high-level plan in Research Plan and Status, based on the problem and the tools; revise it as you learn.
- Research Plan and Status tracks the plan, which steps are done or in progress, and short confirmed results.
- Put only results that an observation confirmed into Research Plan and Status. Performance numbers come only from
  running the code and reading its output.
- Measure the baseline first, and judge every change against the best result so far; undo changes that do not help.
- Reach the goal as directly as you can. Do not install packages.
- State the results and the reasoning that support a conclusion before the conclusion itself.
- When train.py is as good as you can make it, use Final Answer. You can submit only once.

Respond in exactly this format, with every entry:
{format}
Observation:
```
what the tool returned
```"""


def tools_block() -> str:
    """Each action's description and usage example (MLAB's tools prompt, agents/agent.py:127-153, reworded)."""
    return "\n".join(f"- {s.name}: {s.description}\n  Usage:\n  Action: {s.name}\n  Action Input: "
                     + s.usage().replace("\n", "\n  ") + f"\n  Observation: [{s.returns}]"
                     for s in env.ACTIONS.values())


def _clip(text: str, limit=5000) -> str:  # departure 2: first and last halves
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}\n[... {len(text) - limit} characters cut ...]\n{text[-limit // 2:]}"


def build_messages(problem: str, history=(), ideas=(), last_k=3) -> list[dict]:
    """The next prompt, pure (ppo.py rebuilds a state's). history: (response, observation) per step, oldest first;
    ideas (ML-Agent, Appendix B.1): first prompt only. As MLAB (agent_research.py:91-100, 184-188): the last `last_k`
    steps, unreadable-input ones dropped once a later one is read."""
    system = SYSTEM.format(tools=tools_block(), problem=problem.strip(),
                           format="\n".join(f"{k}: {v}" for k, v in FORMAT.items()))
    if not history:
        user = "Now let's start!"
        if ideas:
            user += "\n\nIdeas to explore, in this order:\n" + "\n".join(
                f"{i}. [{cat}] {idea}" for i, (cat, idea) in enumerate(ideas, 1))
    else:
        read = max((i for i, (_, obs) in enumerate(history) if not obs.startswith(INPUT_ERROR)), default=-1)
        kept = [(i, resp, obs) for i, (resp, obs) in enumerate(history) if i > read or not obs.startswith(INPUT_ERROR)]
        shown = [f"Step {i}:\n{shown_response(resp)}\nObservation:\n```\n{_clip(obs)}\n```"
                 for i, resp, obs in kept[-last_k:]]
        user = (f"Here are your most recent steps (up to {last_k}):\n\n" + "\n\n".join(shown)
                + f"\n\nNow respond for step {len(history)}.")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def shown_response(text: str) -> str:
    """A past response as MLAB shows it (agent_research.py:133-139): parsed, plan **marks** removed; else as is."""
    entries = parse_entries(text)
    if not entries:
        return text.strip()
    entries["Research Plan and Status"] = entries["Research Plan and Status"].replace("**", "")
    return "".join(f"{k}:{v}" for k, v in entries.items()).strip()

# ==== Parsing: MLAB's parser (agents/agent.py:168-231); as its agent (agent_research.py:111-170), missing entries
# or an unknown Action are asked again, an unreadable Action Input is not


class ParseError(ValueError):
    """A response not in its format (also orchestrator.py's); the message says why."""


class InputError(ParseError):
    """The Action names a tool but the Action Input is not its arguments."""

    def __init__(self, action: str, why: str):
        super().__init__(why)
        self.action = action


def parse_entries(text: str) -> dict[str, str]:
    """Entries as MLAB's regex finds them (agents/agent.py:218-231): each `Name:` of FORMAT, in order, anywhere
    (`# Name:` works, `**Name**:` not), up to the next; of a repeated name the last in order (the first entry: its
    first); {} if one is missing or out of order. Values unstripped."""
    text = cut_at_stop(text or "", STOP)
    names, starts, end = list(FORMAT), [], len(text)
    for i, name in reversed(list(enumerate(names))):  # from the last back: no regex backtracking
        at = (text.find if i == 0 else text.rfind)(name + ":", 0, end)
        if at < 0:
            return {}
        starts.insert(0, at)
        end = at
    bounds = starts[1:] + [len(text)]
    return {name: text[at + len(name) + 1:stop] for name, at, stop in zip(names, starts, bounds)}


def parse_response(text: str) -> tuple[str, dict]:
    """(action, action_input); ParseError with the reason, InputError if only the input is bad."""
    entries = parse_entries(text)
    if not entries:
        absent = [k for k in FORMAT if k + ":" not in cut_at_stop(text or "", STOP)]
        raise ParseError(f"missing entries: {', '.join(absent)}" if absent else
                         f"the entries are not in this order: {', '.join(FORMAT)}")
    action = entries["Action"].strip()  # as MLAB (agent_research.py:117)
    if action not in env.ACTIONS:
        raise ParseError(f"unknown action {action!r}; the actions are: {', '.join(env.ACTIONS)}")
    return action, read_action_input(entries["Action Input"], env.ACTIONS[action])


def read_action_input(text: str, spec) -> dict:
    """`spec`'s arguments as MLAB reads them (agents/agent.py:168-209): a JSON object with exactly its keys, else each
    value after `"key":` up to `, "next key":` (greedy regex; a trailing comma stays on the last), or InputError."""
    keys = list(spec.args)
    try:
        obj = json_object(text, "the Action Input")
        if set(obj) == set(keys):
            return obj
        why = (f"the Action Input of {spec.name} must have the keys {', '.join(keys)}; missing: "
               f"{', '.join(k for k in keys if k not in obj) or 'none'}; unexpected: "
               f"{', '.join(map(str, (k for k in obj if k not in keys))) or 'none'}")
    except ParseError as e:
        why = str(e)
    body = text[text.find("{") + 1:]
    body = body[:body.rfind("}")] if "}" in body else body
    values, end = {}, len(body)
    for i, key in reversed(list(enumerate(keys))):
        found = list(re.finditer((r",\s*" if i else "") + re.escape(f'"{key}":'), body[:end]))  # the first: its first
        if not found:
            raise InputError(spec.name, why)
        at = found[-1] if i else found[0]
        values[key], end = body[at.end():end], at.start()
    return {k: values[k].strip().strip('"') for k in keys}


def json_object(text: str, what="the answer") -> dict:
    """The JSON object in `text` (fence and words around dropped, raw newlines allowed); else ParseError."""
    raw = re.sub(r"^```\w*|```$", "", (text or "").strip(), flags=re.M).strip()
    start, end = raw.find("{"), raw.rfind("}")
    if start < 0 or end < start:
        raise ParseError(f"{what} holds no JSON object")
    try:
        return json.loads(raw[start:end + 1], strict=False)
    except json.JSONDecodeError as e:
        raise ParseError(f"{what} is not valid JSON: {e}") from None

# ==== The LLM editor


EDIT_PROMPT = """Here is a Python script:
```python
{code}
```
Change it as this instruction says, and make no other change:
{instruction}

Answer with the whole edited script in one ```python block."""


class LLMEditor:
    """`Edit Script (AI)` on an LLM (MLAB's edit action): the whole file rewritten; env.py diffs it."""

    def __init__(self, backend, max_tokens=4096):
        self.backend, self.max_tokens = backend, max_tokens

    def __call__(self, instruction: str, code: str) -> str:
        text = self.backend.chat([{"role": "user", "content": EDIT_PROMPT.format(code=code, instruction=instruction)}],
                                 temperature=0.0, max_tokens=self.max_tokens).texts[0]
        blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", text, re.S)
        if not blocks:
            raise env.EditError("the editor's answer holds no ```python block")
        return max(blocks, key=len)  # the script, not a snippet

# ==== The scripted expert, an offline STAND-IN (departure 4): it sees only the messages (its plan is its state)


PLAN_LINE = re.compile(r"^(\d+)\. (.*?) \[(pending|in progress|done|kept|undone|failed)(?:: ([^\]]*))?\]$", re.M)
NUMBER = r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
SCORE = re.compile(r"Validation [^:\n]*:\s*" + NUMBER)  # what a starter prints
PUBLIC = re.compile(r"Public score \([^)\n]*\): " + NUMBER + r"(?:, (better|not better) than)?")  # env.Env's
RUN_TRAIN = ("Execute Script", {"script_name": "train.py"})


class ScriptedExpert:
    """Baseline, read the script, per idea edit, execute, keep or undo; then Final Answer."""

    def __init__(self):
        self.usage = Usage()

    def chat(self, messages, n=1, temperature=0.0, max_tokens=1024, stop=None) -> Completion:
        user, higher = messages[-1]["content"], "lower is better" not in messages[0]["content"]
        steps = re.split(r"^Step \d+:\n", user, flags=re.M)
        if len(steps) == 1:  # first step: plan the ideas
            ideas = re.findall(r"^\d+\. (\[\w+\] .+)$", user, re.M)
            plan = [["Run train.py to measure the baseline.", "pending", ""],
                    ["Read train.py to see where each change goes.", "pending", ""],
                    *[[f"Try {idea}", "pending", ""] for idea in ideas],
                    ["Submit the best train.py with Final Answer.", "pending", ""]]
            best, reflection, fact, then = None, "This is the start: nothing has been observed yet.", "", None
        else:
            plan, best, reflection, fact, then = self._observe(steps[-1], higher)
        thought, action, action_input = then or self._next(plan, best)
        status = "\n".join(f"{i}. {t} [{s}{': ' + r if r else ''}]" for i, (t, s, r) in enumerate(plan, 1))
        status += f"\nBest score so far: {best if best is not None else 'none'} " \
                  f"({'higher' if higher else 'lower'} is better)"
        text = (f"Reflection: {reflection}\nResearch Plan and Status:\n{status}\n"
                f"Fact Check: {fact or 'Nothing new to check.'}\nThought: {thought}\n"
                f"Action: {action}\nAction Input: {json.dumps(action_input)}")
        return self.usage.add(Completion([text] * n), 0.0)

    @staticmethod
    def _observe(step: str, higher: bool):
        """The last step read back -> (plan, best, reflection, fact, then: the next step if decided here)."""
        response, _, observation = step.partition("\nObservation:\n```\n")
        observation = observation.rsplit("\n```", 1)[0]
        entries = parse_entries(response)
        status = entries.get("Research Plan and Status", "")
        plan = [[t, s, r or ""] for _, t, s, r in PLAN_LINE.findall(status)]
        best = re.search(r"Best score so far: (\S+)", status)
        best = float(best.group(1)) if best and best.group(1) != "none" else None
        cur = next((i for i, p in enumerate(plan) if p[1] in ("pending", "in progress")), len(plan) - 1)
        action, public = entries.get("Action", "").strip(), PUBLIC.findall(observation)
        # public score (the reward's m_t) and verdict, else validation score
        scores, what = (public, "public score") if public else (SCORE.findall(observation), "validation score")
        score, fact, then = float(scores[-1][0] if public else scores[-1]) if scores else None, "", None
        verdict = public[-1][1] if public and public[-1][1] else None
        if action == "Execute Script" and cur == 0:  # the baseline
            plan[0][1:] = ["done", f"{score}" if score is not None else "no score"]
            best, reflection = score, f"The baseline ran; its {what} is {score}."
            fact = f"Baseline {what} {score}: confirmed by the output above."
        elif action == "Inspect Script Lines":
            plan[cur][1:] = ["done", "data and model blocks found"]
            reflection = "The script has a data block, a model block, a training block and a submission block."
            fact = "The layout of train.py: confirmed by the lines above."
        elif action.startswith("Edit Script") and "EnvError" in observation and "could not be applied" in observation:
            plan[cur][1:] = ["failed", "the edit could not be applied"]
            reflection = "The edit could not be applied, so this idea is dropped."
            fact = "The edit failed: confirmed by the error above."
        elif action.startswith("Edit Script"):
            plan[cur][1:] = ["in progress", "edited, to be run"]
            reflection, fact = "The diff shows the change I asked for.", "The edit was applied: confirmed by the diff."
            then = ("Run the edited script to measure the change.", *RUN_TRAIN)
        elif action == "Execute Script":  # an idea was run
            said = f", {verdict} than before the edit" if verdict else ""
            fact = f"The {what} {score}{said}: confirmed by the output above."
            if score is not None and (verdict == "better" if verdict else
                                      best is None or (score > best if higher else score < best)):
                plan[cur][1:] = ["kept", f"{score}"]
                reflection = f"The change improved the {what} from {best} to {score}; I keep it."
                best = score
            else:
                why = "the script failed" if score is None else f"{score} is not better than {best}"
                plan[cur][1:] = ["undone", why]
                reflection = f"The change did not help: {why}."
                then = ("Undo the change so train.py is back to the best version.", "Undo Edit Script",
                        {"script_name": "train.py"})
        else:  # after an undo, or anything else
            reflection = "train.py is back to its best version." if action == "Undo Edit Script" else \
                "The last step did not change the plan."
        return plan, best, reflection, fact, then

    @staticmethod
    def _next(plan, best):
        """(thought, action, input) starting the first pending plan item, now in progress."""
        cur = next((i for i, p in enumerate(plan) if p[1] == "pending"), None)
        if cur is not None:
            plan[cur][1] = "in progress"
        if cur is None or cur == len(plan) - 1:  # only Final Answer left
            kept = [p[0][4:] for p in plan if p[1] == "kept"]
            summary = (f"Kept {len(kept)} change(s): " + "; ".join(kept) if kept else "No change beat the baseline.") \
                + f" Best score: {best}."
            return "Every idea has been tried; submit.", "Final Answer", {"final_answer": summary}
        if cur == 0:
            return ("First measure the starter script.", *RUN_TRAIN)
        if cur == 1:
            return ("Read the script before changing it.", "Inspect Script Lines",
                    {"script_name": "train.py", "start_line_number": 1, "end_line_number": 80})
        idea = re.sub(r"^Try \[\w+\] ", "", plan[cur][0])
        return (f"Apply the next idea: {idea}", "Edit Script (AI)",
                {"script_name": "train.py", "edit_instruction": idea, "save_name": "train.py"})

# ==== The episode loop


@dataclass
class Step:
    """One step s_t -> a_t -> (o_t, r_t), with the state before the action."""
    index: int
    messages: list[dict]
    response: str  # acted on (the last after re-asks)
    action: str | None
    action_input: dict | None
    observation: str
    kind: str  # invalid | error | corner | neutral | edit | final
    metric: float | None  # m_t after the step (public score)
    metric_prev: float | None
    metric_new: float | None
    reward: float
    retries: int  # re-asks
    snapshot: dict  # env.snapshot(): restores s_t
    llm_seconds: float
    env_seconds: float


@dataclass
class Trajectory:
    task: str
    ideas: list  # (category, idea) pairs
    m_init: float | None
    m_best: float | None
    higher_is_better: bool
    steps: list[Step] = field(default_factory=list)
    stopped: str = "max_steps"  # | "final" | "time"
    seconds: float = 0.0
    reset_seconds: float = 0.0  # env.reset(): the starter script


REMINDER = ("Respond with all of these entries: " + ", ".join(FORMAT) + "; Action must be one of the tool names and "
            "Action Input one JSON object.")
REASK = "Your response was not in the right format ({reason}). " + REMINDER
INPUT_ERROR = "Action Input not understood:"  # opens an unreadable Action Input's observation


def act(env_, action, action_input, reason=None, reward_config=RewardConfig()) -> tuple[env.StepResult, float]:
    """A parsed action run in env_ -> (StepResult, reward), alike in collection, evaluation and RL. action None
    (`reason` says why) or an InputError input (as MLAB, agent_research.py:160-170): invalid, R_format."""
    if action is None or isinstance(action_input, InputError):
        text = (f"Invalid response ({reason}); nothing was done. {REMINDER}" if action is None else
                f"{INPUT_ERROR} {action_input}. Nothing was done. Give {action} one valid JSON object (double quotes, "
                f"a comma between entries, no triple quotes):\n{env.ACTIONS[action].usage()}")
        result = env.StepResult(text, "invalid", env_.metric, env_.metric)
    else:
        result = env_.step(action, action_input)
    return result, reward(result.kind, result.metric_prev, result.metric_new, env_.m_init, env_.m_best,
                          env_.task.higher_is_better, reward_config, m_high=result.metric_high)


def run_episode(env_, backend, ideas=(), max_steps=15, time_limit=1800.0, max_retries=2, temperature=0.0,
                max_tokens=1024, reward_config=RewardConfig()) -> Trajectory:
    """Reset `env_`; the agent acts until Final Answer, `max_steps` or `time_limit`."""
    start, problem = time.time(), env_.reset()
    reset_seconds = time.time() - start
    traj = Trajectory(env_.task.name, [list(i) for i in ideas], env_.m_init, env_.m_best, env_.task.higher_is_better)
    while len(traj.steps) < max_steps:
        if time.time() - start > time_limit:
            traj.stopped = "time"
            break
        messages = build_messages(problem, [(s.response, s.observation) for s in traj.steps], ideas)
        snapshot, llm_start, ask, reason = env_.snapshot(), time.time(), list(messages), None
        for retries in range(max_retries + 1):
            response = backend.chat(ask, temperature=temperature, max_tokens=max_tokens, stop=STOP).texts[0]
            try:
                action, action_input = parse_response(response)
                break
            except InputError as e:
                action, action_input = e.action, e
                break
            except ParseError as e:
                action, action_input, reason = None, None, str(e)
                # as MLAB: a note added, the response dropped (agent_research.py:119-123)
                ask = ask[:-1] + [{"role": "user", "content": ask[-1]["content"] + "\n\n"
                                   + REASK.format(reason=reason)}]
        llm_seconds, env_start = time.time() - llm_start, time.time()
        result, r = act(env_, action, action_input, reason, reward_config)
        traj.steps.append(Step(len(traj.steps), messages, response, action,
                               action_input if isinstance(action_input, dict) else None, result.observation,
                               result.kind, env_.metric, result.metric_prev, result.metric_new, r, retries, snapshot,
                               llm_seconds, time.time() - env_start))
        if result.done:
            traj.stopped = "final"
            break
    traj.seconds, traj.reset_seconds = time.time() - start, reset_seconds
    return traj

# ==== Run folders, for every command line; torch-free (fast start)


def lock_file(path, what):
    """An flock on `path` while the returned file is open (dies with the process); ValueError if taken."""
    lock = open(path, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(f"{what} is in use by another run ({path} is locked)") from None
    return lock


def claim_folder(path, flag="--out"):
    """The output folder, made and locked (folder/.lock) -> the lock file (a context manager)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file; give a folder")
    os.makedirs(path, exist_ok=True)
    return lock_file(os.path.join(path, ".lock"), f"{flag} {path}")


def write_atomic(path, text):
    """text (a str or lines) to a hidden file beside path, renamed over it: never half a file."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines([text] if isinstance(text, str) else text)
    os.replace(tmp, path)


def append_jsonl(path, obj):
    """A whole line per write, fsynced: a kill leaves at most a torn last line."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def jsonl_rows(path, complete_only=False):
    """(line number, object) per non-empty line, else a ValueError naming it; complete_only: no torn last line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if complete_only and not raw.endswith(b"\n"):
                return
            try:
                row = json.loads(raw) if raw.strip() else None  # UTF-8 bytes
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({type(e).__name__})") from None
            if row is not None:
                yield n, row


def read_jsonl(path, need=(), what="a JSON object", complete_only=False, repair=False) -> list[dict]:
    """Dicts with the keys `need` ([] if no file); complete_only: no torn last line; repair: cut it."""
    if not os.path.exists(path):
        return []
    if repair:
        with open(path, "r+b") as f:
            f.truncate(f.read().rfind(b"\n") + 1)
    rows = []
    for n, row in jsonl_rows(path, complete_only or repair):
        if not isinstance(row, dict) or any(k not in row for k in need):
            raise ValueError(f"{path}:{n}: not {what}" + (f" (needs {', '.join(need)})" if need else ""))
        rows.append(row)
    return rows


def trim_log(path, key, last, out=None):
    """The log as its checkpoint knows it: lines with `key` past `last` and a torn line go; out: must be ours."""
    if not os.path.exists(path):
        return
    keep = []
    for n, row in jsonl_rows(path, complete_only=True):
        mine = isinstance(row, dict) and (not out or os.path.abspath(str(row.get("out"))) == os.path.abspath(out))
        if out and not mine:
            raise ValueError(f"{path}:{n} is the log of another run (not of --out {out}); pass another --log-file")
        if mine and row.get(key, 0) <= last:
            keep.append(json.dumps(row) + "\n")  # as append_jsonl wrote it
    write_atomic(path, keep)


def swap_folder(tmp, path):
    """`tmp` becomes `path`, never neither (path.old in between)."""
    old = f"{path}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def recover_folder(path, tmp=None):
    """After a kill inside swap_folder: path.old back when path is missing, else deleted; so is tmp."""
    old = f"{path}.old"
    if os.path.isdir(old):
        shutil.rmtree(old) if os.path.exists(path) else os.replace(old, path)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name, base_url=None, endpoint="pass --base-url or set OPENAI_BASE_URL"):
    """Every command's rule -> None/"scripted", the endpoint's name or a checkpoint folder (no weights read): base_url;
    a folder; $OPENAI_BASE_URL or $OPENAI_API_KEY; a hub id Org/Name (HF cache, download); else ValueError."""
    if name is None or endpoint and (name == "scripted" or base_url):
        return name
    if endpoint and not os.path.isdir(name):
        if name.startswith((".", "/", "~", "runs/")) or name.count("/") > 1 or os.path.exists(name):
            raise ValueError(f"no checkpoint folder {name!r}")
        if os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_KEY"):
            return name
        if name.count("/") != 1:
            raise ValueError(f"{name!r} is no checkpoint folder and no endpoint is configured: {endpoint} (or "
                             "OPENAI_API_KEY for OpenAI's), or give a checkpoint folder")
    import model
    folder = None
    try:
        folder = model.resolve(name)
        model.load(folder, "cpu", meta=True)
    except Exception as e:  # noqa: BLE001 - any loader error
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{folder} is not a loadable checkpoint: {why}" if folder else why) from None
    return folder


def check_model(parser, flag, *args, **kw):
    try:
        return resolve_model(*args, **kw)
    except ValueError as e:
        parser.error(f"{flag}: {e}")

# ==== Command line


def make_backend(model_name: str | None, base_url: str | None = None, price_in=0.0, price_out=0.0,
                 stand_in=ScriptedExpert):
    if (name := resolve_model(model_name, base_url)) in (None, "scripted"):
        return stand_in()
    if os.path.isdir(name) and not base_url:
        return LocalBackend(name)
    return OpenAIBackend(model=name, base_url=base_url, price_in=price_in, price_out=price_out)


Parser = env.Parser  # every script's (env.py)


def checked(kind, ok=None, says="finite"):
    """An argparse `type=` reading `kind`, refusing what ok() rejects and non-finite floats (one line, exit 2)."""
    def read(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind.__name__}: {text!r}") from None
        if (isinstance(v, float) and not math.isfinite(v)) or (ok and not ok(v)):
            raise argparse.ArgumentTypeError(f"must be {says}, not {text}")
        return v
    return read


POSITIVE_INT = checked(int, lambda v: v >= 1, "at least 1")
COUNT = checked(int, lambda v: v >= 0, ">= 0")
POSITIVE = checked(float, lambda v: v > 0, "> 0")
NONNEGATIVE = checked(float, lambda v: v >= 0, ">= 0")
FRACTION = checked(float, lambda v: 0 <= v <= 1, "in [0, 1]")
KINDS = {"int": POSITIVE_INT, "float": POSITIVE, "str": str, "list": str, "bool": None}  # by a field's type


def add_fields(p, cls, types, choices={}, names=(), flags={}, more={}, switch=argparse.BooleanOptionalAction):
    """A flag per field of dataclass cls (or of names): flags[name] or --field-name, help the field's trailing
    comment (written once), checked by types or KINDS (other types: no flag)."""
    lines = (line.strip().partition("  # ") for line in inspect.getsource(cls).splitlines())
    d, helps = cls(), {code.partition(":")[0]: text.replace("%", "%%") for code, _, text in lines if text}
    for f in fields(cls):
        kind = (getattr(f.type, "__name__", None) or str(f.type)).split(" |")[0]  # int | None: int
        if kind in KINDS and f.name in (names or [f.name]):
            kw = dict(type=types.get(f.name, KINDS[kind]), choices=choices.get(f.name))
            kw = {"action": switch} if kind == "bool" else kw | {"nargs": "+"} if kind == "list" else kw
            p.add_argument(flags.get(f.name, "--" + f.name.replace("_", "-")), dest=f.name, default=getattr(d, f.name),
                           help=helps[f.name], **kw | more.get(f.name, {}))


def main(argv=None):
    p = Parser(prog="agent.py", description="Run one MLAB-style agent episode on a task and print its steps.")
    p.add_argument("--task", default="digits", help="a built-in task name or a task folder")
    p.add_argument("--model", default="scripted", help="'scripted', a local checkpoint folder, or an endpoint model")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL)")
    p.add_argument("--max-steps", type=POSITIVE_INT, default=15, help="steps at most (ML-Agent: 15)")
    p.add_argument("--idea", action="append", default=[], metavar="CATEGORY:IDEA",
                   help="inject an idea (repeatable; []: the scripted expert's first recipe)")
    args = p.parse_args(argv)
    backend = make_backend(check_model(p, "--model", args.model, args.base_url), args.base_url)
    try:
        e = env.Env(args.task, editor=env.recipe_editor if isinstance(backend, ScriptedExpert) else LLMEditor(backend))
    except (env.TaskError, OSError) as err:
        p.error(str(err))
    ideas = [tuple(i.split(":", 1)) if ":" in i else ("idea", i) for i in args.idea]
    if not ideas and isinstance(backend, ScriptedExpert):
        ideas = [(r.category, r.idea) for r in env.recipes_for(e.task.name)[:1]]
    try:
        traj = run_episode(e, backend, ideas, max_steps=args.max_steps)
    except BackendError as err:
        sys.exit(f"agent.py: {err}")
    g = "{:.6g}".format  # the reward's m_t (env.py), not the scripts' validation score
    for s in traj.steps:
        print(f"--- step {s.index}: {s.action} -> {s.kind}, reward {s.reward:+.3f}, public score "
              f"{g(s.metric) if s.metric is not None else '-'}\n{s.response}\n")
    end = traj.steps[-1].metric if traj.steps else None
    print(f"stopped: {traj.stopped}; public score {g(traj.m_init) if traj.m_init is not None else '-'} -> "
          f"{g(end) if end is not None else '-'}; {traj.seconds:.1f}s; tokens in/out {backend.usage.prompt_tokens}/"
          f"{backend.usage.completion_tokens}")


if __name__ == "__main__":
    main()
