//! Figures as people read them: rates with thousands separators, milliseconds with as many
//! decimals as they need, byte counts in KiB/MiB/GiB. Every report a program prints or
//! writes (the driver's run report, `driver merge`, the capacity report's text, Markdown
//! and HTML) formats its numbers here, so that one figure reads the same everywhere.
//!
//! Pure functions of a number; no I/O, and nothing of any other layer.

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
}
