//! The capacity report as one self-contained HTML page: its layout (setup, SLO, a table
//! per search, the comparison, the sweep and its USL fit) and where each chart goes. The
//! markup is a maud template, which escapes every piece of text it is given; only the
//! style sheet, the charts' SVG and the page's own script go in unescaped, and none of
//! them holds text from the report (a chart's labels are escaped by plotters' SVG writer).
//! A small inline script at the end marks which charts a browser actually drew (for the
//! tests, and for a person who wonders why a chart is blank).
//!
//! The figures are [`crate::report`]'s, formatted by [`rpcmesh_common::format`]; the
//! charts are [`charts`]' and [`bars`]'. The page needs nothing at run time: no fonts, no
//! external files, no JavaScript libraries.

mod bars;
mod charts;
mod faults;

pub use faults::render as render_faults;

use std::collections::BTreeSet;
use std::time::{Duration, UNIX_EPOCH};

use maud::{DOCTYPE, Markup, PreEscaped, html};
use rpcmesh_common::format::{
    MISSING, amount, change, fixed, maybe, ms, percent, rate, share, signed,
};

use self::charts::Chart;
use crate::report::{CapacityReport, Comparison, Search, Step, Sweep};

/// Fewest drawn SVG elements (path, polyline, circle, rect, line) for the page's script to
/// count a chart as drawn: the frame and a background alone are two or three.
const MIN_DRAWN_ELEMENTS: usize = 8;

/// The roles whose CPU figures are shown, in path order; other roles follow by name.
const ROLE_ORDER: [&str; 3] = ["driver", "broker", "provider"];

/// The page's look: readable tables, charts no wider than the window.
const STYLE: &str = "\
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:84em;padding:0 1em;color:#222}\
h1{font-size:1.6em}h2{margin-top:1.8em;border-bottom:1px solid #ccc}h3{margin-top:1.4em}\
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}\
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}\
th{background:#f3f3f3}td.text,th.text{text-align:left}\
tr.fail td{background:#fff1f0}td.pass{color:#176117}td.fail{color:#a61b1b;min-width:11em}\
div.scroll{overflow-x:auto}\
dl.setup{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}\
dl.setup dt{font-weight:600}dl.setup dd{margin:0}\
p.verdict{font-size:1.1em;font-weight:600}p.note{color:#a61b1b}\
figure.chart{margin:1em 0}figure.chart svg{max-width:100%;height:auto}\
figcaption{font-size:.9em;color:#555}";

/// The HTML report of `report`: one file, nothing outside it.
pub fn render(report: &CapacityReport) -> String {
    let r = report;
    let title = format!("rpcmesh capacity: {}", r.setup.workload);
    let body = html! {
        h1 { (title) }
        (summary(r))
        (setup(r))
        (slo(r))
        h2 { "Searches" }
        @for s in &r.searches {
            (search(r, s))
        }
        @if r.searches.is_empty() {
            p { "No search was run." }
        }
        (figure("throughput", charts::throughput_chart(r)))
        (figure("latency", charts::latency_chart(r)))
        @if let Some(c) = &r.comparison {
            (comparison(c))
        }
        (figure("compression", bars::compression_chart(r)))
        @if let Some(s) = &r.sweep {
            (sweep(r, s))
            (figure("usl", charts::usl_chart(s)))
        }
    };
    page(&title, body)
}

/// A whole page titled `title` around `body`: the style sheet, and at its end the script
/// that marks which charts were drawn.
fn page(title: &str, body: Markup) -> String {
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                (body)
                script { (PreEscaped(drawn_check_script())) }
            }
        }
    };
    page.into_string() + "\n"
}

/// The script that marks each `figure.chart` `data-drawn="yes"` when its SVG is there,
/// has an area and holds at least [`MIN_DRAWN_ELEMENTS`] drawn elements (else `"no"`), and
/// writes the number drawn on `<body data-charts-drawn>`.
fn drawn_check_script() -> String {
    format!(
        "\n(function () {{\n\
  var drawn = 0;\n\
  document.querySelectorAll('figure.chart').forEach(function (f) {{\n\
    var svg = f.querySelector('svg'), ok = false;\n\
    if (svg) {{\n\
      try {{\n\
        var box = svg.getBBox();\n\
        var shapes = svg.querySelectorAll('path, polyline, polygon, circle, rect, line').length;\n\
        ok = box.width > 0 && box.height > 0 && shapes >= {MIN_DRAWN_ELEMENTS};\n\
      }} catch (e) {{ ok = false; }}\n\
    }}\n\
    f.setAttribute('data-drawn', ok ? 'yes' : 'no');\n\
    if (ok) {{ drawn += 1; }}\n\
  }});\n\
  document.body.setAttribute('data-charts-drawn', String(drawn));\n\
}})();\n"
    )
}

