"""The addresses a daemon gives other machines: what it listens on, with "every interface"
(/ip4/0.0.0.0, /ip6/::) spelled out as this machine's own IPs, or what the operator says peers
should dial instead (`peerd start --public-ip`, `--announce-maddrs`: port forwarding, a cloud VM
whose public IP is on no interface). These are the addresses of the banner, of our server
record and of `peerd status`, and what identify and the DHT hand to peers (docs/swarm.md)."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time
from collections.abc import Sequence

import multiaddr

# Interfaces change seldom (DHCP, a VPN coming up); the host asks for its addresses on every
# identify, DHT provide and info answer, so the list is read again at most this often.
INTERFACE_CACHE_S = 30.0
# Any address outside this machine: connecting a UDP socket to it sends nothing, it only asks
# the kernel which source address the default route would use (TEST-NET-1 and its v6 twin).
_PROBE = {4: ("192.0.2.1", 9), 6: ("2001:db8::1", 9)}
_UNSPECIFIED = {"/ip4/0.0.0.0/": 4, "/ip6/::/": 6}

# Addresses of our own we announce at most (a server record holds 32, relayed ones included):
# a machine with many bridges (containers, VPNs) lists its best ones.
MAX_ANNOUNCED = 16

_cache: tuple[float, dict[int, list[str]]] | None = None


class BadAnnounceAddr(ValueError):
    """An --announce-maddrs or --public-ip value peers could not dial."""


def _rank(ip: str, primary: str | None) -> tuple[int, str]:
    """Sort key: the default route's address first, then public, private, and last loopback
    and link-local ones (reachable from this machine alone)."""
    addr = ipaddress.ip_address(ip)
    if ip == primary:
        return (0, ip)
    if addr.is_loopback or addr.is_link_local:
        return (3, ip)
    return (2 if addr.is_private else 1, ip)


def _primary_ip(version: int) -> str | None:
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(_PROBE[version])
        return str(probe.getsockname()[0])
    return None


def interface_ips(version: int) -> list[str]:
    """This machine's IPv4 (`version` 4) or IPv6 addresses another machine may dial, best
    first: the one the default route leaves from, then public, then private ones. Loopback and
    link-local addresses only when there is nothing else (a machine without a network)."""
    global _cache
    now = time.monotonic()
    if _cache is None or now - _cache[0] > INTERFACE_CACHE_S:
        import psutil

        found: dict[int, list[str]] = {4: [], 6: []}
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    ip = a.address.split("%")[0]  # v6 link-local carries its interface
                    found[4 if a.family == socket.AF_INET else 6].append(ip)
        for v, ips in found.items():
            primary = _primary_ip(v)
            ranked = sorted(set(ips), key=lambda ip: _rank(ip, primary))
            ips[:] = [ip for ip in ranked if _rank(ip, primary)[0] < 3] or ranked
        _cache = (now, found)
    return list(_cache[1][version])


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:  # a DNS name
        return False


def expand(addr: str, ips: dict[int, list[str]]) -> list[str]:
    """`addr` with an unspecified IP replaced by each of `ips` (by IP version); any other
    address as it is."""
    for prefix, version in _UNSPECIFIED.items():
        if addr.startswith(prefix):
            return [addr.replace(prefix, f"/ip{version}/{ip}/", 1) for ip in ips[version]]
    return [addr]


def announced_addrs(
    listen: Sequence[str],
    *,
    announce: Sequence[str] = (),
    public_ip: str | None = None,
    ips: dict[int, list[str]] | None = None,
) -> list[str]:
    """The transport addresses (no /p2p part) we give peers, best first. `announce` replaces
    them all; `public_ip` puts that IP with each TCP port we listen on in front of the rest
    (the port a router forwards, or a cloud's 1:1 NAT, is the same as ours)."""
    if announce:
        return [a.split("/p2p/")[0] for a in announce][:MAX_ANNOUNCED]
    if ips is None:
        ips = {4: interface_ips(4), 6: interface_ips(6)}
    out: list[str] = []
    if public_ip:
        version = ipaddress.ip_address(public_ip).version
        for addr in listen:
            parts = addr.split("/")
            if len(parts) >= 5 and parts[3] == "tcp" and not _loopback(parts[2]):
                out.append(f"/ip{version}/{public_ip}/tcp/{parts[4]}")
    for addr in listen:
        out += expand(addr, ips)
    return list(dict.fromkeys(out))[:MAX_ANNOUNCED]


def check_announce(announce: Sequence[str], public_ip: str | None) -> None:
    """Refuse values a peer could not dial, saying what a good one looks like."""
    for text in announce:
        try:
            addr = multiaddr.Multiaddr(text)
            addr.value_for_protocol("tcp")
        except Exception:
            raise BadAnnounceAddr(
                f"--announce-maddrs {text!r}: expected a TCP multiaddr peers can dial, such as "
                "/ip4/203.0.113.7/tcp/31337 or /dns4/peerd.example.org/tcp/31337"
            ) from None
        if any(text.startswith(p) for p in _UNSPECIFIED):
            raise BadAnnounceAddr(
                f"--announce-maddrs {text!r}: 0.0.0.0 and :: mean every interface of a "
                "listener; announce an address peers can dial"
            )
    if public_ip is not None:
        try:
            ip = ipaddress.ip_address(public_ip)
        except ValueError:
            raise BadAnnounceAddr(
                f"--public-ip {public_ip!r}: expected an IP address such as 203.0.113.7"
            ) from None
        if ip.is_unspecified or ip.is_loopback:
            raise BadAnnounceAddr(f"--public-ip {public_ip}: peers elsewhere cannot dial it")
