"""Reaching the machines from the controller namespace, and nowhere else: SSH (a key made
for the run, host keys checked against the image's), HTTP GETs (Python's urllib, run
inside the namespace) and `ansible-playbook` over SSH with an inventory written from the
machines booted.

Ansible comes from a venv under /var/lib/rpcmesh-lab/ (`deploy/rehearse --install` makes
it), so that the controller runs the same ansible-core wherever the rehearsal runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import proc
from .topology import CONTROLLER, GROUPS, MACHINES, Host

#: The controller tools of deploy/ansible: the ansible-core pinned there is the one run.
REQUIREMENTS = Path(__file__).resolve().parents[1] / "ansible/requirements.txt"
#: The pin used while deploy/ansible has no requirements file: the newest ansible-core
#: line that supports Python 3.11 (Debian 12's, the controller's and the machines').
FALLBACK_ANSIBLE_CORE = "ansible-core==2.19.14"


def _ansible_core() -> str:
    try:
        for line in REQUIREMENTS.read_text().splitlines():
            if line.strip().startswith("ansible-core"):
                return line.split("#")[0].strip()
    except OSError:
        pass
    return FALLBACK_ANSIBLE_CORE


#: The ansible-core requirement the rehearsal installs and runs.
ANSIBLE_CORE = _ansible_core()
#: Where its venv lives: a folder per requirement, so that a new pin makes a new one.
VENV = Path("/var/lib/rpcmesh-lab") / ("venv-" + "".join(
    c if c.isalnum() or c in ".-" else "-" for c in ANSIBLE_CORE.replace("==", "-")))
#: An SSH command that does not answer in this long has hung.
SSH_TIMEOUT = 60.0
#: Each HTTP GET (a /metrics page, a Prometheus query).
HTTP_TIMEOUT = 10.0
#: Opening or closing a machine's master SSH connection.
MASTER_TIMEOUT = 30.0
#: Ansible's SSH arguments in the rehearsal (its default is `-C -o ControlMaster=auto -o
#: ControlPersist=60s`): no compression, since the links are a local bridge and zlib over
#: the debug binaries and every module's payload only spends the 2 shared cores; and
#: connections kept for the whole run, not 60 s, so that a playbook run after a pause
#: does not open eight new ones. Closed by `Controller.close` at the teardown.
ANSIBLE_SSH_ARGS = "-o ControlMaster=auto -o ControlPersist=30m"


def in_controller(argv: list[str]) -> list[str]:
    """argv run inside the controller namespace."""
    return ["ip", "netns", "exec", CONTROLLER.name, *argv]


class Controller:
    """The controller: the run's SSH key and known hosts, and commands from its namespace.

    Once the machines are up, `open_masters` opens one master SSH connection to each
    (`ssh -M`), which every later command to it shares (ControlPath): the rehearsal's
    hundreds of checks then cost no key exchange each. A command to a machine without a
    master connects as usual."""

    def __init__(self, run_dir: Path, out_dir: Path, host_keys: list[str]):
        self.run_dir, self.out_dir = run_dir, out_dir
        self.key = run_dir / "id_ed25519"
        self.known_hosts = run_dir / "known_hosts"
        self.control_dir = run_dir / "cm"
        self.control_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        #: Ansible's own master connections (ANSIBLE_SSH_ARGS), closed with ours.
        self.ansible_control_dir = run_dir / "ansible/cp"
        self.masters: list[Host] = []
        ssh_dir = run_dir / "ssh"  # bound into every machine as /root/.ssh
        ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.key.exists():
            proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rpcm-rehearsal",
                      "-f", str(self.key)], timeout=30)
        auth = ssh_dir / "authorized_keys"
        auth.write_text((run_dir / "id_ed25519.pub").read_text())
        auth.chmod(0o600)
        self.known_hosts.write_text(
            "".join(f"{m.ip} {k}\n" for m in MACHINES for k in host_keys)
        )

    def base_options(self) -> list[str]:
        """The options every SSH of the run has, Ansible's too."""
        return [
            "-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
        ]

    def ssh_options(self) -> list[str]:
        """The rehearsal's own: through the machine's master connection when it has one."""
        return [*self.base_options(), "-o", f"ControlPath={self.control_dir}/%h",
                "-o", "ControlMaster=no"]

    def open_masters(self, hosts: list[Host]) -> None:
        """Opens a master connection to each machine (in the background, `ssh -f`)."""
        log = self.out_dir / "ssh-masters.log"
        for h in hosts:
            proc.run(in_controller(["ssh", *self.base_options(), "-o",
                                    f"ControlPath={self.control_dir}/%h", "-M", "-N", "-f",
                                    f"root@{h.ip}"]), timeout=MASTER_TIMEOUT, log=log)
            self.masters.append(h)

    def close(self) -> None:
        """Closes the master connections: ours, then Ansible's (`ssh -O exit`)."""
        log = self.out_dir / "ssh-masters.log"
        paths = [(f"{self.control_dir}/%h", h.ip) for h in self.masters]
        if self.ansible_control_dir.is_dir():
            paths += [(str(p), "127.0.0.1") for p in sorted(self.ansible_control_dir.iterdir())]
        for path, host in paths:
            proc.run(in_controller(["ssh", "-F", "/dev/null", "-o", f"ControlPath={path}",
                                    "-O", "exit", host]),
                     timeout=MASTER_TIMEOUT, log=log, check=False)
        self.masters.clear()

    def ssh(self, host: Host, command: str, *, timeout: float = SSH_TIMEOUT,
            check: bool = True, log: Path | None = None):
        """Runs a shell command on a machine as root; the CompletedProcess."""
        return proc.run(
            in_controller(["ssh", *self.ssh_options(), f"root@{host.ip}", command]),
            timeout=timeout, check=check, log=log,
        )

    def ssh_text(self, host: Host, command: str, *, timeout: float = SSH_TIMEOUT) -> str:
        return self.ssh(host, command, timeout=timeout).stdout.decode(errors="replace")

    def put(self, host: Host, path: str, data: bytes, mode: str = "0600") -> None:
        """Writes `data` to a file on a machine (over the SSH connection, with cat), with
        `mode`, renamed into place whole."""
        self.run_input(host, f"mkdir -p $(dirname {path}) && umask 077 && cat > {path}.tmp && "
                             f"chmod {mode} {path}.tmp && mv -f {path}.tmp {path}", data)

    def run_input(self, host: Host, command: str, data: bytes):
        """Runs a shell command on a machine with `data` on its stdin."""
        return proc.run(in_controller(["ssh", *self.ssh_options(), f"root@{host.ip}", command]),
                        timeout=SSH_TIMEOUT, input=data)

    def fetch(self, host: Host, path: str, local: Path) -> None:
        """Copies a file from a machine (over the SSH connection, with cat)."""
        local.write_bytes(self.ssh(host, f"cat {path}").stdout)

    def http_get(self, url: str, *, timeout: float = HTTP_TIMEOUT) -> bytes:
        """A GET from inside the controller namespace (RehearsalError unless 200)."""
        code = (
            "import sys, urllib.request\n"
            "with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r:\n"
            "    sys.stdout.buffer.write(r.read())\n"
        )
        r = proc.run(in_controller([sys.executable, "-c", code, url, str(timeout)]),
                     timeout=timeout + 10, check=False)
        if r.returncode != 0:
            said = r.stderr.decode(errors="replace").strip().splitlines()
            raise proc.RehearsalError(f"GET {url}: {said[-1] if said else r.returncode}")
        return r.stdout

    def http_json(self, url: str):
        return json.loads(self.http_get(url))


