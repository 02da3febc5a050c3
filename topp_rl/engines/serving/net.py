"""Loopback and port helpers shared by the launched servers and the weight broadcast: what binds where."""

import ipaddress
import random
import socket
import sys
from pathlib import Path

LOOPBACK_IFNAME = "lo" if sys.platform == "linux" else "lo0"  # what GLOO_ / NCCL_SOCKET_IFNAME pin to

# Where `free_port` draws from: below the kernel's ephemeral range (Linux's default starts at 32768), and below
# 22000-29999, where SGLang draws its scheduler's port for the same reason, so the two draws never meet.
PICK_RANGE = (10000, 22000)
_DRAWS = 64
_OS_RANDOM = random.SystemRandom()  # not `random`'s state: runs seeded alike (seed_everything) would draw alike


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on `host`, for a server that binds it seconds later. Drawn from `PICK_RANGE`:
    the kernel hands out ports of its ephemeral range on its own, to every bind to port 0 (gloo's listeners, a
    server's helpers) and every outgoing connection, so a port from there can be taken between this pick and the
    server's bind. The kernel's own choice only where that range is too narrow or all taken."""
    low, high = PICK_RANGE[0], min(PICK_RANGE[1], ephemeral_low())
    draws = _OS_RANDOM.sample(range(low, high), _DRAWS) if high - low >= _DRAWS else []
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in draws:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: net.ipv4.ip_local_port_range; 32768 elsewhere, the
    Linux default, under macOS's 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def http_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
