"""Passive outlier ejection, per replica and per peer (plain values, no clock of its own).

A candidate whose calls fail `consecutive_failures` times in a row (refused, unreachable, timed
out) is ejected from routing for `base` seconds, doubling with each ejection up to `cap`. A
success resets the failure streak; a candidate that has stayed clear for `cap` seconds starts again
from `base`. A replica that comes back (its load stream reconnects) is forgiven at once. Routing
ignores ejections that would leave no candidate (see routing._not_ejected).
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EjectionPolicy:
    consecutive_failures: int = 1  # a refused call is strong evidence: the worker said "not me"
    base: float = 1.0  # seconds
    cap: float = 30.0  # seconds

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1 or not 0 < self.base <= self.cap:
            raise ValueError("consecutive_failures >= 1 and 0 < base <= cap")


@dataclass(frozen=True)
class Outlier:
    failures: int = 0  # consecutive
    ejections: int = 0  # times ejected in the current streak of trouble
    ejected_until: float = float("-inf")

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until


def on_failure(o: Outlier, now: float, policy: EjectionPolicy) -> Outlier:
    if o.ejected(now):
        return o  # calls that were already in flight when it was ejected
    o = _forget_old_trouble(o, now, policy)
    failures = o.failures + 1
    if failures < policy.consecutive_failures:
        return replace(o, failures=failures)
    duration = min(policy.base * 2**o.ejections, policy.cap)
    return Outlier(failures=0, ejections=o.ejections + 1, ejected_until=now + duration)


def on_success(o: Outlier, now: float, policy: EjectionPolicy) -> Outlier:
    return replace(_forget_old_trouble(o, now, policy), failures=0)


def _forget_old_trouble(o: Outlier, now: float, policy: EjectionPolicy) -> Outlier:
    if o.ejections and now - o.ejected_until >= policy.cap:
        return replace(o, ejections=0)
    return o
