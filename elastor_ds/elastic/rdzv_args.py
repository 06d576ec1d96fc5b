"""Validation of ``elastor run``'s rendezvous flags (torchrun's meaning), before anything starts.

Pure parsing plus a name lookup: each bad value is a :class:`~elastor_ds.errors.ConfigError` that
names the flag, the value and the fix (exit 2), never an error from deep inside torch elastic
after the job started, and never a retry loop without end.
"""
from __future__ import annotations

import math
import socket
from typing import Any, Callable

from ..errors import ConfigError

BACKENDS = ("c10d", "etcd", "etcd-v2")   # torch.distributed.elastic's registered handlers elastor run can drive
ENDPOINT_BACKENDS = ("etcd", "etcd-v2")   # no default store: --rdzv-endpoint names the etcd server(s)


def _seconds(lo_exclusive: bool) -> Callable[[str, str], float]:
    def parse(key: str, v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise ConfigError(f"--rdzv-conf {key}={v}: expected a number of seconds, e.g. {key}=60") from None
        if not math.isfinite(x) or x < 0 or (lo_exclusive and x == 0):
            raise ConfigError(f"--rdzv-conf {key}={v}: expected a number of seconds "
                              f"{'> 0' if lo_exclusive else '>= 0'}, e.g. {key}=60")
        return x
    return parse


def _whole_seconds(lo_exclusive: bool) -> Callable[[str, str], int]:
    """A time torch's rendezvous reads as whole seconds (``get_as_int``): a fraction was truncated
    there (``keep_alive_interval=0.5`` became 0 and the rendezvous never completed; torchrun refuses it)."""
    parse_float = _seconds(lo_exclusive)

    def parse(key: str, v: str) -> int:
        x = parse_float(key, v)
        if not x.is_integer() or (lo_exclusive and x < 1):
            raise ConfigError(f"--rdzv-conf {key}={v}: torch's rendezvous takes whole seconds"
                              f"{' (at least 1)' if lo_exclusive else ''}; give e.g. {key}={max(1, math.ceil(x))}")
        return int(x)
    return parse


# options torch takes without error but nothing reads (torch 2.x's c10d backend and elastor run): refused,
# not ignored in silence
NO_EFFECT = {
    "use_agent_store": "the workers' store is chosen by the rendezvous backend (TORCHELASTIC_USE_AGENT_STORE), "
                       "not by an option",
    "use_libuv": "the c10d store's transport is chosen by torch (environment USE_LIBUV), not by an option",
    "heartbeat": "torch's key is heartbeat_timeout",
}


def _count(key: str, v: str) -> int:
    try:
        x = int(v)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={v}: expected a whole number >= 1, e.g. {key}=3") from None
    if x < 1:
        raise ConfigError(f"--rdzv-conf {key}={v}: expected a whole number >= 1, e.g. {key}=3")
    return x


def _flag(key: str, v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={v}: expected true or false")


def _text(key: str, v: str) -> str:
    if not v:
        raise ConfigError(f"--rdzv-conf {key}=: empty value; give {key}=<value> or leave the key out")
    return v


# key -> parser; the c10d and etcd backends' options, and elastor run's liveness options
KEYS: dict[str, Callable[[str, str], Any]] = {
    "join_timeout": _whole_seconds(True), "last_call_timeout": _whole_seconds(False),
    "close_timeout": _whole_seconds(True), "timeout": _whole_seconds(True), "read_timeout": _whole_seconds(True),
    "heartbeat_timeout": _whole_seconds(True), "keep_alive_interval": _whole_seconds(True),
    "keep_alive_max_attempt": _count, "is_host": _flag,
    "protocol": _text, "cacert": _text, "cert": _text, "key": _text, "etcd_prefix": _text,
}


def parse_rdzv_conf(text: str) -> dict:
    """``key=value,key=value`` -> typed options; unknown keys and bad values are refused."""
    out: dict = {}
    for kv in filter(None, (x.strip() for x in text.split(","))):
        if "=" not in kv:
            raise ConfigError(f"--rdzv-conf {text!r}: expected key=value pairs separated by commas, "
                              f"e.g. join_timeout=600,read_timeout=60")
        k, v = (x.strip() for x in kv.split("=", 1))
        if k in NO_EFFECT:
            raise ConfigError(f"--rdzv-conf {k}={v}: has no effect ({NO_EFFECT[k]}); drop it")
        if k not in KEYS:
            raise ConfigError(f"--rdzv-conf {k}={v}: unknown option {k!r}; known: {', '.join(sorted(KEYS))}")
        out[k] = KEYS[k](k, v)
    return out


def check_backend(name: str) -> str:
    if name == "static":   # torch's static rendezvous takes its node rank from --node-rank, which elastor run has not
        raise ConfigError("--rdzv-backend 'static': torchrun's static rendezvous needs --node-rank and --master-addr, "
                          "which elastor run does not take (the rendezvous assigns node ranks); use c10d (the default) "
                          "or etcd-v2")
    if name not in BACKENDS:
        raise ConfigError(f"--rdzv-backend {name!r}: unknown backend; use one of {', '.join(BACKENDS)} "
                          f"(c10d needs no extra service)")
    return name


def check_client(backend: str) -> None:
    """The etcd backends need the ``python-etcd`` client (module ``etcd``) and ``urllib3``."""
    if backend not in ("etcd", "etcd-v2"):
        return
    import importlib.util
    missing = [m for m in ("etcd", "urllib3") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"--rdzv-backend {backend}: the etcd client is not installed (no module "
                          f"{', '.join(map(repr, missing))}); pip install python-etcd==0.4.5 (requirements-dev.txt)")


def check_endpoint(endpoint: str, resolve: Callable[[str], Any] = socket.getaddrinfo) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a port in 1..65535 and a host that resolves: a
    typo fails here at once instead of a rendezvous that retries until its timeout."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. node0:29400")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: port {port!r} is not a number; e.g. node0:29400") from None
    if not 1 <= p <= 65535:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: port {p} is outside 1..65535; e.g. node0:29400")
    try:
        resolve(host, p)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: host {host!r} does not resolve ({e}); give the rendezvous "
                          f"host's name or address as every node sees it") from None
    return host, p


LIST_BACKENDS = ("etcd-v2",)   # backends whose --rdzv-endpoint may list several servers (the etcd members)


def check_endpoints(text: str, backend: str,
                    resolve: Callable[[str], Any] = socket.getaddrinfo) -> tuple[tuple[str, int], ...]:
    """``HOST:PORT`` or, for ``etcd-v2``, ``HOST:PORT,HOST:PORT,...`` (the members of one etcd
    cluster: the rendezvous survives losing any member but a quorum); each checked as
    :func:`check_endpoint`, no member twice."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) == 1:
        return (check_endpoint(parts[0], resolve),)
    if backend not in LIST_BACKENDS:
        raise ConfigError(f"--rdzv-endpoint {text!r}: a list of endpoints is for --rdzv-backend etcd-v2 (the members of "
                          f"one etcd cluster); {backend} takes one HOST:PORT, the same on every node")
    if not all(parts):
        raise ConfigError(f"--rdzv-endpoint {text!r}: an empty entry; give HOST:PORT,HOST:PORT,... without empty items")
    members = tuple(check_endpoint(x, resolve) for x in parts)
    if len(set(members)) != len(members):
        raise ConfigError(f"--rdzv-endpoint {text!r}: a member is listed twice; list each etcd member once")
    return members
