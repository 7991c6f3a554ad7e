"""The agentic-ML reward of ML-Agent: one execution outcome in, one scalar out.

ML-Agent (arXiv:2505.23723, §"Agentic ML-specific reward module") turns every kind of feedback an agent can get from an ML
environment into one number, so that step-wise PPO (ppo.py) can learn from crashes, timeouts and metric changes
alike. The cases, as this file implements them (default config):

    | outcome   | what happened (the cases of agent.py's MLAB loop and env.py's actions)             | reward        |
    |-----------|------------------------------------------------------------------------------------|---------------|
    | "invalid" | no action read after the re-asks (entries missing or out of order, Action not a    | -1 (R_format) |
    |           | tool); an Action Input that is not the tool's arguments (bad JSON, other keys: the |               |
    |           | step happens, not re-asked, as in MLAB); a bad path (outside, too long, "."); line |               |
    |           | numbers that are not integers                                                      |               |
    | "error"   | crash; edit that cannot be applied; train.py without a valid submission.csv; a     | -1            |
    |           | missing file; nothing to undo; over 100 lines to inspect; an action that raises    |               |
    | "corner"  | timeout, out of memory, file-size / CPU limit                                      |  0 (R_corner) |
    | "neutral" | a valid non-editing action: List Files, Inspect Script Lines, a successful         |  0            |
    |           | Execute Script, a copy or undo that leaves train.py alone, an edit of a non-script |               |
    | "final"   | Final Answer (valid, non-editing)                                                  |  0            |
    | "edit"    | a script edited and run, a copy onto or an undo of train.py (0 unless train.py's   | R_perf, below |
    |           | score changed)                                                                     |               |

`R_perf = clip(alpha * sign * (m_new - m_prev) / |m_best - m_init|, -clip, clip)`. A response re-asked is scored by
its last answer; an Action Input that MLAB's fallback reads (a trailing comma, triple quotes) is an action like any.

What an "edit" is paid for (our rule; the paper says "the metric change" without saying of which file):
- `m_prev` and `m_new` are the scores of the **submission** (the workspace's train.py, which Final Answer submits)
  before and after the step, never of a side file. An edit saved under another name leaves the submission as it was
  (`m_new == m_prev`) and earns 0, however good the side file is and however often it is saved again; copying that
  file onto train.py, or editing train.py itself, is what reaches the submission and is paid. env.Env sets these
  numbers (`StepResult.metric_prev`, `metric_new`), and Undo Edit Script of train.py is an "edit" too.
- Each improvement is paid once. With the scaled difference the rewards of an episode's edits telescope: their sum is
  (before clipping) the submission's final change from m_init, so an edit undone costs what it earned and redoing
  it earns it back, never twice. The binary ablation has no such sum, so it pays +1 only for a **new best** score of
  the submission in the episode (`m_high`, env's `StepResult.metric_high`: the best submission score before the
  step, m_init at the start); undoing a bad edit and making it again earns nothing.

`sign` is +1 when higher is better and -1 otherwise, so an improvement is always positive. `m_init` is the score of
the task's starter script and `m_best` the best known score (the top of the task's leaderboard), so the scale is "the
fraction of the gap between the baseline and the best human-achievable score that this edit closed".

Where the paper is silent (its equation fixes neither a scale factor nor a clip), this file chooses, and says so:
- `alpha = 1` and `clip = 1`: an edit that closes the whole baseline-to-best gap earns the same magnitude as an error
  costs; the three cases then share the range [-1, 1].
- `m_best == m_init` (the baseline already ties the leaderboard top) leaves the scale undefined; we fall back to the
  relative change, dividing by `|m_init|`, and by 1 when that is 0 too.
- A successful edit without a metric (`m_new` or `m_prev` missing) is treated as neutral (0).

The three ablation switches follow the paper's Table 3 (arXiv:2505.23723, "Effectiveness of agentic-ML specific reward
module"):
- `binary_performance`: the scaled difference becomes +1 when the edit set a new best submission score and 0
  otherwise (the paper: +1 for an improvement; "new best" is our reading that pays each improvement once);
- `format_term=False`: no format term, invalid actions get 0 instead of -1;
- `corner_term=False`: no corner-case term, corner cases are penalised like errors (-1).

To change the reward for an assignment, edit `reward()` below and run `pytest tests/test_reward.py`: the tests pin the
reference numbers of every case, so a failing line shows exactly what moved.
"""
import hashlib
from dataclasses import dataclass, fields
from pathlib import Path

