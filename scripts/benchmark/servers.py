"""The servers of the whole bench, one instance each, started once and stopped at the end:
per upstream kind, the upstream (rpcmesh's provider or the classic server), its broker and,
with --baseline-broker, its baseline broker; one HAProxy and one nginx with a frontend per
kind; with the TLS paths, a TLS provider (`provider-tls`) and a broker with TLS on both hops
(`broker-tls`) of their own, and TLS frontends in the same HAProxy and nginx. `procs` starts them (their own process group, tied to this script's life) and stops
them by PID, in the reverse of the start order; this module knows their command lines,
their ports and which addresses each path's driver targets."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from pathlib import Path

import procs
from procs import ScriptError, free_ports, log, spawn, stop, tail, wait_listening

from . import plan, proxies
from .usage import Usage, proc_usage

# The baseline broker and the classic kind's brokers are stopped with the broker's patience,
# the classic server with the provider's (procs keys it by name).
for _name in ("before", "broker-v1", "before-v1", "broker-tls"):
    procs.STOP_TIMEOUT_S.setdefault(_name, procs.STOP_TIMEOUT_S["broker"])
for _name in ("classic", "provider-tls"):
    procs.STOP_TIMEOUT_S.setdefault(_name, procs.STOP_TIMEOUT_S["provider"])
# nginx (one process, master_process off) stops at once on SIGTERM, like HAProxy.
procs.STOP_TIMEOUT_S.setdefault("nginx", procs.STOP_TIMEOUT_S["haproxy"])


class Servers:
    """The started servers by name, each with its log in the bench's temp folder; with
    `cpus` (--pin: the hops' CPUs and the others'), each on its side's CPUs."""

    def __init__(self, workdir: Path, cpus: tuple[set[int], set[int]] | None = None):
        self.workdir = workdir
        self.cpus = cpus
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        #: Where each broker serves its metrics (from its listening line).
        self.metrics: dict[str, str] = {}

    def cpus_of(self, name: str) -> set[int] | None:
        """The CPUs process `name` (or the driver) runs on with --pin; None without."""
        if self.cpus is None:
            return None
        hops, others = self.cpus
        return hops if name in plan.HOP_PROCESSES else others

    def start(self, name: str, argv: list[str], port: int) -> None:
        path = self.workdir / f"{name}.log"
        self.logs[name] = path
        with open(path, "wb") as f:
            self.procs[name] = spawn(argv, f, f, self.cpus_of(name))
        wait_listening(name, self.procs[name], port, lambda: tail(path, name))
        if name in plan.BROKER_PROCESSES:
            addr = metrics_address(path)
            if addr is not None:
                self.metrics[name] = addr

    def allocations(self, names) -> dict[str, float | None]:
        """`rpcmesh_forwarding_allocations_total` so far of each named broker (None for a
        process that is no broker, or a broker that does not count them: an older one)."""
        return {n: scrape_allocations(self.metrics[n]) if n in self.metrics else None for n in names}

    def wait_listening(self, name: str, port: int) -> None:
        """A started server's further port (a second frontend) accepts connections."""
        wait_listening(name, self.procs[name], port, lambda: tail(self.logs[name], name))

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def check_alive(self, names) -> None:
        for n in names:
            rc = self.procs[n].poll()
            if rc is not None:
                raise ScriptError(f"{n} exited (status {rc}) during the bench\n{tail(self.logs[n], n)}", status=1)

    def usage(self, names) -> dict[str, Usage]:
        """CPU time and context switches so far of each named server."""
        try:
            return {n: proc_usage(self.pid(n)) for n in names}
        except (OSError, ValueError):
            self.check_alive(names)  # says which one died
            raise

    def cpu(self) -> float:
        """CPU seconds so far of every server together."""
        return sum(u.cpu for u in self.usage(tuple(self.procs)).values())

    def stop_all(self) -> None:
        # The reverse of the start order: clients of the provider go first, so the
        # provider has nothing in flight when it is told to stop.
        for name in reversed(list(self.procs)):
            try:
                stop(name, self.procs[name])
            except Exception as e:  # keep stopping the others
                log(f"bench: stopping {name}: {e}")


