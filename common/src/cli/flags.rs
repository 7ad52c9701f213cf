//! Flag groups more than one program takes, flattened into each program's `Args`: the
//! runtime's threads ([`RuntimeArgs`]), stage sampling ([`StageArgs`]), compression
//! tuning ([`CompressionArgs`]), the servers' connection timeouts and memory budget
//! ([`LimitArgs`]), and the retry budget and idempotent calls of the broker and the
//! driver ([`RetryBudgetArgs`], [`IdempotentArgs`]). Each flag is written here once, with its environment fallback
//! and its default as a named constant.

use rpcmesh_wire::compress::{
    CompressionConfig, DEFAULT_COMPRESS_LEVEL, DEFAULT_COMPRESS_THRESHOLD,
};

use crate::cli::config::{ConfigProblems, ConfigWarnings};
use crate::cli::values::{DurationArg, MetricsListen, OnOff, RateArg, SizeArg, parse_bytes};
use crate::metrics::families::DEFAULT_STAGE_SAMPLE;
use crate::net::budget::DEFAULT_MEMORY_BUDGET;
use crate::net::session::{
    DEFAULT_FRAME_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_WRITE_TIMEOUT, Timeouts,
};
use crate::net::sources::{
    AcceptRate, DEFAULT_ACCEPT_BURST_PER_SOURCE, DEFAULT_ACCEPT_RATE_PER_SOURCE,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE, SourceLimits,
};
use crate::retry::{DEFAULT_RETRY_MIN_PER_SECOND, DEFAULT_RETRY_PERCENT, Idempotent, RetryBudget};

/// Worker threads unless told otherwise: 0, one per CPU the process may run on.
pub const DEFAULT_THREADS: usize = 0;
/// Stage histograms are recorded unless turned off: they are what shows where the time of
/// a call goes, and at one call in [`DEFAULT_STAGE_SAMPLE`] they cost under 3 %.
pub const DEFAULT_STAGE_METRICS: bool = true;

/// The runtime's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct RuntimeArgs {
    /// Tokio worker threads (0 = one per CPU).
    #[arg(long, env = "RPCMESH_THREADS", default_value_t = DEFAULT_THREADS)]
    pub threads: usize,
}

/// The stage-timing flags every program takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct StageArgs {
    /// Record per-stage latency histograms: on|off (off: the hot path takes no timestamps).
    #[arg(long, env = "RPCMESH_STAGE_METRICS", default_value_t = OnOff(DEFAULT_STAGE_METRICS))]
    pub stage_metrics: OnOff,
    /// Time the stages of one call in this many (1 = every call; `--stage-metrics off`
    /// times none).
    #[arg(long, env = "RPCMESH_STAGE_SAMPLE", default_value_t = DEFAULT_STAGE_SAMPLE, value_parser = clap::value_parser!(u32).range(1..))]
    pub stage_sample: u32,
}

impl StageArgs {
    /// One call in how many is timed; 0 = none: stages off, or no metrics endpoint to read
    /// the histograms from (then the hot path takes no timestamps at all).
    pub fn every(&self, metrics: MetricsListen) -> u32 {
        if self.stage_metrics.0 && !metrics.is_off() {
            self.stage_sample.max(1)
        } else {
            0
        }
    }

    /// Warns of a `--stage-sample` that does nothing: stages off, or no metrics endpoint.
    pub fn warnings(&self, metrics: MetricsListen, warnings: &mut ConfigWarnings) {
        warnings.check(
            self.stage_sample != DEFAULT_STAGE_SAMPLE && self.every(metrics) == 0,
            || {
                format!(
                    "--stage-sample {} does nothing: no stage is timed (--stage-metrics off, or --metrics-listen off)",
                    self.stage_sample
                )
            },
        );
    }
}

/// How payloads are compressed, for the programs that compress (whether they do is each
/// program's own `--compress`, whose default differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct CompressionArgs {
    /// Payloads shorter than this many bytes are sent plain (a number of bytes, or with
    /// KiB).
    #[arg(long, env = "RPCMESH_COMPRESS_THRESHOLD", default_value_t = DEFAULT_COMPRESS_THRESHOLD, value_parser = parse_bytes)]
    pub compress_threshold: usize,
    /// zlib level, 0-9.
    #[arg(long, env = "RPCMESH_COMPRESS_LEVEL", default_value_t = DEFAULT_COMPRESS_LEVEL)]
    pub compress_level: u32,
}