def ansible_bin(name: str) -> Path:
    return VENV / "bin" / name


def install_ansible(log: Path | None = None) -> None:
    """Makes the venv with deploy/ansible/requirements.txt (ansible-core and ansible-lint,
    from PyPI) unless both are there."""
    if all(ansible_bin(b).exists() for b in ("ansible-playbook", "ansible-lint")):
        return
    if not ansible_bin("python").exists():
        proc.run([sys.executable, "-m", "venv", str(VENV)], timeout=120, log=log)
    proc.run([str(VENV / "bin/pip"), "install", "--quiet", "-r", str(REQUIREMENTS)],
             timeout=900, log=log)


def vars_path(inventory: Path) -> Path:
    """Where the variables of the rehearsal's settings go beside its inventory."""
    return inventory.with_name(inventory.stem + ".vars.json")


def write_inventory(path: Path, controller: Controller, bin_dir: Path, *, joined: bool,
                    extra: dict | None = None) -> None:
    """The rehearsal's inventory (YAML's JSON subset), made from the machines booted: a
    group per role; the late provider only when `joined`. `rpcmesh_bin_dir` and the `extra`
    variables go to `vars_path(path)`, which `playbook` gives as extra variables: in the
    inventory, the playbook's own group_vars (deploy/ansible/group_vars/) would win over
    them."""
    children = {}
    for g in GROUPS:
        hosts = {m.name: {"ansible_host": m.ip} for m in MACHINES
                 if m.group == g and (joined or not m.joins_later)}
        children[g] = {"hosts": hosts}
    inventory = {
        "all": {
            "vars": {
                "ansible_user": "root",
                "ansible_python_interpreter": "/usr/bin/python3",
                "ansible_ssh_private_key_file": str(controller.key),
                "ansible_ssh_common_args": " ".join(
                    o for o in controller.base_options()
                    if o not in ("-F", "/dev/null", "-i", str(controller.key))
                ),
                "ansible_ssh_args": ANSIBLE_SSH_ARGS,
                "ansible_control_path_dir": str(controller.ansible_control_dir),
            },
            "children": children,
        }
    }
    path.write_text(json.dumps(inventory, indent=2) + "\n")
    settings = {"rpcmesh_bin_dir": str(bin_dir), **(extra or {})}
    vars_path(path).write_text(json.dumps(settings, indent=2) + "\n")


