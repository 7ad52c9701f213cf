//! The capacity report as one self-contained HTML file: its layout (setup, SLO, a table
//! per search, the comparison, the sweep and its USL fit), the escaping of every piece of
//! text in it, and its charts, drawn with plotters as inline SVG. A small inline script at
//! the end marks which charts a browser actually drew (for the tests, and for a person who
//! wonders why a chart is blank).
//!
//! The figures are [`crate::report`]'s, the SLO [`crate::slo`]'s and the fit
//! [`crate::usl`]'s; this module only shows them. It needs nothing at run time: no fonts
//! (plotters' SVG backend writes `<text>` elements and leaves the font to the browser), no
//! external files, no JavaScript libraries.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use rpcmesh_common::format::{ms, thousands};

use crate::report::{CapacityReport, Comparison, Phase, Search, Step, Sweep};
use crate::usl::UslFit;

/// Appends formatted text to a `String`. Writing to a `String` cannot fail, so the
/// `fmt::Result` is dropped here once instead of at every line.
macro_rules! put {
    ($dst:expr, $($arg:tt)*) => {{
        let _ = write!($dst, $($arg)*);
    }};
}

/// Size of the line charts, pixels: wide enough for a legend of six series beside the
/// data, and no wider than a laptop's browser window.
const CHART_SIZE: (u32, u32) = (760, 440);

/// Size of the compression chart, pixels: two bar panels side by side.
const COMPRESSION_CHART_SIZE: (u32, u32) = (900, 420);

/// Room above the largest value on a linear axis, as a factor, so that the highest point
/// is not drawn on the frame.
const HEADROOM: f64 = 1.08;

/// Room above and below the data on the logarithmic latency axis, as a factor.
const LOG_HEADROOM: f64 = 1.6;

/// Points the fitted USL curve is drawn with: smooth at [`CHART_SIZE`]'s width.
const USL_CURVE_POINTS: usize = 200;

/// The USL chart's users axis is stretched to show the fitted peak only up to this many
/// times the largest measured concurrency; a peak further out is named in the caption but
/// not drawn, so that the measurements are not squeezed into a corner.
const USL_PEAK_SPAN: f64 = 4.0;

/// Font of chart titles.
const TITLE_FONT: (&str, u32) = ("sans-serif", 18);

/// Font of axis descriptions, tick labels and legends.
const LABEL_FONT: (&str, u32) = ("sans-serif", 13);

/// Fewest drawn SVG elements (path, polyline, circle, rect, line) for the page's script to
/// count a chart as drawn: the frame and a background alone are two or three.
const MIN_DRAWN_ELEMENTS: usize = 8;

/// Colour of everything measured without compression.
const OFF_COLOR: RGBColor = RGBColor(31, 119, 180);

/// Colour of everything measured with compression.
const ON_COLOR: RGBColor = RGBColor(230, 110, 10);

/// p50, p99 and p99.9 without compression: light to dark of [`OFF_COLOR`]'s hue.
const OFF_PERCENTILE_COLORS: [RGBColor; 3] = [
    RGBColor(120, 180, 220),
    RGBColor(31, 119, 180),
    RGBColor(8, 48, 107),
];

/// p50, p99 and p99.9 with compression: light to dark of [`ON_COLOR`]'s hue.
const ON_PERCENTILE_COLORS: [RGBColor; 3] = [
    RGBColor(253, 174, 107),
    RGBColor(230, 110, 10),
    RGBColor(140, 45, 4),
];

/// Colour of the SLO's bounds.
const SLO_COLOR: RGBColor = RGBColor(214, 39, 40);

/// Colour of reference lines (offered = achieved).
const REFERENCE_COLOR: RGBColor = RGBColor(130, 130, 130);

/// Colour of the sweep's measurements.
const SWEEP_COLOR: RGBColor = RGBColor(44, 140, 44);

/// Colour of the fitted USL curve and its peak.
const FIT_COLOR: RGBColor = RGBColor(110, 60, 160);

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
    let mut out = String::new();
    out.push_str("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    out.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    put!(
        out,
        "<title>rpcmesh capacity: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        esc(&report.setup.workload)
    );
    put!(
        out,
        "<h1>rpcmesh capacity: {}</h1>\n",
        esc(&report.setup.workload)
    );
    summary(&mut out, report);
    setup(&mut out, report);
    slo(&mut out, report);

    out.push_str("<h2>Searches</h2>\n");
    for s in &report.searches {
        search(&mut out, s);
    }
    if report.searches.is_empty() {
        out.push_str("<p>No search was run.</p>\n");
    }
    figure(&mut out, "throughput", throughput_chart(report));
    figure(&mut out, "latency", latency_chart(report));

    if let Some(c) = &report.comparison {
        comparison(&mut out, c);
    }
    figure(&mut out, "compression", compression_chart(report));

    if let Some(s) = &report.sweep {
        sweep(&mut out, s);
        figure(&mut out, "usl", usl_chart(s));
    }

    put!(out, "<script>\n{}</script>\n", drawn_check_script());
    out.push_str("</body>\n</html>\n");
    out
}

