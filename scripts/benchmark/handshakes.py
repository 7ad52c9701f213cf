"""Handshakes per second per core of each TLS listener, with and without session
resumption, and the protocol, cipher suite and key exchange each listener negotiates.

**How.** `HANDSHAKE_CLIENTS` client processes each open connections one after another for a
bounded time, each a full TLS 1.3 handshake with the driver's certificate (mutual TLS, as
on the TLS paths), or each resuming the session of the connection before it; the listening
server's CPU time is read before and after, and handshakes ÷ the server's CPU seconds is
its rate per core (what one core of it would sustain). The CPU time is the sum over the
server's threads of /proc/<pid>/task/*/schedstat's time on a CPU, in nanoseconds: a
handshake costs a few hundred microseconds, and /proc/<pid>/stat's 10 ms ticks would make
a short measurement's figure coarse. The clients run in processes of their own.

**Why not `openssl s_time`.** Its `-reuse` keeps the session it holds right after the
handshake; in TLS 1.3 the server sends its session tickets after the handshake, and s_time
reads them only when it also fetches a page over HTTP (`-www`), which the rpcmesh servers
do not serve: without it no handshake resumes. rustls's tickets are also single-use
(stateful, taken from the server's cache on resumption), so a client must keep the newest
ticket of every connection. The client here (`CLIENT`, Python's `ssl`, which is OpenSSL's
client) waits for a new ticket after each handshake in both modes, so the two modes differ
only in whether the last ticket is offered, and keeps it for the next connection.

**Which listeners.** The broker's and the provider's TLS listeners (the TLS paths' own),
and a TLS frontend of HAProxy and of nginx with the same `ssl` settings as their TLS paths'
but no upstream (HAProxy `tcp-request session reject`, nginx `return`): the handshake
alone, as the broker's listener pays it, its upstream connections pooled. Each proxy's path
frontend is measured too (`... path`): there every client connection also costs the proxy
a TLS connection to the provider (each resuming the proxy's last upstream session, both
proxies' default), which the broker does not pay."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from procs import ScriptError, log, spawn, stop

from .usage import schedstat


#: Seconds per measurement in a full bench: at a few thousand handshakes a second, 3 s make
#: thousands of handshakes and 300 clock ticks of server CPU at most (to about 1 %).
HANDSHAKE_S = 3.0
#: In smoke mode: does the measurement work, not its figures.
HANDSHAKE_SMOKE_S = 0.3
#: Measurements in a bench: six listeners (servers.start_all's), new and resumed.
MEASUREMENTS = 6 * 2
#: Client processes at once: two keep a server busy on two cores while each client waits
#: for its tickets.
HANDSHAKE_CLIENTS = 2
#: How long a client waits for the session tickets after a handshake before it goes on
#: without (a server that sends none).
TICKET_WAIT_S = 0.5
#: The client: python3 -c CLIENT HOST PORT SERVER_NAME CA CERT KEY SECONDS RESUME(0|1);
#: prints a JSON line.
CLIENT = r"""
import json, select, socket, ssl, sys, time
host, port, name, ca, cert, key, secs, resume, wait = sys.argv[1:]
port, secs, resume, wait = int(port), float(secs), resume == "1", float(wait)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
ctx.load_verify_locations(ca)
ctx.load_cert_chain(cert, key)
n = resumed = ticketless = failures = 0
session = None
first = None
end = time.monotonic() + secs
while time.monotonic() < end:
    try:
        raw = socket.create_connection((host, port), timeout=5)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s = ctx.wrap_socket(raw, server_hostname=name, session=session if resume else None)
    except (OSError, ssl.SSLError) as e:
        failures += 1
        last_error = str(e)
        continue
    n += 1
    resumed += s.session_reused
    if first is None:
        first = {"version": s.version(), "cipher": s.cipher()[0]}
    # TLS 1.3: the tickets follow the handshake; read until a new one is there (after a
    # resumption the session at hand is the one offered, its ticket already spent on a
    # server whose tickets are single-use). The proxies' handshake frontends close instead,
    # after sending theirs.
    offered = session.id if resume and session is not None else None

    def fresh():
        x = s.session
        return x is not None and x.has_ticket and x.id != offered

    s.setblocking(False)
    deadline = time.monotonic() + wait
    while not fresh() and time.monotonic() < deadline:
        try:
            if s.recv(1) == b"":
                break
        except ssl.SSLWantReadError:
            # The read may have just taken the tickets: wait only when it did not.
            if not fresh():
                select.select([s], [], [], max(0.0, deadline - time.monotonic()))
        except (OSError, ssl.SSLError):
            break
    if fresh():
        session = s.session
    else:
        ticketless += 1
        session = None
    s.close()