impl CompressionArgs {
    /// Warns of compression settings given with compression off (`on` false): they do
    /// nothing.
    pub fn warnings(&self, on: bool, warnings: &mut ConfigWarnings) {
        let tuned = self.compress_threshold != DEFAULT_COMPRESS_THRESHOLD
            || self.compress_level != DEFAULT_COMPRESS_LEVEL;
        warnings.check(!on && tuned, || {
            "--compress-threshold and --compress-level do nothing with --compress off".into()
        });
    }

    /// The compression settings when `on`, else `None`; a level zlib does not have is
    /// recorded in `problems`.
    pub fn config(&self, on: bool, problems: &mut ConfigProblems) -> Option<CompressionConfig> {
        problems.check(self.compress_level > 9, || {
            format!(
                "--compress-level {} is not a zlib level (0-9)",
                self.compress_level
            )
        });
        on.then_some(CompressionConfig {
            threshold: self.compress_threshold,
            level: self.compress_level,
        })
    }
}

/// The time limits of every connection a server (provider, broker) accepts, the limits on
/// each source of connections, and the server's memory budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct LimitArgs {
    /// Close a connection with no call in flight, nothing to write and nothing read for
    /// this long.
    #[arg(long, env = "RPCMESH_IDLE_TIMEOUT", default_value_t = DurationArg(DEFAULT_IDLE_TIMEOUT))]
    pub idle_timeout: DurationArg,
    /// Close a connection whose frame, once begun, is not complete after this long.
    #[arg(long, env = "RPCMESH_FRAME_TIMEOUT", default_value_t = DurationArg(DEFAULT_FRAME_TIMEOUT))]
    pub frame_timeout: DurationArg,
    /// Close a connection whose peer takes none of the bytes waiting for it for this long.
    #[arg(long, env = "RPCMESH_WRITE_TIMEOUT", default_value_t = DurationArg(DEFAULT_WRITE_TIMEOUT))]
    pub write_timeout: DurationArg,
    /// Bytes the process may buffer (partial frames, write backlogs, large requests queued
    /// toward providers): past half of it new calls with bodies of 4 KiB or more are
    /// answered "overloaded"; past three quarters the connections holding most stop
    /// reading.
    #[arg(long, env = "RPCMESH_MEMORY_BUDGET", default_value_t = SizeArg(DEFAULT_MEMORY_BUDGET))]
    pub memory_budget: SizeArg,
    /// Connections one source (a client's IP address; an IPv6 client's /64) may have open
    /// at once; one more is accepted and closed at once.
    #[arg(long, env = "RPCMESH_MAX_CONNECTIONS_PER_SOURCE", default_value_t = DEFAULT_MAX_CONNECTIONS_PER_SOURCE)]
    pub max_connections_per_source: usize,
    /// New connections a second one source may open, sustained (a token bucket), or
    /// `off`; one opened faster is accepted and closed at once.
    #[arg(long, env = "RPCMESH_ACCEPT_RATE_PER_SOURCE", default_value_t = RateArg(Some(DEFAULT_ACCEPT_RATE_PER_SOURCE)))]
    pub accept_rate_per_source: RateArg,
    /// New connections one source may open at once before --accept-rate-per-source holds
    /// it (the token bucket's size).
    #[arg(long, env = "RPCMESH_ACCEPT_BURST_PER_SOURCE", default_value_t = DEFAULT_ACCEPT_BURST_PER_SOURCE)]
    pub accept_burst_per_source: u32,
}

impl LimitArgs {
    /// The timeouts; a zero one is recorded in `problems` (it would close every
    /// connection at once).
    pub fn timeouts(&self, problems: &mut ConfigProblems) -> Timeouts {
        for (flag, d) in [
            ("--idle-timeout", self.idle_timeout),
            ("--frame-timeout", self.frame_timeout),
            ("--write-timeout", self.write_timeout),
        ] {
            problems.check(d.0.is_zero(), || format!("{flag} must be above zero"));
        }
        Timeouts {
            idle: self.idle_timeout.0,
            frame: self.frame_timeout.0,
            write: self.write_timeout.0,
        }
    }

