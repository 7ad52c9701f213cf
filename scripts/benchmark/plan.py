"""What the bench runs, and why these numbers: the paths to the upstream, the kinds of
upstream and the process that plays each role for each, the workloads and their levels, the
repeats and durations of a full run and of smoke mode. No side effects.

Each workload runs against one kind of upstream:

    direct   driver -> upstream
    broker   driver -> broker -> upstream
    haproxy  driver -> haproxy -> upstream
    nginx    driver -> nginx (stream) -> upstream

where the upstream is rpcmesh's provider (workloads echo and platform) or the classic
server (workload classic: `provider --classic`, a plain RPCF v1 server as the original
framework's, which never sets TCP_NODELAY and answers one call at a time per connection, in
order, one write per reply). The classic server has a broker of its own (`--upstream-v1`)
and a second frontend of the same HAProxy and nginx. With `--baseline-broker`, a fifth path
runs right after the broker's:

    before   driver -> baseline broker -> upstream

Against rpcmesh's provider only (the classic server speaks no TLS), four TLS paths follow
the plain ones in every repeat (`--tls off` leaves them out), all with the certificates of
one CA made for the bench (`certs`), TLS 1.3 and client certificates on every hop:

    direct-tls   driver -> provider (TLS)
    broker-tls   driver -> broker (mTLS) -> provider (mTLS, --upstream-tls on)
    haproxy-tls  driver -> haproxy (ssl bind, verify required) -> provider (ssl server line)
    nginx-tls    driver -> nginx (stream, listen ssl) -> provider (proxy_ssl on)

The provider and the broker of the TLS paths are processes of their own (`provider-tls`,
`broker-tls`), so that the plain paths run exactly as before; HAProxy and nginx serve them
from the same process as their plain frontends.
"""

from __future__ import annotations

#: The four ways to reach the upstream, in the order they run within a repeat.
PATHS = ("direct", "broker", "haproxy", "nginx")
#: With --baseline-broker: a fifth, the same provider behind the baseline broker, run right
#: after the current broker's path so that the two are next to each other in time.
BASELINE_PATHS = ("direct", "broker", "before", "haproxy", "nginx")
#: The TLS paths (rpcmesh's provider only), in the order they run, after the plain ones.
TLS_PATHS = ("direct-tls", "broker-tls", "haproxy-tls", "nginx-tls")
#: The TLS proxies the broker with TLS is held against.
TLS_PROXY_PATHS = ("haproxy-tls", "nginx-tls")
#: The roles whose CPU counts for each path (the driver always counts too). "before" is both
#: a path and its role, the baseline broker. Which process plays a role depends on the
#: upstream kind (KIND_PROCESSES); the reports name the role.
PATH_SERVERS = {
    "direct": ("provider",),
    "broker": ("broker", "provider"),
    "before": ("before", "provider"),
    "haproxy": ("haproxy", "provider"),
    "nginx": ("nginx", "provider"),
    "direct-tls": ("provider",),
    "broker-tls": ("broker", "provider"),
    "haproxy-tls": ("haproxy", "provider"),
    "nginx-tls": ("nginx", "provider"),
}
#: The processes in the middle of a path, the hops whose own cost the bench compares. With
#: --pin each runs on a CPU of its own (`pin_cpus`), every other process (the driver, the
#: upstream) on the rest, so that their CPU per call is compared without the scheduler
#: placing them differently from run to run.
HOP_PROCESSES = ("broker", "before", "broker-v1", "before-v1", "broker-tls", "haproxy", "nginx")
#: The brokers, whose forwarding allocations are counted (their metrics are on for it, with
#: the stage timing off: `rpcmesh_forwarding_allocations_total`, read before and after each
#: run).
BROKER_PROCESSES = ("broker", "before", "broker-v1", "before-v1", "broker-tls")


def pin_cpus(cpus: set[int]) -> tuple[set[int], set[int]]:
    """With --pin: the hops' CPU (the last of `cpus`) and the others' (the rest; all of
    them on a one-CPU machine)."""
    hop = max(cpus)
    rest = (cpus - {hop}) or {hop}
    return {hop}, rest


