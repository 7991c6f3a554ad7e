"""Tests for collect.py: the diversity filter, idea sampling and parsing, resume after a kill, the derived files.

- farthest-point selection matches a hand-worked example and keeps no two near-duplicates (vectors and TF-IDF text);
- each trajectory gets 1-3 distinct categories in shuffled order, one idea from each, reproducible from its id;
- LLM idea lists are parsed robustly;
- a collection killed halfway and restarted loses nothing and duplicates nothing (also with a torn last line);
  a failing rollout is logged and the others go on;
- scripted-expert data: every assistant turn of sft.jsonl parses and rows are chat format; a state of states.jsonl
  restores the same workspace and metric;
- the endpoint path end to end (a loopback fake): ideas in batches, TF-IDF when /v1/embeddings is missing, cost;
- the reward flags reach the expert's step rewards and are recorded in trajectories.jsonl and states.jsonl; a resume
  with another reward config (lines without one: the default) is refused, exit 2 with one line;
- usage errors exit 2 with one line.
"""
from __future__ import annotations

import dataclasses
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import agent
import collect
import env
import reward

ROOT = Path(collect.__file__).resolve().parent


# ------------------------------------------------------------------------------------------- diversity filter

def test_farthest_point_hand_worked_example():
    # unit rows a=(1,0), b=(1,0.01) (a near-duplicate of a), c=(0,1), d=(1,1)/sqrt2.
    # centroid ~ (0.677, 0.429): cosine similarities a .677, b .681, c .429, d .782 -> start at d (3).
    # distances to d: a .293, b .286, c .293 -> a and c tie, the lowest index wins: a (0).
    # nearest picked: b min(.286, .00005) = .00005, c min(.293, 1) = .293 -> c (2). b, the duplicate, is left out.
    X = np.array([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0], [1.0, 1.0]])
    assert collect.farthest_point(X, 3) == [3, 0, 2]
    assert collect.farthest_point(X * 7.0, 3) == [3, 0, 2]  # cosine: scale does not matter
    assert collect.farthest_point(X, 4) == [0, 1, 2, 3]  # no more rows than k: all, in order


def test_farthest_point_keeps_no_two_near_duplicates():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(6, 32))
    X = np.concatenate([centers + 0.01 * rng.normal(size=centers.shape) for _ in range(4)])  # 4 copies of 6
    picked = collect.farthest_point(X, 6)
    assert sorted(i % 6 for i in picked) == list(range(6))  # one per cluster
    assert picked == collect.farthest_point(X, 6)  # deterministic