def upstream_argv(provider: Path, kind: str, port: int, args) -> list[str]:
    """The upstream of `kind`: rpcmesh's provider with the provider flags, or the classic
    server, which stands for a fixed program: no provider flags but its thread count."""
    if kind == "rpcmesh":
        return [str(provider), "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off",
                "--threads", str(args.provider_threads), *args.provider_args]  # fmt: skip
    return [str(provider), "--classic", "--listen", f"127.0.0.1:{port}",
            "--metrics-listen", "off", "--threads", str(args.provider_threads)]  # fmt: skip


def broker_argv(binary: Path, port: int, upstream_port: int, args, kind: str = "rpcmesh") -> list[str]:
    """A broker in front of the upstream of `kind` (the classic server is a plain v1 server:
    --upstream-v1): the current one, or the baseline with the same flags. Its metrics are
    served (on a port it picks) for its count of allocations, with no stage timed, so that
    the hot path takes no timestamp for them."""
    upstream = "--upstream" if kind == "rpcmesh" else "--upstream-v1"
    return [
        str(binary), "--listen", f"127.0.0.1:{port}", upstream, f"127.0.0.1:{upstream_port}",
        "--metrics-listen", "127.0.0.1:0", "--stage-metrics", "off",
        "--threads", str(args.broker_threads), *args.broker_args,
    ]  # fmt: skip


#: The broker's listening line (`rpcmesh_common::cli::startup::listening_line`).
LISTENING = re.compile(r"^rpcmesh \S+ listening rpc=\S+ metrics=(\S+)", re.MULTILINE)
#: The broker's count of forwarding allocations in its metrics.
ALLOCATIONS = re.compile(r"^rpcmesh_forwarding_allocations_total\{[^}]*\} (\S+)$", re.MULTILINE)


#: How long a broker that listens may take to print its listening line (it binds, then
#: prints: a connection can come first).
LISTENING_LINE_WAIT_S = 10.0


def metrics_address(log_path: Path) -> str | None:
    """Where a broker that is listening serves its metrics, from the line it prints; None
    for one that serves none (`metrics=off`: the yardsticks `broker/examples/floor*.rs`,
    run as a baseline, whose allocations the tables then show as '-')."""
    deadline = time.monotonic() + LISTENING_LINE_WAIT_S
    while True:
        m = LISTENING.search(log_path.read_text(errors="replace"))
        if m is not None:
            return None if m.group(1) == "off" else m.group(1)
        if time.monotonic() > deadline:
            raise ScriptError(f"no metrics address in {log_path}")
        time.sleep(0.01)


def scrape_allocations(addr: str) -> float | None:
    """A broker's `rpcmesh_forwarding_allocations_total` (None when it has none)."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        m = ALLOCATIONS.search(r.read().decode(errors="replace"))
    return float(m.group(1)) if m else None


#: The TLS paths' ports: the provider, the broker, HAProxy's and nginx's TLS frontends and
#: their handshake-only ones.
TLS_PORTS = 6


def tls_server_flags(cert, certs) -> list[str]:
    """A TLS server's own certificate, the CA, and client certificates required."""
    return ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key), "--tls-ca", str(certs.ca),
            "--tls-client-auth", "required"]  # fmt: skip


