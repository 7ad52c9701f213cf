//! How the broker survives gray failures: providers that answer heartbeats and fail or
//! stall their calls (docs/resilience.md).
//!
//! - [`outlier`]: each provider's failures are counted (only those that are the
//!   provider's fault); one that fails too often in a row, or whose success rate over a
//!   window falls too low, is ejected for a time that grows with each ejection, and comes
//!   back through one probe call. No more than a share of the providers is ejected at once.
//! - [`ewma`]: each provider's latency as a peak-sensitive moving average, which the
//!   router multiplies by its calls in flight to pick the better of two (`--balance
//!   peak-ewma`, the default).
//! - retries of calls that are safe to send again draw from one budget, a share of the
//!   calls plus a floor per second, so that retries never multiply an overload
//!   (`rpcmesh_common::retry`, the driver's too).
//!
//! The flags are here ([`ResilienceArgs`]); the settings they validate into are
//! [`ResilienceConfig`], and what the broker's parts share at run time is [`Guards`].

pub(crate) mod ewma;
pub(crate) mod outlier;

pub use outlier::PROBE_SPACING;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rpcmesh_common::cli::flags::{IdempotentArgs, RetryBudgetArgs};
use rpcmesh_common::cli::{ConfigProblems, DurationArg};
use rpcmesh_common::retry::RetryBudget;

/// Consecutive failures that eject a provider (`--eject-consecutive-failures`; 0 = off):
/// Envoy's `consecutive_5xx` and Finagle's failure accrual both take 5, few enough that a
/// black hole costs a handful of calls, more than an unlucky burst of a healthy provider.
pub const DEFAULT_EJECT_CONSECUTIVE: u32 = 5;
/// The success rate (percent) under which a provider is ejected, over one window of at
/// least [`DEFAULT_EJECT_MIN_CALLS`] calls (`--eject-success-rate`; 0 = off): Finagle's
/// failure accrual asks for 80 %. It catches a provider that fails often but not in a row.
pub const DEFAULT_EJECT_SUCCESS_RATE: u32 = 80;
/// The window over which the success rate is taken (`--eject-window`): Envoy's outlier
/// detection interval (10 s), long enough for a rate to mean something at a few calls a
/// second, short enough to act within seconds.
pub const DEFAULT_EJECT_WINDOW: Duration = Duration::from_secs(10);
/// Calls a window must hold before its success rate counts (`--eject-min-calls`):
/// Envoy's `success_rate_request_volume`, so that two failures of three calls do not
/// eject a quiet provider.
pub const DEFAULT_EJECT_MIN_CALLS: u32 = 100;
/// How long the first ejection lasts; the n-th lasts n times as long, up to
/// [`DEFAULT_EJECT_MAX_TIME`] (`--eject-base-time`): Envoy's `base_ejection_time`. Long
/// against a call (a provider ejected costs one probe call per ejection), short enough
/// that a provider that recovered is back within a minute.
pub const DEFAULT_EJECT_BASE_TIME: Duration = Duration::from_secs(30);
/// The longest an ejection lasts (`--eject-max-time`): Envoy's `max_ejection_time`.
pub const DEFAULT_EJECT_MAX_TIME: Duration = Duration::from_secs(300);
/// The largest share of the providers ejected at once, in percent (`--max-ejection-
/// percent`), rounded down: with two providers one may be ejected, with one none, so that
/// a fault everywhere (the service's own, not one provider's) never empties the pool.
pub const DEFAULT_MAX_EJECTION_PERCENT: u32 = 50;
/// How fast a provider's latency estimate forgets (`--ewma-decay`): linkerd2-proxy's
/// `EWMA_DECAY` (10 s, `linkerd/app/outbound/src/lib.rs`), so that a provider that was
/// slow gets a call again within tens of seconds once nothing else is known of it.
pub const DEFAULT_EWMA_DECAY: Duration = Duration::from_secs(10);
/// The latency a provider is assumed to have before its first reply (`--ewma-default-rtt`):
/// linkerd2-proxy's `EWMA_DEFAULT_RTT` (30 ms), pessimistic for a LAN, so that a new
/// provider is eased in rather than flooded.
pub const DEFAULT_EWMA_DEFAULT_RTT: Duration = Duration::from_millis(30);

