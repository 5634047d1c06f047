from __future__ import annotations

import argparse

import pytest

from meridian.errors import UserError
from meridian.operator.cli import add_arguments, settings_from


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meridian operator")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_namespaces_or_all_namespaces_is_required():
    with pytest.raises(SystemExit):
        parse()
    with pytest.raises(SystemExit):
        parse("--namespace", "a", "--all-namespaces")


def test_flags_become_settings():
    settings = settings_from(
        parse(
            "-n",
            "serving",
            "-n",
            "batch",
            "--no-leader-election",
            "--liveness",
            "http://0.0.0.0:8080/healthz",
        )
    )
    assert settings.namespaces == ("serving", "batch")
    assert not settings.all_namespaces and not settings.leader_election
    assert settings.liveness == "http://0.0.0.0:8080/healthz"
    assert settings_from(parse("--all-namespaces")).all_namespaces


def test_nonsense_values_are_a_user_error():
    with pytest.raises(UserError, match="resync_seconds"):
        settings_from(parse("-A", "--resync-seconds", "0"))
