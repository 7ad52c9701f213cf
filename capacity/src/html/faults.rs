//! The fault lab's report as one HTML page: the summary table (the report's Markdown
//! rows, as a table), and for each experiment two charts against time, its success rate
//! and its p99, the run with the fault beside its control, the fault's window shaded.
//! Drawn with the capacity report's chart pieces ([`super::charts`]) and checked by the
//! same page script.

use maud::{Markup, html};
use plotters::prelude::*;
use rpcmesh_common::format::{fixed, ms};

use super::charts::{
    CHART_SIZE, Chart, LOG_HEADROOM, OFF_COLOR, ON_COLOR, SLO_COLOR, Series, axis_max, draw_svg,
    legend, line_axes, line_with_points, sorted_points, span,
};
use super::{figure, page};
use crate::faults::{Experiment, FaultReport, Phase, Point};

/// The HTML page of `report`: one file, nothing outside it.
pub fn render(report: &FaultReport) -> String {
    let body = html! {
        h1 { "rpcmesh fault lab" }
        p {
            "Each experiment against its control, the same run with no fault. An interval is unhealthy when over "
            (report.unhealthy_failed_points) " percentage point more of its requests failed than in the control's worst interval, or its p99 is over "
            (report.unhealthy_p99_factor) " times the control's worst. Detect: from the fault to the end of the last unhealthy interval while it lasted; recover: the same from the repair."
        }
        (table(report))
        @for e in &report.experiments {
            h2 { (e.name) }
            p { (e.fault) ", from " (fixed(e.fault_start_s, 1)) " s to " (fixed(e.fault_end_s, 1)) " s." }
            (figure(&format!("{}-success", e.name), success_chart(e)))
            (figure(&format!("{}-p99", e.name), p99_chart(e)))
        }
    };
    page("rpcmesh fault lab", body)
}

fn percent(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.2}", v * 100.0))
}

fn millis(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), ms)
}

fn table(r: &FaultReport) -> Markup {
    let cells = |p: &Phase, c: &Phase| {
        html! {
            td { (percent(p.success_rate)) " (" (percent(c.success_rate)) ")" }
            td { (millis(p.p50_ms)) " (" (millis(c.p50_ms)) ")" }
            td { (millis(p.p99_ms)) " (" (millis(c.p99_ms)) ")" }
        }
    };
    let seconds = |v: Option<f64>, none: &str| {
        v.map_or_else(|| none.to_string(), |s| format!("{} s", fixed(s, 1)))
    };
    html! {
        div.scroll { table {
            tr {
                th.text { "experiment" } th.text { "phase" } th { "success % (control)" }
                th { "p50 ms (control)" } th { "p99 ms (control)" } th { "provider 1's share" }
                th.text { "detect / recover" }
            }
            @for e in &r.experiments {
                @let share = |k: usize| e.share_of_faulty.and_then(|s| [s.before, s.during, s.after][k]);
                tr { td.text { (e.name) } td.text { "before" } (cells(&e.phases.before, &e.control_phases.before)) td { (percent(share(0))) } td.text {} }
                tr { td.text {} td.text { "during" } (cells(&e.phases.during, &e.control_phases.during)) td { (percent(share(1))) }
                     td.text { "detect " (seconds(e.detect_s, "not routed around")) } }
                tr { td.text {} td.text { "after" } (cells(&e.phases.after, &e.control_phases.after)) td { (percent(share(2))) }
                     td.text { "recover " (seconds(e.recover_s, "not recovered")) } }
            }
        } }
    }
}

/// The run's and its control's points of `of`, as series.
fn series(e: &Experiment, of: fn(&Point) -> Option<f64>, positive: bool) -> Vec<Series> {
    [
        (format!("{} (fault)", e.name), ON_COLOR, &e.timeline),
        (
            format!("{} (no fault)", e.control),
            OFF_COLOR,
            &e.control_timeline,
        ),
    ]
    .into_iter()
    .map(|(label, color, points)| Series {
        label,
        color,
        points: sorted_points(
            points.iter().filter_map(|p| of(p).map(|v| (p.t_s, v))),
            positive,
        ),
    })
    .filter(|s| !s.points.is_empty())
    .collect()
}