OUTCOMES = ("invalid", "error", "corner", "neutral", "final", "edit")
# This file's code, in every RewardConfig: collect.py and ppo.py never mix rewards of an older reward.py with new ones
CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


@dataclass(frozen=True)
class RewardConfig:
    """Knobs of the reward; defaults are this project's choices where the paper is silent."""
    alpha: float = 1.0                # scale on the normalised metric change (paper: unspecified)
    clip: float = 1.0                 # |reward| bound for edits (paper: unspecified)
    binary_performance: bool = False  # ablation: +1 if the edit set a new best score, else 0
    format_term: bool = True          # ablation off: invalid actions get 0 instead of -1
    corner_term: bool = True          # ablation off: corner cases get -1 like errors
    code: str = CODE                  # sha256 of reward.py (12 hex digits): a record of another code differs


def reward(outcome, m_prev=None, m_new=None, m_init=None, m_best=None, higher_is_better=True,
           config=RewardConfig(), m_high=None):
    """The step reward R(s_t, a_t) of ML-Agent for one executed action; see the table in the module docstring.
    m_prev, m_new: the submission's score before and after; m_high: its best score in the episode before the step
    (None: m_prev), which only the binary ablation reads."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}")
    if outcome == "invalid":                                   # a_t not in A_valid
        return -1.0 if config.format_term else 0.0
    if outcome == "error":                                     # F_error
        return -1.0
    if outcome == "corner":                                    # F_corner
        return 0.0 if config.corner_term else -1.0
    if outcome in ("neutral", "final") or m_new is None or m_prev is None:  # A_valid \ A_edit
        return 0.0
    sign = 1.0 if higher_is_better else -1.0                   # improvement is positive either way
    gain = sign * (m_new - m_prev)
    if config.binary_performance:                              # +1 for a new best submission only
        high = m_prev if m_high is None else m_high
        return 1.0 if sign * (m_new - high) > 0 else 0.0
    scale = abs(m_best - m_init) if m_best is not None and m_init is not None else 0.0
    if scale == 0.0:                                           # m_best == m_init: fall back to relative change
        scale = abs(m_init) if m_init else 1.0
    return max(-config.clip, min(config.clip, config.alpha * gain / scale))


# ---- command line
# One place for the reward flags of ppo.py, collect.py (and any CLI that computes step rewards); a run records
# dataclasses.asdict(config) beside its rewards, and from_record reads such a record back.
_DEFAULTS = {f.name: f.default for f in fields(RewardConfig)}


def add_flags(parser):
    """--reward-alpha, --reward-clip and the three ablation switches of ML-Agent Table 3 on an argparse parser."""
    g = parser.add_argument_group("reward (reward.py; the switches: ablations of ML-Agent Table 3)")
    g.add_argument("--reward-alpha", type=float, default=_DEFAULTS["alpha"], metavar="FLOAT",
                   help="scale on the normalised metric change of an edit")
    g.add_argument("--reward-clip", type=float, default=_DEFAULTS["clip"], metavar="FLOAT",
                   help="bound on |reward| of an edit")
    g.add_argument("--binary-performance", action="store_true", help="+1 for a new best submission score, else 0")
    g.add_argument("--no-format-term", action="store_true", help="invalid actions get 0 instead of -1")
    g.add_argument("--no-corner-term", action="store_true", help="corner cases get -1 like errors instead of 0")


def from_flags(args) -> RewardConfig:
    """The RewardConfig of the flags of `add_flags`; ValueError (one line, naming the flag) for a bad value."""
    if not 0 < args.reward_alpha < float("inf"):  # also refuses nan
        raise ValueError(f"--reward-alpha must be a positive number, not {args.reward_alpha}")
    if not args.reward_clip > 0:
        raise ValueError(f"--reward-clip must be positive, not {args.reward_clip}")
    return RewardConfig(alpha=args.reward_alpha, clip=args.reward_clip, binary_performance=args.binary_performance,
                        format_term=not args.no_format_term, corner_term=not args.no_corner_term)


def mismatch(recorded: RewardConfig, given: RewardConfig) -> str:
    """The words of a refusal to mix rewards of two configs: which code or flags differ."""
    return f"reward.py's code {recorded.code}, now {given.code} (reward.py was changed since)" \
        if recorded.code != given.code else f"{recorded}, the flags give {given}"


def from_record(record) -> RewardConfig:
    """The RewardConfig a run recorded as asdict(config); None (a record older than the key) or a missing field:
    the defaults (a record without "code" counts as this code)."""
    return RewardConfig(**{**_DEFAULTS, **(record or {})})