    /// The limits on each source of connections; a cap or a burst of zero (no connection
    /// could ever be served) is recorded in `problems`, a burst given with the rate off
    /// in `warnings`.
    pub fn sources(
        &self,
        problems: &mut ConfigProblems,
        warnings: &mut ConfigWarnings,
    ) -> SourceLimits {
        problems.check(self.max_connections_per_source == 0, || {
            "--max-connections-per-source must be at least 1".into()
        });
        problems.check(self.accept_burst_per_source == 0, || {
            "--accept-burst-per-source must be at least 1".into()
        });
        warnings.check(
            self.accept_rate_per_source.0.is_none()
                && self.accept_burst_per_source != DEFAULT_ACCEPT_BURST_PER_SOURCE,
            || {
                format!(
                    "--accept-burst-per-source {} does nothing with --accept-rate-per-source off",
                    self.accept_burst_per_source
                )
            },
        );
        SourceLimits {
            max_connections: self.max_connections_per_source,
            rate: self.accept_rate_per_source.0.map(|per_second| AcceptRate {
                per_second,
                burst: self.accept_burst_per_source,
            }),
        }
    }

    /// The memory budget in bytes; one too small for a single large frame's worth of
    /// buffers is recorded in `problems`.
    pub fn memory_budget(&self, problems: &mut ConfigProblems) -> usize {
        let b = self.memory_budget.0;
        problems.check(b < crate::net::budget::MIN_MEMORY_BUDGET, || {
            format!(
                "--memory-budget {} is below 16MiB (a number without a unit is bytes: write 512MiB, 1GiB)",
                self.memory_budget
            )
        });
        b
    }
}

/// The retry budget (`crate::retry`): the share of the calls, and the floor per second,
/// that retries of calls safe to send again may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct RetryBudgetArgs {
    /// Retries of calls safe to send again, as a percent of the calls of the last 10 s;
    /// 0 with --retry-budget-min-per-second 0 = no retries.
    #[arg(long, env = "RPCMESH_RETRY_BUDGET_PERCENT", default_value_t = DEFAULT_RETRY_PERCENT)]
    pub retry_budget_percent: u32,
    /// Retries allowed per second on top of the percent, whatever the traffic.
    #[arg(long, env = "RPCMESH_RETRY_BUDGET_MIN_PER_SECOND", default_value_t = DEFAULT_RETRY_MIN_PER_SECOND)]
    pub retry_budget_min_per_second: u32,
}

impl Default for RetryBudgetArgs {
    fn default() -> Self {
        RetryBudgetArgs {
            retry_budget_percent: DEFAULT_RETRY_PERCENT,
            retry_budget_min_per_second: DEFAULT_RETRY_MIN_PER_SECOND,
        }
    }
}

impl RetryBudgetArgs {
    /// The budget the flags give.
    pub fn budget(&self) -> RetryBudget {
        RetryBudget::of(self.retry_budget_percent, self.retry_budget_min_per_second)
    }
}

/// The calls marked idempotent (`crate::retry::Idempotent`): those lost in flight may be
/// retried too.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct IdempotentArgs {
    /// Calls that may run twice without harm (Service.Method, Service.* or *; repeatable,
    /// or several separated by commas): one lost in flight (its connection lost after it
    /// was written) may be retried, within the retry budget. None by default.
    #[arg(
        long = "idempotent",
        env = "RPCMESH_IDEMPOTENT",
        value_delimiter = ',',
        value_name = "CALLS"
    )]
    pub idempotent: Vec<String>,
}

impl IdempotentArgs {
    /// The calls marked; a bad pattern is recorded in `problems`.
    pub fn calls(&self, problems: &mut ConfigProblems) -> Idempotent {
        let given: Vec<&str> = self
            .idempotent
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .collect();
        Idempotent::parse(&given).unwrap_or_else(|e| {
            problems.check(true, || format!("--idempotent {e}"));
            Idempotent::default()
        })
    }
}
