"""What several test files share: `cli`, a command line run in this process as `python script.py ...` would run it.

A bad-input sweep that starts one python (and torch) per case spends seconds a case on the start alone; `cli` calls
the script's main(argv) here instead and gives back what the fresh process would have: its exit status (SystemExit's
code, a message given to sys.exit printed with status 1, an uncaught exception's traceback on stderr with status 1),
its stdout and its stderr, with each warning the run raised printed there as Python prints it. What the run changes
in this process (the working folder, os.environ, torch's threads, the random generators, signal handlers) is put back.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import subprocess
import sys
import traceback
import warnings

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads -n here
def pytest_cmdline_main(config):
    """One test file named (`pytest tests/test_reward.py`): one process and no durations table, which addopts
    (pyproject.toml) sets for the suite; an explicit -n or --durations is kept."""
    files = {str(a).split("::")[0] for a in config.args}
    given = any(a.startswith(("-n", "--numprocesses", "--durations")) for a in config.invocation_params.args)
    if len(files) == 1 and files.pop().endswith(".py") and not given:
        config.option.numprocesses, config.option.durations = 0, None


def run_main(main, argv, cwd=None) -> subprocess.CompletedProcess:
    """main([str(a) for a in argv]) in this process -> CompletedProcess(argv, returncode, stdout, stderr)."""
    import numpy as np
    import torch
    argv = [str(a) for a in argv]
    saved = (os.getcwd(), dict(os.environ), torch.get_num_threads(), torch.get_rng_state(), random.getstate(),
             np.random.get_state(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    out, err, code = io.StringIO(), io.StringIO(), 0
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        # a fresh interpreter's filters: shown once per place, the deprecation, import and resource kinds hidden
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for kind in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", kind)
        try:
            if cwd is not None:
                os.chdir(cwd)
            main(argv)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except Exception:  # what the interpreter would print before exiting 1
            traceback.print_exc()
            code = 1
        finally:
            os.chdir(saved[0])
            os.environ.clear()
            os.environ.update(saved[1])
            torch.set_num_threads(saved[2])
            torch.set_rng_state(saved[3])
            random.setstate(saved[4])
            np.random.set_state(saved[5])
            for s, handler in saved[6].items():
                signal.signal(s, handler)
    stderr = err.getvalue() + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
                                      for w in caught)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), stderr)


@pytest.fixture
def cli():
    """run_main: a script's main(argv) run here as its command line would run (see the module's docstring)."""
    return run_main


BAD_MODELS = ["{d}/nope", "runs/ckpt/nope", "README.md", "nobody/no-such-model", "gpt-4o-mini"]  # issue 43


@pytest.fixture
def no_endpoint(monkeypatch, tmp_path):
    """No endpoint configured, the HF hub unreachable and its cache empty: -> the URLs any request was sent to
    besides the hub's (a request to the hub fails as offline)."""
    import requests
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path.parent / f"{tmp_path.name}-hf"))
    sent = []

    def request(self, method, url, *a, **kw):
        if not url.startswith("http://hub.invalid/"):
            sent.append(url)
        raise requests.ConnectionError(f"offline: {url}")
    monkeypatch.setattr(requests.Session, "request", request)
    return sent


def assert_bad_models_refused(main, argv, tmp_path, sent, files=None, bad_models=BAD_MODELS):
    """main(argv with {m}: each bad model name, {d}: tmp_path) run in tmp_path (README.md there, `files` too): exit 2,
    one stderr line `prog: error: --flag: ...` naming the name, no request sent, no file made."""
    (tmp_path / "README.md").write_text("not a model\n")
    for rel, data in (files or {}).items():
        (tmp_path / rel).write_bytes(data)
    flag = argv[argv.index("{m}") - 1]
    listing = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for bad in bad_models:
        name = bad.format(d=tmp_path)
        r = run_main(main, [a.format(m=name, d=tmp_path) for a in argv], cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and f": error: {flag}: " in lines[0] and name in lines[0], \
            (name, r.stderr)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == listing, name
        assert sent == [], name
