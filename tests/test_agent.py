"""Tests for agent.py: backends, the response parser, the prompt, the LLM editor, the scripted expert, the episode loop.

- parse_response accepts the response format (also with markdown emphasis, code fences, a made-up observation) and
  rejects each kind of malformed response with a reason;
- build_messages keeps the last three steps and injects the ideas into the first prompt only;
- OpenAIBackend retries 429 and 500 (stub HTTP server on loopback), fails fast and clearly on 401 and 404, gives up
  clearly on an unreachable port, reads embeddings;
- episodes: a scripted chat with malformed responses (re-asked, then an invalid step with reward -1, the episode goes
  on), a tiny random model behind a loopback HTTP endpoint (its output is malformed: every step -1, no crash),
  the scripted expert (every response parses, rewards match reward.py);
- LLMEditor extracts the script from a ```python block and fails with EditError without one.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import agent
import env
import reward

GOOD = """Reflection: Nothing yet.
Research Plan and Status: 1. Look at the files. [in progress]
Fact Check: Nothing to check.
Thought: List the files first.
Action: List Files
Action Input: {"dir_path": "."}"""


# ------------------------------------------------------------------------------------------------------- parsing

def test_parse_response_accepts_the_format():
    assert agent.parse_response(GOOD) == ("List Files", {"dir_path": "."})
    fenced = ("Sure, here it is.\n" + GOOD.replace("Action:", "# Action:")  # MLAB's regex is anchored nowhere
              .replace('Action Input: {"dir_path": "."}', 'Action Input:\n```json\n{\n  "dir_path": "."\n}\n```'))
    assert agent.parse_response(fenced + "\nObservation:\n```\nmade up\n```") == ("List Files", {"dir_path": "."})
    multiline = GOOD.replace("List Files", "Edit Script (AI)").replace(
        '{"dir_path": "."}', '{"script_name": "train.py", "edit_instruction": "line one\nline two",'
                             ' "save_name": "train.py"}')
    action, args = agent.parse_response(multiline)
    assert action == "Edit Script (AI)" and args["edit_instruction"] == "line one\nline two"


@pytest.mark.parametrize("text, reason, error", [
    ("", "missing entries", agent.ParseError),
    ("I think we should train a bigger model.", "missing entries", agent.ParseError),
    (GOOD.replace("Fact Check: Nothing to check.\n", ""), "Fact Check", agent.ParseError),
    (GOOD.replace("Action: List Files", "Action: Delete Everything"), "unknown action", agent.ParseError),
    (GOOD.replace('{"dir_path": "."}', '{dir_path: "."}'), "not valid JSON", agent.InputError),
    (GOOD.replace('{"dir_path": "."}', "dir_path = ."), "no JSON object", agent.InputError),
    (GOOD.replace('{"dir_path": "."}', '{"path": "."}'), "missing: dir_path; unexpected: path", agent.InputError),
])
def test_parse_response_rejects_malformed(text, reason, error):
    with pytest.raises(error, match=reason) as e:
        agent.parse_response(text)
    assert (type(e.value) is agent.InputError) == (error is agent.InputError)


def test_parser_reads_what_mlab_reads():
    """Issue 33, point 5. MLAB's parse_entries (agents/agent.py:218-231) is one regex `Reflection:(.*)Research Plan and
    Status:(.*)...Action Input:(.*)`: every entry, in order, as a plain `Name:`; the action name is compared after
    strip() only (agents/agent_research.py:117); the API stops at "Observation:" anywhere (MLAgentBench/LLM.py:268-278).
    Its parse_action_input (agents/agent.py:168-209) falls back to a regex over the tool's keys in order."""
    for text in (GOOD.replace("Action:", "**Action**:"),  # bold headers: "Action:" is not there
                 GOOD.replace("Action: List Files", "Action: `List Files`"),  # quoted name: not a tool
                 GOOD.replace("Thought: List the files first.\n", "") + "\nThought: List the files first."):  # order
        with pytest.raises(agent.ParseError) as e:
            agent.parse_response(text)
        assert type(e.value) is agent.ParseError  # asked again, not an InputError
    twice = GOOD.replace("Thought: List the files first.", "Thought: the Action: line comes next.")
    assert agent.parse_response(twice) == ("List Files", {"dir_path": "."})  # the last "Action:" before Action Input
    assert agent.parse_response(GOOD.replace('"."}', '"."} Observation: made up')) == ("List Files", {"dir_path": "."})
    assert agent.cut_at_stop("Thought: the Observation: shows it", agent.STOP) == "Thought: the "
    edit = GOOD.replace("List Files", "Edit Script (AI)")
    triple = edit.replace('{"dir_path": "."}', '{"script_name": "train.py", "edit_instruction": """Use a\n"big" '
                          'forest""", "save_name": "train.py"}')  # not JSON; the key regex reads it
    assert agent.parse_response(triple)[1] == {"script_name": "train.py", "edit_instruction": 'Use a\n"big" forest',
                                               "save_name": "train.py"}
    trailing = edit.replace('{"dir_path": "."}', '{"script_name": "a.py", "edit_instruction": "x", '
                            '"save_name": "b.py",}')  # runs; MLAB's regex keeps the comma on the last value
    assert agent.parse_response(trailing)[1] == {"script_name": "a.py", "edit_instruction": "x", "save_name": 'b.py",'}
    extra_first = GOOD.replace('{"dir_path": "."}', '{"why": "look", "dir_path": "."}')  # keys differ: the regex
    assert agent.parse_response(extra_first) == ("List Files", {"dir_path": "."})  # finds "dir_path": all the same


# -------------------------------------------------------------------------------------------- HTTP stub server

class Stub:
    """A loopback HTTP server answering each POST with the next (status, body) of a script."""

    def __init__(self, answers, headers=None):
        self.answers, self.requests = list(answers), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                stub.requests.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                status, body = stub.answers.pop(0) if len(stub.answers) > 1 else stub.answers[0]
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def chat_body(text, prompt_tokens=7, completion_tokens=3):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


def error_body(message):
    return {"error": {"message": message, "type": "x", "code": None}}


def test_backend_retries_429_and_500_then_succeeds():
    stub = Stub([(429, error_body("slow down")), (500, error_body("oops")), (200, chat_body("hello"))])
    try:
        b = agent.OpenAIBackend(model="m", base_url=stub.url, api_key="k", backoff=0.01, price_in=1e6, price_out=2e6)
        c = b.chat([{"role": "user", "content": "hi"}], max_tokens=5, stop=["\nObservation:"])
        assert c.texts == ["hello"] and (c.prompt_tokens, c.completion_tokens) == (7, 3)
        assert len(stub.requests) == 3 and stub.requests[-1][0] == "/v1/chat/completions"
        assert stub.requests[-1][1]["stop"] == ["\nObservation:"] and stub.requests[-1][1]["model"] == "m"
        assert b.usage.calls == 1 and b.usage.cost == pytest.approx(7 * 1 + 3 * 2)
    finally:
        stub.close()


@pytest.mark.parametrize("status, hint", [(401, "OPENAI_API_KEY"), (404, "OPENAI_BASE_URL")])
def test_backend_fails_fast_with_one_clear_line(status, hint):
    stub = Stub([(status, error_body("Incorrect API key provided" if status == 401 else "no such model"))])
    try:
        b = agent.OpenAIBackend(model="m", base_url=stub.url, api_key="bad", backoff=5.0)
        start = time.time()
        with pytest.raises(agent.BackendError) as e:
            b.chat([{"role": "user", "content": "hi"}])
        assert time.time() - start < 2 and len(stub.requests) == 1  # no retry, no backoff sleep
        msg = str(e.value)
        assert "\n" not in msg and str(status) in msg and hint in msg
    finally:
        stub.close()


def test_backend_unreachable_gives_up_clearly():
    stub = Stub([(200, {})])
    url = stub.url
    stub.close()  # nothing listens there any more
    b = agent.OpenAIBackend(model="m", base_url=url, max_retries=2, backoff=0.01)
    with pytest.raises(agent.BackendError, match="cannot reach .*gave up after 2 retries"):
        b.chat([{"role": "user", "content": "hi"}])


def test_backend_embeddings_in_input_order():
    stub = Stub([(200, {"data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}],
                        "usage": {"prompt_tokens": 4}})])
    try:
        e = agent.OpenAIBackend(model="m", base_url=stub.url).embeddings(["a", "b"])
        assert e.tolist() == [[1.0, 0.0], [0.0, 1.0]] and stub.requests[0][0] == "/v1/embeddings"
    finally:
        stub.close()


def test_replies_of_other_shapes_are_read_or_retried_never_a_traceback():
    legacy = {"choices": [{"index": 0, "text": "legacy text", "finish_reason": "stop"}]}
    stub = Stub([(200, {"choices": []}), (200, legacy)])  # an empty answer is retried; a `text` choice is read
    try:
        b = agent.OpenAIBackend(model="m", base_url=stub.url, backoff=0.01)
        assert b.chat([{"role": "user", "content": "hi"}]).texts == ["legacy text"] and len(stub.requests) == 2
    finally:
        stub.close()
    stub = Stub([(200, {"data": [{"index": 0}]})])  # an embeddings reply without vectors: one clear error
    try:
        with pytest.raises(agent.BackendError, match="unexpected shape"):
            agent.OpenAIBackend(model="m", base_url=stub.url).embeddings(["a"])
    finally:
        stub.close()
    stub = Stub([(200, [1, 2])])  # a whole answer that is not a JSON object: not an endpoint of ours, not retried
    try:
        with pytest.raises(agent.BackendError, match="not a JSON object.*OpenAI-compatible endpoint"):
            agent.OpenAIBackend(model="m", base_url=stub.url, backoff=5.0).chat([{"role": "user", "content": "hi"}])
        assert len(stub.requests) == 1
    finally:
        stub.close()


def test_fewer_choices_than_n_are_asked_for_again():
    stub = Stub([(200, chat_body("one")), (200, chat_body("two")), (200, chat_body("three"))])  # ignores n
    try:
        c = agent.OpenAIBackend(model="m", base_url=stub.url).chat([{"role": "user", "content": "hi"}], n=3)
        assert c.texts == ["one", "two", "three"] and [r[1]["n"] for r in stub.requests] == [3, 2, 1]
        assert c.prompt_tokens == 21 and c.completion_tokens == 9
    finally:
        stub.close()


def _raw_server(reply):
    """A loopback server that answers every request with `reply(wfile)` (raw bytes: broken or slow answers)."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            reply(self)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_truncated_and_trickling_answers_are_retried_and_time_out_with_the_right_words():
    calls = []

    def truncated(h):  # the first answer breaks off mid-body, the second is whole
        calls.append(1)
        body = json.dumps(chat_body("whole")).encode()
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body if len(calls) > 1 else body[:10])
        h.close_connection = True

    server, url = _raw_server(truncated)
    try:
        assert agent.OpenAIBackend(model="m", base_url=url, backoff=0.01).chat([{"role": "user",
                                                                               "content": "hi"}]).texts == ["whole"]
        assert len(calls) == 2
    finally:
        server.shutdown()
        server.server_close()

    def trickle(h):  # one byte every 0.3 s, for ever: each read is quick, the whole answer never comes
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        for _ in range(100):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.3)

    server, url = _raw_server(trickle)
    try:
        b = agent.OpenAIBackend(model="m", base_url=url, timeout=1.0, max_retries=0)
        start = time.time()
        with pytest.raises(agent.BackendError, match="did not answer within 1 s") as e:
            b.chat([{"role": "user", "content": "hi"}])
        assert time.time() - start < 5 and "OPENAI_BASE_URL" not in str(e.value)
    finally:
        server.shutdown()
        server.server_close()


def test_routing_a_folder_with_a_base_url_goes_to_the_endpoint_and_a_missing_path_fails_at_once(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    b = agent.make_backend(str(folder), "http://127.0.0.1:9/v1")  # transformers serve names models by path
    assert isinstance(b, agent.OpenAIBackend) and b.model == str(folder)
    start = time.time()
    with pytest.raises(ValueError, match="no checkpoint folder"):
        agent.make_backend("./no-such-checkpoint")
    assert time.time() - start < 1


def test_one_rule_for_model_names(tmp_path, monkeypatch, no_endpoint):
    """Issue 43: "scripted" is the stand-in; a folder a checkpoint; with no endpoint configured a hub id is a
    checkpoint (here not in the cache and the hub offline) and any other name is refused at once, no request sent;
    with $OPENAI_BASE_URL or $OPENAI_API_KEY a name (a hub id too) is the endpoint's, a path never."""
    assert isinstance(agent.make_backend("scripted"), agent.ScriptedExpert)
    for name, words in [("gpt-4o-mini", "no endpoint is configured: pass --base-url or set OPENAI_BASE_URL"),
                        ("Qwen/Qwen2.5-0.5B-Instruct", "is not in the cache"), ("./nope", "no checkpoint folder"),
                        (agent.__file__, "no checkpoint folder")]:
        with pytest.raises(ValueError, match=words):
            agent.make_backend(name)
    assert no_endpoint == []
    for var, url in [("OPENAI_BASE_URL", "http://127.0.0.1:9/v1"), ("OPENAI_API_KEY", "https://api.openai.com/v1")]:
        with monkeypatch.context() as m:
            m.setenv(var, url if var == "OPENAI_BASE_URL" else "sk-test")
            for name in ("gpt-4o-mini", "Qwen/Qwen2.5-0.5B-Instruct"):
                b = agent.make_backend(name)
                assert isinstance(b, agent.OpenAIBackend) and (b.model, b.base_url) == (name, url)
            with pytest.raises(ValueError, match="no checkpoint folder"):
                agent.make_backend("runs/ckpt/nope")
    assert isinstance(agent.make_backend("Qwen/Qwen2.5-0.5B-Instruct", "http://127.0.0.1:9"), agent.OpenAIBackend)
    assert no_endpoint == []  # nothing was sent


def test_a_bad_model_name_is_one_line_exit_2(tmp_path, no_endpoint):
    from conftest import assert_bad_models_refused
    assert_bad_models_refused(agent.main, ["--model", "{m}", "--max-steps", "1"], tmp_path, no_endpoint)


# ------------------------------------------------------------------------------------------------------- editor

def test_llm_editor_extracts_the_script():
    class Fixed:
        def __init__(self, text):
            self.text = text

        def chat(self, messages, **kw):
            assert "print(1)" in messages[0]["content"] and "print two" in messages[0]["content"]
            return agent.Completion([self.text])

    assert agent.LLMEditor(Fixed("Sure:\n```python\nprint(2)\n```\nDone."))("print two", "print(1)\n") == "print(2)\n"
    with pytest.raises(env.EditError, match="python block"):
        agent.LLMEditor(Fixed("print(2)"))("print two", "print(1)\n")


# ------------------------------------------------------------------------------------------------------ episodes

class ScriptedChat:
    """A chat backend that answers from a fixed list, recording the prompts it saw."""

    def __init__(self, answers):
        self.answers, self.prompts, self.usage = list(answers), [], agent.Usage()

    def chat(self, messages, **kw):
        self.prompts.append(messages)
        return agent.Completion([self.answers.pop(0)])


FINAL = GOOD.replace("Action: List Files", "Action: Final Answer").replace('{"dir_path": "."}',
                                                                           '{"final_answer": "done"}')


def test_malformed_responses_are_reasked_then_invalid_and_the_episode_goes_on():
    chat = ScriptedChat(["rubbish", "more rubbish", "still rubbish",  # step 0: 1 try + 2 re-asks, all bad
                         "rubbish", GOOD,                              # step 1: good after one re-ask
                         GOOD.replace('"."', '"nowhere/../.."'),       # step 2: parses, env finds it invalid
                         FINAL])
    traj = agent.run_episode(env.Env("digits"), chat, ideas=[("model", "Use trees.")], max_steps=15)
    kinds = [s.kind for s in traj.steps]
    assert kinds == ["invalid", "neutral", "invalid", "final"] and traj.stopped == "final"
    assert [s.reward for s in traj.steps] == [-1.0, 0.0, -1.0, 0.0]
    assert [s.retries for s in traj.steps[:2]] == [2, 1]
    assert "missing entries" in traj.steps[0].observation and traj.steps[0].action is None
    # MLAB's re-ask (agents/agent_research.py:119-123): the note is added to the prompt, once per try, and the
    # discarded response is not kept
    assert [len(p) for p in chat.prompts[:3]] == [2, 2, 2] and "rubbish" not in str(chat.prompts[:3])
    assert [p[-1]["content"].count("not in the right format") for p in chat.prompts[:3]] == [0, 1, 2]
    assert traj.steps[1].messages == chat.prompts[3]  # the recorded prompt is the one before re-asks
    assert "Step 0:\nstill rubbish" in chat.prompts[5][1]["content"]  # the invalid step stays in the history


def test_a_bad_action_input_is_not_asked_again_the_step_happens_and_is_invalid():
    """Issue 33, point 1. MLAB asks again only when the entries cannot be read or the action is not a tool
    (agents/agent_research.py:111-127); an Action Input that is not valid JSON or has other keys (agents/agent.py:
    168-187) is executed as a step whose observation is the parsing error and the tool's usage (agent_research.py:
    157-170), and such steps leave the history once a later step's input is read (agent_research.py:186-188)."""
    bad_json = GOOD.replace('{"dir_path": "."}', '{dir_path: "."}')
    wrong_keys = GOOD.replace('{"dir_path": "."}', '{"folder": "."}')
    chat = ScriptedChat([bad_json, wrong_keys, GOOD, FINAL])
    e = env.Env("digits")
    traj = agent.run_episode(e, chat, max_steps=15)
    assert len(chat.prompts) == 4  # one answer per step: nothing was asked again
    assert [(s.action, s.kind, s.reward, s.retries) for s in traj.steps] == [
        ("List Files", "invalid", -1.0, 0), ("List Files", "invalid", -1.0, 0), ("List Files", "neutral", 0.0, 0),
        ("Final Answer", "final", 0.0, 0)]
    for step, why in zip(traj.steps[:2], ("not valid JSON", "missing: dir_path; unexpected: folder")):
        assert step.observation.startswith(agent.INPUT_ERROR) and why in step.observation
        assert env.ACTIONS["List Files"].usage() in step.observation and step.action_input is None
    users = [p[1]["content"] for p in chat.prompts]
    assert "Step 0:" in users[1] and "Step 0:" in users[2] and "Step 1:" in users[2]  # in a row: both kept
    assert "Step 0:" not in users[3] and "Step 1:" not in users[3] and "Step 2:" in users[3]  # read: dropped
    assert agent.act(e, "List Files", agent.InputError("List Files", "x"),
                     reward_config=reward.RewardConfig(format_term=False))[1] == 0.0  # R_format's ablation


def test_prompt_holds_what_mlab_says():
    """Issue 33, point 6, in our words: MLAB says the agent knows nothing of the problem yet and asks for results and
    reasoning before conclusions (agents/agent_research.py:14, 23), updates of the plan in **bold** (:39), which are
    removed when the plan is shown again (:137-139); each tool's usage ends with what it returns (agents/agent.py:140)
    and the format with the observation (agent_research.py:27-33)."""
    system = agent.build_messages("Predict the label.", [])[0]["content"]
    assert "know nothing about this problem" in system and "before the conclusion" in system
    assert "double asterisks **like this**" in system
    for spec in env.ACTIONS.values():
        usage = "  Action Input: " + spec.usage().replace("\n", "\n  ") + f"\n  Observation: [{spec.returns}]"
        assert usage in system and spec.returns
    assert system.endswith("Action Input: " + agent.FORMAT["Action Input"] + "\nObservation:\n```\n"
                           "what the tool returned\n```")
    bold = "I will list.\n" + GOOD.replace("1. Look at the files.", "1. **Look at the files.**")
    user = agent.build_messages("p", [(bold, "a.py")])[1]["content"]
    assert "Step 0:\n" + GOOD + "\nObservation:" in user  # the words before Reflection and the ** are gone
    assert agent.shown_response("no entries **here**") == "no entries **here**"  # unreadable: shown as written