/// `chart` (when there is one) as `<figure class="chart" data-chart="NAME">`, or a note
/// when it could not be drawn.
fn figure(name: &str, chart: Option<Chart>) -> Markup {
    html! {
        @if let Some(chart) = chart {
            @match chart.svg {
                Ok(svg) => figure class="chart" data-chart=(name) {
                    (PreEscaped(svg))
                    figcaption { (chart.caption) }
                },
                Err(e) => p class="note" { "The " (name) " chart could not be drawn: " (e) },
            }
        }
    }
}

fn summary(r: &CapacityReport) -> Markup {
    html! {
        p class="summary" {
            @for s in &r.searches {
                "Capacity with " (search_label(r, s)) ": " strong { (maybe(s.capacity, rate)) } ". "
            }
            "rpcmesh " (r.version) ", started " (utc(r.started_unix)) ", took "
            (fixed(r.elapsed_seconds, 1)) " s."
        }
        @if let Some(why) = &r.stopped_early {
            p class="note" { "Stopped early: " (why) }
        }
    }
}

fn setup(r: &CapacityReport) -> Markup {
    let s = &r.setup;
    let probes: Vec<String> = s
        .probes
        .iter()
        .map(|p| format!("{} at {}", p.role, p.address))
        .collect();
    let items: Vec<(&str, String)> = [
        Some(("workload", s.workload.clone())),
        (s.workload == "echo").then(|| ("payload size", format!("{} B", s.payload_size))),
        Some((
            "fan-out",
            format!(
                "{} calls per request, {}",
                s.fanout,
                if s.parallel {
                    "in parallel"
                } else {
                    "one after another"
                }
            ),
        )),
        Some(("concurrency", s.concurrency.to_string())),
        Some(("connections", s.connections.to_string())),
        Some(("targets", s.targets.join(", "))),
        Some((
            "mesh",
            if s.local_mesh {
                "local (started by the driver)".to_string()
            } else {
                "external".to_string()
            },
        )),
        s.service_work.clone().map(|w| ("service work", w)),
        Some((
            "steps",
            format!(
                "{} s measured after {} s warm-up",
                fixed(s.step_seconds, 1),
                fixed(s.warmup_seconds, 1)
            ),
        )),
        Some((
            "search",
            format!(
                "from {} to at most {} requests/s, ×{} per step, precision {}%",
                rate(s.start_rate),
                rate(s.max_rate),
                fixed(s.growth, 2),
                fixed(s.precision * 100.0, 1)
            ),
        )),
        Some((
            "time limit",
            format!("{} s", fixed(s.time_limit_seconds, 0)),
        )),
        Some((
            "probes",
            if probes.is_empty() {
                "none".to_string()
            } else {
                probes.join(", ")
            },
        )),
    ]
    .into_iter()
    .flatten()
    .collect();
    html! {
        h2 { "Setup" }
        dl class="setup" {
            @for (k, v) in &items {
                dt { (k) } dd { (v) }
            }
        }
    }
}

fn slo(r: &CapacityReport) -> Markup {
    let mut parts: Vec<String> = r
        .slo
        .latency
        .iter()
        .map(|b| format!("{} ≤ {} ms", b.percentile.name(), maybe(Some(b.max_ms), ms)))
        .collect();
    parts.push(format!("errors ≤ {}", percent(r.slo.max_error_ratio)));
    html! {
        h2 { "SLO" }
        p {
            code { (r.slo.text) } ": " (parts.join(", "))
            " (latency from each request's intended start)."
        }
    }
}

fn search(r: &CapacityReport, s: &Search) -> Markup {
    let cpu_roles = roles(s.steps.iter().flat_map(|st| st.cpu_us_per_call.keys()));
    let softirq_roles = roles(s.steps.iter().flat_map(|st| st.softirq_share.keys()));
    html! {
        h3 { (capitalized(&search_label(r, s))) }
        p {
            "Capacity " strong { (maybe(s.capacity, rate)) } " requests/s; lowest failing rate "
            (maybe(s.lowest_failing, rate)) "; ended by " code { (s.ended_by) } "."
        }
        @if s.steps.is_empty() {
            p { "No steps." }
        } @else {
            div class="scroll" {
                table class="steps" {
                    thead {
                        tr {
                            th { "#" } th class="text" { "phase" }
                            th { "offered req/s" } th { "achieved req/s" }
                            th { "p50 ms" } th { "p99 ms" } th { "p99.9 ms" } th { "errors" }
                            th { "bytes out/call" } th { "bytes in/call" }
                            @for r in &cpu_roles { th { "CPU µs/call " (r) } }
                            @for r in &softirq_roles { th { "softirq " (r) } }
                            th class="text" { "SLO" }
                        }
                    }
                    tbody {
                        @for (i, st) in s.steps.iter().enumerate() {
                            (step_row(i + 1, st, &cpu_roles, &softirq_roles))
                        }
                    }
                }
            }
        }
    }
}

