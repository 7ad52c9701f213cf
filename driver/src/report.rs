//! The run's report: figures computed from the merged tally, rendered as text for a person
//! and as JSON for scripts (`--json FILE`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use rpcmesh_common::format::bytes;
// `ms` and `thousands` are re-exported for the modules that print figures beside the
// report's (`hdr_log`'s merged report).
pub(crate) use rpcmesh_common::format::{ms, thousands};

use crate::failures::{self, FailureGroup};
use crate::pacer::{Arrival, Pacing, Schedule};
use crate::stats::{Latency, LatencySummary, Tally};

/// A successful call slower than this counts as `slow` in the report: 30 ms. On a LAN or
/// one machine no queue makes a call that slow at a sane load; a stall does. It sits above
/// the machine's own stalls (under 5 ms on the reference VM, docs/performance.md) and
/// below the 40 ms of a delayed ACK meeting Nagle's algorithm, a stall that percentiles
/// hide when it hits under 1 % of the calls.
pub const SLOW_CALL_US: u64 = 30_000;

/// Everything a run measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// rpcmesh version that produced it.
    pub version: String,
    /// Unix time the run started, seconds.
    pub started_unix: u64,
    /// What was run.
    pub setup: Setup,
    /// Measured time, seconds (excludes the warm-up).
    pub measured_seconds: f64,
    /// How the run ended: `completed` (its duration or its requests) or `interrupted`
    /// (SIGINT or SIGTERM before then: the figures are of the part measured).
    #[serde(default)]
    pub ended: Ending,
    /// User requests (fan-out of `fanout` calls).
    pub requests: RequestFigures,
    /// Single calls.
    pub calls: CallFigures,
    /// Bytes.
    pub bytes: ByteFigures,
    /// Open loop: the figures of each step of the schedule (one for a constant rate, one a
    /// second along a ramp), by the step each request was meant to start in.
    #[serde(default)]
    pub steps: Vec<StepFigures>,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ending {
    /// It ran its duration, or its requests.
    #[default]
    Completed,
    /// SIGINT or SIGTERM stopped it before: what was measured until then is reported.
    Interrupted,
}

/// The figures of one step of an open-loop schedule.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepFigures {
    /// When it starts, seconds into the measured window.
    pub start_seconds: f64,
    /// How long it lasts, seconds.
    pub seconds: f64,
    /// Offered rate at its start, requests per second.
    pub rate_from: f64,
    /// Offered rate at its end (equal but along a ramp).
    pub rate_to: f64,
    /// Its requests (those meant to start in it).
    pub requests: RequestFigures,
    /// Their calls.
    pub calls: CallFigures,
}

/// How the run was set up.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Setup {
    /// `platform` or `echo`.
    pub workload: String,
    /// Echo message size (echo only).
    pub payload_size: usize,
    /// Targets called.
    pub targets: Vec<String>,
    /// True when the driver started its own provider and broker.
    pub embedded: bool,
    /// Users.
    pub concurrency: usize,
    /// Connections.
    pub connections: usize,
    /// Calls per request.
    pub fanout: u32,
    /// Calls of a request made at once.
    pub parallel: bool,
    /// Request compression on.
    pub compression: bool,
    /// Plain v1 frames only.
    pub plain_v1: bool,
    /// Warm-up, seconds.
    pub warmup_seconds: f64,
    /// Open loop at a constant rate: requests started per second in all; `None` = closed
    /// loop, or a ramp or steps (see `schedule`).
    #[serde(default)]
    pub rate: Option<f64>,
    /// Open loop: the offered rate over the measured window.
    #[serde(default)]
    pub schedule: Option<Schedule>,
    /// Open loop: how requests were spaced.
    #[serde(default)]
    pub arrival: Option<Arrival>,
    /// Open loop: how the pacer waited for each request.
    #[serde(default)]
    pub pacing: Option<Pacing>,
}

