"""Reference numbers for reward.py, one case per line.

If you change the reward (a course assignment, an ablation), these are the lines that tell you what moved. Each number
is worked out by hand in the comment next to it. The last tests cover the command-line flags (add_flags / from_flags)
that ppo.py and collect.py share, and from_record, which reads a run's recorded config back.
"""
import argparse

import pytest

from reward import OUTCOMES, RewardConfig, add_flags, from_flags, from_record, reward

# An accuracy task: starter 0.80, leaderboard top 0.90 (gap 0.10).
ACC = dict(m_init=0.80, m_best=0.90, higher_is_better=True)
# An MAE task: starter 50, leaderboard top 40 (gap 10); lower is better.
MAE = dict(m_init=50.0, m_best=40.0, higher_is_better=False)


@pytest.mark.parametrize("outcome, expected", [
    ("invalid", -1.0),   # R_format: unparsable / unknown action / bad arguments
    ("error", -1.0),     # crash, edit that cannot be applied, invalid submission
    ("corner", 0.0),     # timeout, out of memory, resource limit
    ("neutral", 0.0),    # valid non-editing action
    ("final", 0.0),      # Final Answer is a valid non-editing action
])
def test_non_edit_cases(outcome, expected):
    assert reward(outcome, m_prev=0.8, m_new=0.85, **ACC) == expected


@pytest.mark.parametrize("m_prev, m_new, expected", [
    (0.80, 0.85, 0.5),     # (0.85 - 0.80) / 0.10 = 0.5
    (0.85, 0.80, -0.5),    # a worse edit is negative
    (0.80, 0.80, 0.0),     # no change
    (0.80, 0.95, 1.0),     # 1.5 clipped to 1
    (0.80, 0.20, -1.0),    # -6 clipped to -1
])
def test_edit_higher_is_better(m_prev, m_new, expected):
    assert reward("edit", m_prev=m_prev, m_new=m_new, **ACC) == pytest.approx(expected)


@pytest.mark.parametrize("m_prev, m_new, expected", [
    (50.0, 47.0, 0.3),     # -1 * (47 - 50) / 10 = 0.3: a lower MAE is an improvement
    (47.0, 50.0, -0.3),    # a higher MAE is a regression
    (50.0, 20.0, 1.0),     # 3.0 clipped to 1
])
def test_edit_lower_is_better(m_prev, m_new, expected):
    assert reward("edit", m_prev=m_prev, m_new=m_new, **MAE) == pytest.approx(expected)


def test_edit_when_best_equals_init_uses_relative_change():
    # |m_best - m_init| = 0: the scale falls back to |m_init| = 0.8, so (0.84 - 0.80) / 0.8 = 0.05
    assert reward("edit", m_prev=0.80, m_new=0.84, m_init=0.8, m_best=0.8) == pytest.approx(0.05)
    # ... and to 1 when m_init is 0 as well: 0.3 - 0.0 = 0.3
    assert reward("edit", m_prev=0.0, m_new=0.3, m_init=0.0, m_best=0.0) == pytest.approx(0.3)


def test_edit_without_metric_is_neutral():
    assert reward("edit", m_prev=None, m_new=0.9, **ACC) == 0.0
    assert reward("edit", m_prev=0.8, m_new=None, **ACC) == 0.0


def test_alpha_and_clip():
    cfg = RewardConfig(alpha=2.0, clip=5.0)
    assert reward("edit", m_prev=0.80, m_new=0.85, config=cfg, **ACC) == pytest.approx(1.0)   # 2 * 0.5
    assert reward("edit", m_prev=0.80, m_new=0.95, config=cfg, **ACC) == pytest.approx(3.0)   # 2 * 1.5, under 5


def test_ablation_binary_performance():
    cfg = RewardConfig(binary_performance=True)
    assert reward("edit", m_prev=0.80, m_new=0.81, config=cfg, **ACC) == 1.0
    assert reward("edit", m_prev=0.80, m_new=0.80, config=cfg, **ACC) == 0.0
    assert reward("edit", m_prev=0.80, m_new=0.70, config=cfg, **ACC) == 0.0
    assert reward("edit", m_prev=50.0, m_new=49.0, config=cfg, **MAE) == 1.0   # lower MAE improved


def test_ablation_no_format_term():
    cfg = RewardConfig(format_term=False)
    assert reward("invalid", config=cfg) == 0.0
    assert reward("error", config=cfg) == -1.0      # errors are still penalised


def test_ablation_no_corner_term():
    cfg = RewardConfig(corner_term=False)
    assert reward("corner", config=cfg) == -1.0
    assert reward("neutral", config=cfg) == 0.0


def test_every_outcome_is_bounded_by_clip():
    for outcome in OUTCOMES:
        for m_new in (0.0, 0.5, 0.8, 1.0):
            assert -1.0 <= reward(outcome, m_prev=0.8, m_new=m_new, **ACC) <= 1.0


def test_unknown_outcome_is_rejected():
    with pytest.raises(ValueError, match="unknown outcome"):
        reward("crashed")


def test_binary_pays_only_a_new_best_submission():
    cfg = RewardConfig(binary_performance=True)
    # the submission went 0.80 -> 0.85 (paid), was undone to 0.80; redoing 0.80 -> 0.85 is no new best (m_high 0.85)
    assert reward("edit", m_prev=0.80, m_new=0.85, m_high=0.85, config=cfg, **ACC) == 0.0
    assert reward("edit", m_prev=0.80, m_new=0.86, m_high=0.85, config=cfg, **ACC) == 1.0   # beyond it: paid
    assert reward("edit", m_prev=50.0, m_new=44.0, m_high=45.0, config=cfg, **MAE) == 1.0   # 44 < 45: a new best
    # the scaled reward ignores m_high: its sum over an episode telescopes to the final change
    assert reward("edit", m_prev=0.80, m_new=0.85, m_high=0.85, **ACC) == pytest.approx(0.5)


def parse(argv):
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(argv)


def test_flags_give_the_matching_config():
    assert from_flags(parse([])) == RewardConfig()  # the defaults are RewardConfig's
    got = from_flags(parse(["--binary-performance", "--no-format-term", "--reward-alpha", "2"]))
    assert got == RewardConfig(alpha=2.0, binary_performance=True, format_term=False)
    assert from_flags(parse(["--no-corner-term", "--reward-clip", "3"])) == RewardConfig(clip=3.0, corner_term=False)


@pytest.mark.parametrize("argv, flag", [(["--reward-clip", "0"], "--reward-clip"),
                                        (["--reward-alpha", "-1"], "--reward-alpha"),
                                        (["--reward-alpha", "nan"], "--reward-alpha")])
def test_flags_out_of_range_raise_naming_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        from_flags(parse(argv))


def test_a_record_reads_back_and_a_missing_one_is_the_default():
    cfg = RewardConfig(clip=2.0, corner_term=False)
    assert from_record({"alpha": 1.0, "clip": 2.0, "binary_performance": False, "format_term": True,
                        "corner_term": False}) == cfg
    assert from_record(None) == RewardConfig() and from_record({"clip": 2.0}) == RewardConfig(clip=2.0)
