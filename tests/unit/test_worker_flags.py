"""The worker's command line, parsed in process: bad values are usage errors, never tracebacks."""

from __future__ import annotations

import pytest

from rpc_server.__main__ import parse_args


@pytest.mark.parametrize("given", ["info", "INFO", "Info"])
def test_log_level_in_any_case(given: str) -> None:
    assert parse_args(["--log-level", given]).log_level == "INFO"


def test_log_level_defaults_to_warning() -> None:
    assert parse_args([]).log_level == "WARNING"


def test_an_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--log-level", "LOUD"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'LOUD'" in err and "DEBUG" in err and "Traceback" not in err