/// The script that marks each `figure.chart` `data-drawn="yes"` when its SVG is there,
/// has an area and holds at least [`MIN_DRAWN_ELEMENTS`] drawn elements (else `"no"`), and
/// writes the number drawn on `<body data-charts-drawn>`.
fn drawn_check_script() -> String {
    format!(
        "(function () {{\n\
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

// ---------------------------------------------------------------------------------------
// Text sections

fn summary(out: &mut String, r: &CapacityReport) {
    out.push_str("<p class=\"summary\">");
    for s in &r.searches {
        put!(
            out,
            "Capacity with {}: <strong>{}</strong>. ",
            search_label(s),
            opt_rate(s.capacity)
        );
    }
    put!(
        out,
        "rpcmesh {}, started {}, took {} s.",
        esc(&r.version),
        utc(r.started_unix),
        num(r.elapsed_seconds, 1)
    );
    out.push_str("</p>\n");
    if let Some(why) = &r.stopped_early {
        put!(out, "<p class=\"note\">Stopped early: {}</p>\n", esc(why));
    }
}

fn setup(out: &mut String, r: &CapacityReport) {
    let s = &r.setup;
    out.push_str("<h2>Setup</h2>\n<dl class=\"setup\">\n");
    let mut item = |k: &str, v: String| put!(out, "<dt>{}</dt><dd>{}</dd>\n", esc(k), v);
    item("workload", esc(&s.workload));
    if s.workload == "echo" {
        item("payload size", format!("{} B", s.payload_size));
    }
    item(
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
    );
    item("concurrency", s.concurrency.to_string());
    item("connections", s.connections.to_string());
    item("targets", esc(&s.targets.join(", ")));
    item(
        "mesh",
        if s.local_mesh {
            "local (started by the driver)".to_string()
        } else {
            "external".to_string()
        },
    );
    if let Some(w) = &s.service_work {
        item("service work", esc(w));
    }
    item(
        "steps",
        format!(
            "{} s measured after {} s warm-up",
            num(s.step_seconds, 1),
            num(s.warmup_seconds, 1)
        ),
    );
    item(
        "search",
        format!(
            "from {} to at most {} requests/s, ×{} per step, precision {}%",
            rate(s.start_rate),
            rate(s.max_rate),
            num(s.growth, 2),
            num(s.precision * 100.0, 1)
        ),
    );
    item("time limit", format!("{} s", num(s.time_limit_seconds, 0)));
    let probes = s
        .probes
        .iter()
        .map(|p| format!("{} at {}", esc(&p.role), esc(&p.address)))
        .collect::<Vec<_>>();
    item(
        "probes",
        if probes.is_empty() {
            "none".to_string()
        } else {
            probes.join(", ")
        },
    );
    out.push_str("</dl>\n");
}

fn slo(out: &mut String, r: &CapacityReport) {
    put!(out, "<h2>SLO</h2>\n<p><code>{}</code>: ", esc(&r.slo.text));
    let mut parts: Vec<String> = r
        .slo
        .latency
        .iter()
        .map(|b| format!("{} ≤ {} ms", b.percentile.name(), opt_ms(Some(b.max_ms))))
        .collect();
    parts.push(format!("errors ≤ {}", pct(r.slo.max_error_ratio)));
    put!(
        out,
        "{} (latency from each request's intended start).</p>\n",
        esc(&parts.join(", "))
    );
}

fn search(out: &mut String, s: &Search) {
    put!(
        out,
        "<h3>Compression {}</h3>\n",
        if s.compression { "on" } else { "off" }
    );
    put!(
        out,
        "<p>Capacity <strong>{}</strong> requests/s; lowest failing rate {}; ended by <code>{}</code>.</p>\n",
        opt_rate(s.capacity),
        opt_rate(s.lowest_failing),
        esc(&s.ended_by)
    );
    if s.steps.is_empty() {
        out.push_str("<p>No steps.</p>\n");
        return;
    }
    let cpu_roles = roles(s.steps.iter().flat_map(|st| st.cpu_us_per_call.keys()));
    let softirq_roles = roles(s.steps.iter().flat_map(|st| st.softirq_share.keys()));
    out.push_str("<div class=\"scroll\"><table class=\"steps\">\n");
    out.push_str("<thead><tr><th>#</th><th class=\"text\">phase</th>");
    out.push_str("<th>offered req/s</th><th>achieved req/s</th>");
    out.push_str("<th>p50 ms</th><th>p99 ms</th><th>p99.9 ms</th><th>errors</th>");
    out.push_str("<th>bytes out/call</th><th>bytes in/call</th>");
    for r in &cpu_roles {
        put!(out, "<th>CPU µs/call {}</th>", esc(r));
    }
    for r in &softirq_roles {
        put!(out, "<th>softirq {}</th>", esc(r));
    }
    out.push_str("<th class=\"text\">SLO</th></tr></thead>\n<tbody>\n");
    for (i, st) in s.steps.iter().enumerate() {
        step_row(out, i + 1, st, &cpu_roles, &softirq_roles);
    }
    out.push_str("</tbody>\n</table></div>\n");
}

fn step_row(out: &mut String, n: usize, st: &Step, cpu_roles: &[String], softirq: &[String]) {
    put!(
        out,
        "<tr class=\"{}\"><td>{n}</td><td class=\"text\">{}</td><td>{}</td><td>{}</td>",
        if st.pass { "pass" } else { "fail" },
        phase_name(st.phase),
        rate(st.offered),
        rate(st.achieved)
    );
    put!(
        out,
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
        opt_ms(Some(st.latency.p50_ms)),
        opt_ms(Some(st.latency.p99_ms)),
        opt_ms(Some(st.latency.p999_ms)),
        pct(st.error_ratio),
        amount(st.bytes_out_per_call),
        amount(st.bytes_in_per_call)
    );
    for r in cpu_roles {
        put!(
            out,
            "<td>{}</td>",
            st.cpu_us_per_call.get(r).map_or("—".into(), |v| amount(*v))
        );
    }
    for r in softirq {
        put!(
            out,
            "<td>{}</td>",
            st.softirq_share.get(r).map_or("—".into(), |v| share(*v))
        );
    }
    if st.pass {
        out.push_str("<td class=\"text pass\">pass</td></tr>\n");
    } else {
        let why = if st.broken.is_empty() {
            String::new()
        } else {
            let reasons: Vec<String> = st.broken.iter().map(|b| esc(b)).collect();
            format!(":<br>{}", reasons.join("<br>"))
        };
        put!(out, "<td class=\"text fail\">fail{why}</td></tr>\n");
    }
}

fn comparison(out: &mut String, c: &Comparison) {
    out.push_str("<h2>Compression off against on</h2>\n");
    put!(out, "<p class=\"verdict\">{}</p>\n", esc(&c.verdict));
    out.push_str("<table class=\"comparison\">\n<thead><tr><th class=\"text\"></th>");
    out.push_str("<th>off</th><th>on</th><th>change</th></tr></thead>\n<tbody>\n");
    put!(
        out,
        "<tr><td class=\"text\">capacity, requests/s</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        opt_rate(c.capacity_off),
        opt_rate(c.capacity_on),
        c.capacity_change_percent
            .map_or("—".into(), |p| format!("{}%", signed(p, 1)))
    );
    let common = opt_rate(c.common_rate);
    put!(
        out,
        "<tr><td class=\"text\">p99 at {common} requests/s, ms</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        opt_ms(c.p99_ms_off),
        opt_ms(c.p99_ms_on),
        change(c.p99_ms_off, c.p99_ms_on)
    );
    put!(
        out,
        "<tr><td class=\"text\">wire bytes per call at {common} requests/s</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        c.bytes_per_call_off.map_or("—".into(), amount),
        c.bytes_per_call_on.map_or("—".into(), amount),
        change(c.bytes_per_call_off, c.bytes_per_call_on)
    );
    for r in roles(
        c.cpu_us_per_call_off
            .keys()
            .chain(c.cpu_us_per_call_on.keys()),
    ) {
        let (off, on) = (
            c.cpu_us_per_call_off.get(&r).copied(),
            c.cpu_us_per_call_on.get(&r).copied(),
        );
        put!(
            out,
            "<tr><td class=\"text\">CPU µs per call, {}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
            esc(&r),
            off.map_or("—".into(), amount),
            on.map_or("—".into(), amount),
            change(off, on)
        );
    }
    out.push_str("</tbody>\n</table>\n");
}

fn sweep(out: &mut String, s: &Sweep) {
    put!(
        out,
        "<h2>Concurrency sweep</h2>\n<p>Closed loop, compression {}.</p>\n",
        if s.compression { "on" } else { "off" }
    );
    if s.points.is_empty() {
        out.push_str("<p>No points.</p>\n");
    } else {
        let cpu_roles = roles(s.points.iter().flat_map(|p| p.cpu_cores.keys()));
        out.push_str("<div class=\"scroll\"><table class=\"sweep\">\n");
        out.push_str("<thead><tr><th>users</th><th>requests/s</th>");
        out.push_str("<th>calls/s</th><th>p50 ms</th><th>p99 ms</th><th>p99.9 ms</th>");
        out.push_str("<th>errors</th>");
        for r in &cpu_roles {
            put!(out, "<th>CPU cores {}</th>", esc(r));
        }
        if s.fit.is_some() {
            out.push_str("<th>USL requests/s</th>");
        }
        out.push_str("</tr></thead>\n<tbody>\n");
        for p in &s.points {
            put!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
                p.users,
                rate(p.throughput),
                rate(p.calls_per_second),
                opt_ms(Some(p.latency.p50_ms)),
                opt_ms(Some(p.latency.p99_ms)),
                opt_ms(Some(p.latency.p999_ms)),
                pct(p.error_ratio)
            );
            for r in &cpu_roles {
                put!(
                    out,
                    "<td>{}</td>",
                    p.cpu_cores.get(r).map_or("—".into(), |v| num(*v, 2))
                );
            }
            if let Some(f) = &s.fit {
                put!(out, "<td>{}</td>", rate(f.throughput(p.users as f64)));
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</tbody>\n</table></div>\n");
    }
    out.push_str("<h3>Universal Scalability Law</h3>\n");
    match (&s.fit, &s.fit_error) {
        (Some(f), _) => {
            out.push_str("<table class=\"usl\">\n<tbody>\n");
            let mut row = |k: &str, v: String| {
                put!(
                    out,
                    "<tr><td class=\"text\">{}</td><td>{}</td></tr>\n",
                    esc(k),
                    v
                )
            };
            row("σ (contention)", num(f.sigma, 4));
            row("κ (coherency)", num(f.kappa, 6));
            row("X(1), requests/s", rate(f.x1));
            row("R²", num(f.r_squared, 4));
            row(
                "peak",
                match (f.peak_users, f.peak_throughput) {
                    (Some(u), Some(x)) => format!("{} requests/s at {} users", rate(x), num(u, 1)),
                    (Some(u), None) => format!("at {} users", num(u, 1)),
                    _ => "none (κ ≤ 0: throughput does not fall)".to_string(),
                },
            );
            row("points fitted", f.points.to_string());
            out.push_str("</tbody>\n</table>\n");
        }
        (None, Some(e)) => put!(out, "<p class=\"note\">No fit: {}</p>\n", esc(e)),
        (None, None) => out.push_str("<p>No fit.</p>\n"),
    }
}

// ---------------------------------------------------------------------------------------
// Charts

/// Why a chart could not be drawn: plotters' drawing error.
type ChartError = Box<dyn std::error::Error>;

/// A drawing area of the SVG backend.
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// A chart ready for the page.
#[derive(Debug)]
struct Chart {
    /// The SVG, or why it could not be drawn.
    svg: Result<String, String>,
    /// What it shows, in words (HTML, escaped).
    caption: String,
}

/// A line through points, with a legend label.
#[derive(Debug, Clone)]
struct Series {
    label: String,
    color: RGBColor,
    /// Finite points, sorted by x.
    points: Vec<(f64, f64)>,
}

/// Writes `chart` (when there is one) as `<figure class="chart" data-chart="NAME">`, or a
/// note when it could not be drawn.
fn figure(out: &mut String, name: &str, chart: Option<Chart>) {
    let Some(chart) = chart else { return };
    match chart.svg {
        Ok(svg) => put!(
            out,
            "<figure class=\"chart\" data-chart=\"{}\">\n{svg}<figcaption>{}</figcaption>\n</figure>\n",
            esc(name),
            chart.caption
        ),
        Err(e) => put!(
            out,
            "<p class=\"note\">The {} chart could not be drawn: {}</p>\n",
            esc(name),
            esc(&e)
        ),
    }
}

/// Draws an SVG of `size` with `draw`.
fn draw_svg(
    size: (u32, u32),
    draw: impl for<'a> FnOnce(&Area<'a>) -> Result<(), ChartError>,
) -> Result<String, String> {
    let mut svg = String::new();
    let drawn = (|| -> Result<(), ChartError> {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
        Ok(())
    })();
    drawn.map(|()| svg).map_err(|e| e.to_string())
}

/// Achieved against offered rate, a line per search, and offered = achieved.
fn throughput_chart(r: &CapacityReport) -> Option<Chart> {
    let series: Vec<Series> = r
        .searches
        .iter()
        .map(|s| Series {
            label: search_label(s).to_string(),
            color: search_color(s),
            points: sorted_points(s.steps.iter().map(|st| (st.offered, st.achieved)), false),
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    if series.is_empty() {
        return None;
    }
    let x_max = axis_max(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let y_max = axis_max(series.iter().flat_map(|s| s.points.iter().map(|p| p.1))).max(x_max);
    let svg = draw_svg(CHART_SIZE, |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Achieved against offered rate", TITLE_FONT)
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("offered, requests/s")
            .y_desc("achieved, requests/s")
            .x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .label_style(LABEL_FONT)
            .draw()?;
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, 0.0), (x_max, x_max)],
                6,
                4,
                REFERENCE_COLOR.stroke_width(1),
            ))?
            .label("offered (y = x)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], REFERENCE_COLOR));
        for s in &series {
            line_with_points(&mut chart, s)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)
    });
    Some(Chart {
        svg,
        caption: "Requests completed successfully per second against the rate offered, \
                  for every step of each search; the dashed line is offered = achieved."
            .to_string(),
    })
}

/// p50, p99 and p99.9 (from the intended start) against offered rate, per search, and the
/// SLO's latency bounds; logarithmic in latency.
fn latency_chart(r: &CapacityReport) -> Option<Chart> {
    type Figure = fn(&Step) -> f64;
    let figures: [(&str, Figure); 3] = [
        ("p50", |s| s.latency.p50_ms),
        ("p99", |s| s.latency.p99_ms),
        ("p99.9", |s| s.latency.p999_ms),
    ];
    let mut series = Vec::new();
    for s in &r.searches {
        let colors = if s.compression {
            ON_PERCENTILE_COLORS
        } else {
            OFF_PERCENTILE_COLORS
        };
        for ((name, of), color) in figures.iter().zip(colors) {
            let points = sorted_points(s.steps.iter().map(|st| (st.offered, of(st))), true);
            if !points.is_empty() {
                series.push(Series {
                    label: format!("{name}, {}", search_label(s)),
                    color,
                    points,
                });
            }
        }
    }
    if series.is_empty() {
        return None;
    }
    let bounds: Vec<(String, f64)> = r
        .slo
        .latency
        .iter()
        .filter(|b| b.max_ms.is_finite() && b.max_ms > 0.0)
        .map(|b| {
            (
                format!("SLO {} ≤ {} ms", b.percentile.name(), ms(b.max_ms)),
                b.max_ms,
            )
        })
        .collect();
    let (x_min, x_max) = span(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let ys = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(bounds.iter().map(|b| b.1));
    let (y_lo, y_hi) = span(ys);
    let (y_lo, y_hi) = (y_lo / LOG_HEADROOM, y_hi * LOG_HEADROOM);
    let (x_lo, x_hi) = (
        (x_min - (x_max - x_min) * 0.05).max(0.0),
        x_max + (x_max - x_min).max(x_max * 0.1) * 0.05,
    );
    let svg = draw_svg(CHART_SIZE, |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Request latency against offered rate", TITLE_FONT)
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(x_lo..x_hi, (y_lo..y_hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("offered, requests/s")
            .y_desc("latency, ms (log)")
            .x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .label_style(LABEL_FONT)
            .draw()?;
        for (label, bound) in &bounds {
            chart
                .draw_series(DashedLineSeries::new(
                    [(x_lo, *bound), (x_hi, *bound)],
                    8,
                    4,
                    SLO_COLOR.stroke_width(2),
                ))?
                .label(label.as_str())
                .legend(|(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], SLO_COLOR.stroke_width(2))
                });
        }
        for s in &series {
            line_with_points(&mut chart, s)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)
    });
    Some(Chart {
        svg,
        caption: "Request latency percentiles, measured from each request's intended start \
                  (corrected for coordinated omission), for every step of each search; \
                  dashed: the SLO's bounds."
            .to_string(),
    })
}

/// The sweep's throughput against users, the fitted USL curve and its peak.
fn usl_chart(s: &Sweep) -> Option<Chart> {
    let measured = sorted_points(
        s.points.iter().map(|p| (p.users as f64, p.throughput)),
        false,
    );
    if measured.is_empty() {
        return None;
    }
    let max_users = measured.iter().map(|p| p.0).fold(1.0, f64::max);
    let fit = s
        .fit
        .as_ref()
        .filter(|f| f.x1.is_finite() && f.sigma.is_finite() && f.kappa.is_finite() && f.x1 > 0.0);
    let peak = fit.and_then(|f| peak(f, max_users));
    let x_max = peak.map_or(max_users, |p| p.0.max(max_users)) * HEADROOM;
    let curve: Vec<(f64, f64)> = fit.map_or_else(Vec::new, |f| {
        (0..=USL_CURVE_POINTS)
            .map(|i| {
                let n = 1.0 + (x_max - 1.0) * i as f64 / USL_CURVE_POINTS as f64;
                (n, f.throughput(n))
            })
            .filter(|p| p.1.is_finite() && p.1 >= 0.0)
            .collect()
    });
    let y_max = axis_max(
        measured
            .iter()
            .chain(&curve)
            .chain(peak.as_ref())
            .map(|p| p.1),
    );
    let svg = draw_svg(CHART_SIZE, |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Throughput against concurrency", TITLE_FONT)
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("users (closed loop)")
            .y_desc("requests/s")
            .x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .label_style(LABEL_FONT)
            .draw()?;
        if curve.len() > 1 {
            chart
                .draw_series(LineSeries::new(
                    curve.iter().copied(),
                    FIT_COLOR.stroke_width(2),
                ))?
                .label("USL fit")
                .legend(|(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], FIT_COLOR.stroke_width(2))
                });
        }
        chart
            .draw_series(
                measured
                    .iter()
                    .map(|&p| Circle::new(p, 4, SWEEP_COLOR.filled())),
            )?
            .label("measured")
            .legend(|(x, y)| Circle::new((x + 10, y), 4, SWEEP_COLOR.filled()));
        if let Some((u, x)) = peak {
            chart
                .draw_series([TriangleMarker::new((u, x), 7, FIT_COLOR.filled())])?
                .label(format!(
                    "peak: {} requests/s at {} users",
                    rate(x),
                    num(u, 1)
                ))
                .legend(|(x, y)| TriangleMarker::new((x + 10, y), 6, FIT_COLOR.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight)
    });
    let caption = match (fit, &s.fit_error) {
        (Some(f), _) => {
            let mut c = format!(
                "Closed-loop throughput against users, and the Universal Scalability Law fitted \
                 to it: σ = {}, κ = {}, X(1) = {} requests/s, R² = {}",
                num(f.sigma, 4),
                num(f.kappa, 6),
                rate(f.x1),
                num(f.r_squared, 4)
            );
            match (f.peak_users, peak) {
                (Some(u), None) if u.is_finite() => put!(
                    c,
                    "; the fitted peak, at {} users, lies beyond the chart",
                    num(u, 1)
                ),
                (None, _) => c.push_str("; no peak (κ ≤ 0)"),
                _ => {}
            }
            c.push('.');
            esc(&c)
        }
        (None, Some(e)) => esc(&format!(
            "Closed-loop throughput against users; no USL fit: {e}."
        )),
        (None, None) => "Closed-loop throughput against users.".to_string(),
    };
    Some(Chart { svg, caption })
}

