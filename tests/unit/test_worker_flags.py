"""The worker's command line, parsed in process: bad values are usage errors, never tracebacks."""

from __future__ import annotations

import re
import socket

import pytest

from distbatch.launch import spawn_workers
from distbatch.launch.flags import (
    GROUP_OPTIONS,
    LOCAL_GROUP_OPTIONS,
    build_parser,
    check_launcher_flags,
    parse_flags,
)
from distbatch.serving.addresses import check_port
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


# --------------------------------------------------------------------------- no abbreviations


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max", "1G"], "unknown worker flag '--max': did you mean one of --max-bytes, --max-request"),
        (["--max=1G"], "unknown worker flag '--max': did you mean one of --max-bytes"),
        (["--max-byte", "1G"], r"unknown worker flag '--max-byte': did you mean --max-bytes\?"),
        (["--max-bites", "1G"], r"unknown worker flag '--max-bites': did you mean --max-bytes\?"),
        (["--no-such-flag"], r"^unknown worker flag '--no-such-flag'$"),
        (["1G"], r"unexpected worker arguments \['1G'\]"),
    ],
)
def test_parse_flags_names_an_unknown_or_abbreviated_flag_and_never_exits(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`parse_flags` promises a ValueError, never an exit: argparse's ambiguous-abbreviation
    path (`--max`) used to exit 2, and `--max-byte` was silently taken for `--max-bytes`."""
    with pytest.raises(ValueError, match=message):
        parse_flags(flags)
    assert capsys.readouterr().err == ""  # no usage printed either


@pytest.mark.parametrize("given", ["--max", "--max-byte", "--ran"])
def test_the_worker_command_takes_no_abbreviation(given: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([given, "1"])
    assert info.value.code == 2
    assert f"unrecognized arguments: {given} 1" in capsys.readouterr().err


def test_flags_spelled_out_still_parse() -> None:
    args = parse_flags(["--max-bytes", "1G", "--max-threads=8", "--port", "0", "--rank=1", "--world-size=2"])
    assert (args.max_bytes, args.max_threads, args.port, args.rank) == (1 << 30, 8, 0, 1)


# --------------------------------------------------------------------------- ports


@pytest.mark.parametrize("port", ["0", "1", "8080", "65535"])
def test_ports_from_0_to_65535_are_taken(port: str) -> None:
    assert parse_args(["--port", port]).port == int(port)
    assert parse_flags([f"--port={port}"]).port == int(port)


@pytest.mark.parametrize("port", ["65536", "99999", "70000", "-1", "http", "1.5"])
def test_a_port_out_of_range_is_a_usage_error_naming_it(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """99999 used to listen on 34463 (the socket layer takes it modulo 65536); -1 was an
    OverflowError traceback."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--port", port])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: '{port}' is not a port: use 0 to 65535" in err and "Traceback" not in err
    with pytest.raises(ValueError, match=f"'{port}' is not a port: use 0 to 65535"):
        parse_flags([f"--port={port}"])


@pytest.mark.parametrize("port", [65536, 70000, -1, 1.5, "80", True, None])
def test_a_server_refuses_a_port_it_cannot_listen_on(port: object) -> None:
    with pytest.raises(ValueError, match=f"port {re.escape(repr(port))} is not a port to listen on"):
        check_port(port)
    assert check_port(0) == 0 and check_port(65535) == 65535


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "40123"], "--port is the group's to choose: each worker listens on a free port"),
        (["--port=0"], "--port is the group's to choose"),
        (["--address-file", "/tmp/x"], "--address-file would be written by every worker"),
        (["--exit-with-parent", "1"], "--exit-with-parent is the group's to set"),
        (["--rank", "1"], "--rank is the group's to set"),
    ],
)
def test_a_local_group_refuses_the_flags_it_sets_itself(args: list[str], message: str) -> None:
    decided = {**LOCAL_GROUP_OPTIONS, **GROUP_OPTIONS}
    with pytest.raises(ValueError, match=message):
        check_launcher_flags(args, decided)
    assert check_launcher_flags(["--host", "0.0.0.0"], decided).host == "0.0.0.0"  # a bind address: fine


def _a_port() -> int:
    """A port number the kernel picks (port 0), released at once: nothing listens on it here."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("form", ["separate", "joined", "repeated"])
def test_several_workers_cannot_share_one_port(form: str) -> None:
    port = str(_a_port())
    args = {
        "separate": ["--port", port],
        "joined": [f"--port={port}"],
        "repeated": ["--port", "0", "--port", port],  # the last one counts
    }[form]
    with pytest.raises(ValueError, match="2 workers cannot all listen on port"):
        spawn_workers(2, args=args)


def test_a_data_dir_names_the_workers_rank() -> None:
    from rpc_server.__main__ import server_config

    config = server_config(parse_args(["--data-dir", "/data/w{rank}", "--rank", "3", "--world-size", "4"]))
    assert config.data_dir == "/data/w3" and not config.sync_writes
    assert server_config(parse_args(["--data-dir", "/d", "--sync"])).sync_writes


def test_sync_without_a_data_dir_is_refused() -> None:
    from rpc_server.__main__ import server_config

    with pytest.raises(ValueError, match="--sync needs --data-dir"):
        server_config(parse_args(["--sync"]))


def test_a_controller_to_tell_needs_a_data_dir_and_an_address() -> None:
    from rpc_server.__main__ import server_config

    config = server_config(parse_args(["--data-dir", "/d", "--controller", "10.0.0.2:7000"]))
    assert config.controller == "10.0.0.2:7000"
    with pytest.raises(ValueError, match="--controller needs --data-dir"):
        server_config(parse_args(["--controller", "10.0.0.2:7000"]))
    with pytest.raises(ValueError, match="node"):
        server_config(parse_args(["--data-dir", "/d", "--controller", "http://10.0.0.2:7000/x"]))


def test_the_transferqueue_backend_starts_durable_workers_when_asked() -> None:
    from distbatch.transferqueue.options import BackendOptions

    options = BackendOptions.from_config({"data_dir": "/data/w{rank}", "sync_writes": True, "capacity": "1G"})
    assert options.worker_args() == ["--max-bytes", str(1 << 30), "--data-dir", "/data/w{rank}", "--sync"]
    assert BackendOptions.from_config(options.as_config()) == options
    assert BackendOptions().worker_args() == []
