//! What the workers of one run share ([`RunShared`]): the configuration and workload,
//! the measured window and when requests stop, the figures each worker hands over on its
//! tick, the metric handles, and the [`FinishLine`] where the workers wait for each other
//! before closing their connections.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rpcmesh_common::net::shutdown::CancellationToken;

use crate::config::DriverConfig;
use crate::metrics::DriverMetrics;
use crate::stats::Tally;
use crate::workload::Workload;

/// How long before a measured step starts a worker makes its figures (on a tick, see
/// [`crate::stats::Books::prepare`]): several ticks, so that a late tick still comes
/// before it, and each worker's at its own phase of the tick period rather than all at
/// the step's start.
const PREPARE_AHEAD: Duration = Duration::from_millis(500);

/// What all workers of a run share.
#[derive(Debug)]
pub(crate) struct RunShared {
    pub config: DriverConfig,
    pub workload: Workload,
    /// Calls and requests started from here on are measured.
    pub measure_from: Instant,
    /// No request starts after this (duration mode).
    pub until: Option<Instant>,
    /// Measured requests left to start (count mode).
    pub budget: Option<AtomicU64>,
    /// Cancelled to stop starting requests (Ctrl-C).
    pub stop: CancellationToken,
    /// Each worker's figures since the progress line last took them.
    pub intervals: Vec<Mutex<Tally>>,
    /// With `--hdr-log`: each worker's measured figures since the log last took them.
    pub logs: Vec<Mutex<Tally>>,
    /// Metric handles.
    pub metrics: DriverMetrics,
    /// Where workers wait for each other before closing their connections.
    pub finish: FinishLine,
    /// TLS to the targets, when on (one configuration for every worker).
    pub tls: Option<std::sync::Arc<rpcmesh_common::net::tls::ClientTls>>,
    /// The run's retry budget: every worker's calls deposit in it, every retry draws
    /// from it (docs/resilience.md).
    pub retry: rpcmesh_common::retry::RetryBudget,
    /// The calls are marked idempotent (`--idempotent`): one lost in flight may be sent
    /// again too.
    pub retry_lost: bool,
}

/// Workers close their connections only once every worker is done, so that no call still
/// in flight waits behind another connection's close: a close is work for the driver and
/// for the server, which sees it, and the run's last calls would take it as latency.
#[derive(Debug)]
pub(crate) struct FinishLine {
    /// Workers not done yet.
    left: AtomicUsize,
    /// Cancelled when the last one is.
    all: CancellationToken,
}

impl FinishLine {
    /// A line for `workers` workers.
    pub fn new(workers: usize) -> Self {
        let all = CancellationToken::new();
        if workers == 0 {
            all.cancel();
        }
        FinishLine {
            left: AtomicUsize::new(workers),
            all,
        }
    }

    /// A worker's place on the line: it counts as done when it crosses, or when it is
    /// dropped without crossing (a worker that panicked holds no one up).
    pub fn runner(&self) -> Runner<'_> {
        Runner {
            line: self,
            crossed: false,
        }
    }

    fn done(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.all.cancel();
        }
    }
}

/// One worker's place on the [`FinishLine`].
#[derive(Debug)]
pub(crate) struct Runner<'a> {
    line: &'a FinishLine,
    crossed: bool,
}

impl Runner<'_> {
    /// This worker is done: returns once every worker is.
    pub async fn cross(mut self) {
        self.crossed = true;
        self.line.done();
        self.line.all.cancelled().await;
    }
}

impl Drop for Runner<'_> {
    fn drop(&mut self) {
        if !self.crossed {
            self.line.done();
        }
    }
}

impl RunShared {
    /// The measured step that a call or request meant to start at `intended` belongs to;
    /// `None` for the warm-up.
    pub(crate) fn step_of(&self, intended: Instant) -> Option<usize> {
        let since = intended.checked_duration_since(self.measure_from)?;
        Some(
            self.config
                .schedule
                .as_ref()
                .map_or(0, |s| s.step_of(since)),
        )
    }

    /// The measured step under way [`PREPARE_AHEAD`] from `now` (`None` in the warm-up, and
    /// once no request starts then: the run is ending).
    pub(crate) fn step_ahead(&self, now: Instant) -> Option<usize> {
        let t = now + PREPARE_AHEAD;
        if self.until.is_some_and(|u| t >= u) {
            return None;
        }
        self.step_of(t)
    }

    /// Whether a new request may start now (claims one from the budget if so).
    pub(crate) fn may_start(&self, now: Instant) -> bool {
        if self.stop.is_cancelled() || self.until.is_some_and(|u| now >= u) {
            return false;
        }
        match &self.budget {
            Some(b) if now >= self.measure_from => b
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_worker_passes_the_finish_line_only_once_every_worker_is_done() {
        let line = Arc::new(FinishLine::new(2));
        let first = {
            let line = line.clone();
            tokio::spawn(async move { line.runner().cross().await })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!first.is_finished(), "the other worker is still running");
        line.runner().cross().await;
        first.await.unwrap();
    }

    #[tokio::test]
    async fn a_worker_that_panics_holds_no_one_up() {
        let line = Arc::new(FinishLine::new(2));
        let panicked = {
            let line = line.clone();
            tokio::spawn(async move {
                let _runner = line.runner();
                panic!("a worker's bug");
            })
        };
        assert!(panicked.await.is_err());
        line.runner().cross().await;
    }

    #[tokio::test]
    async fn a_run_without_workers_waits_for_none() {
        FinishLine::new(0).all.cancelled().await;
    }
}