def test_diverse_pool_on_text_drops_reworded_duplicates():
    ideas = ["Replace the model with a random forest of 300 trees.",
             "Replace the model with a random forest of 500 trees.",
             "Standardise every feature to zero mean and unit variance.",
             "Standardise each feature to zero mean and unit variance.",
             "Tune the learning rate with cross-validated grid search.",
             "Tune the learning rate with a cross-validated grid search."]
    pool = collect.diverse_pool({"x": ideas}, 3, collect.tfidf_embed)["x"]
    assert len(pool) == 3 and sorted(ideas.index(i) // 2 for i in pool) == [0, 1, 2]


# --------------------------------------------------------------------------------------------- ideas, sampling

def test_sample_ideas_one_per_category_seeded_by_id():
    pool = {c: [f"{c} idea {i}" for i in range(4)] for c in collect.CATEGORIES}
    seen_sizes, seen_orders = set(), set()
    for i in range(200):
        ideas = collect.sample_ideas(pool, random.Random(f"0:digits-{i:04d}"))
        cats = [c for c, _ in ideas]
        assert 1 <= len(ideas) <= 3 and len(set(cats)) == len(cats)
        assert all(idea in pool[c] for c, idea in ideas)
        seen_sizes.add(len(ideas))
        seen_orders.add(tuple(cats))
        assert ideas == collect.sample_ideas(pool, random.Random(f"0:digits-{i:04d}"))
    assert seen_sizes == {1, 2, 3} and len(seen_orders) == 15  # every non-empty ordered choice of categories


def test_parse_ideas_from_a_messy_list():
    text = ("Here are ideas:\n1. **Use target encoding** for the categorical columns.\n2) Add polynomial features of"
            " degree 2.\n\n- Drop rows with missing target values.\n* ok\n3: Clip outliers at the 1st and 99th "
            "percentiles.\nThanks!")
    assert collect.parse_ideas(text) == ["Use target encoding for the categorical columns.",
                                         "Add polynomial features of degree 2.",
                                         "Drop rows with missing target values.",
                                         "Clip outliers at the 1st and 99th percentiles."]


# ---------------------------------------------------------------------------------------------- collection runs

CHEAP = {"digits": {"data": [env.recipes_for("digits")[0].idea], "model": ["An idea no recipe knows."],
                    "learning": ["Another idea no recipe knows."]}}  # one cached or failing edit at most


def short(job):  # a real rollout, cut to two steps (baseline run and inspect: cached sandbox runs)
    return collect.rollout({**job, "max_steps": 2})


CALLS = []


def killed_after_two(job):
    CALLS.append(job["id"])
    if len(CALLS) > 2:
        raise KeyboardInterrupt  # what a Ctrl-C or a kill does to the loop: no bookkeeping, no derived files
    return short(job)


def failing_one(job):
    if job["id"].endswith("1"):
        raise RuntimeError("boom")
    return short(job)


def ids(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_killed_collection_resumes_without_loss_or_duplicates(tmp_path):
    (tmp_path / "ideas.json").write_text(json.dumps(CHEAP))
    with pytest.raises(KeyboardInterrupt):
        collect.collect(["digits"], trajectories=5, workers=1, out=tmp_path, rollout_fn=killed_after_two,
                        progress=False)
    before = (tmp_path / "trajectories.jsonl").read_bytes()
    assert ids(tmp_path / "trajectories.jsonl") == ["digits-0000", "digits-0001"]
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write('{"id": "digits-0002", "task": "dig')  # a kill in the middle of a write
    collect.collect(["digits"], trajectories=5, workers=1, out=tmp_path, rollout_fn=short, progress=False)
    got = ids(tmp_path / "trajectories.jsonl")
    assert sorted(got) == [f"digits-{i:04d}" for i in range(5)] and len(got) == 5
    assert (tmp_path / "trajectories.jsonl").read_bytes().startswith(before)  # finished lines untouched
    states = [json.loads(line) for line in (tmp_path / "states.jsonl").read_text().splitlines()]
    assert len(states) == 10 and len({s["id"] for s in states}) == 10


def test_failing_rollout_is_logged_and_the_rest_go_on(tmp_path, capsys):
    (tmp_path / "ideas.json").write_text(json.dumps(CHEAP))
    text = collect.collect(["digits"], trajectories=3, workers=2, out=tmp_path, rollout_fn=failing_one,
                           progress=False)
    assert sorted(ids(tmp_path / "trajectories.jsonl")) == ["digits-0000", "digits-0002"]
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["digits-0001"] and "boom" in errors[0]["error"]
    assert "digits-0001 failed: RuntimeError: boom" in capsys.readouterr().err and "1 rollouts failed" in text


def no_step(job):  # what a time limit spent before the first step gives
    return {**short(job), "steps": [], "stopped": "time"}


def test_a_trajectory_of_no_step_is_a_failed_rollout_and_retried(tmp_path):
    (tmp_path / "ideas.json").write_text(json.dumps(CHEAP))
    text = collect.collect(["digits"], trajectories=1, workers=1, out=tmp_path, rollout_fn=no_step, progress=False)
    assert not (tmp_path / "trajectories.jsonl").exists() and "1 rollouts failed" in text
    assert "no step within --time-limit" in (tmp_path / "errors.jsonl").read_text()
    collect.collect(["digits"], trajectories=1, workers=1, out=tmp_path, rollout_fn=short, progress=False)
    assert ids(tmp_path / "trajectories.jsonl") == ["digits-0000"]


@pytest.fixture(scope="module")
def scripted_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    (out / "ideas.json").write_text(json.dumps(CHEAP))
    text = collect.collect(["digits"], trajectories=3, workers=1, out=out, progress=False)
    return out, text


def test_scripted_sft_rows_are_valid_chat_and_parse(scripted_run):
    out, text = scripted_run
    rows = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    assert rows and "trajectories/min" in text and "sandbox" in text
    for row in rows:
        assert list(row) == ["messages"]
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])
        agent.parse_response(row["messages"][-1]["content"])  # raises if the expert broke the format
    first_prompts = [r["messages"][1]["content"] for r in rows if "Now let's start!" in r["messages"][1]["content"]]
    assert len(first_prompts) == 3 and all("Ideas to explore" in p for p in first_prompts)


