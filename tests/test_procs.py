"""The process helpers the multi-process tests stand on (``tests/procs.py``).

Small Python processes, no torch; each is killed by PID on the way out and every wait is
bounded.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from procs import LineReader, alive, kill_orphans, orphans, run_python, started_python

_WAITS = "import time; print('up', flush=True); time.sleep(60)"

#: A child that starts a grandchild in a session of its own, prints its PID and exits: the
#: grandchild is re-parented to the test process (its subreaper), a real orphan.
_LEAVES_AN_ORPHAN = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True)
print(child.pid, flush=True)
"""


async def test_a_process_being_started_is_not_taken_for_an_orphan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trio forks in a worker thread, so a task may sweep orphans while another start sits
    between its fork and its registration. The sweep must leave that process alone. In a
    background run of the suite, a joined node was SIGKILLed this way before its first line:
    a concurrent reference run, ending, swept it."""
    real = trio.lowlevel.open_process
    forked, resume = trio.Event(), trio.Event()
    started: list[trio.Process] = []

    async def held_open(*args: Any, **options: Any) -> trio.Process:
        proc = await real(*args, **options)
        started.append(proc)
        forked.set()
        await resume.wait()  # the window in which the start is not yet registered
        return proc

    monkeypatch.setattr(trio.lowlevel, "open_process", held_open)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def start() -> None:
                async with started_python(_WAITS) as proc:
                    assert await LineReader(proc.stdout).line_starting("up") == "up"

            nursery.start_soon(start)
            await forked.wait()
            (proc,) = started
            assert proc.pid not in orphans()
            kill_orphans()
            assert alive(proc.pid)
            resume.set()


async def test_a_real_orphan_is_still_found_and_killed() -> None:
    """The same sweep, with no start in flight, finds and kills a process re-parented to us."""
    done = await run_python(_LEAVES_AN_ORPHAN, timeout_s=30)
    assert done.returncode == 0, done.describe()
    orphan = int(done.stdout.split()[0])
    # run_python already swept; the orphan it found is reported and gone
    assert done.stragglers == (orphan,)
    assert not alive(orphan)
    assert orphans() == []