#: The kinds of upstream server, in the order they are started: rpcmesh's provider, and the
#: classic server (`provider --classic`, see the module docstring).
KINDS = ("rpcmesh", "classic")
#: The process that plays each role for each kind: the classic server has a broker (and a
#: baseline broker) of its own, started with --upstream-v1; HAProxy and nginx serve both
#: kinds from one process each, one frontend (server block) per kind.
KIND_PROCESSES = {
    "rpcmesh": {"provider": "provider", "broker": "broker", "before": "before", "haproxy": "haproxy", "nginx": "nginx"},
    "classic": {"provider": "classic", "broker": "broker-v1", "before": "before-v1", "haproxy": "haproxy",
                "nginx": "nginx"},
}  # fmt: skip
#: On a TLS path the provider and the broker are the TLS processes of their own; HAProxy
#: and nginx are the same processes (a TLS frontend each).
TLS_PROCESSES = {"provider": "provider-tls", "broker": "broker-tls", "haproxy": "haproxy", "nginx": "nginx"}
#: The upstream kind of each workload.
WORKLOAD_KIND = {"echo": "rpcmesh", "platform": "rpcmesh", "classic": "classic"}
#: What the driver is told for each workload: its --workload, and flags of its own. The
#: classic server speaks plain v1 only (a flagged request is refused), so its callers send
#: plain v1 frames, as the original framework's client does.
DRIVER_WORKLOAD = {"echo": ("echo", ()), "platform": ("platform", ()), "classic": ("echo", ("--v1",))}
#: The L4 proxies the broker is held against (P1: broker ÷ the better of them).
PROXY_PATHS = ("haproxy", "nginx")
#: Echo of 32 bytes (the published echo benchmarks) and the reference platform query, both
#: against rpcmesh's provider; echo of 32 bytes in plain v1 frames against the classic server.
WORKLOADS = ("echo", "platform", "classic")
ECHO_PAYLOAD_BYTES = 32
#: (calls in flight, client connections): 1, 8 and 64 in flight over 8 connections, and
#: the reference report's shape, 200 connections with one call in flight each, where the
#: broker's pooling matters. The driver never opens more connections than calls in flight,
#: so "1 over 8" uses one connection.
LEVELS = ((1, 8), (8, 8), (64, 8), (200, 200))
#: The classic server's shape (P3), unless --levels says otherwise: 8 client connections
#: with one call in flight each, the original framework's benchmark (8 client threads making
#: synchronous calls over a pool of 8 connections, as its published figures were run). Each
#: client connection carries one call at a time, so HAProxy and nginx, one server
#: connection per client connection, never have two calls on one server connection; the
#: broker pools the 8 callers onto its 4 connections (--upstream-v1, its defaults), two
#: calls on each, so a reply the server writes while its previous one is still
#: unacknowledged meets Nagle's algorithm on the server and a delayed ACK on the broker.
#: More calls per client connection would put HAProxy in the same spot; one connection in
#: all would leave the broker nothing to pool.
CLASSIC_LEVELS = ((8, 8),)
#: Three repeats: the median of three already ignores one disturbed run.
DEFAULT_REPEATS = 3
#: 2 s measured after 0.5 s of warm-up: (2 workloads x 4 levels + the classic level) x 4
#: paths x 3 repeats = 108 runs of ~2.6 s, about 4.8 minutes, under the 5-minute budget; a run
#: still makes 10^4 to 10^5 calls, enough for a stable p99.9. With --baseline-broker, 5 paths:
#: 135 runs, about 6 minutes (over the budget: narrow it with --workloads or --levels when
#: that matters).
DEFAULT_DURATION_S = 2.0
DEFAULT_WARMUP_S = 0.5
#: A TLS path's run warms up longer: its 200 connections each begin with a handshake (two
#: through a proxy, which also connects to the provider, at 1.5-2.5 ms of a proxy's CPU
#: each on the reference machine), and in 0.5 s a loaded proxy was still handshaking when
#: the measured window opened (its CPU per call at 200/200 tripled). 2 s covers it with room.
TLS_WARMUP_S = 2.0
#: Smoke mode (for the test that keeps this script from rotting): echo and classic at 8 in
#: flight, one repeat, each run well under a second. It checks that every path of both
#: upstream kinds answers, not the numbers.
SMOKE_WORKLOADS = ("echo", "classic")
SMOKE_LEVELS = ((8, 8),)
SMOKE_DURATION_S = 0.3
SMOKE_WARMUP_S = 0.1
#: All processes share two cores: one runtime thread each is the fair and fastest setting
#: (the way to win is fewer syscalls, not more threads).
DEFAULT_THREADS = 1
#: The bench part (not the build) is meant to stay under this: about 5 minutes for the
#: plain paths, and as much again for the TLS paths (4 more paths for the 8 cells of
#: rpcmesh's provider, 96 runs, with a longer warm-up: TLS_WARMUP_S) and the handshake
#: measurement (about a minute).
TIME_BUDGET_S = 780.0


def paths(baseline: bool, tls: bool = False) -> tuple[str, ...]:
    """The paths of a run, in the order they run within a repeat (the TLS ones only for
    rpcmesh's provider: `kind_paths`)."""
    return (BASELINE_PATHS if baseline else PATHS) + (TLS_PATHS if tls else ())


def kind_paths(paths, kind: str) -> tuple[str, ...]:
    """The paths of `paths` that an upstream kind has: the classic server has no TLS."""
    return tuple(p for p in paths if kind == "rpcmesh" or p not in TLS_PATHS)


def is_tls(path: str) -> bool:
    return path in TLS_PATHS


def process_of(kind: str, path: str, role: str) -> str:
    """The server process that plays `role` on `path` for the upstream `kind`."""
    return TLS_PROCESSES[role] if is_tls(path) else KIND_PROCESSES[kind][role]


def kinds(workloads) -> list[str]:
    """The upstream kinds the workloads need, in the order they are started."""
    return [k for k in KINDS if any(WORKLOAD_KIND[w] == k for w in workloads)]


def cell_key(r: dict) -> tuple:
    """(workload, (in flight, connections asked)): which cell a run, cell or ratio row is of."""
    return r["workload"], (r["in_flight"], r["connections_asked"])
