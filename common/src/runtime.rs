//! What every program's `main` sets up before calling its library `run`: logging, the
//! Tokio runtime, and the parsing of durations on the command line.

use std::time::Duration;

/// Starts logging to stderr. The filter comes from `RUST_LOG` when set, else `default`
/// (e.g. `"info"`). Log lines are plain (no colours) when stderr is not a terminal.
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

/// Worker threads to use when the operator says 0: one per CPU the process may run on.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The Tokio runtime with `threads` workers (0 = one per CPU). Its threads are named after
/// the program so that `top -H` shows who is busy.
///
/// One worker (`threads` 1, or 0 on a one-CPU machine) gets the current-thread scheduler,
/// not a multi-thread one with one worker: it has no work-stealing queues, no cross-thread
/// wake-ups and no clock read per batch of polled tasks (the multi-thread scheduler's
/// queue tuning). With all three programs at one thread, the broker path did about a
/// sixth more calls per second on the 64-in-flight echo bench (docs/performance.md).
/// Tasks then run on the thread that calls `block_on` (so `thread_name` names only the
/// blocking pool's threads), and only while it is inside `block_on`; nothing may block
/// that thread, as on any worker.
pub fn build(name: &str, threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = if threads == 0 {
        default_threads()
    } else {
        threads
    };
    if threads == 1 {
        return tokio::runtime::Builder::new_current_thread()
            .thread_name(name)
            .enable_all()
            .build();
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
}

/// Parses a duration for clap: `250ms`, `2s`, `1m30s`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    if let Ok(secs) = s.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(format!("{s}: not a duration"));
    }
    humantime::parse_duration(s).map_err(|e| format!("{s}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_or_as_seconds() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("soon").is_err());
    }
}

/// Parses a duration as [`parse_duration`] does, or `off` (`None`).
pub fn parse_duration_or_off(s: &str) -> Result<Option<Duration>, String> {
    if s.eq_ignore_ascii_case("off") {
        Ok(None)
    } else {
        parse_duration(s).map(Some)
    }
}

/// Parses `on` / `off` (also `true`/`false`, `yes`/`no`, `1`/`0`) for clap.
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("{s}: expected on or off")),
    }
}

/// Every problem found while validating a configuration, reported together so that an
/// operator fixes them in one go.
#[derive(Debug, Default, thiserror::Error, PartialEq, Eq)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigProblems(pub Vec<String>);

impl ConfigProblems {
    /// Records a problem when `bad` holds.
    pub fn check(&mut self, bad: bool, problem: impl FnOnce() -> String) {
        if bad {
            self.0.push(problem());
        }
    }

    /// `Ok(value)` when no problem was recorded.
    pub fn into_result<T>(self, value: T) -> Result<T, ConfigProblems> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(self)
        }
    }
}
