"""The Debian root the machines boot from: built once with debootstrap, cached under
/var/lib/rpcmesh-lab/ keyed by the suite, variant and package list, and never modified
afterwards (the machines boot it with `--volatile=overlay`: their writes go to a tmpfs).

A base built by hand at /var/lib/rpcmesh-lab/base (the lab's recipe) is used as it is when
it is the same suite and has every package of the list installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
import time
from pathlib import Path

from . import proc

#: Debian 12: the release the reference machines run.
SUITE = "bookworm"
#: The smallest root that boots systemd: what the packages below need and nothing more.
VARIANT = "minbase"
#: What the machines need, since they have no route out: systemd as PID 1 with D-Bus,
#: sshd and python3 for Ansible, ip and ps, Prometheus (Debian's 2.42) and Alertmanager
#: (0.25) with curl for the monitoring host, and what the roles firewall, host and
#: node_exporter install on every host (nftables, systemd-timesyncd,
#: prometheus-node-exporter 1.5).
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "iproute2", "openssh-server", "python3",
    "prometheus", "prometheus-alertmanager", "prometheus-node-exporter", "procps", "curl",
    "ca-certificates", "nftables", "systemd-timesyncd",
)
#: Where images are cached (the lab's folder).
LAB_DIR = Path("/var/lib/rpcmesh-lab")
#: A base built by hand with the lab's recipe, used when it holds every package.
HAND_BUILT = LAB_DIR / "base"
#: debootstrap took 100 s here; a slow mirror gets some room.
DEBOOTSTRAP_TIMEOUT = 900.0
#: Held while a base is looked for or built: `deploy/rehearse --image` (which scripts/test
#: starts beside the compile) and a rehearsal's image step may run at the same time, and
#: the second waits for the first's base instead of building its own.
IMAGE_LOCK = LAB_DIR / "image.lock"
#: How long a waiter waits for the lock: one whole debootstrap, and a minute more.
IMAGE_LOCK_WAIT_S = DEBOOTSTRAP_TIMEOUT + 60.0
#: How often it tries again.
IMAGE_LOCK_POLL_S = 0.5
#: What a waiter says on stderr, once, when it finds the lock held (a test waits for it).
IMAGE_LOCK_WAITING = "waiting for the image lock, held by another image build"


def key() -> str:
    """The cache key: the first 12 hex digits of a hash of what the image is made of."""
    what = f"{SUITE} {VARIANT} {','.join(sorted(PACKAGES))}"
    return hashlib.sha256(what.encode()).hexdigest()[:12]


def cached_path() -> Path:
    return LAB_DIR / f"base-{SUITE}-{key()}"


def installed_packages(root: Path) -> set[str]:
    """The packages dpkg says are installed in a root (read only)."""
    got, name = set(), None
    try:
        text = (root / "var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return got
    for line in text.splitlines():
        if line.startswith("Package: "):
            name = line.split(": ", 1)[1].strip()
        elif line.startswith("Status: ") and line.endswith(" installed") and name:
            got.add(name)
    return got


def fits(root: Path) -> bool:
    """Whether a root is a usable base: the suite, and every package installed."""
    try:
        release = (root / "etc/os-release").read_text()
    except OSError:
        return False
    return f"VERSION_CODENAME={SUITE}" in release and set(PACKAGES) <= installed_packages(root)


def ensure(log: Path) -> tuple[Path, bool]:
    """The base to boot: the cached one, the hand-built one if it fits, or one built now
    (into a scratch folder renamed when complete, so an interrupted build is never used).
    Returns the path and whether it was built now. Holds IMAGE_LOCK meanwhile."""
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    with open(IMAGE_LOCK, "a+") as lock:
        deadline = time.monotonic() + IMAGE_LOCK_WAIT_S
        said = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    print(f"rehearse: {IMAGE_LOCK_WAITING} ({IMAGE_LOCK})", file=sys.stderr, flush=True)
                    said = True
                if time.monotonic() > deadline:
                    raise proc.RehearsalError(
                        f"{IMAGE_LOCK} still held after {IMAGE_LOCK_WAIT_S:.0f} s by another image build"
                    ) from None
                time.sleep(IMAGE_LOCK_POLL_S)
        return _ensure_locked(log)


def _ensure_locked(log: Path) -> tuple[Path, bool]:
    cached = cached_path()
    if fits(cached):
        return cached, False
    if fits(HAND_BUILT):
        return HAND_BUILT, False
    if shutil.which("debootstrap") is None:
        raise proc.RehearsalError("debootstrap is missing: run `deploy/rehearse --install`")
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    proc.run(
        ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}", SUITE,
         str(partial)],
        timeout=DEBOOTSTRAP_TIMEOUT, log=log,
    )
    if not fits(partial):
        raise proc.RehearsalError(f"debootstrap made {partial} without every package of {PACKAGES}")
    shutil.rmtree(cached, ignore_errors=True)
    partial.rename(cached)
    return cached, True


#: What `fingerprint` looks at: the folders the machines write to most (an overlay that
#: leaked would change their modification times) and the files Ansible changes.
WATCHED = (".", "etc", "etc/systemd/system", "etc/rpcmesh", "root", "usr/local/bin", "var/lib",
           "etc/passwd", "etc/prometheus/prometheus.yml", "var/lib/dpkg/status")


def fingerprint(root: Path) -> dict[str, str]:
    """Modification times and sizes of WATCHED in the base: equal before and after a run
    when no machine wrote to it."""
    got = {}
    for rel in WATCHED:
        try:
            st = (root / rel).stat()
            got[rel] = f"{st.st_mtime_ns} {st.st_size}"
        except OSError:
            got[rel] = "absent"
    return got


def host_keys(root: Path) -> list[str]:
    """The image's SSH host public keys (every machine has them: they share the base)."""
    keys = []
    for p in sorted((root / "etc/ssh").glob("ssh_host_*_key.pub")):
        keys.append(" ".join(p.read_text().split()[:2]))
    if not keys:
        raise proc.RehearsalError(f"{root} has no SSH host keys (openssh-server not configured?)")
    return keys
