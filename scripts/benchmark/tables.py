"""The rows of the reports' tables (the cells, where their CPU went, the ratios, the
targets) and how a table is drawn, as aligned text for the terminal or as Markdown for the
file: one set of rows, two drawings. Number formatting for every report line lives here
too (`fmt_num`: '-' for a figure not measured)."""

from __future__ import annotations

from .plan import ECHO_PAYLOAD_BYTES
from .summary import CPU_COLUMNS


def workload_label(w: str) -> str:
    """How the tables name a workload: the echoes with their size."""
    return {"echo": f"echo {ECHO_PAYLOAD_BYTES} B", "classic": f"classic echo {ECHO_PAYLOAD_BYTES} B"}.get(w, w)


def fmt_num(v, spec):
    """`v` formatted by `spec`, or '-' when it was not measured (None)."""
    return "-" if v is None else format(v, spec)


def table_rows(cells, columns=CPU_COLUMNS) -> tuple[list[str], list[list[str]]]:
    """The main table: each cell's medians, its errors, and the CPU per 1,000 calls of each
    process in `columns`."""
    head = ["workload", "in flight", "conns", "path", "calls/s", "p50 us", "p99 us", "p99.9 us", "max us",
            "calls >30ms", "errors", *(f"cpu {n}" for n in columns)]  # fmt: skip
    rows = []
    for c in cells:
        m = c["median"]
        flag = ""
        if c["failed_runs"]:
            flag = f"FAILED {c['failed_runs']}/{c['runs']}"
        elif c["errors_total"]:
            flag = f"{c['errors_total']} (!)"
        else:
            flag = "0"
        rows.append(
            [
                workload_label(c["workload"]),
                str(c["in_flight"]),
                str(c["connections"]) + ("*" if c["connections"] != c["connections_asked"] else ""),
                c["path"],
                fmt_num(m["calls_per_second"], ",.0f"),
                fmt_num(m["p50_us"], ".0f"),
                fmt_num(m["p99_us"], ".0f"),
                fmt_num(m["p999_us"], ".0f"),
                fmt_num(m["max_us"], ".0f"),
                # Summed over the repeats, like the errors.
                str(c.get("slow_calls_total", 0)),
                flag,
            ]
            + [fmt_num(c["median_cpu_per_1000_calls"][n], ".5f") for n in columns]
        )
    return head, rows


def split_rows(cells, columns=CPU_COLUMNS) -> tuple[list[str], list[list[str]]]:
    """Where the CPU goes: each process's µs per call in user mode + in the kernel, its
    context switches per call, and for a server the µs per call it waited for a CPU."""
    head = ["workload", "in flight", "conns", "path"]
    for n in columns:
        head += [f"{n} user+sys us", f"{n} switches"] + ([f"{n} waited us"] if n != "driver" else [])
    head.append("broker allocs/call")
    rows = []
    for c in cells:
        row = [
            workload_label(c["workload"]),
            str(c["in_flight"]),
            str(c["connections"]) + ("*" if c["connections"] != c["connections_asked"] else ""),
            c["path"],
        ]
        for n in columns:
            m = c.get("median_per_call", {}).get(n)
            if m is None:
                row += ["-", "-"]
            else:
                row += [f"{m['user_us']:.2f}+{m['system_us']:.2f}", f"{m['switches']:.3f}"]
            if n != "driver":
                row.append(fmt_num((m or {}).get("waited_us"), ".2f"))
        row.append(fmt_num(c.get("median_allocations_per_call"), ".4f"))
        rows.append(row)
    return head, rows


def ratio_rows(ratios, baseline=False) -> tuple[list[str], list[list[str]]]:
    """The paths held against each other, one row per workload x level."""
    head = ["workload", "in flight", "conns", "broker/direct calls/s", "broker/haproxy calls/s", "broker/nginx calls/s",
            "broker-direct p50 us", "broker/haproxy p99.9", "added cpu us broker/haproxy"]  # fmt: skip
    if baseline:
        head += ["broker/before calls/s", "broker/before broker cpu/call"]
    rows = [
        [
            workload_label(r["workload"]),
            str(r["in_flight"]),
            str(r["connections"]),
            fmt_num(r["broker_over_direct"], ".2f"),
            fmt_num(r["broker_over_haproxy"], ".2f"),
            fmt_num(r.get("broker_over_nginx"), ".2f"),
            fmt_num(r["broker_minus_direct_p50_us"], "+.0f"),
            fmt_num(r.get("broker_over_haproxy_p999"), ".2f"),
            (f"{fmt_num(r.get('broker_added_cpu_us_per_call'), '+.2f')} / {fmt_num(r.get('haproxy_added_cpu_us_per_call'), '+.2f')}"
             f" = {fmt_num(r.get('broker_over_haproxy_added_cpu'), '.2f')}"),
        ]
        # Three decimals: the verdict is about a few per cent.
        + ([fmt_num(r["broker_over_before"], ".3f"), fmt_num(r["broker_over_before_cpu_per_call"], ".3f")]
           if baseline else [])  # fmt: skip
        for r in ratios
    ]
    return head, rows