/// The fitted peak (users, requests/s) when it is finite and close enough to the measured
/// concurrencies to be drawn (see [`USL_PEAK_SPAN`]).
fn peak(f: &UslFit, max_users: f64) -> Option<(f64, f64)> {
    let u = f.peak_users.filter(|u| u.is_finite() && *u > 0.0)?;
    if u > max_users * USL_PEAK_SPAN {
        return None;
    }
    let x = f
        .peak_throughput
        .filter(|x| x.is_finite())
        .unwrap_or_else(|| f.throughput(u));
    (x.is_finite() && x >= 0.0).then_some((u, x))
}

/// A group of two bars: one figure off and on.
#[derive(Debug, Clone)]
struct BarGroup {
    label: String,
    off: Option<f64>,
    on: Option<f64>,
}

/// The compression figures as two bar panels: CPU µs per call by role, and wire bytes per
/// call; off against on. From the comparison (at the common rate) when there is one, else
/// from each search's last common-rate step or, failing that, its last passing step.
fn compression_chart(r: &CapacityReport) -> Option<Chart> {
    let (cpu, bytes, at) = match &r.comparison {
        Some(c) => comparison_bars(c),
        None => step_bars(r)?,
    };
    let keep = |g: &BarGroup| g.off.is_some() || g.on.is_some();
    let cpu: Vec<BarGroup> = cpu.into_iter().filter(keep).collect();
    let bytes: Vec<BarGroup> = bytes.into_iter().filter(keep).collect();
    if cpu.is_empty() && bytes.is_empty() {
        return None;
    }
    let svg = draw_svg(COMPRESSION_CHART_SIZE, |root| {
        let root = root.titled(&format!("Compression off against on{at}"), TITLE_FONT)?;
        let panels: Vec<(&str, &[BarGroup])> = [
            ("CPU µs per call", cpu.as_slice()),
            ("wire bytes per call", bytes.as_slice()),
        ]
        .into_iter()
        .filter(|(_, g)| !g.is_empty())
        .collect();
        let areas = if panels.len() == 2 {
            let (w, _) = root.dim_in_pixel();
            let (left, right) = root.split_horizontally(w * 3 / 5);
            vec![left, right]
        } else {
            vec![root]
        };
        for (area, (title, groups)) in areas.iter().zip(&panels) {
            bars(area, title, groups)?;
        }
        Ok(())
    });
    Some(Chart {
        svg,
        caption: esc(&format!(
            "CPU time per call of each process on the path, and bytes on the wire per call, \
             without compression (blue) and with it (orange){at}."
        )),
    })
}