/// Figures of user requests.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RequestFigures {
    /// Requests due in the measured window (the schedule's, in the open loop); each ends
    /// completed or not sent: `due = completed + not_sent`.
    #[serde(default)]
    pub due: u64,
    /// Requests completed (every call answered).
    pub completed: u64,
    /// Of which every call succeeded.
    pub ok: u64,
    /// Of which at least one call failed.
    pub failed: u64,
    /// Completed requests per second, successful or not.
    pub per_second: f64,
    /// Successful requests per second: the headline's rate.
    #[serde(default)]
    pub ok_per_second: f64,
    /// Requests with a failed call per second.
    #[serde(default)]
    pub failed_per_second: f64,
    /// Open loop: requests due while every slot (`concurrency`) was busy and the backlog
    /// was full: never sent. Requests due = completed + not sent.
    #[serde(default)]
    pub not_sent: u64,
    /// Open loop: requests that found every slot busy, or no connection, and waited in the
    /// backlog (their latency counts that wait: it runs from the intended start).
    #[serde(default)]
    pub backlogged: u64,
    /// Open loop: how late the requests that found a free slot started after their
    /// intended time, ms: the pacer's precision.
    #[serde(default)]
    pub start_lag: Option<LatencySummary>,
    /// Latency of the successful requests (all calls), ms, from the intended start in the
    /// open loop (from the start in the closed loop, where there is no schedule).
    pub latency: LatencySummary,
    /// Open loop: latency of the successful requests from the actual start, ms (what a
    /// tool that ignores the schedule would report; it hides the wait for a free slot).
    #[serde(default)]
    pub latency_uncorrected: Option<LatencySummary>,
    /// Latency of the requests with a failed call, ms, from the intended start: apart, so
    /// that fast failures do not flatter the successful requests' figures.
    #[serde(default)]
    pub failed_latency: LatencySummary,
}

/// Figures of calls.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CallFigures {
    /// Calls sent in the measured window. Each has exactly one outcome:
    /// `sent = ok + sum(errors)`.
    pub sent: u64,
    /// Successful calls.
    pub ok: u64,
    /// Failed calls by kind: a reply's status (`failed`, `timeout`, `unavailable`,
    /// `overloaded`, `bad_request`) or the driver's own finding (`no_reply`, `connection`:
    /// lost with the connection after it was written, so it may have run; `no_connection`:
    /// no target took it within the timeout, never written; `bad_reply`, `encode`).
    pub errors: BTreeMap<String, u64>,
    /// The failed calls by outcome and by what the reply said (its status text, such as
    /// `service not found: EchoServic`), largest first: every failed call in one group.
    /// Bounded: texts cut at 120 bytes, at most 32 texts (the failures with texts beyond
    /// them in a group of their outcome with `other_texts`), failures without a text (the
    /// driver's own findings) in a group of their outcome with no `text`.
    #[serde(default)]
    pub failures: Vec<FailureGroup>,
    /// Times a call was sent again, for any reason (the sum of `retries`). Not an
    /// outcome: the call's outcome is that of its last try, and its latency runs from its
    /// first intended start, detours included.
    #[serde(default)]
    pub rerouted: u64,
    /// Times a call was sent again, by why (docs/resilience.md): `not_run` (a draining
    /// target refused it unstarted), `unsent` (its connection was lost before it was
    /// written), `overloaded` (its target shed it; sent to another target), `lost` (its
    /// connection was lost after it was written: idempotent calls only). Only the reasons
    /// that happened.
    #[serde(default)]
    pub retries: BTreeMap<String, u64>,
    /// Calls safe to send again that were not, because the retry budget was spent, by
    /// the reason they would have been sent again for.
    #[serde(default)]
    pub retry_budget_exhausted: BTreeMap<String, u64>,
    /// Calls sent per second.
    pub per_second: f64,
    /// Successful calls per second.
    pub ok_per_second: f64,
    /// Latency of successful calls, ms, from the intended start (see the requests').
    pub latency: LatencySummary,
    /// Open loop: latency of successful calls from their actual start, ms.
    #[serde(default)]
    pub latency_uncorrected: Option<LatencySummary>,
    /// Replies that arrived after their call had timed out.
    pub late_replies: u64,
    /// Failed connection attempts, and connections that closed before bringing a reply.
    pub connect_failures: u64,
    /// Times a worker that had moved to another target (its own refused, failed or
    /// drained) went back to its own once it answered again.
    #[serde(default)]
    pub returned_home: u64,
    /// Successful calls slower than [`SLOW_CALL_US`] (30 ms), from the intended start.
    #[serde(default)]
    pub slow: u64,
}