fn step_row(n: usize, st: &Step, cpu_roles: &[String], softirq: &[String]) -> Markup {
    html! {
        tr class=(if st.pass { "pass" } else { "fail" }) {
            td { (n) }
            td class="text" { (st.phase.name()) }
            td { (rate(st.offered)) }
            td { (rate(st.achieved)) }
            td { (maybe(Some(st.latency.p50_ms), ms)) }
            td { (maybe(Some(st.latency.p99_ms), ms)) }
            td { (maybe(Some(st.latency.p999_ms), ms)) }
            td { (percent(st.error_ratio)) }
            td { (amount(st.bytes_out_per_call)) }
            td { (amount(st.bytes_in_per_call)) }
            @for r in cpu_roles {
                td { (st.cpu_us_per_call.get(r).map_or(MISSING.into(), |v| amount(*v))) }
            }
            @for r in softirq {
                td { (st.softirq_share.get(r).map_or(MISSING.into(), |v| share(*v))) }
            }
            @if st.pass {
                td class="text pass" { "pass" }
            } @else {
                td class="text fail" {
                    "fail"
                    @if !st.broken.is_empty() { ":" }
                    @for b in &st.broken { br; (b) }
                }
            }
        }
    }
}

fn comparison(c: &Comparison) -> Markup {
    let common = maybe(c.common_rate, rate);
    let cpu: Vec<(String, Option<f64>, Option<f64>)> = roles(
        c.cpu_us_per_call_off
            .keys()
            .chain(c.cpu_us_per_call_on.keys()),
    )
    .into_iter()
    .map(|r| {
        let (off, on) = (
            c.cpu_us_per_call_off.get(&r).copied(),
            c.cpu_us_per_call_on.get(&r).copied(),
        );
        (r, off, on)
    })
    .collect();
    let row = |label: String, off: String, on: String, change: String| {
        html! {
            tr { td class="text" { (label) } td { (off) } td { (on) } td { (change) } }
        }
    };
    html! {
        h2 { (capitalized(c.compared.name())) " off against on" }
        p class="verdict" { (c.verdict) }
        table class="comparison" {
            thead { tr { th class="text" {} th { "off" } th { "on" } th { "change" } } }
            tbody {
                (row(
                    "capacity, requests/s".into(),
                    maybe(c.capacity_off, rate),
                    maybe(c.capacity_on, rate),
                    c.capacity_change_percent
                        .map_or(MISSING.into(), |p| format!("{}%", signed(p, 1))),
                ))
                (row(
                    format!("p99 at {common} requests/s, ms"),
                    maybe(c.p99_ms_off, ms),
                    maybe(c.p99_ms_on, ms),
                    change(c.p99_ms_off, c.p99_ms_on),
                ))
                (row(
                    format!("wire bytes per call at {common} requests/s"),
                    c.bytes_per_call_off.map_or(MISSING.into(), amount),
                    c.bytes_per_call_on.map_or(MISSING.into(), amount),
                    change(c.bytes_per_call_off, c.bytes_per_call_on),
                ))
                @for (r, off, on) in &cpu {
                    (row(
                        format!("CPU µs per call, {r}"),
                        off.map_or(MISSING.into(), amount),
                        on.map_or(MISSING.into(), amount),
                        change(*off, *on),
                    ))
                }
            }
        }
    }
}