def playbook(controller: Controller, playbook: Path, inventory: Path, log: Path,
             *, timeout: float, extra: list[str] | None = None, check: bool = True):
    """Runs `ansible-playbook` from the controller namespace; with `check`, a failure is
    a RehearsalError with the end of its output. Returns the CompletedProcess."""
    env = dict(
        os.environ,
        ANSIBLE_HOME=str(controller.run_dir / "ansible"),
        ANSIBLE_LOCAL_TEMP=str(controller.run_dir / "ansible/tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_RETRY_FILES_ENABLED="0",
        PYTHONDONTWRITEBYTECODE="1",
        # The same output with a time stamp on each line, to see where the time goes.
        ANSIBLE_LOG_PATH=str(log.with_suffix(".timed.log")),
    )
    cfg = playbook.parent / "ansible.cfg"
    if cfg.exists():
        env["ANSIBLE_CONFIG"] = str(cfg)
    return proc.run(
        in_controller([str(ansible_bin("ansible-playbook")), "-i", str(inventory),
                       "-e", f"@{vars_path(inventory)}", *(extra or []), str(playbook)]),
        timeout=timeout, log=log, env=env, cwd=playbook.parent, check=check,
    )


def recap(log: Path, field: str = "changed") -> dict[str, int]:
    """Changed (or `field`: failed, rescued...) tasks per host, from the last PLAY RECAP
    of an Ansible log."""
    part = log.read_text(errors="replace").rsplit("PLAY RECAP", 1)[-1]
    counts = {}
    for line in part.splitlines():
        if " : ok=" in line and f"{field}=" in line:
            host = line.split(":", 1)[0].strip()
            counts[host] = int(line.split(f"{field}=", 1)[1].split()[0])
    return counts


def prometheus_config(source: Path, run_dir: Path, interval: str,
                      kept: dict[str, str] | None = None) -> Path:
    """A copy of the deployment's Prometheus configuration with the scrape and evaluation
    intervals (and the scrape timeout) at `interval`, but for the jobs of `kept` (job:
    the deployment's interval), and nothing else changed."""
    lines = []
    for line in source.read_text().splitlines():
        key = line.strip().split(":", 1)[0]
        if line.startswith("  ") and key in ("scrape_interval", "scrape_timeout", "evaluation_interval"):
            line = f"{line.split(':', 1)[0]}: {interval}"
        lines.append(line)
        job = line.strip().removeprefix("- job_name:").strip() if "- job_name:" in line else None
        if job in (kept or {}):
            indent = line[:len(line) - len(line.lstrip())] + "  "
            lines += [f"{indent}scrape_interval: {kept[job]}", f"{indent}scrape_timeout: 10s"]
    path = run_dir / "prometheus.yml"
    path.write_text("\n".join(lines) + "\n")
    return path