/// The bar groups of a comparison: CPU by role, bytes both ways; and where they were
/// measured.
fn comparison_bars(c: &Comparison) -> (Vec<BarGroup>, Vec<BarGroup>, String) {
    let cpu = roles(
        c.cpu_us_per_call_off
            .keys()
            .chain(c.cpu_us_per_call_on.keys()),
    )
    .into_iter()
    .map(|role| BarGroup {
        off: finite(c.cpu_us_per_call_off.get(&role).copied()),
        on: finite(c.cpu_us_per_call_on.get(&role).copied()),
        label: role,
    })
    .collect();
    let bytes = vec![BarGroup {
        label: "both ways".to_string(),
        off: finite(c.bytes_per_call_off),
        on: finite(c.bytes_per_call_on),
    }];
    let at = c
        .common_rate
        .filter(|r| r.is_finite())
        .map_or(String::new(), |r| format!(" at {} requests/s", rate(r)));
    (cpu, bytes, at)
}

/// The bar groups from the searches' steps, when there is no comparison but both settings
/// were searched.
fn step_bars(r: &CapacityReport) -> Option<(Vec<BarGroup>, Vec<BarGroup>, String)> {
    let pick = |compression: bool| -> Option<&Step> {
        let s = r.searches.iter().find(|s| s.compression == compression)?;
        s.steps
            .iter()
            .rev()
            .find(|st| st.phase == Phase::Common)
            .or_else(|| s.steps.iter().rev().find(|st| st.pass))
    };
    let (off, on) = (pick(false)?, pick(true)?);
    let cpu = roles(off.cpu_us_per_call.keys().chain(on.cpu_us_per_call.keys()))
        .into_iter()
        .map(|role| BarGroup {
            off: finite(off.cpu_us_per_call.get(&role).copied()),
            on: finite(on.cpu_us_per_call.get(&role).copied()),
            label: role,
        })
        .collect();
    let bytes = vec![
        BarGroup {
            label: "out".to_string(),
            off: finite(Some(off.bytes_out_per_call)),
            on: finite(Some(on.bytes_out_per_call)),
        },
        BarGroup {
            label: "in".to_string(),
            off: finite(Some(off.bytes_in_per_call)),
            on: finite(Some(on.bytes_in_per_call)),
        },
    ];
    let at = format!(
        " at {} and {} requests/s",
        rate(off.offered),
        rate(on.offered)
    );
    Some((cpu, bytes, at))
}