print(json.dumps({"handshakes": n, "resumed": resumed, "ticketless": ticketless, "failures": failures,
                  "first": first, **({"last_error": last_error} if failures else {})}))
"""


def measure(name: str, pid: int, port: int, server_name: str, certs, seconds: float, resume: bool) -> dict:
    """One measurement: handshakes with the listener on `port` of the process `pid`, by
    HANDSHAKE_CLIENTS clients at once."""
    driver = certs["driver"]
    argv = [sys.executable, "-c", CLIENT, "127.0.0.1", str(port), server_name, str(certs.ca), str(driver.cert),
            str(driver.key), str(seconds), "1" if resume else "0", str(TICKET_WAIT_S)]  # fmt: skip
    before = cpu_ns(pid)
    t0 = time.monotonic()
    clients = [spawn(argv, subprocess.PIPE, subprocess.PIPE) for _ in range(HANDSHAKE_CLIENTS)]
    results = []
    try:
        for p in clients:
            try:
                out, err = p.communicate(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                raise ScriptError(f"the handshake client against {name} did not finish", status=1) from None
            try:
                results.append(json.loads(out.decode().strip().splitlines()[-1]))
            except (ValueError, IndexError):
                raise ScriptError(f"the handshake client against {name} failed: "
                                  f"{err.decode(errors='replace')[-500:]}", status=1) from None  # fmt: skip
    finally:
        for p in clients:
            stop("driver", p)
    wall = time.monotonic() - t0
    cpu = (cpu_ns(pid) - before) / 1e9
    r = {k: sum(x[k] for x in results) for k in ("handshakes", "resumed", "ticketless", "failures")}
    r["first"] = results[0]["first"]
    errors = [x["last_error"] for x in results if "last_error" in x]
    if errors:
        r["last_error"] = errors[-1]
    return {
        "listener": name,
        "mode": "resumed" if resume else "new",
        "clients": HANDSHAKE_CLIENTS,
        **r,
        "wall_seconds": round(wall, 3),
        "server_cpu_seconds": round(cpu, 3),
        "per_second": round(r["handshakes"] / wall, 1) if wall > 0 else None,
        # Handshakes per CPU second of the server: one core's worth.
        "per_core_second": round(r["handshakes"] / cpu, 1) if cpu > 0 else None,
        "server_cpu_us_per_handshake": round(cpu * 1e6 / r["handshakes"], 1) if r["handshakes"] else None,
    }


def cpu_ns(pid: int) -> int:
    """Nanoseconds the process `pid` has run on a CPU, over all its threads
    (`usage.schedstat`); 0 on a kernel without schedstat."""
    sched = schedstat(pid)
    return 0 if sched is None else sched[0]


def measure_all(listeners: list[dict], certs, seconds: float) -> list[dict]:
    """Every listener (name, pid, port, server_name) without and with resumption."""
    out = []
    for li in listeners:
        for resume in (False, True):
            m = measure(li["name"], li["pid"], li["port"], li["server_name"], certs, seconds, resume)
            m["process"] = li["process"]
            out.append(m)
            log(f"bench: handshakes {li['name']:<17} {m['mode']:<7} {m['handshakes']:>6} in {m['wall_seconds']:.1f} s, "
                f"{m['resumed']} resumed, server {m['server_cpu_seconds']:.2f} CPU s: "
                f"{m['per_core_second'] or 0:,.0f} per core-second")  # fmt: skip
    return out


def negotiated(port: int, server_name: str, certs) -> dict:
    """What the listener on `port` negotiates with `openssl s_client` offering what the
    driver (rustls) offers: TLS 1.3, its suites in its order, its groups in its order."""
    d = certs["driver"]
    argv = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", server_name, "-CAfile",
            str(certs.ca), "-cert", str(d.cert), "-key", str(d.key), "-tls1_3", "-brief",
            "-ciphersuites", RUSTLS_SUITES, "-groups", RUSTLS_GROUPS]  # fmt: skip
    try:
        r = subprocess.run(argv, input=b"", capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return {"error": "s_client timed out"}
    text = (r.stdout + r.stderr).decode(errors="replace")
    found = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip().lower()
        if k in ("protocol version", "ciphersuite", "server temp key", "verification"):
            found[k.replace(" ", "_")] = v.strip()
    if "ciphersuite" not in found:
        found["error"] = text.strip()[-300:]
    return found


#: The TLS 1.3 suites rustls's ring provider offers, in its order (the driver's offer), as
#: OpenSSL names them; the proxies are given the same list, so every hop agrees on the first.
RUSTLS_SUITES = "TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256"
#: The key exchange groups rustls's ring provider offers, in its order.
RUSTLS_GROUPS = "X25519:P-256:P-384"
