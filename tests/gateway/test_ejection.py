"""Outlier ejection: how long a failing replica or peer is kept out of routing."""

import pytest

from meridian.gateway.ejection import EjectionPolicy, Outlier, on_failure, on_success

POLICY = EjectionPolicy(consecutive_failures=1, base=1.0, cap=8.0)


def fail(o: Outlier, at: float, policy: EjectionPolicy = POLICY) -> Outlier:
    return on_failure(o, at, policy)


def test_the_first_failure_ejects_for_the_base_time():
    o = fail(Outlier(), 10.0)
    assert o.ejected(10.0) and o.ejected(10.999)
    assert not o.ejected(11.0)


def test_each_ejection_in_a_streak_doubles_up_to_the_cap():
    o, now, durations = Outlier(), 0.0, []
    for _ in range(6):
        o = fail(o, now)
        durations.append(o.ejected_until - now)
        now = o.ejected_until + 0.5  # fails again soon after coming back
    assert durations == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_failures_while_ejected_do_not_extend_it():
    # Calls that were in flight when it was ejected come back failed too.
    o = fail(Outlier(), 0.0)
    assert fail(fail(o, 0.2), 0.9) == o
    assert not o.ejected(1.0)


def test_ejection_waits_for_the_consecutive_failures_threshold():
    policy = EjectionPolicy(consecutive_failures=3, base=1.0, cap=8.0)
    o = fail(fail(Outlier(), 0.0, policy), 0.1, policy)
    assert not o.ejected(0.1)
    o = fail(o, 0.2, policy)
    assert o.ejected(0.2) and o.ejected_until == pytest.approx(1.2)


def test_a_success_resets_the_failure_streak():
    policy = EjectionPolicy(consecutive_failures=3, base=1.0, cap=8.0)
    o = fail(fail(Outlier(), 0.0, policy), 0.1, policy)
    o = on_success(o, 0.2, policy)
    o = fail(fail(o, 0.3, policy), 0.4, policy)
    assert not o.ejected(0.4)  # two since the success, not four in all
    assert fail(o, 0.5, policy).ejected(0.5)


def test_trouble_is_forgotten_after_cap_seconds_clear():
    o = fail(fail(Outlier(), 0.0), 1.0)  # ejected for 1 s, then 2 s: clear from 3.0
    assert o.ejected_until == 3.0
    assert fail(o, 3.0 + 7.9).ejected_until == pytest.approx(10.9 + 4.0)  # still in the streak
    assert fail(o, 3.0 + 8.0).ejected_until == pytest.approx(11.0 + 1.0)  # from base again


@pytest.mark.parametrize(
    "kw",
    [
        {"consecutive_failures": 0},
        {"base": 0.0},
        {"base": -1.0},
        {"base": 10.0, "cap": 5.0},
    ],
)
def test_policy_rejects_nonsense(kw):
    with pytest.raises(ValueError):
        EjectionPolicy(**kw)
