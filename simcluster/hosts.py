"""The hosts and their network: one network namespace per host, joined by a bridge.

Each host `<prefix>h{i}` is a network namespace with `lo` and `eth0` (one end of a veth pair;
the other end, `<prefix>v{i}`, is a port of the bridge `<prefix>br` in the root namespace) at
address 10.77.0.{i+1}/24. A `tbf` qdisc of rate R sits on both ends of every veth, so each host
has a NIC of rate R each way. The root namespace gets no address on the bridge: traffic flows
only between the hosts' own addresses. Commands run in a host see `DISTBATCH_HOST_ID=<prefix>h{i}`
(abstract Unix sockets are per namespace too, so hosts do not share them).

Needs root, `ip` (iproute2) and `tc`; `check` says whether this machine allows it and why not.
From Python (tests, benchmarks), torn down on leaving the block, whatever happens:

    with Cluster.up(2, rate="200mbit", prefix="dbc") as cluster:
        worker = cluster.popen(1, [sys.executable, "-m", "rpc_server", "--host", cluster.address(1)])
        cluster.run(0, [sys.executable, "client.py"], timeout=60)

`down` finds what to remove by name (`ip netns list`, `ip -o link show`), so it works after a
crash, twice in a row, or with nothing up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_PREFIX = "dbc"
DEFAULT_RATE = "200mbit"
SUBNET = "10.77.0"  # host i is SUBNET.{i+1}/24
MAX_HOSTS = 253  # .1 to .253; .254 and .255 left alone
IFNAMSIZ = 15  # the kernel's limit on an interface name (16 bytes with the NUL)
# Room the suffixes need after the prefix: "v" or "p" and up to 3 digits for the veths, "br".
MAX_PREFIX = IFNAMSIZ - 4
NS_IFNAME = "eth0"  # the host's end of its veth, inside its namespace
TBF_LATENCY = "50ms"  # how long a packet may wait in the qdisc (sets its queue length)
TBF_MIN_BURST = 64 * 1024  # bytes: at least one full GSO packet (64K) passes without splitting
TBF_BURST_SECONDS = 0.01  # else 10 ms at the rate, enough for a 1000 Hz or 250 Hz timer
COMMAND_TIMEOUT = 30.0  # seconds for one `ip` / `tc` command

_PREFIX_PATTERN = re.compile(r"[a-z][a-z0-9]*")
# tc's units: bit/s with SI prefixes; "bps" is bytes per second.
_RATE_PATTERN = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?", re.IGNORECASE)
_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class ClusterError(RuntimeError):
    """The cluster cannot be set up here, or a setup command failed."""


def check_prefix(prefix: str) -> str:
    """`prefix` if it is a lowercase name short enough for every interface name, else ValueError."""
    if not _PREFIX_PATTERN.fullmatch(prefix) or len(prefix) > MAX_PREFIX:
        raise ValueError(
            f"invalid prefix {prefix!r}: a lowercase letter, then letters or digits, "
            f"{MAX_PREFIX} characters at most (interface names are limited to {IFNAMSIZ})"
        )
    return prefix


def rate_bits(rate: str) -> int:
    """A tc-style rate ("200mbit", "1gbit", "10mbps", "5000000") in bits per second."""
    match = _RATE_PATTERN.fullmatch(rate.strip())
    if match is None:
        raise ValueError(f"invalid rate {rate!r}: expected e.g. 200mbit, 1gbit, 100kbit")
    number, si, unit = match.groups()
    bits = float(number) * _SI[si.lower()] * (8 if (unit or "bit").lower() == "bps" else 1)
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit")
    return int(bits)


def tbf_burst(bits_per_second: int) -> int:
    """The bucket size in bytes for a rate: 10 ms of it, at least 64 KiB."""
    return max(TBF_MIN_BURST, int(bits_per_second / 8 * TBF_BURST_SECONDS))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)


def _failed(what: str, error: BaseException) -> str:
    detail = getattr(error, "stderr", None) or str(error)
    return f"{what} failed: {str(detail).strip()}"


def check() -> str | None:
    """Why this machine cannot run a simulated cluster, or None when it can.

    Tries everything `up` needs inside a throwaway namespace (a bridge, a veth pair and a tbf
    qdisc on it), so the check itself leaves the root namespace untouched, and removes it.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root (creating network namespaces, links and qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    namespace = f"dbcheck{os.getpid()}"
    try:
        _ip("netns", "add", namespace)
    except (subprocess.SubprocessError, OSError) as error:
        return _failed("`ip netns add`", error)
    try:
        steps = [
            ("a bridge", ["ip", "-n", namespace, "link", "add", "ckbr", "type", "bridge"]),
            ("a veth pair", ["ip", "-n", namespace, "link", "add", "cka", "type", "veth",
                             "peer", "name", "ckb"]),
            ("bringing it up", ["ip", "-n", namespace, "link", "set", "cka", "up"]),
            ("a tbf qdisc", ["tc", "-n", namespace, "qdisc", "add", "dev", "cka", "root", "tbf",
                             "rate", "200mbit", "burst", "64kb", "latency", TBF_LATENCY]),
        ]  # fmt: skip
        for what, argv in steps:
            try:
                subprocess.run(argv, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
            except (subprocess.SubprocessError, OSError) as error:
                return _failed(what, error)
    finally:
        _ip("netns", "delete", namespace, check=False)
    return None


def namespaces() -> list[str]:
    """Every named network namespace (`ip netns list` prints `name (id: N)` or `name`)."""
    listing = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _links() -> list[str]:
    """Every interface of the root namespace, by name (`ip -o link show`: `N: name@peer: ...`)."""
    names = []
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            names.append(parts[1].strip().split("@")[0])
    return names


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The namespaces and root-namespace links a cluster with `prefix` left (empty: none)."""
    check_prefix(prefix)
    host = re.compile(rf"{re.escape(prefix)}h\d+")
    link = re.compile(rf"{re.escape(prefix)}(?:[vp]\d+|br)")
    return [f"netns {n}" for n in namespaces() if host.fullmatch(n)] + [
        f"link {n}" for n in _links() if link.fullmatch(n)
    ]


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace, veth and bridge named with `prefix`; returns what it removed.

    Idempotent: found by name, so it cleans up after a crash and does nothing when nothing is up.
    Processes still running in a removed namespace keep it alive (unnamed, cut off from the rest:
    its veth goes with the bridge end deleted here); stop them first.
    """
    check_prefix(prefix)
    removed = []
    host = re.compile(rf"{re.escape(prefix)}h\d+")
    for namespace in namespaces():
        if host.fullmatch(namespace):
            _ip("netns", "delete", namespace, check=False)
            removed.append(f"netns {namespace}")
    # Deleting a namespace destroys its veth end and so the pair; delete what is left (a pair
    # whose namespace end never moved, or one kept alive by a process) and then the bridge.
    link = re.compile(rf"{re.escape(prefix)}(?:[vp]\d+)")
    names = _links()
    for name in names:
        if link.fullmatch(name):
            _ip("link", "delete", name, check=False)
            removed.append(f"link {name}")
    if f"{prefix}br" in names:
        _ip("link", "delete", f"{prefix}br", check=False)
        removed.append(f"link {prefix}br")
    return removed


class Cluster:
    """N simulated hosts (network namespaces) behind one bridge, each with a NIC of `rate`.

    Build one with `Cluster.up(...)`; use it as a context manager (`with Cluster.up(2) as c:`)
    or call `down()`, which is idempotent.
    """

    def __init__(self, hosts: int, rate: str = DEFAULT_RATE, prefix: str = DEFAULT_PREFIX) -> None:
        check_prefix(prefix)
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1 to {MAX_HOSTS}, not {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.rate_bits = rate_bits(rate)
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        for name in (self.bridge, self._veth(hosts - 1), self._peer(hosts - 1)):
            if len(name) > IFNAMSIZ:
                raise ValueError(f"interface name {name!r} is over {IFNAMSIZ} characters: shorten the prefix")

    # names and addresses

    def namespace(self, host: int) -> str:
        """Host `host`'s network namespace, also its `DISTBATCH_HOST_ID`."""
        return f"{self.prefix}h{self._index(host)}"

    def address(self, host: int) -> str:
        """Host `host`'s IPv4 address on the cluster's network."""
        return f"{SUBNET}.{self._index(host) + 1}"

    def host_id(self, host: int) -> str:
        return self.namespace(host)

    def set_link(self, host: int, up: bool) -> None:
        """Take host `host`'s link down (its cable pulled: no reset reaches anyone) or back up."""
        subprocess.run(
            ["ip", "link", "set", "dev", self._veth(host), "up" if up else "down"],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def link_stats(self, host: int) -> dict[str, int]:
        """Host `host`'s NIC so far: bytes it received and sent, and packets its two `tbf`
        queues dropped (read at the bridge end and, for its sending queue, in its namespace)."""
        veth = self._veth(host)
        counters = Path("/sys/class/net", veth, "statistics")
        received = int((counters / "tx_bytes").read_text())  # what the bridge end sent to the host
        sent = int((counters / "rx_bytes").read_text())
        inbound = _tbf_drops(["tc", "-s", "-j", "qdisc", "show", "dev", veth])
        outbound = _tbf_drops(
            ["ip", "netns", "exec", self.namespace(host), "tc", "-s", "-j", "qdisc", "show", "dev", NS_IFNAME]
        )
        return {"received": received, "sent": sent, "dropped_in": inbound, "dropped_out": outbound}

    def _veth(self, host: int) -> str:  # the bridge end, in the root namespace
        return f"{self.prefix}v{host}"

    def _peer(self, host: int) -> str:  # the host end before it moves into its namespace
        return f"{self.prefix}p{host}"

    def _index(self, host: int) -> int:
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"no host {host!r}: this cluster has hosts 0 to {self.hosts - 1}")
        return host

    # life cycle

    @classmethod
    def up(cls, hosts: int, rate: str = DEFAULT_RATE, prefix: str = DEFAULT_PREFIX) -> Cluster:
        """Set up `hosts` hosts with NICs of `rate`; on any failure remove what was made and raise."""
        cluster = cls(hosts, rate, prefix)
        reason = check()
        if reason is not None:
            raise ClusterError(f"cannot simulate a cluster on this machine: {reason}")
        existing = leftovers(prefix)
        if existing:
            raise ClusterError(
                f"a cluster with prefix {prefix!r} is already up ({', '.join(existing)}): "
                f"`python -m simcluster down --prefix {prefix}` first"
            )
        try:
            cluster._create()
        except BaseException as error:
            cluster.down()
            if isinstance(error, subprocess.CalledProcessError):
                raise ClusterError(f"{' '.join(error.cmd)} failed: {(error.stderr or '').strip()}") from error
            raise
        return cluster

    @classmethod
    def attach(cls, hosts: int, rate: str = DEFAULT_RATE, prefix: str = DEFAULT_PREFIX) -> Cluster:
        """A handle on a cluster already up (made by `up`, e.g. from the command line)."""
        return cls(hosts, rate, prefix)

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge",
            # Bridged frames skip the root namespace's iptables, whatever rules it has.
            "nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0")  # fmt: skip
        _ip("link", "set", self.bridge, "up")
        tbf = ["root", "tbf", "rate", f"{self.rate_bits}bit", "burst", str(tbf_burst(self.rate_bits)),
               "latency", TBF_LATENCY]  # fmt: skip
        for host in range(self.hosts):
            namespace, veth, peer = self.namespace(host), self._veth(host), self._peer(host)
            _ip("netns", "add", namespace)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", namespace)
            _ip("-n", namespace, "link", "set", peer, "name", NS_IFNAME)
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", NS_IFNAME)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", NS_IFNAME, "up")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _tc("-n", namespace, "qdisc", "add", "dev", NS_IFNAME, *tbf)
            _tc("qdisc", "add", "dev", veth, *tbf)

    def down(self) -> list[str]:
        """Remove this cluster (see the module-level `down`)."""
        return down(self.prefix)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # running commands in a host

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run in host `host`'s namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def environment(self, host: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """`env` (default: this process's environment) with host `host`'s `DISTBATCH_HOST_ID`."""
        merged = dict(os.environ if env is None else env)
        merged["DISTBATCH_HOST_ID"] = self.host_id(host)
        return merged

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in host `host` (keyword arguments go to `subprocess.Popen`; `env` gets the
        host's `DISTBATCH_HOST_ID`)."""
        kwargs["env"] = self.environment(host, kwargs.get("env"))
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run `argv` in host `host` to its end (keyword arguments go to `subprocess.run`: pass a
        `timeout`)."""
        kwargs["env"] = self.environment(host, kwargs.get("env"))
        return subprocess.run(self.command(host, argv), **kwargs)

    def __repr__(self) -> str:
        return f"Cluster(hosts={self.hosts}, rate={self.rate!r}, prefix={self.prefix!r})"


def _tbf_drops(argv: list[str]) -> int:
    """Packets the tbf qdiscs `argv` lists (tc -s -j) have dropped."""
    shown = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT).stdout
    return sum(int(q.get("drops", 0)) for q in json.loads(shown or "[]") if q.get("kind") == "tbf")