def start_all(servers: Servers, bins: dict[str, Path], args, kinds, haproxy: str, nginx: str,
              certs=None) -> tuple[dict[str, dict[str, str]], list[dict]]:
    """Starts every server of `kinds` (and, with `certs`, those of the TLS paths) and waits
    for each to listen; returns the address each kind's paths target (kind -> path ->
    host:port) and the TLS listeners whose handshakes are measured (empty without TLS)."""
    # Per kind: the upstream, the broker, HAProxy's and nginx's frontends, and the
    # baseline broker's port with --baseline-broker.
    per_kind = 5 if args.baseline_broker else 4
    # All at once, so that none is handed out twice (the proxies bind theirs last).
    ports = free_ports(per_kind * len(kinds) + (TLS_PORTS if certs is not None else 0))
    tls_ports = ports[per_kind * len(kinds) :]
    addresses: dict[str, dict[str, str]] = {}
    frontends = []
    for k, kind in enumerate(kinds):
        uport, bport, hport, nport, *more = ports[k * per_kind : (k + 1) * per_kind]
        role = plan.KIND_PROCESSES[kind]
        servers.start(role["provider"], upstream_argv(bins["provider"], kind, uport, args), uport)
        servers.start(role["broker"], broker_argv(bins["broker"], bport, uport, args, kind), bport)
        addresses[kind] = {"direct": f"127.0.0.1:{uport}", "broker": f"127.0.0.1:{bport}",
                           "haproxy": f"127.0.0.1:{hport}", "nginx": f"127.0.0.1:{nport}"}  # fmt: skip
        if args.baseline_broker:
            (oport,) = more
            try:
                argv = broker_argv(args.baseline_broker, oport, uport, args, kind) + args.baseline_args
                servers.start(role["before"], argv, oport)
            except ScriptError as e:
                raise ScriptError(f"the baseline broker {args.baseline_broker} (started with the broker's "
                                  f"flags and --baseline-args) did not start: {e}") from None  # fmt: skip
            addresses[kind]["before"] = f"127.0.0.1:{oport}"
        frontends.append((kind, hport, nport, uport))
    htls = ntls = None
    listeners: list[dict] = []
    if certs is not None:
        # The TLS paths: a provider and a broker of their own, mTLS on both of the broker's
        # hops; a TLS frontend and a handshake-only one in HAProxy and in nginx.
        tport, btport, htport, ntport, hhport, nhport = tls_ports
        servers.start("provider-tls", upstream_argv(bins["provider"], "rpcmesh", tport, args)
                      + tls_server_flags(certs["provider"], certs), tport)  # fmt: skip
        servers.start("broker-tls", broker_argv(bins["broker"], btport, tport, args)
                      + tls_server_flags(certs["broker"], certs) + ["--upstream-tls", "on"], btport)  # fmt: skip
        addresses["rpcmesh"].update({"direct-tls": f"127.0.0.1:{tport}", "broker-tls": f"127.0.0.1:{btport}",
                                     "haproxy-tls": f"127.0.0.1:{htport}", "nginx-tls": f"127.0.0.1:{ntport}"})  # fmt: skip
        htls = proxies.tls_settings(certs, htport, hhport, tport)
        ntls = proxies.tls_settings(certs, ntport, nhport, tport)
        pdns, bdns, xdns = certs["provider"].dns, certs["broker"].dns, certs["proxy"].dns
        listeners = [
            {"name": "provider", "process": "provider-tls", "port": tport, "server_name": pdns},
            {"name": "broker", "process": "broker-tls", "port": btport, "server_name": bdns},
            {"name": "haproxy", "process": "haproxy", "port": hhport, "server_name": xdns},
            {"name": "nginx", "process": "nginx", "port": nhport, "server_name": xdns},
            {"name": "haproxy path", "process": "haproxy", "port": htport, "server_name": xdns},
            {"name": "nginx path", "process": "nginx", "port": ntport, "server_name": xdns},
        ]
    cfg = servers.workdir / "haproxy.cfg"
    cfg.write_text(proxies.haproxy_config([(k, h, u) for k, h, _, u in frontends], htls))
    servers.start("haproxy", proxies.haproxy_argv(haproxy, cfg), frontends[0][1])
    for port in [h for _, h, _, _ in frontends[1:]] + ([htls["path_port"], htls["handshake_port"]] if htls else []):
        servers.wait_listening("haproxy", port)
    ncfg = servers.workdir / "nginx.conf"
    ncfg.write_text(proxies.nginx_config([(k, n, u) for k, _, n, u in frontends], servers.workdir, ntls))
    servers.start("nginx", proxies.nginx_argv(nginx, ncfg, servers.workdir), frontends[0][2])
    for port in [n for _, _, n, _ in frontends[1:]] + ([ntls["path_port"], ntls["handshake_port"]] if ntls else []):
        servers.wait_listening("nginx", port)
    for li in listeners:
        li["pid"] = servers.pid(li["process"])
    return addresses, listeners