/// One panel of grouped bars (off, on) titled `title`.
fn bars(area: &Area<'_>, title: &str, groups: &[BarGroup]) -> Result<(), ChartError> {
    let n = groups.len();
    let y_max = axis_max(groups.iter().flat_map(|g| [g.off, g.on]).flatten()) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(title, LABEL_FONT)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(Groups(n), 0.0..y_max)?;
    let label_of = |x: &f64| {
        groups
            .iter()
            .enumerate()
            .find(|(i, _)| (*i as f64 + 0.5 - x).abs() < 1e-6)
            .map_or(String::new(), |(_, g)| g.label.clone())
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_label_formatter(&label_of)
        .y_label_formatter(&|v| tick(*v))
        .label_style(LABEL_FONT)
        .draw()?;
    let value_style =
        TextStyle::from(LABEL_FONT.into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    for (is_on, color, label) in [
        (false, OFF_COLOR, "compression off"),
        (true, ON_COLOR, "compression on"),
    ] {
        let (from, to) = if is_on { (0.5, 0.88) } else { (0.12, 0.5) };
        let bars: Vec<(f64, f64)> = groups
            .iter()
            .enumerate()
            .filter_map(|(i, g)| Some((i as f64, if is_on { g.on } else { g.off }?)))
            .collect();
        chart
            .draw_series(
                bars.iter()
                    .map(|&(i, v)| Rectangle::new([(i + from, 0.0), (i + to, v)], color.filled())),
            )?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        chart
            .draw_series(bars.iter().map(|&(i, v)| {
                Text::new(tick(v), (i + (from + to) / 2.0, v), value_style.clone())
            }))?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

/// The x axis of a bar chart: `n` groups side by side, group `i` from `i` to `i + 1`, a
/// tick (with the group's label) in the middle of each.
#[derive(Debug, Clone, Copy)]
struct Groups(usize);

impl Ranged for Groups {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let width = f64::from(limit.1 - limit.0);
        limit.0 + (width * value / self.0.max(1) as f64).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        (0..self.0).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        0.0..self.0 as f64
    }
}

/// Draws `s` as a line through its points, with the points marked.
fn line_with_points<'a, Y>(
    chart: &mut ChartContext<
        'a,
        SVGBackend<'a>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
    >,
    s: &Series,
) -> Result<(), ChartError>
where
    Y: Ranged<ValueType = f64>,
{
    let c = s.color;
    chart
        .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))?
        .label(s.label.as_str())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(2)));
    chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
    Ok(())
}