fn sweep(r: &CapacityReport, s: &Sweep) -> Markup {
    let cpu_roles = roles(s.points.iter().flat_map(|p| p.cpu_cores.keys()));
    html! {
        h2 { "Concurrency sweep" }
        p { "Closed loop, " (s.setting().label(r.comparison.as_ref().map(|c| c.compared))) "." }
        @if s.points.is_empty() {
            p { "No points." }
        } @else {
            div class="scroll" {
                table class="sweep" {
                    thead {
                        tr {
                            th { "users" } th { "requests/s" }
                            th { "calls/s" } th { "p50 ms" } th { "p99 ms" } th { "p99.9 ms" }
                            th { "errors" }
                            @for r in &cpu_roles { th { "CPU cores " (r) } }
                            @if s.fit.is_some() { th { "USL requests/s" } }
                        }
                    }
                    tbody {
                        @for p in &s.points {
                            tr {
                                td { (p.users) }
                                td { (rate(p.throughput)) }
                                td { (rate(p.calls_per_second)) }
                                td { (maybe(Some(p.latency.p50_ms), ms)) }
                                td { (maybe(Some(p.latency.p99_ms), ms)) }
                                td { (maybe(Some(p.latency.p999_ms), ms)) }
                                td { (percent(p.error_ratio)) }
                                @for r in &cpu_roles {
                                    td { (p.cpu_cores.get(r).map_or(MISSING.into(), |v| fixed(*v, 2))) }
                                }
                                @if let Some(f) = &s.fit {
                                    td { (rate(f.throughput(p.users as f64))) }
                                }
                            }
                        }
                    }
                }
            }
        }
        h3 { "Universal Scalability Law" }
        @match (&s.fit, &s.fit_error) {
            (Some(f), _) => table class="usl" {
                tbody {
                    @for (k, v) in [
                        ("σ (contention)", fixed(f.sigma, 4)),
                        ("κ (coherency)", fixed(f.kappa, 6)),
                        ("X(1), requests/s", rate(f.x1)),
                        ("R²", fixed(f.r_squared, 4)),
                        ("peak", match (f.peak_users, f.peak_throughput) {
                            (Some(u), Some(x)) => {
                                format!("{} requests/s at {} users", rate(x), fixed(u, 1))
                            }
                            (Some(u), None) => format!("at {} users", fixed(u, 1)),
                            _ => "none (κ ≤ 0: throughput does not fall)".to_string(),
                        }),
                        ("points fitted", f.points.to_string()),
                    ] {
                        tr { td class="text" { (k) } td { (v) } }
                    }
                }
            },
            (None, Some(e)) => p class="note" { "No fit: " (e) },
            (None, None) => p { "No fit." },
        }
    }
}

/// The roles among `keys`, [`ROLE_ORDER`] first, each once.
fn roles<'a>(keys: impl Iterator<Item = &'a String>) -> Vec<String> {
    let all: BTreeSet<&String> = keys.collect();
    let mut v: Vec<String> = ROLE_ORDER
        .iter()
        .filter(|r| all.iter().any(|k| k.as_str() == **r))
        .map(|r| (*r).to_string())
        .collect();
    v.extend(
        all.into_iter()
            .filter(|k| !ROLE_ORDER.contains(&k.as_str()))
            .cloned(),
    );
    v
}

/// How a search is named: `compression off`, `TLS on`, ... (see [`crate::step::Setting::label`]).
fn search_label(r: &CapacityReport, s: &Search) -> String {
    s.setting().label(r.comparison.as_ref().map(|c| c.compared))
}

/// Whether a search has the compared setting on: it is drawn in the "on" colour.
fn search_on(r: &CapacityReport, s: &Search) -> bool {
    s.setting().is_on(r.compared())
}

/// `s` with its first letter in capitals.
fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

/// Unix time `secs` as a UTC date and time (`2026-12-01 13:09:17 UTC`): RFC 3339 as
/// humantime writes it, with a space for the `T` and the zone spelled out.
fn utc(secs: u64) -> String {
    let t = UNIX_EPOCH + Duration::from_secs(secs);
    let rfc3339 = humantime::format_rfc3339_seconds(t).to_string();
    rfc3339.replacen('T', " ", 1).replace('Z', " UTC")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_time_reads_as_a_utc_date() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_796_130_557), "2026-12-01 13:09:17 UTC");
    }

    #[test]
    fn roles_come_in_path_order_then_by_name() {
        let keys = ["provider", "zeta", "driver", "alpha"].map(String::from);
        assert_eq!(roles(keys.iter()), ["driver", "provider", "alpha", "zeta"]);
    }

    #[test]
    fn text_from_the_report_is_escaped() {
        let mut r: CapacityReport = serde_json::from_str(
            r#"{"version": "0.1.0", "started_unix": 0, "elapsed_seconds": 1.0,
                "slo": {"text": "p99<=20ms", "latency": [], "max_error_ratio": 0.0},
                "searches": [], "setup": {"workload": "echo", "payload_size": 32,
                "fanout": 1, "parallel": false, "concurrency": 1, "connections": 1,
                "targets": [], "local_mesh": true, "step_seconds": 1.0,
                "warmup_seconds": 1.0, "start_rate": 1.0, "max_rate": 1.0, "growth": 2.0,
                "precision": 0.05, "time_limit_seconds": 1.0, "probes": []}}"#,
        )
        .expect("the test report parses");
        r.setup.workload = "<b>echo</b>".into();
        r.stopped_early = Some("a & b".into());
        let page = render(&r);
        assert!(
            page.contains("rpcmesh capacity: &lt;b&gt;echo&lt;/b&gt;"),
            "{page}"
        );
        assert!(page.contains("Stopped early: a &amp; b"), "{page}");
        assert!(!page.contains("<b>"), "{page}");
    }
}
