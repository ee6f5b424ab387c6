"""Addresses: whether a host is only this machine (the servers bind beyond it only when told to)."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (a name that does not resolve is not)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