/// Draws the legend of `chart` at `pos`.
fn legend<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    pos: SeriesLabelPosition,
) -> Result<(), ChartError>
where
    X: Ranged,
    Y: Ranged,
{
    chart
        .configure_series_labels()
        .position(pos)
        .label_font(LABEL_FONT)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Data helpers

/// The finite points of `points` (with y above zero when `positive_y`: a logarithmic axis
/// has no zero), sorted by x.
fn sorted_points(points: impl Iterator<Item = (f64, f64)>, positive_y: bool) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = points
        .filter(|(x, y)| x.is_finite() && y.is_finite() && (!positive_y || *y > 0.0))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The top of a linear axis from zero that shows every finite value of `values`.
fn axis_max(values: impl Iterator<Item = f64>) -> f64 {
    let max = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    if max > 0.0 { max * HEADROOM } else { 1.0 }
}

/// The smallest and largest finite value of `values`, pulled apart when they are equal (an
/// axis needs a width); (1, 10) when there is none.
fn span(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !(lo.is_finite() && hi.is_finite()) {
        (1.0, 10.0)
    } else if hi > lo {
        (lo, hi)
    } else if lo > 0.0 {
        (lo / 2.0, hi * 2.0)
    } else {
        (lo - 1.0, hi + 1.0)
    }
}

/// `v` when it is there and finite.
fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
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

fn search_label(s: &Search) -> &'static str {
    if s.compression {
        "compression on"
    } else {
        "compression off"
    }
}

