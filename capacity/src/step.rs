//! One step of the experiment, as the planner sees it: the [`StepRunner`] that runs it (an
//! open-loop step at one rate, or a closed-loop one with N users), what the runner hands
//! back ([`Measured`]: the load's own figures and the CPU each program on the path used),
//! and the step's figures in the report ([`Step::of`], judged by the SLO;
//! [`SweepPoint::of`]).
//!
//! How a step is run (sockets, pacing, reading each program's `/metrics`) is the runner's;
//! the planner never does I/O beyond the progress lines it hands to [`StepRunner::say`].

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::report::{LatencySummary, Phase, Step, SweepPoint};
use crate::slo::{Breach, Slo};

/// What a comparison turns off and on: compression (`--compare-compression`) or TLS
/// (`--compare-tls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Compared {
    /// Request compression (the runner's load says how).
    #[default]
    Compression,
    /// TLS on every hop the runner controls.
    Tls,
}

impl Compared {
    /// Its name in text: `compression` or `TLS`.
    pub fn name(self) -> &'static str {
        match self {
            Compared::Compression => "compression",
            Compared::Tls => "TLS",
        }
    }
}

/// The settings of a step besides its rate: the two a comparison may turn off and on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Setting {
    /// Request payloads compressed (as the runner's load configures it), compressed
    /// replies accepted.
    pub compression: bool,
    /// The load speaks TLS (as the runner's load configures it).
    pub tls: bool,
}

impl Setting {
    /// Whether `what` is on.
    pub fn is_on(self, what: Compared) -> bool {
        match what {
            Compared::Compression => self.compression,
            Compared::Tls => self.tls,
        }
    }

    /// This setting with `what` turned on or off.
    pub fn with(mut self, what: Compared, on: bool) -> Setting {
        match what {
            Compared::Compression => self.compression = on,
            Compared::Tls => self.tls = on,
        }
        self
    }

    /// As the progress lines say it: `compression off`, or `compression off, TLS` when
    /// the load speaks TLS without comparing it; `TLS on` or `TLS off` when TLS is
    /// compared.
    pub fn label(self, compared: Option<Compared>) -> String {
        let onoff = |b: bool| if b { "on" } else { "off" };
        match compared {
            Some(Compared::Tls) => format!("TLS {}", onoff(self.tls)),
            _ if self.tls => format!("compression {}, TLS", onoff(self.compression)),
            _ => format!("compression {}", onoff(self.compression)),
        }
    }
}

/// What runs the experiment's steps: a load engine and the probes that read each
/// program's CPU around a step's measured window. Each call blocks until its step ends.
pub trait StepRunner {
    /// Why a step could not be run (the experiment then ends, and says so).
    type Error: fmt::Display;

    /// Offers `rate` requests per second on the open-loop schedule for one step.
    fn open(&mut self, rate: f64, setting: Setting) -> Result<Measured, Self::Error>;

    /// Runs `users` closed-loop users for one step.
    fn closed(&mut self, users: usize, setting: Setting) -> Result<Measured, Self::Error>;

    /// True once the experiment must end (Ctrl-C): no step starts after it, and a step it
    /// cut short is left out.
    fn stopped(&self) -> bool;

    /// The longest a step may run past its measured window: its last replies (up to the
    /// call timeout when the step is beyond capacity) and its closing readings. A step
    /// whose end, so counted, would pass the time budget is not started.
    fn overrun(&self) -> Duration;

    /// Shows one progress line (a person watches the experiment through these).
    fn say(&mut self, line: fmt::Arguments<'_>);
}

/// What one step measured: the load's figures over its measured window, and the CPU of
/// each program on the path (by role: `driver`, `broker`, `provider`) from the window's
/// start until the step's last reply.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// Length of the measured window, seconds.
    pub seconds: f64,
    /// The requests of the window.
    pub requests: Requests,
    /// Their calls.
    pub calls: Calls,
    /// Bytes the load wrote to the wire (frames, as sent).
    pub wire_out: u64,
    /// Bytes it read from the wire.
    pub wire_in: u64,
    /// The CPU each program on the path used.
    pub cpu: CpuUse,
}

/// The requests of a measured window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Requests {
    /// Due on the schedule (open loop; 0 in a closed loop).
    pub due: u64,
    /// Completed (every call answered).
    pub completed: u64,
    /// Completed with every call successful.
    pub ok: u64,
    /// Completed with at least one failed call.
    pub failed: u64,
    /// Never sent (every slot busy and the backlog full).
    pub not_sent: u64,
    /// Latency from the intended start (the start, in a closed loop), ms.
    pub latency: LatencySummary,
    /// Open loop: latency from the actual start, ms.
    pub latency_uncorrected: Option<LatencySummary>,
}

/// The calls of a measured window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calls {
    /// Sent.
    pub sent: u64,
    /// Successful.
    pub ok: u64,
    /// Successful, per second.
    pub ok_per_second: f64,
    /// Failed, by outcome (`timeout`, `overloaded`, `no_reply`, ...).
    pub errors: BTreeMap<String, u64>,
}

