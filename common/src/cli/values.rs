//! Values on the command line: durations (`250ms`, `2s`, `1m30s`: always with a unit, but
//! `0`), byte sizes (`512MiB`, `64KiB`, `1GiB`, or a number of bytes), `on`/`off`,
//! and the addresses to listen on (`IP:PORT` or `:PORT`; the metrics endpoint's may be
//! `off`). Each is a
//! type with `FromStr` and `Display`, so that a flag's default is given as the named
//! constant itself (`default_value_t = DurationArg(DEFAULT_GRACE)`) and `--help` prints it
//! in the form the flag takes.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

/// The units a duration is written in, as the errors list them (humantime's; it also
/// takes their long forms: `msec`, `seconds`, `min`, `hours`…).
pub const DURATION_UNITS: &str = "ns, us, ms, s, m (minutes), h, d";

/// Parses a duration: a number with a unit (`250ms`, `2s`, `1.5s`, `1m30s`), or `0`. A
/// number without a unit is refused, the units listed: `--busy-poll 50` could mean 50 µs
/// or 50 s, and reading it as seconds made a 50 µs window a 50 s one. `0` is the same in
/// every unit.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(t).map_err(|e| match e {
        humantime::DurationError::UnknownUnit { unit, .. } if unit.is_empty() => {
            format!("{s:?} has no unit: write a duration with one of {DURATION_UNITS} (e.g. {t}ms or {t}s)")
        }
        humantime::DurationError::UnknownUnit { unit, .. } => {
            format!("{s:?}: unknown unit {unit:?}; a duration takes {DURATION_UNITS} (e.g. 250ms, 2s, 1m30s)")
        }
        e => format!(
            "{s:?} is not a duration ({e}): write a number with one of {DURATION_UNITS} (e.g. 250ms, 2s, 1m30s)"
        ),
    })
}

/// Parses a duration as [`parse_duration`] does, or `off` (`None`).
pub fn parse_duration_or_off(s: &str) -> Result<Option<Duration>, String> {
    if s.eq_ignore_ascii_case("off") {
        Ok(None)
    } else {
        parse_duration(s).map(Some)
    }
}

/// Parses `on` / `off` (also `true`/`false`, `yes`/`no`, `1`/`0`).
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("{s}: expected on or off")),
    }
}

/// A duration flag's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DurationArg(pub Duration);

impl FromStr for DurationArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration(s).map(DurationArg)
    }
}

impl fmt::Display for DurationArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        // humantime writes `1m 30s`; without the spaces it reads as one word in `--help`.
        let text = humantime::format_duration(self.0).to_string();
        f.write_str(&text.replace(' ', ""))
    }
}

/// A byte-size flag's value: a number of bytes, or one with `KiB`, `MiB` or `GiB`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeArg(pub usize);

const SIZE_UNITS: [(&str, usize); 4] = [
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("B", 1),
];

/// Parses a number of bytes: bare (`1048576`: the flags that take one say bytes in their
/// name or help, so a bare count is not ambiguous) or with `B`, `KiB`, `MiB` or `GiB`
/// (`1MiB`).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, unit) = SIZE_UNITS
        .iter()
        .find_map(|(u, n)| t.strip_suffix(u).map(|rest| (rest, *n)))
        .unwrap_or((t, 1));
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| {
            format!(
                "{s:?} is not a size: write a number of bytes (1048576) or one with B, KiB, MiB or GiB (1MiB, 512KiB)"
            )
        })
}

/// As [`parse_bytes`], for a limit that is a 32-bit count on the wire (a frame's body).
pub fn parse_bytes_u32(s: &str) -> Result<u32, String> {
    let n = parse_bytes(s)?;
    u32::try_from(n).map_err(|_| format!("{s:?} is more than a frame can hold (4GiB - 1)"))
}

impl FromStr for SizeArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_bytes(s).map(SizeArg)
    }
}

impl fmt::Display for SizeArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match SIZE_UNITS
            .iter()
            .filter(|(_, n)| *n > 1)
            .find(|(_, n)| self.0 >= *n && self.0 % n == 0)
        {
            Some((u, n)) => write!(f, "{}{u}", self.0 / n),
            None => write!(f, "{}", self.0),
        }
    }
}

/// A rate flag's value: a count a second (`256`), or `off` (no limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateArg(pub Option<u32>);

impl FromStr for RateArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(RateArg(None));
        }
        match t.parse::<u32>() {
            Ok(n) if n > 0 => Ok(RateArg(Some(n))),
            _ => Err(format!(
                "{s:?} is not a rate: write a number a second above zero (256), or off"
            )),
        }
    }
}

impl fmt::Display for RateArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("off"),
        }
    }
}

/// An `on`/`off` flag's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnOff(pub bool);

impl FromStr for OnOff {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_on_off(s).map(OnOff)
    }
}

impl fmt::Display for OnOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0 { "on" } else { "off" })
    }
}