fn search_color(s: &Search) -> RGBColor {
    if s.compression { ON_COLOR } else { OFF_COLOR }
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Grow => "grow",
        Phase::Bisect => "bisect",
        Phase::Confirm => "confirm",
        Phase::Common => "common",
    }
}

// ---------------------------------------------------------------------------------------
// Text helpers

/// `s` with the characters HTML gives a meaning escaped (for text and attribute values).
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `v` with `decimals` decimals; a dash when it is not a number.
fn num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "—".to_string()
    }
}

/// `v` with a sign.
fn signed(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:+.decimals$}")
    } else {
        "—".to_string()
    }
}

/// A rate, requests per second: thousands separated, decimals only when it is small.
fn rate(v: f64) -> String {
    if !v.is_finite() {
        "—".to_string()
    } else if v.abs() >= 100.0 {
        let s = thousands(v.abs());
        if v < 0.0 { format!("-{s}") } else { s }
    } else {
        format!("{v:.1}")
    }
}

fn opt_rate(v: Option<f64>) -> String {
    v.map_or("—".to_string(), rate)
}

fn opt_ms(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => ms(v),
        _ => "—".to_string(),
    }
}

/// A share (0 to 1) as a percentage.
fn pct(ratio: f64) -> String {
    if ratio.is_finite() {
        format!("{:.3}%", ratio * 100.0)
    } else {
        "—".to_string()
    }
}

