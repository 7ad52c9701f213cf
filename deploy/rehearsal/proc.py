"""Running commands: every one with a timeout, its output to a log or captured, and every
process a run starts in the background remembered, so that teardown can stop it by its id.

A signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP) becomes an `Interrupted` exception in the
main thread, so that the command's `finally` tears everything down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


class RehearsalError(Exception):
    """A step failed: what failed, in a sentence a person can act on."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived (a BaseException, as KeyboardInterrupt is, so
    that no `except Exception` swallows it)."""


#: How long a background process has after SIGTERM before it gets SIGKILL.
STOP_GRACE = 5.0
#: How often waits poll.
POLL = 0.2

_background: list[subprocess.Popen] = []


def _raise_interrupted(signum: int, _frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def trap_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted from now on (SIGINT too: a shell
    starts a background command with SIGINT ignored, and Python then leaves it so)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _raise_interrupted)


def ignore_signals() -> None:
    """Teardown must finish: SIGINT, SIGTERM and SIGHUP are ignored from now on."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)


def run(
    argv: list[str],
    *,
    timeout: float,
    check: bool = True,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    input: bytes | None = None,
) -> subprocess.CompletedProcess:
    """Runs argv to its end (at most `timeout` seconds: then it is killed and this raises).
    Output goes to `log` (appended, both streams) or is captured (stdout, stderr: bytes).
    With `check`, a non-zero exit raises RehearsalError quoting the end of its output."""
    out = open(log, "ab") if log else subprocess.PIPE  # noqa: SIM115 (closed below)
    try:
        if log:
            out.write(f"\n$ {' '.join(argv)}\n".encode())
            out.flush()
        r = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL if input is None else None,
            input=input,
            stdout=out,
            stderr=subprocess.STDOUT if log else subprocess.PIPE,
            timeout=timeout,
            env=env,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise RehearsalError(f"{' '.join(argv[:6])}...: still running after {timeout:.0f} s") from e
    finally:
        if log:
            out.close()
    if check and r.returncode != 0:
        if log:
            said = tail(log)
        else:
            said = (r.stderr or b"").decode(errors="replace").strip() or (
                r.stdout or b""
            ).decode(errors="replace").strip()
        raise RehearsalError(f"{' '.join(argv)}: exit {r.returncode}\n{said[-3000:]}")
    return r


def output(argv: list[str], *, timeout: float, check: bool = True) -> str:
    """stdout of argv, as text."""
    return run(argv, timeout=timeout, check=check).stdout.decode(errors="replace")


def start(argv: list[str], *, log: Path, env: dict[str, str] | None = None,
          preexec=None, cwd: Path | None = None) -> subprocess.Popen:
    """Starts argv in the background, its output to `log`; remembered for teardown.
    `preexec` runs in the child just before argv (e.g. to enter a cgroup)."""
    with open(log, "ab") as f:
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
            preexec_fn=preexec, cwd=cwd,
        )
    _background.append(p)
    return p


def stop_background() -> None:
    """Stops every background process still running (SIGTERM, then SIGKILL), by its id."""
    live = [p for p in _background if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=STOP_GRACE)
    _background.clear()


def wait_until(what: str, ready, *, timeout: float, poll: float = POLL):
    """Calls `ready()` until it returns something true (returned) or `timeout` passes
    (RehearsalError naming `what`, and the last exception `ready` raised)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            got = ready()
            if got:
                return got
        except RehearsalError as e:
            last = e
        if time.monotonic() > deadline:
            raise RehearsalError(
                f"{what}: not within {timeout:.0f} s" + (f" ({last})" if last else "")
            )
        time.sleep(poll)


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether a process of that id exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> list[str]:
    """A process's command line ([] if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def kill(pid: int, sig: int) -> None:
    """Sends a signal to a process by its id; a process already gone is fine."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