/// The time axis: from 0 to the last interval, a little beyond.
fn time_range(e: &Experiment) -> (f64, f64) {
    let last = e
        .timeline
        .iter()
        .chain(&e.control_timeline)
        .map(|p| p.t_s)
        .fold(e.fault_end_s, f64::max);
    (0.0, axis_max(std::iter::once(last)))
}

/// Success rate against time.
fn success_chart(e: &Experiment) -> Option<Chart> {
    let s = series(e, |p| p.success_rate.map(|v| v * 100.0), false);
    if s.is_empty() {
        return None;
    }
    let (x0, x1) = time_range(e);
    let low = s
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(100.0, f64::min);
    let y0 = (low - (100.0 - low) * 0.08).clamp(0.0, 99.0);
    let svg = draw_svg(CHART_SIZE, |root| {
        let mut chart = line_axes(
            root,
            "Requests that succeeded, per interval",
            ("seconds into the run", "success, %"),
            x0..x1,
            y0..100.5,
        )?;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(e.fault_start_s, y0), (e.fault_end_s, 100.5)],
            SLO_COLOR.mix(0.12).filled(),
        )))?;
        for s in &s {
            line_with_points(&mut chart, s)?;
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight)
    });
    Some(Chart {
        svg,
        caption: format!(
            "The share of the requests meant to start in each interval that succeeded, with the fault ({}) and without; shaded: while the fault lasted.",
            e.fault
        ),
    })
}

/// p99 against time, logarithmic.
fn p99_chart(e: &Experiment) -> Option<Chart> {
    let s = series(e, |p| p.p99_ms, true);
    if s.is_empty() {
        return None;
    }
    let (x0, x1) = time_range(e);
    let (lo, hi) = span(s.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let (lo, hi) = (lo / LOG_HEADROOM, hi * LOG_HEADROOM);
    let svg = draw_svg(CHART_SIZE, |root| {
        let mut chart = line_axes(
            root,
            "p99 of the successful requests, per interval",
            ("seconds into the run", "p99, ms (log)"),
            x0..x1,
            (lo..hi).log_scale(),
        )?;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(e.fault_start_s, lo), (e.fault_end_s, hi)],
            SLO_COLOR.mix(0.12).filled(),
        )))?;
        for s in &s {
            line_with_points(&mut chart, s)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)
    });
    Some(Chart {
        svg,
        caption: "The p99 of each interval's successful requests, from their intended start, with the fault and without; shaded: while the fault lasted.".into(),
    })
}

#[cfg(test)]
mod tests {
    use crate::faults::{Interval, RunData, build};

    #[test]
    fn each_experiment_has_its_two_charts_and_text_is_escaped() {
        let timeline = |bad: u64| -> Vec<Interval> {
            (0..20)
                .map(|k| Interval {
                    start_s: k as f64 * 0.5,
                    seconds: 0.5,
                    due: 100,
                    ok: if k == 6 { 100 - bad } else { 100 },
                    p99_ms: Some(1.0 + k as f64 / 10.0),
                })
                .collect()
        };
        let run = |name: &str, fault: Option<&str>, bad| RunData {
            name: name.into(),
            fault: fault.map(Into::into),
            control: fault.map(|_| "control".into()),
            window: fault.map(|_| (2.0, 6.0)),
            timeline: timeline(bad),
            shares: None,
            ejections: None,
        };
        let runs = [
            run("control", None, 0),
            run("hole", Some("<b>fails</b>"), 40),
        ];
        let report = build(serde_json::json!({}), &runs, |_, _, _| Some((1.0, 2.0, 10))).unwrap();
        let page = super::render(&report);
        for chart in ["hole-success", "hole-p99"] {
            let at = page
                .find(&format!("data-chart=\"{chart}\""))
                .unwrap_or_else(|| panic!("no {chart} in {page}"));
            assert!(page[at..].contains("<svg"), "{chart} drawn");
        }
        assert!(page.contains("&lt;b&gt;fails&lt;/b&gt;"), "escaped");
        assert!(!page.contains("<b>fails"), "escaped");
    }
}
