"""From runs to the report's cells and ratio rows: a cell is one workload x level x path,
its figures the medians over the repeats; a ratio row is one workload x level, the paths
held against each other (the ratios of the cells' medians, and the same ratios within each
repeat, which show how much they move). Pure: no I/O."""

from __future__ import annotations

import statistics

from .plan import PATHS, PROXY_PATHS, TLS_PATHS, TLS_PROXY_PATHS, WORKLOAD_KIND, cell_key, kind_paths

#: The run figures each cell gives the median of.
METRICS = ("calls_per_second", "p50_us", "p99_us", "p999_us", "max_us", "slow_calls", "cpu_us_per_call_all")
#: The processes whose CPU the tables show, by role.
CPU_COLUMNS = ("provider", "broker", "haproxy", "nginx", "driver")
#: With --baseline-broker: the baseline broker's column too.
BASELINE_CPU_COLUMNS = ("provider", "broker", "before", "haproxy", "nginx", "driver")
#: Where a process's time went, per call sent: user-mode µs, kernel µs, context switches,
#: and (servers only) µs waiting for a CPU.
PER_CALL = ("user_us", "system_us", "switches", "waited_us")


def median_of(runs, key):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def cpu_columns(baseline: bool) -> tuple[str, ...]:
    return BASELINE_CPU_COLUMNS if baseline else CPU_COLUMNS


def summarize(runs: list[dict], workloads, levels: dict, paths=PATHS) -> tuple[list[dict], list[dict]]:
    """Cells (workload x level x path: medians over the repeats) and ratio rows (workload x
    level); `levels` gives each workload's levels."""
    cells, ratios = [], []
    baseline = "before" in paths
    for w in workloads:
        for level in levels[w]:
            by_path = {}
            for path in kind_paths(paths, WORKLOAD_KIND[w]):
                rs = [r for r in runs if (cell_key(r), r["path"]) == ((w, level), path)]
                cell = summarize_cell(rs, w, level, path, cpu_columns(baseline))
                cells.append(cell)
                by_path[path] = cell
            cell_runs = [r for r in runs if cell_key(r) == (w, level)]
            ratios.append(ratio_row(by_path, cell_runs, w, level, baseline))
    return cells, ratios


def summarize_cell(rs: list[dict], w: str, level, path: str, columns) -> dict:
    """One cell from its runs `rs` (one per repeat)."""
    cell = {
        "workload": w,
        "kind": WORKLOAD_KIND[w],
        "in_flight": level[0],
        "connections_asked": level[1],
        "connections": next((r["connections"] for r in rs if "connections" in r), min(level)),
        "path": path,
        "runs": len(rs),
        "failed_runs": sum(not r["ok"] for r in rs),
        "errors_total": sum(r.get("errors_total", 0) for r in rs),
        "slow_calls_total": sum(r.get("slow_calls", 0) for r in rs),
        "median": {m: median_of(rs, m) for m in METRICS},
        "median_cpu_per_1000_calls": {},
    }
    cell["median_per_call"] = {}
    for n in columns:
        vals = [r["cpu_per_1000_calls"][n] for r in rs if n in r.get("cpu_per_1000_calls", {})]
        cell["median_cpu_per_1000_calls"][n] = statistics.median(vals) if vals else None
        split = [r["per_call"][n] for r in rs if n in r.get("per_call", {})]
        if split:
            cell["median_per_call"][n] = {
                k: statistics.median(x[k] for x in split) for k in PER_CALL if all(k in x for x in split)
            }
    allocs = [r["allocations_per_call"]["broker"] for r in rs if "broker" in r.get("allocations_per_call", {})]
    # The broker's heap allocations per call (its forwarding path's count), on its paths.
    cell["median_allocations_per_call"] = statistics.median(allocs) if allocs else None
    return cell


#: The TLS goals of issue 32: broker-tls ÷ the better TLS proxy at least this at 200
#: connections x 1 in flight (pooling's point, as T2), and at least TLS_GOAL elsewhere.
TLS_GOAL_200 = 1.3
TLS_GOAL = 1.0


def tls_goal(level) -> float:
    """The goal of broker-tls ÷ the better TLS proxy in a cell of this level."""
    return TLS_GOAL_200 if tuple(level) == (200, 200) else TLS_GOAL


