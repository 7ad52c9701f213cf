//! The report's line charts, drawn with plotters as inline SVG: achieved against offered
//! rate, latency against offered rate (with the SLO's bounds), and the sweep's throughput
//! against users with the fitted USL curve; and what every chart shares (sizes, fonts,
//! colours, the SVG backend, legends, axes that keep a width whatever the data). The
//! compression bars are [`super::bars`]'.
//!
//! A chart needs nothing at run time: plotters' SVG backend writes `<text>` elements and
//! leaves the font to the browser. Points that are not numbers are left out, and a chart
//! with no point left is not drawn at all (the page then has no figure for it).

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use rpcmesh_common::format::{fixed, ms, rate, tick};

use super::{search_label, search_on};
use crate::report::{CapacityReport, Step, Sweep};
use crate::usl::UslFit;

/// Size of the line charts, pixels: wide enough for a legend of six series beside the
/// data, and no wider than a laptop's browser window.
pub(super) const CHART_SIZE: (u32, u32) = (760, 440);

/// Room above the largest value on a linear axis, as a factor, so that the highest point
/// is not drawn on the frame.
pub(super) const HEADROOM: f64 = 1.08;

/// Room above and below the data on the logarithmic latency axis, as a factor.
pub(super) const LOG_HEADROOM: f64 = 1.6;

/// Points the fitted USL curve is drawn with: smooth at [`CHART_SIZE`]'s width.
pub(super) const USL_CURVE_POINTS: usize = 200;

/// The USL chart's users axis is stretched to show the fitted peak only up to this many
/// times the largest measured concurrency; a peak further out is named in the caption but
/// not drawn, so that the measurements are not squeezed into a corner.
pub(super) const USL_PEAK_SPAN: f64 = 4.0;

/// Font of chart titles.
pub(super) const TITLE_FONT: (&str, u32) = ("sans-serif", 18);

/// Font of axis descriptions, tick labels and legends.
pub(super) const LABEL_FONT: (&str, u32) = ("sans-serif", 13);

/// Colour of everything measured without compression.
pub(super) const OFF_COLOR: RGBColor = RGBColor(31, 119, 180);

/// Colour of everything measured with compression.
pub(super) const ON_COLOR: RGBColor = RGBColor(230, 110, 10);

/// p50, p99 and p99.9 without compression: light to dark of [`OFF_COLOR`]'s hue.
pub(super) const OFF_PERCENTILE_COLORS: [RGBColor; 3] = [
    RGBColor(120, 180, 220),
    RGBColor(31, 119, 180),
    RGBColor(8, 48, 107),
];

/// p50, p99 and p99.9 with compression: light to dark of [`ON_COLOR`]'s hue.
pub(super) const ON_PERCENTILE_COLORS: [RGBColor; 3] = [
    RGBColor(253, 174, 107),
    RGBColor(230, 110, 10),
    RGBColor(140, 45, 4),
];

/// Colour of the SLO's bounds.
pub(super) const SLO_COLOR: RGBColor = RGBColor(214, 39, 40);

/// Colour of reference lines (offered = achieved).
pub(super) const REFERENCE_COLOR: RGBColor = RGBColor(130, 130, 130);

/// Colour of the sweep's measurements.
pub(super) const SWEEP_COLOR: RGBColor = RGBColor(44, 140, 44);

/// Colour of the fitted USL curve and its peak.
pub(super) const FIT_COLOR: RGBColor = RGBColor(110, 60, 160);

/// Why a chart could not be drawn: plotters' drawing error.
pub(super) type ChartError = Box<dyn std::error::Error>;

/// A drawing area of the SVG backend.
pub(super) type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// A chart drawn on the SVG backend, over the coordinates `X` and `Y`.
pub(super) type SvgChart<'a, X, Y> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>;

/// A chart ready for the page.
#[derive(Debug)]
pub(super) struct Chart {
    /// The SVG, or why it could not be drawn.
    pub(super) svg: Result<String, String>,
    /// What it shows, in words (text: the page escapes it).
    pub(super) caption: String,
}

/// A line through points, with a legend label.
#[derive(Debug, Clone)]
pub(super) struct Series {
    pub(super) label: String,
    pub(super) color: RGBColor,
    /// Finite points, sorted by x.
    pub(super) points: Vec<(f64, f64)>,
}

