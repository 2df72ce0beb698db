"""Child processes of the tests: each leads a session of its own, and a timeout kills all of it.

``subprocess.run(..., timeout=...)`` kills only the direct child. A child that
started Ray leaves Ray's processes (GCS, raylet, workers, the reaper) running,
and they keep their ports and CPUs for the rest of the session. Ray's services
stay in the process group of the process that started them (that process makes
itself a group leader, and a session leader already is one), so a child started
with ``start_new_session=True`` holds them all in its group: on a timeout, or
when the test itself is interrupted, ``os.killpg(pid, SIGKILL)`` ends the lot,
and the test fails with what the child had printed so far. Processes that leave
the group on purpose (``kvledger up --detach``'s owner, in a session of its own)
are the test's to stop, with ``kvledger down``.
"""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

#: How long, after the kill, to collect what the child's pipes still hold (a process outside the group may keep
#: them open: then what arrived so far is what is reported).
DRAIN_S = 10.0


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of ``proc``'s group (``proc`` leads it: it was started in a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:   # the whole group is gone already
        pass


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def run(args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)``, the child in its own session.

    On a timeout the child's whole process group is killed and the test fails with the output so far; any
    other interruption (pytest-timeout, Ctrl-C) kills the group too before it propagates.
    """
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env=None if env is None else dict(env), cwd=cwd, start_new_session=True)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            kill_group(proc)
            try:
                out, err = proc.communicate(timeout=DRAIN_S)
            except subprocess.TimeoutExpired:   # the pipes are held by a process outside the group
                out, err = _text(expired.output), _text(expired.stderr)
            pytest.fail(f"{' '.join(map(str, args))} ran past {timeout:g} s; its process group was killed.\n"
                        f"--- stdout (last 3000 characters)\n{_text(out)[-3000:]}\n"
                        f"--- stderr (last 3000 characters)\n{_text(err)[-3000:]}", pytrace=False)
    except BaseException:
        kill_group(proc)
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        if proc.returncode is None:
            try:
                proc.wait(timeout=DRAIN_S)
            except subprocess.TimeoutExpired:
                pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
