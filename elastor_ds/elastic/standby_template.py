"""The standby template of ``elastor run``: one interpreter per node that does the trainers' slow
imports (torch, DeepSpeed, Megatron-core: ~8 s of CPU each time) once, and forks every standby
worker from that state. A node then pays for its imports once per job instead of once per standby
and refill; on a 2-core node a 4-rank job's refills used to take the cores from training.

``python -u -m elastor_ds.elastic.standby_template`` with ``ELASTOR_STANDBY_TEMPLATE_FD``: one end of
a socketpair that only the agent holds (no path: nothing another user can connect to), and the
preload list of :mod:`standby_main`. The protocol on it (SOCK_SEQPACKET, one message each):

- template -> agent, once its imports are done: ``R``, or ``C`` when an import loaded the CUDA
  driver. A CUDA context does not survive ``fork``, so after ``C`` the template forks nothing and
  the agent spawns standbys itself, as with ``--no-standby-fork``.
- agent -> template: ``{"agent": PID}`` with two descriptors (SCM_RIGHTS): the read end of the new
  standby's assignment pipe and the write end of its readiness pipe.
- template -> agent: ``{"pid": N}`` (or ``{"error": ...}``).

Parenthood. The template forks A; A forks the standby B and exits at once. The agent is a child
subreaper (``PR_SET_CHILD_SUBREAPER``) during the request, so B is re-parented to the agent before
the reply: the agent waits for it, signals its process group and reads its exit status exactly as
for a spawned standby. B waits until its parent is the agent (in the template's process group until
then, so the agent's kill of that group takes it; adopted by anyone else, it exits), then leads its
own session (the agent waits for that before it uses B), sets its parent-death signal, re-seeds numpy's global generator (Python's ``random`` re-seeds itself at
fork), and goes on as a spawned standby does after its imports (:func:`standby_main.serve`).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

from elastor_ds.elastic import standby_main
from elastor_ds.elastic.protocol import ENV_STANDBY_TEMPLATE_FD

_MAX_REQUEST = 4096
_FORKED_PARENT = 0   # in B: its first parent, A (see _become_standby)


def _log(msg: str) -> None:
    print(f"[elastor standby template {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _become_standby(stdin_fd: int, ready_fd: int, agent: int, parent: int) -> None:
    """In B, at the top of the template's stack: a standby whose parent is the agent. From
    :func:`standby_main.serve` on it ends as a spawned standby does (the worker's exit code, or the
    interpreter's normal exit).

    ``parent``: B's first parent, A. B stays in the
    template's process group until the agent has adopted it, so the agent's kill of that group (its
    ``close``) takes a B still on its way; and a B adopted by anyone else (the agent stopped being a
    subreaper: it gave the request up) exits at once instead of outliving the agent."""
    try:
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        deadline = time.monotonic() + 10.0
        while True:   # A exits right after forking us; the agent adopts us
            ppid = os.getppid()
            if ppid == agent:
                break
            if ppid != parent or time.monotonic() > deadline:
                _log(f"not adopted by the agent {agent} (parent {ppid}); exiting")
                os._exit(1)
            time.sleep(0.001)
        os.setsid()
        from elastor_ds.elastic import worker
        worker.set_parent_death_signal()
        if os.getppid() != agent:   # the agent died between the check and the prctl
            os._exit(1)
        standby_main.set_spawn_time(time.time())
        if "numpy" in sys.modules:   # a fresh interpreter's global generator is seeded from the OS
            sys.modules["numpy"].random.seed()
    except Exception as e:  # noqa: BLE001 - B must never go back to serving requests
        _log(f"forked standby failed before its assignment ({type(e).__name__}: {e})")
        os._exit(1)
    standby_main.serve(ready_fd, forked=True)


def fork_standby(agent: int) -> int:
    """Fork a standby that the agent adopts: its pid in the template, 0 in the standby itself (which
    finds its first parent, A, in :data:`_FORKED_PARENT`)."""
    r, w = os.pipe()
    a = os.fork()
    if a == 0:   # A: fork B, tell the template its pid, exit (B is re-parented to the agent)
        try:
            os.close(r)
            me = os.getpid()
            b = os.fork()
        except BaseException:  # noqa: BLE001
            os._exit(1)
        if b == 0:   # B
            global _FORKED_PARENT
            _FORKED_PARENT = me   # A: B's parent until A exits (getppid here could already be the next)
            os.close(w)
            return 0
        try:
            os.write(w, str(b).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = os.read(r, 32)
    finally:
        os.close(r)
        os.waitpid(a, 0)   # A has exited: B is the agent's child from here on
    if not data:
        raise OSError("the intermediate process exited without forking the standby")
    return int(data)


def main() -> None:
    from elastor_ds.elastic import worker
    worker.set_parent_death_signal()
    sock = socket.socket(fileno=int(os.environ.pop(ENV_STANDBY_TEMPLATE_FD)))
    names = standby_main.preload_names()
    t0 = time.time()
    ok, failed = standby_main.preload(names)
    cuda = standby_main.libcuda_mapped()
    _log(f"template imports done: {ok} module(s) in {time.time() - t0:.2f} s ({failed} failed); "
         f"CUDA driver {'loaded: forking nothing' if cuda else 'not loaded'}")
    sock.send(b"C" if cuda else b"R")
    child = None
    while child is None:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST, 2)
        except OSError:
            break
        if not msg:   # the agent closed its end (or died)
            break
        try:
            req = json.loads(msg)
            if cuda or len(fds) != 2 or not isinstance(req, dict) or not isinstance(req.get("agent"), int):
                raise ValueError("not a fork request" if not cuda else "the CUDA driver is loaded here")
            # the node's learned module list (written by the workers of a launch) grows after the
            # template started: import what is new here, once, not in every standby
            standby_main.preload(standby_main.preload_names())
            pid = fork_standby(req["agent"])
            if pid == 0:   # the standby: leave the loop (and the template's socket) behind
                child = (fds[0], fds[1], req["agent"], _FORKED_PARENT)
                sock.close()
                break
            reply = {"pid": pid}
        except (ValueError, OSError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        for fd in fds:
            os.close(fd)
        try:
            sock.send(json.dumps(reply).encode())
        except OSError:
            break
    if child is None:
        os._exit(0)
    _become_standby(*child)


if __name__ == "__main__":
    main()
