"""The builds the rehearsal rolls out, each a folder of `provider`, `broker` and `driver`
with the manifest the roles check them against (scripts/manifest):

- `good`: the build under test (`--bin-dir`, or target/release), copied as it is;
- `second`: the same binaries with a few bytes appended (an ELF file runs the same with
  a trailer), so another build by SHA-256 and name, with the same version and commit:
  something to roll out, lose a restart of, and roll back;
- `broken`: the good broker and driver, and a provider that starts and says READY=1 but
  listens on 127.0.0.1 only (as a build with a wrong default address would), so no broker
  reaches it and it fails its health check: a shell script that runs the good build's
  provider as the host keeps it (/opt/rpcmesh/builds/GOOD/provider). Its manifest is
  written here (the script has no `--version`), naming the good build's version and
  commit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from . import proc
from .topology import PROVIDER_PORT

ROOT = Path(__file__).resolve().parents[2]
#: The manifest writer the deployment documents (cargo build && scripts/manifest DIR).
MANIFEST = ROOT / "scripts/manifest"
PROGRAMS = ("provider", "broker", "driver")
#: Where the hosts keep builds (group_vars/all.yml's rpcmesh_builds_dir).
HOST_BUILDS = "/opt/rpcmesh/builds"
#: Appended to each binary of the second build.
TRAILER = b"\n# rpcmesh rehearsal: the second build\n"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_manifest(folder: Path) -> dict:
    proc.run([str(MANIFEST), str(folder)], timeout=120)
    return json.loads((folder / "manifest.json").read_text())


def good(bin_dir: Path, folder: Path) -> dict:
    """The build under test, copied into `folder` with its manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in PROGRAMS:
        shutil.copy2(bin_dir / p, folder / p)
    return _write_manifest(folder)


def second(good_dir: Path, folder: Path) -> dict:
    """The good build's binaries with a trailer: another build of the same commit."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in PROGRAMS:
        data = (good_dir / p).read_bytes() + TRAILER
        (folder / p).write_bytes(data)
        (folder / p).chmod(0o755)
    return _write_manifest(folder)


def broken(good_dir: Path, good_manifest: dict, folder: Path) -> dict:
    """A build whose provider never gets healthy (see the module's doc)."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in ("broker", "driver"):
        shutil.copy2(good_dir / p, folder / p)
    script = folder / "provider"
    script.write_text(
        "#!/bin/sh\n"
        "# rpcmesh rehearsal: a deliberately broken build. The good build's provider,\n"
        "# listening on 127.0.0.1 only: it starts, but no broker reaches it.\n"
        f"exec {HOST_BUILDS}/{good_manifest['build']}/provider"
        f" --listen 127.0.0.1:{PROVIDER_PORT} \"$@\"\n")
    script.chmod(0o755)
    binaries = {p: {"sha256": _sha256(folder / p)} for p in PROGRAMS}
    digest = hashlib.sha256("".join(b["sha256"] for b in binaries.values()).encode()).hexdigest()
    manifest = {"build": f"broken-{digest[:8]}", "version": good_manifest["version"],
                "commit": good_manifest["commit"], "profile": good_manifest["profile"],
                "binaries": binaries}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
