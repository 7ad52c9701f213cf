//! The capacity report for people: a table per search, the comparison and the sweep with
//! its fit, as aligned text for a terminal or as Markdown. The two differ only in how
//! headings, tables and notes look. Numbers are formatted by [`rpcmesh_common::format`].

use rpcmesh_common::format::{ms, thousands};

use crate::report::{CapacityReport, Comparison, Search, Sweep};
use crate::step::Compared;

/// A table, rendered aligned for a terminal or as Markdown.
struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn text(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::from(" ");
            for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
                let pad = w - c.chars().count();
                // The first column (a label) to the left, figures to the right.
                if i == 0 {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                } else {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                }
                s.push_str("  ");
            }
            s.trim_end().to_string() + "\n"
        };
        let mut out = line(&self.headers);
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }

    fn markdown(&self) -> String {
        let mut out = format!("| {} |\n", self.headers.join(" | "));
        out.push('|');
        for i in 0..self.headers.len() {
            out.push_str(if i == 0 { "---|" } else { "---:|" });
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

/// The roles whose CPU the report shows, in path order.
pub const ROLES: [&str; 3] = ["driver", "broker", "provider"];

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

fn rate(v: f64) -> String {
    thousands(v)
}

/// `s` with its first letter in capitals (`TLS` stays `TLS`).
fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

/// What the report compared, if anything: how its searches and sweep are named.
fn compared(r: &CapacityReport) -> Option<Compared> {
    r.comparison.as_ref().map(|c| c.compared)
}

impl Search {
    fn table(&self) -> Table {
        let mut t = Table::new(&[
            "step",
            "offered/s",
            "achieved/s",
            "calls/s",
            "p50 ms",
            "p99 ms",
            "p99.9 ms",
            "errors",
            "B out/call",
            "B in/call",
            "µs/call driver",
            "broker",
            "(polling)",
            "provider",
            "softirq",
            "SLO",
        ]);
        for s in &self.steps {
            let cpu = |r: &str| opt(s.cpu_us_per_call.get(r).copied(), |v| format!("{v:.1}"));
            let softirq = s
                .softirq_share
                .values()
                .copied()
                .reduce(f64::max)
                .map_or("-".into(), |v| format!("{:.1}%", v * 100.0));
            t.row(vec![
                s.phase.name().to_string(),
                rate(s.offered),
                rate(s.achieved),
                rate(s.calls_per_second),
                ms(s.latency.p50_ms),
                ms(s.latency.p99_ms),
                ms(s.latency.p999_ms),
                format!("{:.3}%", s.error_ratio * 100.0),
                format!("{:.0}", s.bytes_out_per_call),
                format!("{:.0}", s.bytes_in_per_call),
                cpu("driver"),
                cpu("broker"),
                opt(s.idle_poll_us_per_call.get("broker").copied(), |v| {
                    format!("{v:.1}")
                }),
                cpu("provider"),
                softirq,
                if s.pass {
                    "pass".into()
                } else {
                    format!("FAIL: {}", s.broken.join("; "))
                },
            ]);
        }
        t
    }

    /// One line: the capacity found and how the search ended.
    pub fn summary(&self, compared: Option<Compared>) -> String {
        let cap = match self.capacity {
            Some(c) => format!("{} requests/s", rate(c)),
            None => "none found".into(),
        };
        let fail = opt(self.lowest_failing, |f| format!("{} requests/s", rate(f)));
        format!(
            "{}: capacity {cap} (lowest failing {fail}; ended by {})",
            self.setting().label(compared),
            self.ended_by
        )
    }
}

impl Sweep {
    fn table(&self) -> Table {
        let mut t = Table::new(&[
            "users",
            "requests/s",
            "calls/s",
            "p50 ms",
            "p99 ms",
            "errors",
            "USL fit/s",
            "cores driver",
            "broker",
            "provider",
        ]);
        for p in &self.points {
            let cores = |r: &str| opt(p.cpu_cores.get(r).copied(), |v| format!("{v:.2}"));
            t.row(vec![
                p.users.to_string(),
                rate(p.throughput),
                rate(p.calls_per_second),
                ms(p.latency.p50_ms),
                ms(p.latency.p99_ms),
                format!("{:.3}%", p.error_ratio * 100.0),
                opt(self.fit.map(|f| f.throughput(p.users as f64)), rate),
                cores("driver"),
                cores("broker"),
                cores("provider"),
            ]);
        }
        t
    }

    /// The fit in one line.
    pub fn fit_line(&self) -> String {
        match (&self.fit, &self.fit_error) {
            (Some(f), _) => {
                let peak = match (f.peak_users, f.peak_throughput) {
                    (Some(n), Some(x)) => {
                        format!("peak {} requests/s at {n:.0} users", rate(x))
                    }
                    _ => "no peak (κ ≤ 0: throughput levels off instead of falling)".into(),
                };
                let bound = if f.constrained {
                    " (held at the σ ≥ 0, κ ≥ 0 bound: the unconstrained fit was unphysical)"
                } else {
                    ""
                };
                format!(
                    "USL fit: σ {:.4} (contention), κ {:.6} (coherency), X(1) {} requests/s, R² {:.4}{bound}; {peak}",
                    f.sigma,
                    f.kappa,
                    rate(f.x1),
                    f.r_squared
                )
            }
            (None, Some(e)) => format!("no USL fit: {e}"),
            (None, None) => "no USL fit".into(),
        }
    }
}

impl Comparison {
    fn table(&self) -> Table {
        let name = self.compared.name();
        let (off, on) = (format!("{name} off"), format!("{name} on"));
        let mut t = Table::new(&["", &off, &on]);
        t.row(vec![
            "capacity, requests/s".into(),
            opt(self.capacity_off, rate),
            opt(self.capacity_on, rate),
        ]);
        let at = opt(self.common_rate, rate);
        t.row(vec![
            format!("p99 ms at {at}/s"),
            opt(self.p99_ms_off, ms),
            opt(self.p99_ms_on, ms),
        ]);
        t.row(vec![
            "wire bytes per call".into(),
            opt(self.bytes_per_call_off, |v| format!("{v:.0}")),
            opt(self.bytes_per_call_on, |v| format!("{v:.0}")),
        ]);
        for role in ROLES {
            t.row(vec![
                format!("{role} CPU µs per call"),
                opt(self.cpu_us_per_call_off.get(role).copied(), |v| {
                    format!("{v:.1}")
                }),
                opt(self.cpu_us_per_call_on.get(role).copied(), |v| {
                    format!("{v:.1}")
                }),
            ]);
        }
        t
    }
}

impl CapacityReport {
    fn header(&self) -> String {
        let s = &self.setup;
        let target = if s.local_mesh {
            "a local broker and provider (child processes)".to_string()
        } else {
            s.targets.join(", ")
        };
        format!(
            "{} workload, {} calls per request{}, at most {} requests in flight over {} connections, against {target}; steps of {:.0} s after {:.0} s warm-up; SLO {}",
            s.workload,
            s.fanout,
            if s.parallel { " at once" } else { " in a row" },
            s.concurrency,
            s.connections,
            s.step_seconds,
            s.warmup_seconds,
            self.slo
        )
    }

    /// The report for a terminal.
    pub fn render_text(&self) -> String {
        self.render(false)
    }

    /// The report as Markdown.
    pub fn render_markdown(&self) -> String {
        self.render(true)
    }

    /// Text and Markdown differ only in how headings, tables and notes look.
    fn render(&self, md: bool) -> String {
        let mut out = if md {
            format!(
                "# rpcmesh capacity {}\n\n{}.\n",
                self.version,
                self.header()
            )
        } else {
            format!("rpcmesh capacity {}\n{}\n", self.version, self.header())
        };
        let mut section = |title: String, table: Option<Table>, note: &str| {
            if md {
                out.push_str(&format!("\n## {title}\n\n"));
            } else {
                out.push_str(&format!("\n{title}\n"));
            }
            if let Some(t) = table {
                out.push_str(&if md { t.markdown() } else { t.text() });
            }
            if md {
                out.push_str(&format!("\n{note}.\n"));
            } else {
                out.push_str(&format!(" {note}\n"));
            }
        };
        let compared = compared(self);
        for s in &self.searches {
            section(
                format!("Search, {}", s.setting().label(compared)),
                Some(s.table()),
                &s.summary(compared),
            );
        }
        if let Some(c) = &self.comparison {
            section(
                format!("{} off against on", capitalized(c.compared.name())),
                Some(c.table()),
                &c.verdict,
            );
        }
        if let Some(w) = &self.sweep {
            let title = format!("Closed-loop sweep, {}", w.setting().label(compared));
            section(title, Some(w.table()), &w.fit_line());
        }
        if let Some(why) = &self.stopped_early {
            section("Ended early".into(), None, why);
        }
        if !md {
            out.push_str(&format!("\n{:.0} s in all\n", self.elapsed_seconds));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_render_as_markdown() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["x".into(), "1,000".into()]);
        assert_eq!(t.text(), " a     bb\n x  1,000\n");
        assert_eq!(t.markdown(), "| a | bb |\n|---|---:|\n| x | 1,000 |\n");
    }
}
