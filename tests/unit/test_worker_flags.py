"""The worker's command line, parsed in process: bad values are usage errors, never tracebacks."""

from __future__ import annotations

import pytest

from distbatch.launch.flags import build_parser
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


@pytest.mark.parametrize(
    ("given", "size"),
    [
        ("1048576", 1 << 20),
        ("512M", 512 << 20),
        ("8G", 8 << 30),
        ("8g", 8 << 30),
        ("64KiB", 64 << 10),
        ("1.5G", 3 << 29),
        ("2T", 2 << 40),
        ("8GB", 8 << 30),
    ],
)
def test_sizes_take_binary_units(given: str, size: int) -> None:
    assert parse_args(["--max-bytes", given]).max_bytes == size
    assert parse_args(["--shm-max-bytes", given]).shm_max_bytes == size


@pytest.mark.parametrize("given", ["8X", "G", "-1G", "eight"])
def test_a_bad_size_is_a_usage_error(given: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([f"--max-request-bytes={given}"])
    assert info.value.code == 2
    assert "is not a size: use bytes or a unit, e.g. 512M or 8G" in capsys.readouterr().err


def test_every_flag_says_what_it_does_and_its_default() -> None:
    parser = build_parser()
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public list of its flags
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help text"
        assert "default" in action.help, f"{action.option_strings} does not show its default"
    text = parser.format_help()
    assert "DISTBATCH_TOKEN" in text and "512M" in text
    assert "(default: 1G)" in text  # sizes read as sizes