def target_rows(targets) -> tuple[list[str], list[list[str]]]:
    """Each target: what it is, the value measured, its goal, the verdict and the note."""
    head = ["target", "what", "measured", "goal", "verdict", "note"]
    rows = []
    for t in targets:
        unit = f" {t['unit']}" if t["unit"] else ""
        spec = ".0f" if t["unit"] else ".3f"
        value = fmt_num(t["value"], spec) + (unit if t["value"] is not None else "")
        goal = f"{t['op']} {t['threshold']:g}{unit}"
        if "and" in t:
            a = t["and"]
            value += f"; {a['what']} {fmt_num(t.get('value2'), spec)}"
            goal += f" and {a['what']} {a['op']} {a['threshold']:g}"
        rows.append([t["id"], t["what"], value, goal, t["verdict"], t["note"]])
    return head, rows


def text_table(head, rows, left=(0,)) -> str:
    """Columns in `left` are text (left-aligned); the others are numbers."""
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        parts = [x.ljust(w) if i in left else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(head, rows, left=(0,)) -> str:
    """The same table in Markdown: columns in `left` left-aligned, `|` escaped."""
    align = ["---" if i in left else "---:" for i in range(len(head))]
    esc = lambda x: x.replace("|", "\\|")  # noqa: E731
    return "\n".join("| " + " | ".join(esc(x) for x in r) + " |" for r in [head, align, *rows])


def tls_rows(cells, ratios) -> tuple[list[str], list[list[str]]]:
    """The TLS table, one row per cell of rpcmesh's provider: each TLS path's calls/s,
    broker-tls ÷ the better TLS proxy against its goal, what TLS costs the broker (its
    calls/s ÷ the plain broker's) and the CPU of all processes per call of each TLS path."""
    head = ["workload", "in flight", "conns", "direct-tls", "broker-tls", "haproxy-tls", "nginx-tls",
            "broker-tls / best TLS proxy", "goal", "verdict", "broker-tls / broker",
            "cpu us/call all: direct-tls", "broker-tls", "haproxy-tls", "nginx-tls"]  # fmt: skip
    rows = []
    for r in ratios:
        if "broker_tls_over_best_tls_proxy" not in r:
            continue

        def cell(path, r=r):
            return next((c for c in cells if c["path"] == path and c["workload"] == r["workload"]
                         and (c["in_flight"], c["connections_asked"]) == (r["in_flight"], r["connections_asked"])), None)  # fmt: skip

        def cps(path):
            c = cell(path)
            return fmt_num(c["median"]["calls_per_second"] if c else None, ",.0f")

        def cpu(path):
            c = cell(path)
            return fmt_num(c["median"]["cpu_us_per_call_all"] if c else None, ".2f")

        best = r.get("best_tls_proxy")
        rows.append(
            [workload_label(r["workload"]), str(r["in_flight"]), str(r["connections"]),
             cps("direct-tls"), cps("broker-tls"), cps("haproxy-tls"), cps("nginx-tls"),
             fmt_num(r["broker_tls_over_best_tls_proxy"], ".2f") + (f" ({best.removesuffix('-tls')})" if best else ""),
             f">= {r['tls_goal']:g}", r["tls_verdict"], fmt_num(r.get("broker_tls_over_plain"), ".2f"),
             cpu("direct-tls"), cpu("broker-tls"), cpu("haproxy-tls"), cpu("nginx-tls")]  # fmt: skip
        )
    return head, rows


def handshake_rows(handshakes) -> tuple[list[str], list[list[str]]]:
    """Handshakes per second per core of each TLS listener, new and resumed side by side."""
    head = ["listener", "process", "new: per core-second", "server us each", "handshakes",
            "resumed: per core-second", "server us each", "handshakes", "of them resumed"]  # fmt: skip
    rows = []
    for name in dict.fromkeys(h["listener"] for h in handshakes):
        new = next((h for h in handshakes if h["listener"] == name and h["mode"] == "new"), None)
        res = next((h for h in handshakes if h["listener"] == name and h["mode"] == "resumed"), None)
        row = [name, (new or res)["process"]]
        for h in (new, res):
            row += ["-", "-", "-"] if h is None else [fmt_num(h["per_core_second"], ",.0f"),
                                                       fmt_num(h["server_cpu_us_per_handshake"], ".0f"), str(h["handshakes"])]  # fmt: skip
        row.append("-" if res is None else f"{res['resumed']}")
        rows.append(row)
    return head, rows


def suite_rows(suites: dict) -> tuple[list[str], list[list[str]]]:
    """What each TLS path's first listener negotiates with openssl s_client."""
    head = ["path", "protocol", "cipher suite", "key exchange", "server certificate"]
    rows = []
    for path, s in suites.items():
        rows.append([path, s.get("protocol_version", "-"), s.get("ciphersuite", s.get("error", "-")[:60]),
                     s.get("server_temp_key", "-"), s.get("verification", "-")])  # fmt: skip
    return head, rows