def test_state_restores_the_same_workspace_and_metric(scripted_run):
    out, _ = scripted_run
    states = [json.loads(line) for line in (out / "states.jsonl").read_text().splitlines()]
    trajs = {t["id"]: t for t in map(json.loads, (out / "trajectories.jsonl").read_text().splitlines())}
    after_edit = [s for s in states if s["step"] > 0 and
                  trajs[s["id"].split("/")[0]]["steps"][s["step"] - 1]["kind"] == "edit"]
    assert after_edit, "no state after a successful edit"
    state = after_edit[0]
    e = env.Env(state["task"])
    e.restore(state["snapshot"])
    assert e.files == state["snapshot"]["files"] and e.files["train.py"] != (e.task.public_dir / "train.py").read_text()
    assert (e.metric, e.m_init, e.m_best) == (state["m_t"], state["m_init"], state["m_best"])
    e.step("Execute Script", {"script_name": "train.py"})  # run the restored script again
    assert e.metric == pytest.approx(state["m_t"])
    rebuilt = agent.build_messages(e.task.description, [(s["response"], s["observation"]) for s in
                                                        trajs[state["id"].split("/")[0]]["steps"][:state["step"]]])
    assert rebuilt == state["messages"]  # ppo.py can rebuild the exact prompt


def test_default_reward_config_is_recorded(scripted_run):
    out, _ = scripted_run
    for name in ("trajectories.jsonl", "states.jsonl"):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert rows and all(r["reward_config"] == dataclasses.asdict(reward.RewardConfig()) for r in rows)