/// CPU used over a step, by role (summed over a role's endpoints).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuUse {
    /// CPU seconds.
    pub seconds: BTreeMap<String, f64>,
    /// Of those, seconds spent busy polling with nothing to read (only roles that did).
    pub idle_polling: BTreeMap<String, f64>,
    /// Cores used on average.
    pub cores: BTreeMap<String, f64>,
    /// The host's share of CPU time in softirq (0 to 1), read from the role's first
    /// endpoint.
    pub softirq: BTreeMap<String, f64>,
}

/// CPU µs per successful call of each role.
fn per_call(cpu_seconds: &BTreeMap<String, f64>, calls: u64) -> BTreeMap<String, f64> {
    cpu_seconds
        .iter()
        .filter(|_| calls > 0)
        .map(|(k, v)| (k.clone(), v / calls as f64 * 1e6))
        .collect()
}

impl Step {
    /// The figures of an open-loop step at `offered` requests/s, judged by `slo`.
    pub fn of(phase: Phase, offered: f64, m: &Measured, slo: &Slo) -> Step {
        let r = &m.requests;
        let secs = m.seconds.max(1e-9);
        let due = r.due.max(r.completed + r.not_sent);
        let error_ratio = if due == 0 {
            1.0
        } else {
            due.saturating_sub(r.ok) as f64 / due as f64
        };
        let sent = m.calls.sent.max(1) as f64;
        let latency = r.latency;
        let mut broken = slo.broken(&latency, error_ratio);
        if r.ok == 0 {
            broken.push(Breach::NothingSucceeded);
        }
        Step {
            phase,
            offered,
            achieved: r.ok as f64 / secs,
            calls_per_second: m.calls.ok_per_second,
            due,
            ok: r.ok,
            failed: r.failed,
            not_sent: r.not_sent,
            latency,
            latency_uncorrected: r.latency_uncorrected.unwrap_or(latency),
            errors: m.calls.errors.clone(),
            error_ratio,
            bytes_out_per_call: m.wire_out as f64 / sent,
            bytes_in_per_call: m.wire_in as f64 / sent,
            cpu_us_per_call: per_call(&m.cpu.seconds, m.calls.ok),
            idle_poll_us_per_call: per_call(&m.cpu.idle_polling, m.calls.ok),
            cpu_cores: m.cpu.cores.clone(),
            softirq_share: m.cpu.softirq.clone(),
            pass: broken.is_empty(),
            broken: broken.iter().map(Breach::to_string).collect(),
        }
    }
}

impl SweepPoint {
    /// The figures of a closed-loop step with `users`.
    pub fn of(users: usize, m: &Measured) -> SweepPoint {
        let r = &m.requests;
        let secs = m.seconds.max(1e-9);
        let completed = r.completed.max(1) as f64;
        SweepPoint {
            users,
            throughput: r.ok as f64 / secs,
            calls_per_second: m.calls.ok_per_second,
            latency: r.latency,
            error_ratio: r.failed as f64 / completed,
            cpu_cores: m.cpu.cores.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(due: u64, ok: u64, p99: f64) -> Measured {
        Measured {
            seconds: 2.0,
            requests: Requests {
                due,
                completed: ok,
                ok,
                latency: LatencySummary {
                    count: ok,
                    p99_ms: p99,
                    ..LatencySummary::default()
                },
                ..Requests::default()
            },
            calls: Calls {
                sent: ok * 5,
                ok: ok * 5,
                ok_per_second: ok as f64 * 2.5,
                errors: BTreeMap::new(),
            },
            wire_out: ok * 5 * 127,
            wire_in: ok * 5 * 103,
            cpu: CpuUse {
                seconds: BTreeMap::from([("broker".to_string(), 0.5)]),
                ..CpuUse::default()
            },
        }
    }

    #[test]
    fn a_step_is_judged_on_its_requests_due() {
        let slo: Slo = "p99<=20ms,errors<=1%".parse().unwrap();
        let s = Step::of(Phase::Grow, 500.0, &measured(1000, 1000, 5.0), &slo);
        assert!(s.pass, "{:?}", s.broken);
        assert_eq!(s.achieved, 500.0);
        assert_eq!(s.bytes_out_per_call, 127.0);
        assert_eq!(s.cpu_us_per_call["broker"], 100.0);
        // 2 % of the requests due never succeeded, and p99 is over its bound.
        let s = Step::of(Phase::Grow, 500.0, &measured(1000, 980, 25.0), &slo);
        assert!(!s.pass);
        assert_eq!(s.broken, ["p99 25.0 > 20.0", "errors 2.000% > 1.000%"]);
    }

    #[test]
    fn a_step_where_nothing_succeeded_fails_whatever_the_slo() {
        let slo: Slo = "errors<=100%".parse().unwrap();
        let s = Step::of(Phase::Grow, 500.0, &measured(1000, 0, 0.0), &slo);
        assert!(!s.pass);
        assert_eq!(s.broken, ["no request succeeded"]);
        assert!(
            s.cpu_us_per_call.is_empty(),
            "no call to share the CPU over"
        );
    }
}
