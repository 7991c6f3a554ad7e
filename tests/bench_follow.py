"""Does a policy condition on its prompt? The two measures of issue 42's target 1 on recorded expert states, without
running any script (not collected by pytest; a pilot takes minutes, not an evaluation's hour):

- decisions: states whose last observation is an Execute Script of train.py with env.Env's verdict (", better than"
  / ", not better than ... before the last edit"); the policy's action is right when it undoes (Undo Edit Script)
  exactly after "not better". Printed as right of valid, with the (wanted, got) counts.
- first plans: first states (step 0) with injected ideas; right when the ideas of the plan the policy writes (its
  "Try [category] idea" lines, or lines that repeat the prompt's "[category] idea") are the prompt's, in its order.
- edits: later states (step > 0) where the expert edits (Edit Script (AI)), its plan with the prompt's ideas in the
  history the policy reads; right when the policy's edit instruction holds an idea of the prompt.

  python tests/bench_follow.py --model runs/ckpt/sft --states runs/data/states.jsonl   # held-in (seen) states
  python collect.py --tasks loans energy ... --trajectories 2 --seed 7 --out runs/heldout-states  # unseen states

Greedy by default (--temperature), the first --n states of each kind in the file's order. tests/RESULTS.md ("the
miniature that teaches") has the pilots measured with it.
"""
import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agent  # noqa: E402

VERDICT = re.compile(r", (better|not better) than \S+ before the last edit\s*$")
PLAN_IDEA = re.compile(r"^(?:\d+\. )?(?:Try )?\[\w+\] (.+?) \[(?:pending|in progress)", re.M)


def last_verdict(state) -> str | None:
    """ "keep" or "undo": what the verdict of the state's last observation asks for; None without one."""
    observation = state["messages"][-1]["content"].rsplit("Observation:\n```\n", 1)[-1].rsplit("\n```", 1)[0]
    found = VERDICT.search(observation.rstrip())
    return None if found is None else ("keep" if found.group(1) == "better" else "undo")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (or an endpoint model with --base-url)")
    p.add_argument("--states", required=True, help="a states.jsonl of collect.py")
    p.add_argument("--base-url", help="an OpenAI-compatible endpoint")
    p.add_argument("--n", type=int, default=60, help="states of each kind")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=400)
    a = p.parse_args(argv)
    backend = agent.make_backend(a.model, a.base_url)
    states = agent.read_jsonl(a.states, ("messages", "step", "ideas"))

    def act(state):
        text = backend.chat(state["messages"], temperature=a.temperature, max_tokens=a.max_tokens,
                            stop=agent.STOP).texts[0]
        try:
            return text, agent.parse_response(text)[0]
        except agent.ParseError:
            return text, None

    counts = Counter()
    for state in [s for s in states if last_verdict(s)][:a.n]:
        action = act(state)[1]
        counts[last_verdict(state), "invalid" if action is None else
               "undo" if action == "Undo Edit Script" else "keep"] += 1
    valid = sum(n for (_, got), n in counts.items() if got != "invalid")
    right = counts["keep", "keep"] + counts["undo", "undo"]
    print(f"decisions: right {right} of {valid} valid ({sum(counts.values())} states): "
          + ", ".join(f"{want}->{got} {n}" for (want, got), n in sorted(counts.items())))
    firsts = [s for s in states if s["step"] == 0 and s["ideas"]][:a.n]
    same = sum(PLAN_IDEA.findall(act(s)[0]) == [idea for _, idea in s["ideas"]] for s in firsts)
    print(f"first plans: {same} of {len(firsts)} list the prompt's ideas in its order")
    edits = [s for s in states if s["step"] > 0 and s["ideas"] and s["expert"]["action"] == "Edit Script (AI)"][:a.n]
    ours = Counter()
    for state in edits:
        text, action = act(state)
        if action != "Edit Script (AI)":
            ours["invalid" if action is None else "other action"] += 1
            continue
        said = agent.parse_response(text)[1].get("edit_instruction", "")
        ours["own idea" if any(idea in str(said) for _, idea in state["ideas"]) else "other idea"] += 1
    print(f"edits: {ours['own idea']} of {len(edits)} edit with an idea of the prompt ("
          + ", ".join(f"{k} {n}" for k, n in sorted(ours.items())) + ")")
    print(json.dumps({"decisions": {f"{w}->{g}": n for (w, g), n in counts.items()}, "first_plans": same,
                      "first_states": len(firsts), "edits": dict(ours), "edit_states": len(edits)}))


if __name__ == "__main__":
    main()