def test_reward_flags_reach_the_recorded_rewards_and_a_resume_must_match(tmp_path, capsys):
    model_idea = next(r.idea for r in env.recipes_for("digits") if r.category == "model")  # changes the score
    (tmp_path / "ideas.json").write_text(json.dumps({"digits": {"model": [model_idea]}}))
    binary = reward.RewardConfig(binary_performance=True)
    collect.collect(["digits"], trajectories=1, workers=1, out=tmp_path, max_steps=3, reward_config=binary,
                    progress=False)  # baseline run, inspect, the recipe's edit
    before = (tmp_path / "trajectories.jsonl").read_bytes()
    (traj,) = [json.loads(line) for line in before.decode().splitlines()]
    assert traj["reward_config"] == dataclasses.asdict(binary)
    edit = traj["steps"][-1]
    assert edit["kind"] == "edit" and edit["metric_new"] != edit["metric_prev"]
    args = (edit["kind"], edit["metric_prev"], edit["metric_new"], traj["m_init"], traj["m_best"],
            traj["higher_is_better"])
    assert edit["reward"] == reward.reward(*args, binary) != reward.reward(*args)  # +1 or 0, not the scaled change
    states = [json.loads(line) for line in (tmp_path / "states.jsonl").read_text().splitlines()]
    assert [s["reward_config"] for s in states] == [dataclasses.asdict(binary)] * 3
    argv = ["--tasks", "digits", "--trajectories", "2", "--workers", "1", "--max-steps", "3", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        collect.main(argv)  # the default reward onto binary-reward trajectories: refused
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "binary_performance=True" in err and "binary_performance=False" in err
    assert (tmp_path / "trajectories.jsonl").read_bytes() == before  # nothing appended
    # the same flags, but reward.py's code changed since (a course assignment's edit): refused, saying so
    older = json.dumps({**traj, "reward_config": {**traj["reward_config"], "code": "0" * 12}}) + "\n"
    (tmp_path / "trajectories.jsonl").write_text(older)
    with pytest.raises(SystemExit) as exit_:
        collect.main(argv + ["--binary-performance"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"reward.py's code {'0' * 12}, now {reward.CODE} (reward.py was changed since)" in err
    assert (tmp_path / "trajectories.jsonl").read_text() == older  # nothing appended


def test_a_resume_reads_lines_without_a_reward_config_as_the_default(tmp_path):
    (tmp_path / "trajectories.jsonl").write_text(json.dumps({
        "id": "digits-0000", "task": "digits", "steps": [], "ideas": [], "m_init": 0.9, "m_best": 0.9,
        "higher_is_better": True}) + "\n")  # a line from before the key
    with pytest.raises(ValueError, match="holds trajectories collected with .*corner_term=False"):
        collect.collect(["digits"], trajectories=1, workers=1, out=tmp_path, progress=False,
                        reward_config=reward.RewardConfig(corner_term=False))
    assert not (tmp_path / "ideas.json").exists()  # refused before any work


@pytest.mark.parametrize("args", [["--tasks", "no-such-task"], ["--trajectories", "0"], ["--bogus"],
                                  ["--reward-clip", "0"]])
def test_usage_errors_exit_2_with_one_line(args, cli):  # main(argv) here (conftest.cli), not a python + torch
    r = cli(collect.main, args, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_collection_on_an_endpoint_expert(tmp_path):
    """The LLM path end to end against a loopback fake endpoint: ideas asked in batches and parsed, /v1/embeddings
    missing (404) so TF-IDF filters, the expert answers Final Answer at once, usage and cost are reported."""
    final = ("Reflection: -\nResearch Plan and Status: -\nFact Check: -\nThought: -\nAction: Final Answer\n"
             'Action Input: {"final_answer": "done"}')
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.endswith("/embeddings"):
                status, body = 404, {"error": {"message": "no embeddings here"}}
            else:
                prompt = req["messages"][-1]["content"]
                asked.append(prompt)
                if "Propose" in prompt:
                    n = len(asked)
                    text = "\n".join(f"{i}. Idea number {n * 100 + i} about {'trees ' * (i % 3)}features." for i in
                                     range(1, 26))
                else:
                    text = final
                status, body = 200, {"choices": [{"index": 0, "message": {"content": text}}],
                                     "usage": {"prompt_tokens": 10, "completion_tokens": 5}}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        text = collect.collect(["digits"], trajectories=2, workers=1, expert="fake-model", seed=1,
                               base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", out=tmp_path, k=4,
                               candidates=50, prices=(1e6, 1e6), progress=False)
    finally:
        server.shutdown()
        server.server_close()
    pools = json.loads((tmp_path / "ideas.json").read_text())["digits"]
    assert sorted(pools) == sorted(collect.CATEGORIES) and all(len(v) == 4 for v in pools.values())
    assert sum("Propose" in a for a in asked) == 3 * 2  # two batches of 25 per category reach 50 candidates
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [len(t["steps"]) for t in trajs] == [1, 1] and all(t["steps"][0]["kind"] == "final" for t in trajs)
    assert all(t["usage"]["calls"] == 1 and t["usage"]["cost"] == pytest.approx(15) for t in trajs)
    assert "cost $30.0000" in text
    # the idea proposals alone (6 calls of 10 + 5 tokens): one worker shares the backend with the rollouts
    assert "idea proposals: tokens in/out 60/30, cost $90.0000" in text


def test_sft_and_states_follow_the_trajectory_ids_not_the_finishing_order(tmp_path):
    # parallel rollouts append in the order they finish, which changes from run to run; the derived files must not
    (tmp_path / "ideas.json").write_text(json.dumps(CHEAP))
    collect.collect(["digits"], trajectories=3, workers=1, out=tmp_path, rollout_fn=short, progress=False)
    sft, states = (tmp_path / "sft.jsonl").read_bytes(), (tmp_path / "states.jsonl").read_bytes()
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(reversed(path.read_text().splitlines(True))))  # as if they had finished the other way
    collect.collect(["digits"], trajectories=3, workers=1, out=tmp_path, rollout_fn=short, progress=False)
    assert ids(path)[0] == "digits-0002"  # the record itself is left as it was written
    assert (tmp_path / "sft.jsonl").read_bytes() == sft and (tmp_path / "states.jsonl").read_bytes() == states


def test_a_bad_expert_is_one_line_exit_2_before_any_rollout(tmp_path, no_endpoint):
    """Issue 43: a missing folder, a file, a hub id not in the cache (hub offline), an endpoint's name with no
    endpoint configured: `collect.py: error: --expert: ...`, exit 2, no request, no --out made."""
    from conftest import assert_bad_models_refused
    assert_bad_models_refused(collect.main, ["--tasks", "digits", "--trajectories", "1", "--expert", "{m}", "--out",
                                             "{d}/o"], tmp_path, no_endpoint)