/// Draws an SVG of `size` with `draw`.
pub(super) fn draw_svg(
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
pub(super) fn throughput_chart(r: &CapacityReport) -> Option<Chart> {
    let series: Vec<Series> = r
        .searches
        .iter()
        .map(|s| Series {
            label: search_label(r, s),
            color: search_color(search_on(r, s)),
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
        let mut chart = line_axes(
            root,
            "Achieved against offered rate",
            ("offered, requests/s", "achieved, requests/s"),
            0.0..x_max,
            0.0..y_max,
        )?;
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
pub(super) fn latency_chart(r: &CapacityReport) -> Option<Chart> {
    type Figure = fn(&Step) -> f64;
    let figures: [(&str, Figure); 3] = [
        ("p50", |s| s.latency.p50_ms),
        ("p99", |s| s.latency.p99_ms),
        ("p99.9", |s| s.latency.p999_ms),
    ];
    let mut series = Vec::new();
    for s in &r.searches {
        let colors = if search_on(r, s) {
            ON_PERCENTILE_COLORS
        } else {
            OFF_PERCENTILE_COLORS
        };
        for ((name, of), color) in figures.iter().zip(colors) {
            let points = sorted_points(s.steps.iter().map(|st| (st.offered, of(st))), true);
            if !points.is_empty() {
                series.push(Series {
                    label: format!("{name}, {}", search_label(r, s)),
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
        let mut chart = line_axes(
            root,
            "Request latency against offered rate",
            ("offered, requests/s", "latency, ms (log)"),
            x_lo..x_hi,
            (y_lo..y_hi).log_scale(),
        )?;
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
pub(super) fn usl_chart(s: &Sweep) -> Option<Chart> {
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
        let mut chart = line_axes(
            root,
            "Throughput against concurrency",
            ("users (closed loop)", "requests/s"),
            0.0..x_max,
            0.0..y_max,
        )?;
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
                    fixed(u, 1)
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
                fixed(f.sigma, 4),
                fixed(f.kappa, 6),
                rate(f.x1),
                fixed(f.r_squared, 4)
            );
            match (f.peak_users, peak) {
                (Some(u), None) if u.is_finite() => c.push_str(&format!(
                    "; the fitted peak, at {} users, lies beyond the chart",
                    fixed(u, 1)
                )),
                (None, _) => c.push_str("; no peak (κ ≤ 0)"),
                _ => {}
            }
            c.push('.');
            c
        }
        (None, Some(e)) => format!("Closed-loop throughput against users; no USL fit: {e}."),
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

/// A line chart's frame on `root`: titled `title`, its axes over `x` and `y` (ranges of
/// `f64`, linear or logarithmic) described by `desc` (x, y), and their ticks labelled by
/// [`tick`].
pub(super) fn line_axes<'a, X, Y>(
    root: &Area<'a>,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    x: X,
    y: Y,
) -> Result<SvgChart<'a, X::CoordDescType, Y::CoordDescType>, ChartError>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(root)
        .caption(title, TITLE_FONT)
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style(LABEL_FONT)
        .draw()?;
    Ok(chart)
}

/// Draws `s` as a line through its points, with the points marked.
pub(super) fn line_with_points<'a, Y>(
    chart: &mut SvgChart<'a, plotters::coord::types::RangedCoordf64, Y>,
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
pub(super) fn legend<'a, X, Y>(
    chart: &mut SvgChart<'a, X, Y>,
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

/// The finite points of `points` (with y above zero when `positive_y`: a logarithmic axis
/// has no zero), sorted by x.
pub(super) fn sorted_points(
    points: impl Iterator<Item = (f64, f64)>,
    positive_y: bool,
) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = points
        .filter(|(x, y)| x.is_finite() && y.is_finite() && (!positive_y || *y > 0.0))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The top of a linear axis from zero that shows every finite value of `values`.
pub(super) fn axis_max(values: impl Iterator<Item = f64>) -> f64 {
    let max = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    if max > 0.0 { max * HEADROOM } else { 1.0 }
}

/// The smallest and largest finite value of `values`, pulled apart when they are equal (an
/// axis needs a width); (1, 10) when there is none.
pub(super) fn span(values: impl Iterator<Item = f64>) -> (f64, f64) {
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
pub(super) fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
}

/// The colour of everything measured with the compared setting on, or off.
fn search_color(on: bool) -> RGBColor {
    if on { ON_COLOR } else { OFF_COLOR }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
