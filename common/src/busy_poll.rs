//! Busy polling: after a socket read, keep a runtime worker polling for more I/O for a
//! short window instead of letting it sleep in `epoll_wait`.
//!
//! On a virtual machine, waking a sleeping process is the dearest part of a small call:
//! the process that sends pays for the wake-up (an inter-processor interrupt, a VM exit)
//! and the receiver only starts after it. A broker that is already polling when the next
//! request or reply arrives costs its peers no wake-up and starts at once. The price is
//! CPU: while traffic keeps arriving within the window, one worker thread stays busy.
//! An idle process does not spin: the window starts only when a read returned data.
//!
//! [`FramedIo`](crate::io::FramedIo) calls [`note_read`] on every read that returned data;
//! [`spawn`] starts the task that spins. Without [`spawn`], [`note_read`] is one relaxed
//! load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use metrics::Histogram;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::shutdown::CancellationToken;

/// Whether a spinner was started in this process.
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Whether the spinner is spinning now (reads need not wake it).
static SPINNING: AtomicBool = AtomicBool::new(false);
/// A read returned data since the spinner last looked.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Wakes the spinner out of its sleep.
static WAKE: Notify = Notify::const_new();

/// Whether the spinner is polling now (for tests and diagnostics).
pub fn is_spinning() -> bool {
    SPINNING.load(Ordering::Relaxed)
}

/// Records that a read returned data: the spinner (if any) keeps polling, or starts.
#[inline]
pub fn note_read() {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    if !ACTIVE.load(Ordering::Relaxed) {
        ACTIVE.store(true, Ordering::Relaxed);
    }
    if !SPINNING.load(Ordering::Relaxed) {
        WAKE.notify_one();
    }
}

/// Starts the spinner: after each read that returned data, one runtime worker keeps
/// polling the reactor (`epoll_wait` without a timeout) for up to `window` with no further
/// read, then sleeps until the next one. Stops when `stop` is cancelled.
///
/// One spinner per process: it keeps one worker awake, which is what a process with one
/// worker thread (the benchmark's set-up) or a lightly loaded one needs.
///
/// `idle` gets the length of each stretch of polling that found no read (up to `window`
/// each): its sum is the CPU time busy polling cost beyond the work itself.
pub fn spawn(window: Duration, stop: CancellationToken, idle: Histogram) -> JoinHandle<()> {
    ENABLED.store(true, Ordering::Relaxed);
    tokio::spawn(async move {
        loop {
            SPINNING.store(false, Ordering::Relaxed);
            tokio::select! {
                () = WAKE.notified() => {}
                () = stop.cancelled() => break,
            }
            SPINNING.store(true, Ordering::Relaxed);
            ACTIVE.store(false, Ordering::Relaxed);
            // The first and the latest round of the current stretch without a read; the
            // clock is read only on such rounds, so a busy spinner costs no clock reads.
            let mut stretch: Option<(Instant, Instant)> = None;
            loop {
                // Deferred to after the worker has polled the reactor without blocking
                // and run every task that made ready.
                tokio::task::yield_now().await;
                if stop.is_cancelled() {
                    SPINNING.store(false, Ordering::Relaxed);
                    return;
                }
                if ACTIVE.swap(false, Ordering::Relaxed) {
                    if let Some((first, latest)) = stretch.take() {
                        idle.record(latest.duration_since(first).as_secs_f64());
                    }
                    continue;
                }
                let now = Instant::now();
                match stretch {
                    None => stretch = Some((now, now)),
                    Some((first, _)) if now.duration_since(first) >= window => {
                        idle.record(now.duration_since(first).as_secs_f64());
                        break;
                    }
                    Some((first, _)) => stretch = Some((first, now)),
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_starts_the_spinning_and_it_stops_after_the_window_and_on_stop() {
        let stop = CancellationToken::new();
        let task = spawn(Duration::from_millis(30), stop.clone(), Histogram::noop());
        let wait_for = |want: bool| async move {
            for _ in 0..400 {
                if is_spinning() == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            panic!("spinning never became {want}");
        };
        for _ in 0..2 {
            note_read();
            wait_for(true).await;
            // No more reads: the window passes and the spinner sleeps.
            wait_for(false).await;
        }
        note_read();
        wait_for(true).await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the spinner stops when told")
            .unwrap();
        assert!(!is_spinning());
    }
}