/// A share (0 to 1) of CPU time as a percentage.
fn share(ratio: f64) -> String {
    if ratio.is_finite() {
        format!("{:.1}%", ratio * 100.0)
    } else {
        "—".to_string()
    }
}

/// A per-call figure (bytes, µs): whole from 100 up, else with one decimal.
fn amount(v: f64) -> String {
    if !v.is_finite() {
        "—".to_string()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// (on − off) ÷ off as a signed percentage.
fn change(off: Option<f64>, on: Option<f64>) -> String {
    match (finite(off), finite(on)) {
        (Some(off), Some(on)) if off != 0.0 => format!("{}%", signed((on - off) / off * 100.0, 1)),
        _ => "—".to_string(),
    }
}

/// An axis tick: short, thousands separated.
fn tick(v: f64) -> String {
    if !v.is_finite() {
        String::new()
    } else if v.abs() >= 1000.0 {
        rate(v)
    } else if v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Unix time `secs` as a UTC date and time (`2026-12-01 13:09:17 UTC`).
fn utc(secs: u64) -> String {
    const SECS_PER_DAY: u64 = 86_400;
    let (days, rem) = (secs / SECS_PER_DAY, secs % SECS_PER_DAY);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (never negative here).
    let z = days as i64 + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&#39;");
    }

    #[test]
    fn unix_time_reads_as_a_utc_date() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_796_130_557), "2026-12-01 13:09:17 UTC");
    }

    #[test]
    fn points_that_are_not_numbers_are_left_out_and_the_rest_sorted() {
        let p = sorted_points(
            [
                (3.0, 1.0),
                (f64::NAN, 1.0),
                (1.0, f64::INFINITY),
                (2.0, 0.0),
                (1.0, 2.0),
            ]
            .into_iter(),
            false,
        );
        assert_eq!(p, vec![(1.0, 2.0), (2.0, 0.0), (3.0, 1.0)]);
        let log = sorted_points([(1.0, 0.0), (2.0, -1.0), (3.0, 4.0)].into_iter(), true);
        assert_eq!(log, vec![(3.0, 4.0)]);
    }

    #[test]
    fn axes_have_a_width_whatever_the_data() {
        assert_eq!(axis_max(std::iter::empty()), 1.0);
        assert_eq!(axis_max([0.0, f64::NAN].into_iter()), 1.0);
        let (lo, hi) = span([5.0, 5.0].into_iter());
        assert!(lo < 5.0 && hi > 5.0);
        assert_eq!(span(std::iter::empty()), (1.0, 10.0));
    }

    #[test]
    fn roles_come_in_path_order_then_by_name() {
        let keys = ["provider", "zeta", "driver", "alpha"].map(String::from);
        assert_eq!(roles(keys.iter()), ["driver", "provider", "alpha", "zeta"]);
    }
}
