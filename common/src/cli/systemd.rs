//! What a server tells systemd (sd_notify(3)), so that a unit of `Type=notify` with
//! `WatchdogSec=` knows when the program is ready and that it is not hung: `READY=1`
//! once it serves (the provider once it listens, the broker once its pools have also
//! settled: [`Readiness`]), `STOPPING=1` when it starts to drain, and `WATCHDOG=1` from a
//! task of the program's own runtime ([`spawn_watchdog`]), so that a runtime that stops
//! running its tasks stops the pings and systemd restarts the unit.
//!
//! The protocol is `sd-notify`'s (a maintained crate, pure Rust over libc; its safe calls
//! only: it reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` and never unsets
//! them, so nothing here touches the environment). Without `NOTIFY_SOCKET` (not run by
//! systemd, or a unit of another type) every call does nothing. A notification that
//! cannot be sent is logged and the program goes on: systemd then reports the unit as
//! it sees it (a start that times out, a watchdog that fires), which is the failure to
//! act on, not the log line.
//!
//! The pings come from one task: a runtime whose every worker is blocked (or the one
//! thread of a current-thread runtime) sends none and is restarted. One blocked worker
//! among several is not caught this way: the others keep running the ping, and the
//! tasks queued behind the blocked one are stolen by them.

use std::time::Duration;

use sd_notify::NotifyState;

/// Pings per `WatchdogSec=`: sd_watchdog_enabled(3) asks for a ping in less than half of
/// it, so that one late tick never lets the timer run out.
pub const PINGS_PER_WATCHDOG_PERIOD: u32 = 2;

/// When a server tells systemd it is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// As soon as it listens (calls and `/metrics`): the provider.
    WhenListening,
    /// When the program says so itself with [`notify_ready`]: the broker, once the pools
    /// to its providers have settled, so that systemd's "active" means calls are routed.
    Announced,
}

/// `READY=1`, with the status `systemctl status` shows.
pub fn notify_ready(status: &str) {
    send(
        &[NotifyState::Ready, NotifyState::Status(status)],
        "READY=1",
    );
}

/// `STOPPING=1`: the program drains (SIGTERM) and exits when its calls are done.
pub fn notify_stopping() {
    send(
        &[
            NotifyState::Stopping,
            NotifyState::Status("draining: finishing the calls in flight"),
        ],
        "STOPPING=1",
    );
}

/// The interval between two watchdog pings when systemd asked for them (`WATCHDOG_USEC`,
/// for this process), else None.
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled().map(|period| period / PINGS_PER_WATCHDOG_PERIOD)
}

/// Starts the task that pings systemd's watchdog on the current runtime, when systemd
/// asked for pings; it runs until the runtime stops.
pub fn spawn_watchdog() -> Option<tokio::task::JoinHandle<()>> {
    let every = watchdog_interval()?;
    tracing::debug!(?every, "pinging systemd's watchdog");
    Some(tokio::spawn(async move {
        let mut ticker = tokio::time::interval(every);
        // A late tick pings once, not in a burst: what counts is that pings keep coming.
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failed = false;
        loop {
            ticker.tick().await;
            // Thinned: the first failure at warn, the others at debug.
            if let Err(e) = sd_notify::notify(&[NotifyState::Watchdog]) {
                if std::mem::replace(&mut failed, true) {
                    tracing::debug!(error = %e, "cannot ping systemd's watchdog");
                } else {
                    tracing::warn!(error = %e, "cannot ping systemd's watchdog (further failures at debug)");
                }
            }
        }
    }))
}

fn send(states: &[NotifyState<'_>], what: &str) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "cannot tell systemd {what}");
    }
}
