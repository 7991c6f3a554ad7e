"""Bad input to the command lines (issue 15): each case runs the CLI and expects exit status 2, one line on stderr
that names the input, and no traceback; a run on an --out that another run holds is refused alike. The cases call
each script's main(argv) in this process (conftest.run_main gives the exit status, stdout and stderr a fresh process
would, warnings included), since a python and torch start per case cost most of the sweep's time; one case also runs
as a real subprocess, so the script's own start is covered. The arguments are checked before any heavy work."""
from __future__ import annotations

import argparse
import importlib
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import agent

ROOT = Path(agent.__file__).resolve().parent
COLLECT = ["collect.py", "--tasks", "digits", "--trajectories", "1", "--workers", "1", "--max-steps", "1"]
EVAL = ["eval.py", "--tasks", "wine", "--k", "1", "--max-steps", "1", "--no-plots"]
RUN = ["orchestrator.py", "run", "--task", "wine", "--rounds", "1", "--sub-iters", "1", "--calls", "1"]
TREE = ["orchestrator.py", "tree", "--task", "wine", "--depth", "1", "--sub-iters", "1", "--calls", "1"]
TRAIN = ["orchestrator.py", "train", "--task", "wine", "--depth", "1", "--sub-iters", "1"]
SFT = ["sft.py", "--data", "{d}/chat.jsonl", "--epochs", "1", "--scratch-hidden", "32", "--scratch-vocab", "300"]
CHAT = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n' * 4
STATE = (b'{"task": "digits", "task_dir": "tasks/digits", "step": 0, "messages": [], "snapshot": {}, "m_init": 0.9, '
         b'"m_best": 1.0, "higher_is_better": true}\n')  # ppo.py reads a pool of one state before the model
PPO = ["ppo.py", "--states", "{d}/states.jsonl", "--batch-size", "1", "--out", "{d}/o"]