def tls_ratios(by_path: dict[str, dict], by_repeat, level) -> dict:
    """The TLS paths held against each other: broker-tls against the better TLS proxy of
    the cell (and its goal and verdict), against direct-tls, and what TLS costs each path
    (its calls/s ÷ the plain path's, its CPU of all processes per call minus the plain
    path's)."""

    def cps(p):
        return by_path[p]["median"]["calls_per_second"] if p in by_path else None

    def cpu_all(p):
        return by_path[p]["median"]["cpu_us_per_call_all"] if p in by_path else None

    proxies = {p: cps(p) for p in TLS_PROXY_PATHS if cps(p)}
    best = max(proxies, key=proxies.get) if proxies else None
    b = cps("broker-tls")
    value = b / proxies[best] if best and b is not None else None
    goal = tls_goal(level)
    out = {
        "best_tls_proxy": best,
        "broker_tls_over_best_tls_proxy": value,
        "broker_tls_over_best_tls_proxy_by_repeat": by_repeat("broker-tls", best) if best else [],
        "tls_goal": goal,
        "tls_verdict": "-" if value is None else ("PASS" if value >= goal else "MISS"),
        "broker_tls_over_direct_tls": b / cps("direct-tls") if b is not None and cps("direct-tls") else None,
        "broker_tls_over_haproxy_tls": b / cps("haproxy-tls") if b is not None and cps("haproxy-tls") else None,
        "broker_tls_over_nginx_tls": b / cps("nginx-tls") if b is not None and cps("nginx-tls") else None,
    }
    for tls_path in TLS_PATHS:
        plain = tls_path.removesuffix("-tls")
        key = plain.replace("-", "_")
        x, y = cps(tls_path), cps(plain)
        out[f"{key}_tls_over_plain"] = x / y if x is not None and y else None
        cx, cy = cpu_all(tls_path), cpu_all(plain)
        out[f"{key}_tls_added_cpu_us_per_call"] = cx - cy if cx is not None and cy is not None else None
    return out


def ratio_row(by_path: dict[str, dict], runs: list[dict], w: str, level, baseline: bool) -> dict:
    """One workload x level's ratios, from its cells by path and its runs (every path and
    repeat)."""

    def ratio(a, b):
        x, y = by_path[a]["median"]["calls_per_second"], by_path[b]["median"]["calls_per_second"]
        return x / y if x is not None and y else None

    def by_repeat(a, b):
        # The same ratio within each repeat (runs next to each other in time): the
        # table uses the ratio of the medians; these show how much it moves.
        rs = {(r["path"], r["repeat"]): r.get("calls_per_second") for r in runs}
        reps = sorted({k[1] for k in rs})
        return [rs[(a, i)] / rs[(b, i)] if rs.get((a, i)) and rs.get((b, i)) else None for i in reps]

    # P1: the broker against the better of the two L4 proxies in this cell.
    proxies = {p: by_path[p]["median"]["calls_per_second"] for p in PROXY_PATHS if p in by_path}
    proxies = {p: v for p, v in proxies.items() if v}
    best = max(proxies, key=proxies.get) if proxies else None
    bcps = by_path["broker"]["median"]["calls_per_second"]
    b50, d50 = by_path["broker"]["median"]["p50_us"], by_path["direct"]["median"]["p50_us"]
    b999, h999 = by_path["broker"]["median"]["p999_us"], by_path["haproxy"]["median"]["p999_us"]

    def added_cpu(path):
        # What the hop adds, CPU of all processes per call, over the direct path.
        x, d = by_path[path]["median"]["cpu_us_per_call_all"], by_path["direct"]["median"]["cpu_us_per_call_all"]
        return x - d if x is not None and d is not None else None

    badd, hadd = added_cpu("broker"), added_cpu("haproxy")
    row = {
        "workload": w,
        "kind": WORKLOAD_KIND[w],
        "in_flight": level[0],
        "connections_asked": level[1],
        "connections": by_path["direct"]["connections"],
        "broker_over_direct": ratio("broker", "direct"),
        "broker_over_haproxy": ratio("broker", "haproxy"),
        "broker_over_nginx": ratio("broker", "nginx"),
        "best_proxy": best,
        "broker_over_best_proxy": bcps / proxies[best] if best and bcps is not None else None,
        "broker_minus_direct_p50_us": b50 - d50 if b50 is not None and d50 is not None else None,
        "broker_over_haproxy_p999": b999 / h999 if b999 is not None and h999 else None,
        "broker_added_cpu_us_per_call": badd,
        "haproxy_added_cpu_us_per_call": hadd,
        # P2. A hop that adds nothing (or less than nothing, within the noise) has no ratio.
        "broker_over_haproxy_added_cpu": badd / hadd if badd is not None and hadd and hadd > 0 else None,
        "broker_over_direct_by_repeat": by_repeat("broker", "direct"),
        "broker_over_haproxy_by_repeat": by_repeat("broker", "haproxy"),
        "broker_over_nginx_by_repeat": by_repeat("broker", "nginx"),
    }
    if "broker-tls" in by_path:
        row.update(tls_ratios(by_path, by_repeat, level))
    if baseline:
        # The current broker against the baseline: calls/s, and the broker process's
        # own CPU per call (each on its own path).
        x = by_path["broker"]["median_cpu_per_1000_calls"]["broker"]
        y = by_path["before"]["median_cpu_per_1000_calls"]["before"]
        row["broker_over_before"] = ratio("broker", "before")
        row["broker_over_before_cpu_per_call"] = x / y if x is not None and y else None
        row["broker_over_before_by_repeat"] = by_repeat("broker", "before")
    return row
