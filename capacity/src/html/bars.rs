//! The comparison chart: two panels of grouped bars, CPU µs per call by role and wire
//! bytes per call, the compared setting (compression or TLS) off against on. From the comparison (at its common rate)
//! when there is one, else from each search's last common-rate step or, failing that, its
//! last passing step.

use std::collections::BTreeMap;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use rpcmesh_common::format::{rate, tick};

use super::charts::{
    Area, Chart, ChartError, LABEL_FONT, OFF_COLOR, ON_COLOR, TITLE_FONT, axis_max, draw_svg,
    finite, legend,
};
use super::roles;
use crate::report::{CapacityReport, Comparison, Phase, Step};

/// Size of the compression chart, pixels: two bar panels side by side.
const COMPRESSION_CHART_SIZE: (u32, u32) = (900, 420);

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
pub(super) fn compression_chart(r: &CapacityReport) -> Option<Chart> {
    let name = r.compared().name();
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
        let title = format!("{} off against on{at}", super::capitalized(name));
        let root = root.titled(&title, TITLE_FONT)?;
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
            bars(area, title, name, groups)?;
        }
        Ok(())
    });
    Some(Chart {
        svg,
        caption: format!(
            "CPU time per call of each process on the path, and bytes on the wire per call, \
             without {name} (blue) and with it (orange){at}."
        ),
    })
}

/// The bar groups of a comparison: CPU by role, bytes both ways; and where they were
/// measured.
fn comparison_bars(c: &Comparison) -> (Vec<BarGroup>, Vec<BarGroup>, String) {
    let cpu = cpu_groups(&c.cpu_us_per_call_off, &c.cpu_us_per_call_on);
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
    let pick = |on: bool| -> Option<&Step> {
        let s = r.search(on)?;
        s.steps
            .iter()
            .rev()
            .find(|st| st.phase == Phase::Common)
            .or_else(|| s.steps.iter().rev().find(|st| st.pass))
    };
    let (off, on) = (pick(false)?, pick(true)?);
    let cpu = cpu_groups(&off.cpu_us_per_call, &on.cpu_us_per_call);
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

/// A bar group per role of either map, in path order: its CPU µs per call off and on.
fn cpu_groups(off: &BTreeMap<String, f64>, on: &BTreeMap<String, f64>) -> Vec<BarGroup> {
    roles(off.keys().chain(on.keys()))
        .into_iter()
        .map(|role| BarGroup {
            off: finite(off.get(&role).copied()),
            on: finite(on.get(&role).copied()),
            label: role,
        })
        .collect()
}

/// One panel of grouped bars (off, on) titled `title`.
fn bars(area: &Area<'_>, title: &str, name: &str, groups: &[BarGroup]) -> Result<(), ChartError> {
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
        (false, OFF_COLOR, format!("{name} off")),
        (true, ON_COLOR, format!("{name} on")),
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