/// Parses an address to listen on: `IP:PORT` (`0.0.0.0:7700`, `[::]:7700`), or `:PORT`
/// for every IPv4 interface (`:9781` is `0.0.0.0:9781`, as the docs write ports).
pub fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    let t = s.trim();
    let full;
    let addr = match t.strip_prefix(':') {
        Some(port) => {
            full = format!("0.0.0.0:{port}");
            full.as_str()
        }
        None => t,
    };
    addr.parse().map_err(|_| {
        format!(
            "{s:?} is not an address to listen on: write IP:PORT (0.0.0.0:7700, [::]:7700 for IPv6) or :PORT for every interface"
        )
    })
}

/// A `--metrics-listen` value: an address as [`parse_listen_addr`] takes it, or `off` (no
/// endpoint: nothing is recorded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsListen(pub Option<SocketAddr>);

impl MetricsListen {
    /// True for `off`.
    pub fn is_off(&self) -> bool {
        self.0.is_none()
    }
}

impl FromStr for MetricsListen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("off") || s.eq_ignore_ascii_case("none") {
            return Ok(MetricsListen(None));
        }
        parse_listen_addr(s)
            .map(|a| MetricsListen(Some(a)))
            .map_err(|e| format!("{e}, or off"))
    }
}

impl fmt::Display for MetricsListen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(a) => write!(f, "{a}"),
            None => f.write_str("off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_a_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("50us"), Ok(Duration::from_micros(50)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bare in ["50", "5", "100", "1.5", " 2 "] {
            let e = parse_duration(bare).unwrap_err();
            assert!(e.contains("has no unit"), "{bare}: {e}");
            assert!(e.contains(DURATION_UNITS), "{bare}: {e}");
        }
        assert_eq!(
            parse_duration("50").unwrap_err(),
            "\"50\" has no unit: write a duration with one of ns, us, ms, s, m (minutes), h, d (e.g. 50ms or 50s)"
        );
        for bad in ["-1", "soon", "5 parsecs", ""] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(DURATION_UNITS), "{bad}: {e}");
        }
    }

    #[test]
    fn every_value_reads_back_what_it_prints() {
        for d in [0, 1, 250, 1000, 1500, 90_000, 3_600_000] {
            let v = DurationArg(Duration::from_millis(d));
            assert_eq!(v.to_string().parse::<DurationArg>(), Ok(v), "{v}");
        }
        assert_eq!(DurationArg(Duration::from_secs(5)).to_string(), "5s");
        assert_eq!(DurationArg(Duration::from_micros(50)).to_string(), "50us");
        for v in [OnOff(true), OnOff(false)] {
            assert_eq!(v.to_string().parse::<OnOff>(), Ok(v));
        }
        for v in [
            MetricsListen(None),
            MetricsListen(Some("0.0.0.0:9770".parse().unwrap())),
        ] {
            assert_eq!(v.to_string().parse::<MetricsListen>(), Ok(v));
        }
        assert!("nowhere".parse::<MetricsListen>().is_err());
    }

    #[test]
    fn sizes_take_a_count_of_bytes_or_a_unit() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("1MiB"), Ok(1 << 20));
        assert_eq!(parse_bytes("512 KiB"), Ok(512 << 10));
        assert_eq!(parse_bytes("64B"), Ok(64));
        assert_eq!(parse_bytes_u32("10MiB"), Ok(10 << 20));
        assert!(
            parse_bytes_u32("4GiB")
                .unwrap_err()
                .contains("more than a frame")
        );
        for bad in ["10MB", "lots", "-1", "1.5MiB"] {
            let e = parse_bytes(bad).unwrap_err();
            assert!(e.contains("B, KiB, MiB or GiB"), "{bad}: {e}");
        }
        assert_eq!(SizeArg(64).to_string(), "64");
        assert_eq!(SizeArg(512 << 20).to_string(), "512MiB");
    }

    #[test]
    fn a_port_alone_listens_on_every_interface() {
        let any = |port| SocketAddr::from(([0, 0, 0, 0], port));
        assert_eq!(parse_listen_addr(":9781"), Ok(any(9781)));
        assert_eq!(
            parse_listen_addr("127.0.0.1:7700"),
            Ok("127.0.0.1:7700".parse().unwrap())
        );
        assert_eq!(
            parse_listen_addr("[::]:7700"),
            Ok("[::]:7700".parse().unwrap())
        );
        assert_eq!(
            ":9781".parse::<MetricsListen>(),
            Ok(MetricsListen(Some(any(9781))))
        );
        for bad in [":", ":x", "9781", "host:1", ":70000"] {
            let e = parse_listen_addr(bad).unwrap_err();
            assert!(e.contains("or :PORT for every interface"), "{bad}: {e}");
        }
        let e = "nowhere".parse::<MetricsListen>().unwrap_err();
        assert!(e.ends_with(", or off"), "{e}");
    }
}