def test_episode_stops_at_max_steps_and_time_limit():
    traj = agent.run_episode(env.Env("digits"), ScriptedChat([GOOD] * 5), max_steps=3)
    assert len(traj.steps) == 3 and traj.stopped == "max_steps"
    traj = agent.run_episode(env.Env("digits"), ScriptedChat([GOOD] * 5), time_limit=-1)
    assert traj.steps == [] and traj.stopped == "time"


def test_scripted_expert_episode_parses_and_rewards_match_reward_py():
    ideas = [("data", env.recipes_for("digits")[0].idea), ("model", "An idea no recipe knows.")]
    e = env.Env("digits")
    traj = agent.run_episode(e, agent.ScriptedExpert(), ideas)
    assert traj.stopped == "final" and len(traj.steps) <= 15
    actions = [s.action for s in traj.steps]
    assert actions[:4] == ["Execute Script", "Inspect Script Lines", "Edit Script (AI)", "Execute Script"]
    assert "Final Answer" == actions[-1]
    for s in traj.steps:
        assert agent.parse_response(s.response) == (s.action, s.action_input) and s.retries == 0
        assert s.reward == reward.reward(s.kind, s.metric_prev, s.metric_new, traj.m_init, traj.m_best, True)
    edit = traj.steps[2]
    assert edit.kind == "edit" and edit.metric_new is not None
    assert any(s.kind == "error" for s in traj.steps)  # the unknown idea: the offline editor cannot apply it
    assert "[failed: the edit could not be applied]" in traj.steps[-1].response


