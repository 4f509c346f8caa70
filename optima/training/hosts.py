"""The hosts of a multi-node training, checked on the driver before anything starts (ssh launcher).

torchrun's static rendezvous listens on ``--main_process_ip`` on the first node, and every other node connects to
it; the driver (this process: the servers, rank 0's launcher) runs on the first node. So before a run starts:

* each host is resolved as ssh resolves it (``ssh -G HOST``: ``user@host``, aliases and ``HostName`` of
  ``~/.ssh/config``; ``optima.training.nodes.ssh_resolver``), then to addresses (``getaddrinfo``); a host that
  does not resolve is refused;
* the first host must resolve to an address that is not loopback (``localhost``, or a hostname that
  ``/etc/hosts`` maps to 127.0.1.1 as Ubuntu does), or the other nodes would wait on their own loopback until the
  rendezvous times out; that address is the ``--main_process_ip`` every node gets;
* the first host must be this machine: one of its addresses can be bound here;
* no other host may be loopback either.

``check_hosts`` returns the main address and every problem; ``verify_hosts`` raises them as one ``RecipeError``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from optima.config import RecipeError


def bare_host(host: str) -> str:
    """``host`` without a ``user@``: the destination when ssh is not asked (``optima.training.nodes.ssh_resolver``
    asks ``ssh -G``)."""
    return host.rsplit("@", 1)[-1]


def host_addresses(name: str) -> list[str]:
    """The addresses ``name`` resolves to here (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback


def is_local(address: str) -> bool:
    """Whether ``address`` belongs to this machine: a socket can be bound to it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Resolver:
    """How hosts are resolved (replaced in tests): ssh's destination, its addresses, whether one is local."""

    destination: Callable[[str], str] = bare_host
    addresses: Callable[[str], list[str]] = host_addresses
    local: Callable[[str], bool] = is_local


def check_hosts(hosts: Sequence[str], resolver: Resolver = Resolver()) -> tuple[str | None, list[str]]:
    """``(main address, problems)`` of the training hosts (module docstring); the address is None on a problem.

    Every host on this machine's loopback (a rehearsal of several nodes on one machine) is one machine: its
    loopback is the rendezvous.
    """
    names = [resolver.destination(host) for host in hosts]
    resolved = [resolver.addresses(name) for name in names]
    if all(addresses and all(is_loopback(a) for a in addresses) for addresses in resolved):
        return resolved[0][0], []
    problems, main = [], None
    for rank, (host, name, addresses) in enumerate(zip(hosts, names, resolved, strict=True)):
        via = f"{host!r}" + (f" (ssh: {name})" if name != host else "")
        if not addresses:
            problems.append(f"train_hosts[{rank}] {via} does not resolve on the driver: name a host it can reach")
            continue
        reachable = [a for a in addresses if not is_loopback(a)]
        if not reachable:
            problems.append(
                f"train_hosts[{rank}] {via} resolves to {addresses[0]}, a loopback address: the other nodes cannot "
                "reach it (their own loopback answers); name the host by an address they reach, or map its name "
                "to its network address (/etc/hosts)"
            )
            continue
        if rank == 0:
            if not any(resolver.local(a) for a in reachable):
                problems.append(
                    f"train_hosts[0] {via} resolves to {reachable[0]}, not an address of this machine: the driver "
                    "(its servers and rank 0) runs on the first host; run the script there, or list this machine "
                    "first"
                )
            else:
                main = reachable[0]
    return (main if not problems else None), problems


def verify_hosts(hosts: Sequence[str], resolver: Resolver = Resolver()) -> str:
    """The main address of an ssh-launched multi-node training; every problem as one ``RecipeError``."""
    main, problems = check_hosts(hosts, resolver)
    if problems or main is None:
        raise RecipeError("train_hosts", "; ".join(problems))
    return main
