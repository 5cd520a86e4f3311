"""A small internet built from Linux network namespaces, for the NAT tests and `peerd bench wan`:
a bridge for "the internet", public hosts on it, and home networks behind NAT routers
(iptables MASQUERADE), with optional `tc netem` delay, jitter and bandwidth on every link.

Every namespace is named `pdn<creator pid>-<role>`, so teardown removes exactly what one run
made, and `remove_stale()` removes what runs that died left behind (their creator pid is gone)
without touching anything else on the machine. Every address lies in ranges the topology owns:
the internet is 198.51.100.0/24 (TEST-NET-2, never routed on the real internet) and home `n` is
10.(100+n).0.0/24. Needs root, iproute2 and iptables (scripts/setup.sh installs them).
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

PREFIX = "pdn"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERNET_NET = "198.51.100"  # /24: TEST-NET-2
_NAME = re.compile(rf"^{PREFIX}(\d+)-([a-z0-9]+)$")


class NetnsUnavailable(RuntimeError):
    """This machine cannot build the topology (not root, or a tool is missing)."""


class Nat(enum.StrEnum):
    """How a home router maps its LAN's connections onto its public address."""

    # Linux MASQUERADE keeps the source port when it can and reuses one mapping for every
    # destination (endpoint-independent mapping): TCP hole punching can work through it.
    CONE = "cone"
    # --random-fully gives every connection a random public port (endpoint-dependent mapping,
    # a "symmetric" NAT): the port a peer sees via the relay is not the one a punch comes from.
    SYMMETRIC = "symmetric"


@dataclass(frozen=True)
class Host:
    """A machine of the topology: its namespace and the address its daemon listens on."""

    name: str
    netns: str
    ip: str
    behind_nat: Nat | None = None

    def exec_args(self) -> list[str]:
        """Prefix for a command that runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns]


def check_available() -> None:
    """Raise NetnsUnavailable, saying what is missing, unless we can build topologies."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (run the tests as root)")
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(
                f"`{tool}` is missing: install iproute2 and iptables (scripts/test.sh does it as "
                "root: `apt-get install iproute2 iptables`)"
            )