# (id, argv ({d}: the case's folder, {ck}: broken checkpoints), files to write under {d}, words the error must say)
CASES = [
    ("collect-trajectories-utf8", COLLECT + ["--out", "{d}/o"], {"o/trajectories.jsonl": b"\xff\xfe\n"},
     "trajectories.jsonl:1"),
    ("collect-trajectories-not-object", COLLECT + ["--out", "{d}/o"], {"o/trajectories.jsonl": b"[1, 2]\n"},
     "trajectories.jsonl:1"),
    ("collect-ideas-corrupt", COLLECT + ["--out", "{d}/o"], {"o/ideas.json": b"{bad"}, "ideas.json"),
    ("collect-ideas-shape", COLLECT + ["--out", "{d}/o"], {"o/ideas.json": b'{"digits": 5}'}, "ideas.json"),
    ("collect-out-file", COLLECT + ["--out", "{d}/f"], {"f": b"mine"}, "--out"),
    ("collect-time-limit-negative", COLLECT + ["--time-limit", "-5", "--out", "{d}/o"], {}, "--time-limit"),
    ("collect-time-limit-nan", COLLECT + ["--time-limit", "nan", "--out", "{d}/o"], {}, "--time-limit"),
    ("collect-max-steps-0", COLLECT + ["--max-steps", "0", "--out", "{d}/o"], {}, "--max-steps"),
    ("collect-price-nan", COLLECT + ["--price", "nan", "1", "--out", "{d}/o"], {}, "--price"),
    ("collect-expert-truncated", COLLECT + ["--expert", "{ck}/truncated", "--out", "{d}/o"], {}, "--expert"),
    ("eval-runs-utf8", EVAL + ["--out", "{d}/o"], {"o/runs.jsonl": b"\xff\n"}, "runs.jsonl:1"),
    ("eval-runs-not-object", EVAL + ["--out", "{d}/o"], {"o/runs.jsonl": b"5\n"}, "runs.jsonl:1"),
    ("eval-temperature-nan", EVAL + ["--temperature", "nan", "--out", "{d}/o"], {}, "--temperature"),
    ("eval-threads-negative", EVAL + ["--threads", "-1", "--out", "{d}/o"], {}, "--threads"),
    ("eval-time-limit-nan", EVAL + ["--time-limit", "nan", "--out", "{d}/o"], {}, "--time-limit"),
    ("eval-out-file", EVAL + ["--out", "{d}/f"], {"f": b"mine"}, "--out"),
    ("eval-policy-truncated", EVAL + ["--policy", "{ck}/truncated", "--out", "{d}/o"], {}, "--policy"),
    ("eval-policy-bad-config", EVAL + ["--policy", "{ck}/bad-config", "--out", "{d}/o"], {}, "--policy"),
    ("eval-ppo-log-not-object", EVAL[:-1] + ["--ppo-log", "{d}/log.jsonl", "--out", "{d}/o"], {"log.jsonl": b"5\n"},
     "log.jsonl:1"),
    ("orchestrator-run-json-corrupt", RUN + ["--out", "{d}/o"], {"o/run.json": b"{bad"}, "run.json"),
    ("orchestrator-run-json-shape", RUN + ["--out", "{d}/o"], {"o/run.json": b'{"attempts": 5}'}, "run.json"),
    ("orchestrator-tree-json-corrupt", TREE + ["--out", "{d}/o"], {"o/tree.json": b"\xff"}, "tree.json"),
    ("orchestrator-tree-json-shape", TREE + ["--out", "{d}/o"], {"o/tree.json": b'{"nodes": 1}'}, "tree.json"),
    ("orchestrator-out-file", RUN + ["--out", "{d}/f"], {"f": b"mine"}, "--out"),
    ("orchestrator-rounds-0", RUN + ["--rounds", "0"], {}, "--rounds"),
    ("orchestrator-calls-negative", RUN + ["--calls", "-2"], {}, "--calls"),
    ("orchestrator-depth-negative", TREE + ["--depth", "-1"], {}, "--depth"),
    ("orchestrator-orchestrator-bad-config", RUN + ["--orchestrator", "{ck}/bad-config", "--out", "{d}/o"], {},
     "--orchestrator"),
    ("orchestrator-train-model-truncated", TRAIN + ["--model", "{ck}/truncated", "--out", "{d}/o"], {}, "--model"),
    ("sft-message-without-role", ["sft.py", "--data", "{d}/d.jsonl", "--out", "{d}/o"],
     {"d.jsonl": b'{"messages": [{"content": "x"}]}\n'}, "d.jsonl:1"),
    ("sft-trainer-state-truncated", SFT + ["--out", "{d}/o"], {"chat.jsonl": CHAT, "o/checkpoint-3/trainer_state.pt":
                                                               b"trunc"}, "trainer_state.pt"),
    ("sft-trainer-state-not-sfts", SFT + ["--out", "{d}/o"], {"chat.jsonl": CHAT, "o/checkpoint-3/trainer_state.pt":
                                                              pickle.dumps({})}, "trainer_state.pt"),
    ("sft-model-bad-config", SFT + ["--model", "{ck}/bad-config", "--out", "{d}/o"], {"chat.jsonl": CHAT}, "--model"),
    ("sft-threads-negative", SFT + ["--threads", "-1", "--out", "{d}/o"], {"chat.jsonl": CHAT}, "--threads"),
    # issue 33: weights shorter than the 8-byte header length in every loader; a missing --model; --max-steps < 1;
    # a torn ppo.py trainer state
    ("agent-model-safetensors-empty", ["agent.py", "--model", "{ck}/empty"], {}, "empty/model.safetensors"),
    ("agent-model-safetensors-4-bytes", ["agent.py", "--model", "{ck}/short"], {}, "short/model.safetensors"),
    ("agent-model-missing", ["agent.py", "--model", "{d}/nonexistent"], {}, "nonexistent"),
    ("agent-max-steps-0", ["agent.py", "--max-steps", "0"], {}, "--max-steps"),
    ("agent-max-steps-negative", ["agent.py", "--max-steps", "-1"], {}, "--max-steps"),
    ("model-generate-safetensors-4-bytes", ["model.py", "generate", "--model", "{ck}/short", "--prompt", "hi"], {},
     "short/model.safetensors"),
    ("ppo-model-safetensors-empty", PPO + ["--model", "{ck}/empty"], {"states.jsonl": STATE},
     "empty/model.safetensors"),
    ("ppo-trainer-state-torn", PPO + ["--model", "{ck}/bad-config"], {"states.jsonl": STATE,
                                                                      "o/trainer_state/state.pt": b"PK\x03\x04torn"},
     "trainer_state/state.pt"),
]
IN_USE = [("collect", COLLECT), ("eval", EVAL), ("orchestrator-run", RUN), ("orchestrator-train", TRAIN),
          ("sft", SFT)]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """Broken checkpoints: a truncated weight file, an empty one, one of 4 bytes, a config.json that is not JSON."""
    import model
    root = tmp_path_factory.mktemp("ck")
    tok = model.train_tokenizer(["hello world " * 20], 300)
    lm = model.Qwen(model.tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model.save(lm, tok, str(root / "truncated"))
    for name in ("bad-config", "empty", "short"):
        shutil.copytree(root / "truncated", root / name)
    (root / "empty" / "model.safetensors").write_bytes(b"")
    (root / "short" / "model.safetensors").write_bytes((root / "truncated" / "model.safetensors").read_bytes()[:4])
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    (root / "bad-config" / "config.json").write_text("{bad")
    return root


def run_cli(argv, d, ck, cli=None):
    """The command line argv ({d}, {ck} filled in) from ROOT: main(argv) here with cli (conftest.run_main), else
    python as a subprocess."""
    argv = [a.format(d=d, ck=ck) for a in argv]
    if cli is not None:
        return cli(importlib.import_module(argv[0].removesuffix(".py")).main, argv[1:], cwd=ROOT)
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_one_line_error(r, words):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and "error" in lines[0] and words in lines[0], r.stderr


@pytest.mark.parametrize("argv, files, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(argv, files, words, tmp_path, ck, cli):
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    before = {rel: (tmp_path / rel).read_bytes() for rel in files}
    assert_one_line_error(run_cli(argv, tmp_path, ck, cli), words)
    assert {rel: (tmp_path / rel).read_bytes() for rel in files} == before  # nothing given was changed


def test_bad_input_to_a_subprocess_is_one_line_exit_2(tmp_path, ck):
    """The sweep's emulation checked once against the real thing: python sft.py, torch imported, exits 2."""
    (tmp_path / "chat.jsonl").write_bytes(CHAT)
    assert_one_line_error(run_cli(SFT + ["--threads", "-1", "--out", "{d}/o"], tmp_path, ck), "--threads")


@pytest.mark.parametrize("argv", [c[1] for c in IN_USE], ids=[c[0] for c in IN_USE])
def test_an_out_in_use_by_another_run_is_refused(argv, tmp_path, ck, cli):
    (tmp_path / "chat.jsonl").write_bytes(CHAT)
    with agent.claim_folder(tmp_path / "o"):  # what a running command on this --out holds (flock: the command's own
        r = run_cli(argv + ["--out", "{d}/o"], tmp_path, ck, cli)  # open of .lock is refused, in this process too)
    assert_one_line_error(r, "in use")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [".lock"]  # it wrote nothing


# ---- --help (issue 43): every flag says what it is and its default, resolved (the help of a None says what it means)

CLIS = ["model.py", "ppo.py", "sft.py", "env.py", "agent.py", "orchestrator.py", "collect.py", "eval.py",
        "tests/bench_ppo.py", "tests/bench_claims.py"]  # reward.py's flags: in ppo.py's and collect.py's


class Built(Exception):
    pass


def built_parser(script, monkeypatch):
    """The parser script's main() builds, caught at its parse_args (nothing runs); help lines not wrapped."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("COLUMNS", "1000")

    def caught(self, *args, **kwargs):
        raise Built(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(Built) as e:
        importlib.import_module(Path(script).stem).main([])
    return e.value.args[0]


def flags(parser):
    """(parser, action) of each optional flag but -h of parser and of its subcommands."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            yield from (x for sub in a.choices.values() for x in flags(sub))
        elif a.option_strings and not isinstance(a, argparse._HelpAction):
            yield parser, a


@pytest.mark.parametrize("script", CLIS)
def test_every_flag_has_a_help_naming_its_default(script, monkeypatch):
    parser = built_parser(script, monkeypatch)
    for p, a in flags(parser):
        text, flag = p._get_formatter()._expand_help(a) if a.help else "", f"{p.prog} {a.dest}"
        assert text.strip(), f"{flag}: no help"
        assert "(default: None)" not in text and "(default: [])" not in text, f"{flag}: what None means: {text}"
        if not (a.required or a.nargs == 0 and not isinstance(a, argparse.BooleanOptionalAction)):  # a switch: off
            said = any(w in a.help for w in ("default:", "None:", "[]:"))
            assert said or f"(default: {a.default})" in text, f"{flag}: no default in {text!r}"


def test_help_says_the_resolved_defaults(monkeypatch):
    import orchestrator
    import ppo
    import sft
    helps = {a.dest: a.help for a in sft.parser()._actions}
    for name, says in (("lr", "None: 2e-5 (ML-Agent), 3e-3 from scratch"), ("epochs", "None: 2 (ML-Agent), 5 from"),
                       ("batch_size", "None: 64 (ML-Agent), 2 from"), ("micro_batch", "None: 1, 2 from scratch"),
                       ("prompt_loss_weight", "None: 0 (ML-Agent)")):
        assert says in helps[name]
    assert "2e-5" in sft.parser().format_help()  # what --help prints
    helps = {a.dest: a.help for a in ppo.parser()._actions}
    for name, value in ppo.TINY.items():  # the Config comments' tiny values are ppo.TINY's, what resolve_defaults sets
        assert type(value)(helps[name].rsplit("tiny: ", 1)[1]) == value, helps[name]
    assert f"None: {ppo.PAPER['actor_lr']:.0e}".replace("e-0", "e-") in helps["actor_lr"]
    assert f"{ppo.TINY_PARAMS // 10**6}M parameters" in helps["grad_checkpointing"]
    train = built_parser("orchestrator.py", monkeypatch)._actions[-1].choices["train"]
    lora = next(a for a in train._actions if a.dest == "lora_rank")
    assert f"from {orchestrator.LARGE // 10**6}M parameters" in lora.help