/// The resilience flags (flattened into the broker's).
#[derive(Debug, Clone, clap::Args)]
pub struct ResilienceArgs {
    /// Eject a provider after this many failures in a row that are its own fault (an
    /// error it answered, a lost connection, a timeout of the broker's); 0 = never.
    #[arg(long, env = "RPCMESH_EJECT_CONSECUTIVE_FAILURES", default_value_t = DEFAULT_EJECT_CONSECUTIVE)]
    pub eject_consecutive_failures: u32,
    /// Eject a provider whose success rate over --eject-window falls under this percent
    /// (with at least --eject-min-calls calls); 0 = never.
    #[arg(long, env = "RPCMESH_EJECT_SUCCESS_RATE", default_value_t = DEFAULT_EJECT_SUCCESS_RATE)]
    pub eject_success_rate: u32,
    /// The window of the success rate.
    #[arg(long, env = "RPCMESH_EJECT_WINDOW", default_value_t = DurationArg(DEFAULT_EJECT_WINDOW))]
    pub eject_window: DurationArg,
    /// Calls a window needs before its success rate counts.
    #[arg(long, env = "RPCMESH_EJECT_MIN_CALLS", default_value_t = DEFAULT_EJECT_MIN_CALLS)]
    pub eject_min_calls: u32,
    /// How long a first ejection lasts; the n-th lasts n times as long.
    #[arg(long, env = "RPCMESH_EJECT_BASE_TIME", default_value_t = DurationArg(DEFAULT_EJECT_BASE_TIME))]
    pub eject_base_time: DurationArg,
    /// The longest an ejection lasts.
    #[arg(long, env = "RPCMESH_EJECT_MAX_TIME", default_value_t = DurationArg(DEFAULT_EJECT_MAX_TIME))]
    pub eject_max_time: DurationArg,
    /// The largest share of the providers ejected at once, in percent (rounded down).
    #[arg(long, env = "RPCMESH_MAX_EJECTION_PERCENT", default_value_t = DEFAULT_MAX_EJECTION_PERCENT)]
    pub max_ejection_percent: u32,
    #[command(flatten)]
    pub retry: RetryBudgetArgs,
    #[command(flatten)]
    pub idempotent: IdempotentArgs,
    /// How fast a provider's latency estimate forgets (--balance peak-ewma).
    #[arg(long, env = "RPCMESH_EWMA_DECAY", default_value_t = DurationArg(DEFAULT_EWMA_DECAY))]
    pub ewma_decay: DurationArg,
    /// The latency a provider is assumed to have before its first reply.
    #[arg(long, env = "RPCMESH_EWMA_DEFAULT_RTT", default_value_t = DurationArg(DEFAULT_EWMA_DEFAULT_RTT))]
    pub ewma_default_rtt: DurationArg,
}

/// Validated resilience settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResilienceConfig {
    /// Failures in a row that eject; 0 = off.
    pub eject_consecutive: u32,
    /// Success rate (percent) under which a provider is ejected; 0 = off.
    pub eject_success_rate: u32,
    /// The success rate's window.
    pub eject_window: Duration,
    /// Calls a window needs.
    pub eject_min_calls: u32,
    /// A first ejection's length.
    pub eject_base_time: Duration,
    /// The longest ejection.
    pub eject_max_time: Duration,
    /// The largest share of providers ejected at once, percent.
    pub max_ejection_percent: u32,
    /// The retry budget's share of the calls and floor.
    pub retry: RetryBudgetArgs,
    /// The latency estimate's decay.
    pub ewma_decay: Duration,
    /// The latency assumed before the first reply.
    pub ewma_default_rtt: Duration,
}

impl Default for ResilienceConfig {
    fn default() -> Self {
        ResilienceConfig {
            eject_consecutive: DEFAULT_EJECT_CONSECUTIVE,
            eject_success_rate: DEFAULT_EJECT_SUCCESS_RATE,
            eject_window: DEFAULT_EJECT_WINDOW,
            eject_min_calls: DEFAULT_EJECT_MIN_CALLS,
            eject_base_time: DEFAULT_EJECT_BASE_TIME,
            eject_max_time: DEFAULT_EJECT_MAX_TIME,
            max_ejection_percent: DEFAULT_MAX_EJECTION_PERCENT,
            retry: RetryBudgetArgs::default(),
            ewma_decay: DEFAULT_EWMA_DECAY,
            ewma_default_rtt: DEFAULT_EWMA_DEFAULT_RTT,
        }
    }
}

impl ResilienceArgs {
    /// Checks the flags, adding what is wrong to `p`.
    pub fn config(&self, p: &mut ConfigProblems) -> ResilienceConfig {
        p.check(self.eject_success_rate > 100, || {
            format!(
                "--eject-success-rate {} is a percent: at most 100",
                self.eject_success_rate
            )
        });
        p.check(self.max_ejection_percent > 100, || {
            format!(
                "--max-ejection-percent {} is a percent: at most 100",
                self.max_ejection_percent
            )
        });
        p.check(self.eject_window.0.is_zero(), || {
            "--eject-window must be above zero".into()
        });
        p.check(self.eject_base_time.0.is_zero(), || {
            "--eject-base-time must be above zero".into()
        });
        p.check(self.eject_max_time.0 < self.eject_base_time.0, || {
            format!(
                "--eject-max-time {} is below --eject-base-time {}",
                self.eject_max_time, self.eject_base_time
            )
        });
        p.check(self.ewma_decay.0.is_zero(), || {
            "--ewma-decay must be above zero".into()
        });
        ResilienceConfig {
            eject_consecutive: self.eject_consecutive_failures,
            eject_success_rate: self.eject_success_rate,
            eject_window: self.eject_window.0,
            eject_min_calls: self.eject_min_calls,
            eject_base_time: self.eject_base_time.0,
            eject_max_time: self.eject_max_time.0,
            max_ejection_percent: self.max_ejection_percent,
            retry: self.retry,
            ewma_decay: self.ewma_decay.0,
            ewma_default_rtt: self.ewma_default_rtt.0,
        }
    }
}

/// What the sessions and the pools of one broker share: the settings, the ejections'
/// count (for the cap on them) and the retry budget.
#[derive(Debug)]
pub(crate) struct Guards {
    pub config: ResilienceConfig,
    pub ejections: Arc<outlier::Ejections>,
    pub budget: RetryBudget,
}

impl Guards {
    pub fn new(config: ResilienceConfig, metrics: &crate::metrics::BrokerMetrics) -> Arc<Guards> {
        Arc::new(Guards {
            ejections: Arc::new(outlier::Ejections::new(
                config.max_ejection_percent,
                metrics.ejected.clone(),
            )),
            budget: config.retry.budget(),
            config,
        })
    }
}

/// Nanoseconds since the process's first look at the clock: what the lock-free estimates
/// store their instants as.
pub(crate) fn nanos(now: Instant) -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(now.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}
