"""Process plumbing shared by rpcmesh's measurement scripts (`bench`, `accuracy`): every
process they start is in its own process group (Ctrl-C reaches only the script, which stops
them in order), dies with the script (PR_SET_PDEATHSIG) should the script itself be killed,
and is stopped by PID (SIGTERM, then SIGKILL after a timeout). Stdlib only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PR_SET_PDEATHSIG = 1
#: A release binary listens within milliseconds; 10 s covers a loaded CI machine.
LISTEN_TIMEOUT_S = 10.0
#: SIGTERM first; SIGKILL after this. The provider's and broker's grace for calls in
#: flight is 10 s, and nothing is in flight when they are stopped (drivers stop first).
STOP_TIMEOUT_S = {"driver": 3.0, "haproxy": 5.0, "broker": 12.0, "provider": 12.0}


class ScriptError(Exception):
    """A failure the user must look at (the message says what); `status` is the exit status:
    2 for a setup problem, 1 for a process that died during the run."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class Interrupted(BaseException):
    """SIGTERM/SIGHUP/SIGINT arrived: unwind through every `finally` and stop what runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: The running script's name, the prefix of the lines this module prints (set by `run`).
PROG = Path(sys.argv[0]).name

#: The signals that interrupt a script.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _on_signal(signum, _frame):
    raise Interrupted(signum)


def run(main, argv: list[str]) -> None:
    """Runs `main(argv)` and exits with its status: a ScriptError's status (its message
    printed), or 128 + the signal's number when interrupted (every process stopped)."""
    for s in SIGNALS:
        signal.signal(s, _on_signal)
    try:
        sys.exit(main(argv))
    except ScriptError as e:
        log(f"{PROG}: {e}")
        sys.exit(e.status)
    except Interrupted as e:
        log(f"{PROG}: interrupted by {e}; every process stopped")
        sys.exit(128 + e.signum)


@contextlib.contextmanager
def uninterruptible():
    """No signal cuts the block short (a cleanup that must stop every process)."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s in SIGNALS:
            signal.signal(s, _on_signal)


#: Where the scripts find provider, broker and driver unless `--bin-dir` names another
#: folder: the release build, the one whose figures the docs quote.
RELEASE_DIR = ROOT / "target" / "release"


def add_binary_args(p) -> None:
    """`--no-build` and `--bin-dir`, the same in every script."""
    p.add_argument("--no-build", action="store_true", help="use target/release/* as they are (no cargo build)")
    p.add_argument("--bin-dir", type=Path, metavar="DIR",
                   help="run the provider, broker and driver in DIR as they are (implies --no-build); "
                        "the tests' smoke runs use their debug build. Figures are only those of a release build")  # fmt: skip


def build_release() -> float:
    """`cargo build --release --locked`; returns the seconds it took."""
    t = time.monotonic()
    log(f"{PROG}: cargo build --release --locked")
    rc = subprocess.run(["cargo", "build", "--release", "--locked"], cwd=ROOT).returncode
    if rc != 0:
        raise ScriptError(f"cargo build --release --locked failed (status {rc})")
    return time.monotonic() - t


def build_unless_told(args) -> float | None:
    """Builds the release binaries unless `--no-build` or `--bin-dir` was given; the seconds
    it took, or None."""
    return None if args.no_build or args.bin_dir is not None else build_release()


def binaries(names, bin_dir: Path | None = None) -> dict[str, Path]:
    """<bin_dir>/<name> for each name (bin_dir RELEASE_DIR unless given), made absolute
    (the servers run from the workspace root) and checked to be there."""
    folder = (bin_dir or RELEASE_DIR).resolve()
    bins = {n: folder / n for n in names}
    for b in bins.values():
        if not os.access(b, os.X_OK):
            hint = "build it with `cargo build --release --locked` (or drop --no-build)" if bin_dir is None else "check --bin-dir"
            raise ScriptError(f"{b} missing: {hint}")
    return bins


def tail(path: Path, label: str, lines: int = 15) -> str:
    """The last lines of a process's log, each prefixed with `label`."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"  {label}| {line}" for line in text[-lines:])


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - every glibc/musl Linux has it
    _LIBC = None
_PARENT = os.getpid()


def _die_with_parent() -> None:
    """In the child before exec: be killed if the script dies without cleaning up."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _PARENT:  # the script died between fork and prctl
        os._exit(1)


def spawn(argv: list[str], out, err, cpus: set[int] | None = None) -> subprocess.Popen:
    """Starts `argv` in its own process group, tied to this script's life; on the CPUs
    `cpus` only (every thread it makes inherits them), when given."""

    def prepare() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        cwd=ROOT,
        process_group=0,
        preexec_fn=prepare,
    )


def stop(name: str, p: subprocess.Popen) -> None:
    """SIGTERM, wait, SIGKILL, reap. Safe to call on a process that already exited."""
    if p.poll() is not None:
        return
    try:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=STOP_TIMEOUT_S.get(name, 5.0))
    except subprocess.TimeoutExpired:
        log(f"{PROG}: {name} (pid {p.pid}) ignored SIGTERM; killing it")
        p.kill()
        p.wait(timeout=5.0)


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_listening(name: str, p: subprocess.Popen, port: int, tail) -> None:
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while True:
        if p.poll() is not None:
            raise ScriptError(f"{name} exited (status {p.returncode}) at start\n{tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ScriptError(f"{name} not listening on 127.0.0.1:{port} after {LISTEN_TIMEOUT_S:.0f} s\n{tail()}")
        time.sleep(0.02)
