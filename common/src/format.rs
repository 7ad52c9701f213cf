//! Figures as people read them: rates with thousands separators, milliseconds with as many
//! decimals as they need, byte counts in KiB/MiB/GiB, shares as percentages, axis ticks.
//! Every report a program prints or writes (the driver's run report, `driver merge`, the
//! capacity report's text, Markdown and HTML) formats its numbers here, so that one figure
//! reads the same everywhere.
//!
//! [`ms`], [`thousands`] and [`bytes`] are for figures that are always there (a run's
//! own). The others stand for a figure that may be missing or not a number (a step whose
//! probe could not be read, a ratio of nothing) with [`MISSING`] rather than `NaN`.
//!
//! Pure functions of a number; no I/O, and nothing of any other layer.

/// What a figure that is missing or not a number reads as.
pub const MISSING: &str = "—";

/// Milliseconds: whole from 100 up, one decimal from 10, three below (a p50 of 0.042 ms
/// and a p99 of 123 ms both keep their meaningful digits and no more).
pub fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// A count or a rate, rounded to a whole number, with a comma between thousands
/// (`1,234,567`). Negative and non-finite values read as 0: they are not counts.
pub fn thousands(v: f64) -> String {
    let n = v.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A byte count: bytes below 10 KiB, then KiB, MiB and GiB with one decimal (the unit
/// changes where the number would otherwise grow past four digits).
pub fn bytes(n: u64) -> String {
    match n {
        n if n >= 10 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 10 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 10 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// `v` with `decimals` decimals.
pub fn fixed(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        MISSING.to_string()
    }
}

/// `v` with a sign and `decimals` decimals.
pub fn signed(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:+.decimals$}")
    } else {
        MISSING.to_string()
    }
}

/// A rate, requests per second: thousands separated from 100 up, one decimal below (a
/// sweep's single user may do 12.5 a second).
pub fn rate(v: f64) -> String {
    if !v.is_finite() {
        MISSING.to_string()
    } else if v.abs() >= 100.0 {
        let s = thousands(v.abs());
        if v < 0.0 { format!("-{s}") } else { s }
    } else {
        format!("{v:.1}")
    }
}

/// `f(v)` when `v` is there and finite.
pub fn maybe(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    match v {
        Some(v) if v.is_finite() => f(v),
        _ => MISSING.to_string(),
    }
}

/// A share (0 to 1) of requests as a percentage, to a thousandth of a per cent (an SLO's
/// errors bound is often 0.1 %).
pub fn percent(ratio: f64) -> String {
    if ratio.is_finite() {
        format!("{:.3}%", ratio * 100.0)
    } else {
        MISSING.to_string()
    }
}

/// A share (0 to 1) of CPU time as a percentage, to a tenth of a per cent.
pub fn share(ratio: f64) -> String {
    if ratio.is_finite() {
        format!("{:.1}%", ratio * 100.0)
    } else {
        MISSING.to_string()
    }
}

/// A per-call figure (bytes, µs): whole from 100 up, else with one decimal.
pub fn amount(v: f64) -> String {
    if !v.is_finite() {
        MISSING.to_string()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// (`to` − `from`) ÷ `from` as a signed percentage.
pub fn change(from: Option<f64>, to: Option<f64>) -> String {
    match (from.filter(|v| v.is_finite()), to.filter(|v| v.is_finite())) {
        (Some(from), Some(to)) if from != 0.0 => {
            format!("{}%", signed((to - from) / from * 100.0, 1))
        }
        _ => MISSING.to_string(),
    }
}

/// An axis tick: short, thousands separated; empty when not a number.
pub fn tick(v: f64) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_readable() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(ms(0.0421), "0.042");
        assert_eq!(ms(123.4), "123");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(20 << 20), "20.0 MiB");
    }

    #[test]
    fn a_figure_that_is_not_a_number_reads_as_missing() {
        for f in [
            fixed(f64::NAN, 1),
            rate(f64::INFINITY),
            percent(f64::NAN),
            amount(f64::NAN),
        ] {
            assert_eq!(f, MISSING);
        }
        assert_eq!(maybe(None, rate), MISSING);
        assert_eq!(maybe(Some(f64::NAN), ms), MISSING);
        assert_eq!(change(Some(0.0), Some(1.0)), MISSING);
        assert_eq!(tick(f64::NAN), "");
    }

    #[test]
    fn shares_rates_and_ticks_are_readable() {
        assert_eq!(rate(12.345), "12.3");
        assert_eq!(rate(-1234.0), "-1,234");
        assert_eq!(percent(0.001), "0.100%");
        assert_eq!(share(0.236), "23.6%");
        assert_eq!(amount(230.4), "230");
        assert_eq!(amount(12.34), "12.3");
        assert_eq!(change(Some(200.0), Some(150.0)), "-25.0%");
        assert_eq!(signed(3.0, 1), "+3.0");
        assert_eq!(tick(25_000.0), "25,000");
        assert_eq!(tick(0.5), "0.50");
        assert_eq!(tick(40.0), "40");
    }
}