/// Bytes of the measured window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ByteFigures {
    /// Written to the wire.
    pub wire_out: u64,
    /// Read from the wire.
    pub wire_in: u64,
    /// Request payloads before compression.
    pub payload_out_plain: u64,
    /// Request payloads as sent.
    pub payload_out_wire: u64,
    /// Reply payloads after inflation.
    pub payload_in_plain: u64,
    /// Reply payloads as received.
    pub payload_in_wire: u64,
    /// Wire bytes (both ways) per call.
    pub wire_per_call: f64,
}

impl RequestFigures {
    /// The request figures of `t`, over `secs` seconds; `lag`, the pacer's start lag.
    pub fn of(t: &Tally, secs: f64, open_loop: bool, lag: Option<&Latency>) -> Self {
        let completed = t.requests_ok + t.requests_failed;
        RequestFigures {
            due: t.requests_due,
            completed,
            ok: t.requests_ok,
            failed: t.requests_failed,
            per_second: completed as f64 / secs,
            ok_per_second: t.requests_ok as f64 / secs,
            failed_per_second: t.requests_failed as f64 / secs,
            not_sent: t.requests_not_sent,
            backlogged: t.requests_backlogged,
            start_lag: lag.filter(|_| open_loop).map(Latency::summary),
            latency: t.requests.summary(),
            latency_uncorrected: open_loop.then(|| t.requests_uncorrected.summary()),
            failed_latency: t.requests_failed_latency.summary(),
        }
    }
}

impl CallFigures {
    /// The call figures of `t`, over `secs` seconds.
    pub fn of(t: &Tally, secs: f64, open_loop: bool, late: u64, connect_failures: u64) -> Self {
        CallFigures {
            sent: t.sent,
            ok: t.ok(),
            errors: t.errors().map(|(k, v)| (k.to_string(), v)).collect(),
            failures: failures::groups(&t.outcomes, &t.texts),
            rerouted: t.retried(),
            retries: Tally::by_reason(&t.retries),
            retry_budget_exhausted: Tally::by_reason(&t.retries_refused),
            per_second: t.sent as f64 / secs,
            ok_per_second: t.ok() as f64 / secs,
            latency: t.calls.summary(),
            latency_uncorrected: open_loop.then(|| t.calls_uncorrected.summary()),
            late_replies: late,
            connect_failures,
            returned_home: 0,
            slow: t.calls.count_above_us(SLOW_CALL_US),
        }
    }
}

impl ByteFigures {
    /// The byte figures of `t`.
    pub fn of(t: &Tally) -> Self {
        ByteFigures {
            wire_out: t.wire_out,
            wire_in: t.wire_in,
            payload_out_plain: t.payload_out_plain,
            payload_out_wire: t.payload_out_wire,
            payload_in_plain: t.payload_in_plain,
            payload_in_wire: t.payload_in_wire,
            wire_per_call: if t.sent > 0 {
                (t.wire_out + t.wire_in) as f64 / t.sent as f64
            } else {
                0.0
            },
        }
    }
}

/// A count as the text report prints it: with thousands separators.
fn count(n: u64) -> String {
    thousands(n as f64)
}