def test_scripted_expert_keeps_or_undoes_by_the_public_score_the_reward_pays():
    """The expert decides by env.Env's verdict on the public score, so no Undo it makes is paid negative and every
    kept change was paid non-negative (issue 42: by the printed validation score, 17 of 36 Undos were)."""
    decisions = []
    for task in ("wine", "diabetes"):
        ideas = [("model", r.idea) for r in env.recipes_for(task) if r.category == "model"][:4]
        traj = agent.run_episode(env.Env(task), agent.ScriptedExpert(), ideas)
        for prev, s in zip(traj.steps, traj.steps[1:]):
            if prev.action == "Execute Script" and ", better than" in prev.observation:
                decisions.append("keep")
                assert s.action != "Undo Edit Script" and "; I keep it." in s.response
            elif prev.action == "Execute Script" and ", not better than" in prev.observation:
                decisions.append("undo")
                assert s.action == "Undo Edit Script" and s.reward >= 0
    assert {"keep", "undo"} <= set(decisions), decisions


def test_episode_against_a_tiny_model_behind_an_http_endpoint():
    """A tiny random model answers over real HTTP on loopback (GET /v1/models, POST /v1/chat/completions through
    LocalBackend, as vLLM or `transformers serve` would answer for a saved folder): its output is malformed, so every
    step is invalid with reward -1, each asked again once, and the episode ends without a crash."""
    model = pytest.importorskip("model")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tok = model.train_tokenizer([agent.SYSTEM, GOOD, agent.tools_block()], vocab_size=400)
    lm = model.Qwen(model.tiny_config(vocab_size=len(tok), max_position_embeddings=16384)).eval()
    local, posts = agent.LocalBackend(lm=lm, tokenizer=tok), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            assert self.path == "/v1/models"
            self.answer({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append((self.path, req))
            c = local.chat(req["messages"], req["n"], req["temperature"], req["max_tokens"], req.get("stop"))
            self.answer({"choices": [{"index": i, "message": {"role": "assistant", "content": t},
                                      "finish_reason": "stop"} for i, t in enumerate(c.texts)],
                         "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = agent.OpenAIBackend(base_url=f"http://127.0.0.1:{server.server_address[1]}", backoff=0.01)
        traj = agent.run_episode(env.Env("digits"), backend, max_steps=2, max_retries=1, max_tokens=8,
                                 temperature=1.0)
    finally:
        server.shutdown()
        server.server_close()
    assert backend.model == "tiny"  # asked /v1/models
    assert [s.kind for s in traj.steps] == ["invalid", "invalid"] and [s.reward for s in traj.steps] == [-1, -1]
    assert backend.usage.calls == 4 and backend.usage.prompt_tokens > 100 and backend.usage.completion_tokens > 0
    assert len(posts) == 4 and all(p == "/v1/chat/completions" and r["model"] == "tiny" for p, r in posts)
    assert backend.usage.completion_tokens == local.usage.completion_tokens  # what the model generated, counted once


def test_local_backend_stops_at_stop_strings_while_generating_and_shares_n_samples():
    model = pytest.importorskip("model")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tok = model.train_tokenizer([agent.SYSTEM, GOOD], vocab_size=400)
    lm = model.Qwen(model.tiny_config(vocab_size=len(tok))).eval()
    backend = agent.LocalBackend(lm=lm, tokenizer=tok)
    msgs = [{"role": "user", "content": "Go."}]
    torch.manual_seed(1)  # the same draws for both calls: the stopped run is a prefix of the free one
    free = backend.chat(msgs, max_tokens=24, temperature=1.0)
    text = free.texts[0]
    stop = next(text[k:k + 2] for k in range(2, len(text) - 2) if text[k:k + 2].strip() and "\ufffd" not in text[:k + 2])
    torch.manual_seed(1)
    cut = backend.chat(msgs, max_tokens=24, temperature=1.0, stop=[stop])
    assert cut.texts[0] == text[:text.index(stop)]
    assert cut.completion_tokens < free.completion_tokens  # it stopped generating there, not at max_tokens
    greedy = backend.chat(msgs, max_tokens=6)
    many = backend.chat(msgs, n=3, max_tokens=6)  # one prefill, three rows
    assert many.texts == greedy.texts * 3 and many.completion_tokens == 3 * greedy.completion_tokens


# ------------------------------------------------------------------------------------------------ run-folder plumbing

def test_run_folder_files_atomic_writes_jsonl_reading_and_log_trimming(tmp_path):
    """write_atomic leaves no temporary file; read_jsonl names the bad line, skips (and with repair cuts off) a line
    torn by a kill; trim_log keeps the lines up to the checkpoint's and drops a torn last line, and with `out` refuses
    another run's log."""
    path = tmp_path / "rows.jsonl"
    agent.write_atomic(path, (json.dumps({"step": i}) + "\n" for i in (1, 2, 3)))
    assert os.listdir(tmp_path) == ["rows.jsonl"]
    agent.append_jsonl(path, {"step": 4})
    with open(path, "a") as f:
        f.write('{"step": 5')  # a kill mid-write
    assert [r["step"] for r in agent.read_jsonl(path, complete_only=True)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"rows.jsonl:5: not a JSON line"):
        agent.read_jsonl(path)
    with pytest.raises(ValueError, match=r"rows.jsonl:1: not a row \(needs x\)"):
        agent.read_jsonl(path, need=("x",), what="a row", complete_only=True)
    agent.trim_log(path, "step", 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and sorted(os.listdir(tmp_path)) == ["rows.jsonl"]
    agent.trim_log(path, "step", 2)  # nothing past the checkpoint: unchanged
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    with pytest.raises(ValueError, match="another run"):
        agent.trim_log(path, "step", 2, out=str(tmp_path / "o"))
    path.write_text('{"x": 1}\n{"x": 2')
    assert agent.read_jsonl(path, repair=True) == [{"x": 1}] and path.read_text() == '{"x": 1}\n'
    assert agent.read_jsonl(tmp_path / "none.jsonl") == []


def test_the_cli_prints_each_steps_public_score_short(cli):
    """agent.py names the number it prints (the public score, the reward's m_t), in 6 significant digits."""
    out = cli(agent.main, ["--task", "wine", "--max-steps", "3"])
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("--- step")]
    assert len(steps) == 3 and all(re.search(r"public score (-|-?[\d.e+-]+)$", s) for s in steps), steps
    assert all(len(s.rsplit(" ", 1)[1]) <= 12 for s in steps)  # 0.171058, not 0.17105831528264418
