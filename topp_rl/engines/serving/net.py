"""Loopback and port helpers shared by the launched servers and the weight broadcast: what binds where."""

import ipaddress
import socket
import sys

LOOPBACK_IFNAME = "lo" if sys.platform == "linux" else "lo0"  # what GLOO_ / NCCL_SOCKET_IFNAME pin to


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