/// Counts by reason, as the text report prints them: `not_run 3, unsent 1`.
fn reasons(by: &BTreeMap<String, u64>) -> String {
    by.iter()
        .map(|(k, n)| format!("{k} {}", count(*n)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Report {
    /// The report as text.
    pub fn render_text(&self) -> String {
        let s = &self.setup;
        let mut o = String::new();
        let target = if s.embedded {
            format!(
                "embedded provider + broker on 127.0.0.1 ({})",
                s.targets.join(", ")
            )
        } else {
            s.targets.join(", ")
        };
        let _ = writeln!(
            o,
            "rpcmesh driver {} — {} workload against {}",
            self.version, s.workload, target
        );
        let load = match &s.schedule {
            Some(sched) => format!(
                "open loop, {sched}, {} arrivals, {} pacing (at most {} in flight)",
                match s.arrival {
                    Some(Arrival::Poisson) => "poisson",
                    _ => "uniform",
                },
                s.pacing.unwrap_or_default(),
                s.concurrency
            ),
            None => format!("{} users", s.concurrency),
        };
        let measured = match self.ended {
            Ending::Completed => format!(
                "{:.1} s measured after {:.1} s warm-up",
                self.measured_seconds, s.warmup_seconds
            ),
            Ending::Interrupted => format!(
                "interrupted after {:.1} s measured ({:.1} s warm-up): a partial report",
                self.measured_seconds, s.warmup_seconds
            ),
        };
        let _ = writeln!(
            o,
            "  {} on {} connections, {} call{} per request ({}), compression {}{}, {measured}",
            load,
            s.connections,
            s.fanout,
            if s.fanout == 1 { "" } else { "s" },
            if s.parallel { "at once" } else { "in a row" },
            if s.compression { "on" } else { "off" },
            if s.plain_v1 { ", plain v1 frames" } else { "" },
        );
        let q = &self.requests;
        if q.not_sent > 0 {
            let _ = writeln!(
                o,
                "  NOT SENT: {} of the {} requests due ({:.1} %) found all {} slots busy and the backlog full: raise --concurrency (or --backlog), or lower the rate",
                count(q.not_sent),
                count(q.due),
                q.not_sent as f64 * 100.0 / q.due.max(1) as f64,
                s.concurrency
            );
        }
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "              {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "per second", "p50", "p90", "p99", "p99.9", "p99.99", "max", "mean"
        );
        let row = |o: &mut String, name: &str, rate: f64, l: &LatencySummary| {
            let _ = writeln!(
                o,
                "  {name:<10} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
                thousands(rate),
                ms(l.p50_ms),
                ms(l.p90_ms),
                ms(l.p99_ms),
                ms(l.p999_ms),
                ms(l.p9999_ms),
                ms(l.max_ms),
                ms(l.mean_ms)
            );
        };
        let uncorrected = self
            .requests
            .latency_uncorrected
            .as_ref()
            .zip(self.calls.latency_uncorrected.as_ref());
        if uncorrected.is_some() {
            let _ = writeln!(
                o,
                "  from the intended start (corrected: waits for a slot count)"
            );
        }
        row(
            &mut o,
            "requests",
            self.requests.ok_per_second,
            &self.requests.latency,
        );
        row(
            &mut o,
            "calls",
            self.calls.ok_per_second,
            &self.calls.latency,
        );
        let failed_row = self.requests.failed > 0;
        if failed_row {
            row(
                &mut o,
                "failed",
                self.requests.failed_per_second,
                &self.requests.failed_latency,
            );
        }
        if let Some((requests, calls)) = uncorrected {
            let _ = writeln!(o, "  from the actual send (uncorrected: hides the waits)");
            row(&mut o, "requests", self.requests.ok_per_second, requests);
            row(&mut o, "calls", self.calls.ok_per_second, calls);
        }
        let _ = writeln!(
            o,
            "  (latency in ms; requests and calls: the successful ones{})",
            if failed_row {
                "; failed: the requests with a failed call"
            } else {
                ""
            }
        );
        let _ = writeln!(o);
        let failed: u64 = self.calls.errors.values().sum();
        let _ = writeln!(
            o,
            "  calls: {} sent, {} ok, {} failed ({:.3} %){}",
            count(self.calls.sent),
            count(self.calls.ok),
            count(failed),
            if self.calls.sent > 0 {
                failed as f64 * 100.0 / self.calls.sent as f64
            } else {
                0.0
            },
            if failed > 0 {
                ", by outcome and what the replies said:"
            } else {
                ""
            }
        );
        o.push_str(&failures::render(&self.calls.failures, "    "));
        if self.calls.rerouted > 0 {
            let _ = writeln!(
                o,
                "  retried: {} sends again of calls that did not run{} ({})",
                count(self.calls.rerouted),
                if self.calls.retries.contains_key("lost") {
                    " or are idempotent"
                } else {
                    ""
                },
                reasons(&self.calls.retries)
            );
        }
        if !self.calls.retry_budget_exhausted.is_empty() {
            let refused: u64 = self.calls.retry_budget_exhausted.values().sum();
            let _ = writeln!(
                o,
                "  not retried for want of retry budget: {} ({})",
                count(refused),
                reasons(&self.calls.retry_budget_exhausted)
            );
        }
        let _ = writeln!(
            o,
            "  requests: {} completed, {} ok, {} with a failed call",
            count(self.requests.completed),
            count(self.requests.ok),
            count(self.requests.failed)
        );
        if self.steps.len() > 1 {
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "  steps (each request counted in the step it was meant to start in; achieved and latency: the successful ones, from the intended start, ms)"
            );
            let _ = writeln!(
                o,
                "  {:>8} {:>8} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9}",
                "from s",
                "for s",
                "offered/s",
                "achieved/s",
                "p50",
                "p99",
                "p99.9",
                "failed",
                "not sent"
            );
            for st in &self.steps {
                let l = &st.requests.latency;
                let offered = if (st.rate_from - st.rate_to).abs() < 1e-9 {
                    thousands(st.rate_from)
                } else {
                    format!("{}-{}", thousands(st.rate_from), thousands(st.rate_to))
                };
                let _ = writeln!(
                    o,
                    "  {:>8.1} {:>8.1} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9}",
                    st.start_seconds,
                    st.seconds,
                    offered,
                    thousands(st.requests.ok_per_second),
                    ms(l.p50_ms),
                    ms(l.p99_ms),
                    ms(l.p999_ms),
                    count(st.requests.failed),
                    count(st.requests.not_sent)
                );
            }
        }
        if let Some(lag) = &self.requests.start_lag {
            let _ = writeln!(
                o,
                "  open loop: {} waited in the backlog (all {} slots busy, or no connection), {} not sent (backlog full); start lag p50 {} ms, p99 {} ms, max {} ms",
                count(self.requests.backlogged),
                s.concurrency,
                count(self.requests.not_sent),
                ms(lag.p50_ms),
                ms(lag.p99_ms),
                ms(lag.max_ms)
            );
        }
        if self.calls.late_replies > 0 || self.calls.connect_failures > 0 {
            let _ = writeln!(
                o,
                "  late replies {}, failed connection attempts {}",
                self.calls.late_replies, self.calls.connect_failures
            );
        }
        if self.calls.returned_home > 0 {
            let _ = writeln!(
                o,
                "  workers back on their own target after moving away: {}",
                self.calls.returned_home
            );
        }
        let b = &self.bytes;
        let _ = writeln!(
            o,
            "  wire: {} out, {} in ({:.0} B per call); payload out {} → {}, in {} → {}",
            bytes(b.wire_out),
            bytes(b.wire_in),
            b.wire_per_call,
            bytes(b.payload_out_plain),
            bytes(b.payload_out_wire),
            bytes(b.payload_in_wire),
            bytes(b.payload_in_plain)
        );
        o
    }
}
