"""A node started by the launcher dies with it: ``shard up --die-with-parent PID``.

The launcher stops its children itself on every way out it lives through (an error, the end of
``swarm run``, SIGINT, SIGTERM, SIGHUP). This covers the ways it does not: SIGKILL, a crash.
When process ``PID`` exits, the kernel makes its pidfd readable; a watcher thread blocked on it
then SIGKILLs this process — what ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` would do, but without
that signal's trap: it fires when the *thread* that forked the child exits, and Trio forks in
a worker thread that retires after a few idle seconds, which would kill a healthy node.

The watcher is a thread, not a Trio task, so it acts while the node is still importing torch
or loading weights (before ``trio.run``) and while its event loop is busy; it shares nothing
with the rest of the process. Linux only (``pidfd_open``, Linux 5.3); elsewhere the node says
it cannot watch and runs on.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading

__all__ = ["die_with_parent"]


def die_with_parent(parent: int, node: str) -> None:
    """SIGKILL this process as soon as process ``parent`` (this process's parent) exits —
    at once if it has exited already."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        print(
            f"shard: WARNING: {node}: cannot watch parent {parent} on this platform "
            "(no pidfd_open); this node outlives its launcher if the launcher is killed",
            file=sys.stderr,
        )
        return
    try:
        fd: int = pidfd_open(parent)
    except ProcessLookupError:
        _die(node, parent)
        return
    # The launcher may have died before we ran and its PID gone to another process: then we
    # were re-parented, and our parent is no longer ``parent``.
    if os.getppid() != parent:
        _die(node, parent)
        return
    watcher = threading.Thread(target=_watch, args=(fd, node, parent), name="die-with-parent")
    watcher.daemon = True  # never joined: it ends the process, or the process ends it
    watcher.start()


def _watch(fd: int, node: str, parent: int) -> None:
    select.select([fd], [], [])  # readable once the parent process has exited
    _die(node, parent)


def _die(node: str, parent: int) -> None:
    print(f"shard: {node}: launcher (pid {parent}) exited; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