def _run(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside (only processes of this namespace), then delete it."""
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        for pid in _run("ip", "netns", "pids", name).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _run("ip", "netns", "del", name)


def remove_stale() -> list[str]:
    """Delete namespaces of earlier runs whose creating process is gone; return their names."""
    removed = []
    for name in _namespaces():
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


@dataclass
class Topology:
    """The namespaces of one run. Build with the add_* methods, always end with `down()` (or
    use `topology()` as a context manager)."""

    run_id: int = field(default_factory=os.getpid)
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, Host] = field(default_factory=dict)
    _next_public: int = 10
    _homes: int = 0
    _delayers: list[subprocess.Popen[str]] = field(default_factory=list)

    def _ns(self, role: str) -> str:
        name = f"{PREFIX}{self.run_id}-{role}"
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._in(name, "ip", "link", "set", "lo", "up")
        return name

    def _in(self, netns: str, *args: str) -> str:
        return _run("ip", "netns", "exec", netns, *args)

    @property
    def internet(self) -> str:
        return f"{PREFIX}{self.run_id}-inet"

    def up(self) -> Topology:
        """Create the internet: a namespace holding one bridge that every public port joins."""
        check_available()
        remove_stale()
        self._ns("inet")
        self._in(self.internet, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.internet, "ip", "link", "set", "br0", "up")
        return self

    @staticmethod
    def _internet_port(role: str) -> str:
        """The internet's end (on the bridge) of the link of the host or router named `role`."""
        return f"v{role}"[:15]

    def _plug_into_internet(self, netns: str, role: str, ifname: str, ip: str) -> None:
        port = self._internet_port(role)
        _run(
            "ip", "link", "add", ifname, "netns", netns, "type", "veth",
            "peer", "name", port, "netns", self.internet,
        )  # fmt: skip
        self._in(self.internet, "ip", "link", "set", port, "master", "br0")
        self._in(self.internet, "ip", "link", "set", port, "up")
        self._in(netns, "ip", "addr", "add", f"{ip}/24", "dev", ifname)
        self._in(netns, "ip", "link", "set", ifname, "up")

    def add_public(self, name: str) -> Host:
        """A host with a public address on the internet."""
        ip = f"{INTERNET_NET}.{self._next_public}"
        self._next_public += 1
        netns = self._ns(name)
        self._plug_into_internet(netns, name, "eth0", ip)
        host = Host(name, netns, ip)
        self.hosts[name] = host
        return host

    def add_home(self, name: str, nat: Nat) -> Host:
        """A host on its own LAN behind a NAT router whose WAN side is on the internet. The
        router drops unsolicited inbound connections (nothing is forwarded to the LAN)."""
        self._homes += 1
        lan = f"10.{100 + self._homes}.0"
        wan_ip = f"{INTERNET_NET}.{200 + self._homes}"
        router = self._ns(f"{name}gw")
        self._plug_into_internet(router, f"{name}gw", "wan", wan_ip)
        netns = self._ns(name)
        _run(
            "ip", "link", "add", "lan", "netns", router, "type", "veth",
            "peer", "name", "eth0", "netns", netns,
        )  # fmt: skip
        self._in(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan")
        self._in(router, "ip", "link", "set", "lan", "up")
        self._in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
        if nat is Nat.SYMMETRIC:
            masquerade.append("--random-fully")
        self._in(router, *masquerade)
        # A home router: replies to what the LAN opened pass, nothing else comes in.
        self._in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack",
                 "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        self._in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP")
        # ...and the router itself stays silent (no RST) to what it did not open, as home
        # routers do: a refused punch would otherwise reset the other side's attempt.
        self._in(router, "iptables", "-A", "INPUT", "-i", "wan", "-m", "conntrack",
                 "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        self._in(router, "iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP")
        self._in(netns, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
        self._in(netns, "ip", "link", "set", "eth0", "up")
        self._in(netns, "ip", "route", "add", "default", "via", f"{lan}.1")
        host = Host(name, netns, f"{lan}.2", behind_nat=nat)
        self.hosts[name] = host
        self.hosts[f"{name}gw"] = Host(f"{name}gw", router, wan_ip)
        return host

    def shape(self, host: Host, delay_ms: float, rate_mbit: float, jitter_ms: float = 0.0) -> str:
        """WAN emulation on the host's link: every packet it receives waits `delay_ms` (+-
        jitter) and the link carries at most `rate_mbit` (netem: on the way in; tbf: on the way
        out), so each direction of a link between two shaped hosts costs one delay. Uses `tc
        netem` where the kernel has it; otherwise a `tbf` qdisc for the rate and
        peerd.devtools.netem (an
        NFQUEUE delayer) for the delay. Returns which of the two ("netem" or "nfqueue").

        The delay is on the way in, after the veth: as on a real path, the packets wait in the
        network, not in the sender's stack. Held in the sender's own qdisc or OUTPUT hook they
        would still count against its socket (TCP small queues), and every message of more than
        two segments would wait a whole extra delay for the first ones to leave (measured: a
        3 KB echo took 77.5 ms for a 51 ms path)."""
        # A queue deep enough for a bandwidth-delay product of 100 Mbit/s x 100 ms.
        # netem on the internet's port of this host's link: its way out is the host's way in.
        port = self._internet_port(host.name if host.behind_nat is None else f"{host.name}gw")
        netem = ["tc", "qdisc", "replace", "dev", port, "root", "netem"]
        netem += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        netem += ["rate", f"{rate_mbit}mbit", "limit", "10000"]
        try:
            self._in(self.internet, *netem)
            return "netem"
        except RuntimeError as e:
            if "unknown" not in str(e).lower():
                raise
        self._in(host.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                 "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "400ms")  # fmt: skip
        delayer = subprocess.Popen(
            [*host.exec_args(), sys.executable, "-m", "peerd.devtools.netem", "--queue", "0",
             "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms)],
            stdout=subprocess.PIPE, text=True, cwd=_ROOT,
        )  # fmt: skip
        self._delayers.append(delayer)
        assert delayer.stdout is not None
        if delayer.stdout.readline().strip() != "delaying":
            raise RuntimeError(f"the packet delayer in {host.netns} did not start")
        # --queue-bypass: should the delayer die, packets flow undelayed instead of dropping.
        self._in(host.netns, "iptables", "-t", "mangle", "-A", "PREROUTING", "-i", "eth0",
                 "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass")  # fmt: skip
        return "nfqueue"

    def block(self, a: Host, b: Host) -> None:
        """Drop everything from `a` to `b` (both ways are cut once done for b->a too)."""
        self._in(a.netns, "iptables", "-A", "OUTPUT", "-d", b.ip, "-j", "DROP")

    def down(self) -> None:
        """Delete every namespace of this run (processes inside are killed first)."""
        for delayer in self._delayers:
            delayer.kill()
            delayer.wait(10)
        self._delayers.clear()
        for name in reversed(self.namespaces):
            _delete_namespace(name)
        self.namespaces.clear()
        self.hosts.clear()


def connect_seconds(addresses: Iterable[tuple[str, int]], tries: int = 1) -> list[float]:
    """The seconds each TCP connect from here to `addresses` takes, `tries` times each in turn:
    one round trip (SYN, SYN-ACK, the kernel's alone), what the links' delays realise without
    any daemon's work."""
    times = []
    for ip, port in addresses:
        for _ in range(tries):
            started = time.perf_counter()
            socket.create_connection((ip, port), timeout=10).close()
            times.append(time.perf_counter() - started)
    return times


@contextlib.contextmanager
def topology() -> Iterator[Topology]:
    """A Topology that is torn down however the block ends."""
    topo = Topology()
    try:
        yield topo.up()
    finally:
        topo.down()
