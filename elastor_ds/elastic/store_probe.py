"""Waiting, in Python, for a c10d rendezvous store that this node does not host.

Why: torch's ``TCPStore`` client retries an unreachable endpoint in C++ and logs every failed try
with a dump of C++ stack frames (dozens of ``frame #N`` lines per try) before the rendezvous gives
up. ``elastor run`` promises one line on stderr for a user error. So, before torch builds the
rendezvous handler, a node that will connect as a client (``--rdzv-conf is_host=0``, or an endpoint
that is not this machine, decided by torch's own rule) opens plain TCP connections to the endpoint
until one is accepted or twice ``read_timeout`` has passed (torch's client, measured with
``is_host=0,read_timeout=3``, gave up after 7-8 s: its C++ connect loop retries once more after the
timeout).
An endpoint that answers is then connected to by torch at once, without warnings; one that never
does is a :class:`~elastor_ds.errors.ConfigError` naming the endpoint and the fix (exit 2).

The probe connection is closed without sending a byte; a ``TCPStore`` server drops it silently.
"""
from __future__ import annotations

import socket
import time
from typing import Callable, Optional

from . import overrides

__all__ = ["client_deadline_s", "wait_for_store", "DEFAULT_READ_TIMEOUT_S"]

DEFAULT_READ_TIMEOUT_S = 60.0   # torch's default for --rdzv-conf read_timeout
_RETRY_S = 0.25                 # between refused connections
_CONNECT_S = 2.0                # the longest single connect attempt (a black-holed address waits this long)


def client_deadline_s(host: str, conf: dict, matches_this_machine: Optional[Callable[[str], bool]] = None) -> Optional[float]:
    """How long torch would try to reach the store at ``host`` as a client, in seconds; None when
    this node hosts it (nothing to wait for)."""
    is_host = conf.get("is_host")
    read_timeout = float(conf.get("read_timeout", DEFAULT_READ_TIMEOUT_S))
    if is_host is True:
        return None
    if is_host is None and (matches_this_machine or overrides.matches_machine_hostname)(host):
        return None   # torch hosts the store here (and falls back to a client only if the port is taken)
    return 2 * read_timeout


def wait_for_store(host: str, port: int, deadline_s: float, *, connect: Callable = socket.create_connection,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   on_wait: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """Open (and close) TCP connections to ``host:port`` until one is accepted (returns None) or
    ``deadline_s`` seconds have passed (returns the last error, for the message). ``on_wait`` is
    called once, with the error, when the first attempt fails."""
    end = clock() + deadline_s
    last = "no attempt"
    tries = 0
    while True:
        left = end - clock()
        if left <= 0:
            return last
        try:
            conn = connect((host, port), timeout=min(_CONNECT_S, max(left, 0.05)))
        except OSError as e:
            last = f"{type(e).__name__}: {e.strerror or e}"
            tries += 1
            if tries == 1 and on_wait is not None:
                on_wait(last)
            left = end - clock()
            if left > 0:
                sleep(min(_RETRY_S, left))
            continue
        conn.close()
        return None
