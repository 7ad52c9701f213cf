//! Busy polling: after a socket read, keep a runtime worker polling for more I/O for a
//! short window instead of letting it sleep in `epoll_wait`.
//!
//! On a virtual machine, waking a sleeping process is the dearest part of a small call:
//! the process that sends pays for the wake-up (an inter-processor interrupt, a VM exit)
//! and the receiver only starts after it. A process that is already polling when the next
//! request or reply arrives costs its peers no wake-up and starts at once. The price is
//! CPU: while traffic keeps arriving within the window, one worker thread stays busy.
//! An idle process does not spin: the window starts only when a read returned data.
//!
//! It spins only on a CPU no one else wants: every round that finds no read ends with
//! `sched_yield`, which returns at once when no other thread waits for this CPU and
//! otherwise lets those that do run first. A spinner that only spun would keep its CPU for
//! the scheduler's whole slice while the callers and providers beside it, or any other
//! process, waited: on a machine busy with other work it lost more than the wake-ups it
//! spared (docs/performance.md, "Busy polling").
//!
//! The sockets of a server share one [`Activity`] with its spinner ([`spawn`]):
//! [`FramedIo`](crate::net::connection::FramedIo) calls [`Activity::note_read`] on every read that
//! returned data. Each server has its own, so several servers in one process (tests, the
//! driver's embedded mesh) do not disturb one another.
//!
//! It pays with one worker thread. With several, the spinner's zero-timeout polls find the
//! reactor held by a worker blocked in `epoll_wait`, and the I/O still arrives by a
//! wake-up more often than not. On 2 vCPUs at one call in flight, busy polling with one
//! worker nearly doubles the calls/s (about 22k against 12k) for one core; with two
//! workers it adds a fifth to a half (17–20k against 13–14k) for 1.2–1.3 cores.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::net::shutdown::CancellationToken;

/// Idle polling is recorded in chunks of at least this much (and when the spinner goes to
/// sleep), not per stretch: a stretch between two reads is often a single round, and a
/// sample per read would cost more than it tells.
pub const IDLE_RECORD_CHUNK: Duration = Duration::from_millis(10);

/// What a spinner and the sockets it watches share.
#[derive(Debug, Default)]
pub struct Activity {
    /// A read returned data since the spinner last looked.
    active: AtomicBool,
    /// The spinner is polling now (reads need not wake it).
    spinning: AtomicBool,
    /// Wakes the spinner out of its sleep.
    wake: Notify,
}

impl Activity {
    /// A new, shareable activity record.
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity::default())
    }

    /// Records that a read returned data: the spinner keeps polling, or starts.
    #[inline]
    pub fn note_read(&self) {
        if !self.active.load(Ordering::Relaxed) {
            self.active.store(true, Ordering::Relaxed);
        }
        if !self.spinning.load(Ordering::Relaxed) {
            self.wake.notify_one();
        }
    }

    /// Whether the spinner is polling now (for tests and diagnostics).
    pub fn is_spinning(&self) -> bool {
        self.spinning.load(Ordering::Relaxed)
    }
}

/// Clears `spinning` however the spinner ends (stopped, aborted, runtime dropped), so
/// that reads go back to waking it if it is ever polled again.
struct NotSpinningOnDrop(Arc<Activity>);

impl Drop for NotSpinningOnDrop {
    fn drop(&mut self) {
        self.0.spinning.store(false, Ordering::Relaxed);
    }
}

/// Starts the spinner: after each read that `activity` records, one runtime worker keeps
/// polling the reactor (`epoll_wait` with a zero timeout) until `window` passes with no
/// further read, then sleeps until the next one. Stops when `stop` is cancelled.
///
/// `idle` is told the time spent polling without finding a read, in chunks of about
/// [`IDLE_RECORD_CHUNK`] (the broker records it as `rpcmesh_busy_poll_idle_seconds`); its
/// sum is at most the CPU time busy polling cost beyond the work: rounds in which only
/// other tasks ran, woken without a read, count as idle too, and so does the time other
/// threads ran on this CPU when a round yielded to them.
pub fn spawn(
    activity: Arc<Activity>,
    window: Duration,
    stop: CancellationToken,
    mut idle: impl FnMut(Duration) + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let guard = NotSpinningOnDrop(activity);
        let a = &guard.0;
        let mut idle_unrecorded = Duration::ZERO;
        loop {
            a.spinning.store(false, Ordering::Relaxed);
            if !idle_unrecorded.is_zero() {
                idle(idle_unrecorded);
                idle_unrecorded = Duration::ZERO;
            }
            // A read that came after the last look but saw `spinning` still set did not
            // wake us: spin again rather than sleep past it. (What is left of that race
            // costs a spin window, never a read: the reactor still delivers it.)
            if !a.active.load(Ordering::Relaxed) {
                tokio::select! {
                    () = a.wake.notified() => {}
                    () = stop.cancelled() => return,
                }
            }
            a.spinning.store(true, Ordering::Relaxed);
            a.active.store(false, Ordering::Relaxed);
            // The first and the latest round of the current stretch without a read; the
            // clock is read only on such rounds, so a busy spinner costs no clock reads.
            let mut stretch: Option<(Instant, Instant)> = None;
            loop {
                // Deferred to after the worker has polled the reactor without blocking
                // and run every task that made ready.
                tokio::task::yield_now().await;
                if stop.is_cancelled() {
                    return;
                }
                if a.active.swap(false, Ordering::Relaxed) {
                    if let Some((first, latest)) = stretch.take() {
                        idle_unrecorded += latest - first;
                        if idle_unrecorded >= IDLE_RECORD_CHUNK {
                            idle(idle_unrecorded);
                            idle_unrecorded = Duration::ZERO;
                        }
                    }
                    continue;
                }
                // A round without a read: let any other thread waiting for this CPU run
                // first (`sched_yield`, which returns at once when none waits).
                std::thread::yield_now();
                let now = Instant::now();
                match stretch {
                    None => stretch = Some((now, now)),
                    Some((first, _)) if now - first >= window => {
                        idle_unrecorded += now - first;
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
        let activity = Activity::new();
        let stop = CancellationToken::new();
        let task = spawn(
            activity.clone(),
            Duration::from_millis(200),
            stop.clone(),
            |_| {},
        );
        let wait_for = |want: bool| {
            let a = activity.clone();
            async move {
                for _ in 0..1000 {
                    if a.is_spinning() == want {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                panic!("spinning never became {want}");
            }
        };
        for _ in 0..2 {
            activity.note_read();
            wait_for(true).await;
            // No more reads: the window passes and the spinner sleeps.
            wait_for(false).await;
        }
        activity.note_read();
        wait_for(true).await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the spinner stops when told")
            .unwrap();
        assert!(!activity.is_spinning());
    }

    /// CPU time of the calling thread.
    fn thread_cpu() -> Duration {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }

    /// Pins the calling thread to `cpu`.
    fn pin(cpu: usize) {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        rustix::thread::sched_setaffinity(None, &set).expect("pin the thread");
    }

    #[test]
    fn a_spinning_worker_lets_a_thread_waiting_for_its_cpu_run() {
        // The spinner's worker and a thread that always has work share one CPU while the
        // spinner's window lasts. A spinner that only spun would take about half of it;
        // one that yields in every round without a read takes a small part.
        let allowed = rustix::thread::sched_getaffinity(None).expect("affinity");
        let cpu = (0..rustix::thread::CpuSet::MAX_CPU)
            .find(|&c| allowed.is_set(c))
            .expect("an allowed CPU");
        let done = Arc::new(AtomicBool::new(false));
        let neighbour = {
            let done = done.clone();
            std::thread::spawn(move || {
                pin(cpu);
                let start = thread_cpu();
                let mut spins = 0u64;
                while !done.load(Ordering::Relaxed) {
                    spins = std::hint::black_box(spins + 1);
                }
                thread_cpu() - start
            })
        };
        let spinner_cpu = std::thread::spawn(move || {
            pin(cpu);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let start = thread_cpu();
            rt.block_on(async {
                let activity = Activity::new();
                let stop = CancellationToken::new();
                let task = spawn(
                    activity.clone(),
                    Duration::from_secs(3600),
                    stop.clone(),
                    |_| {},
                );
                activity.note_read();
                tokio::time::sleep(Duration::from_millis(600)).await;
                assert!(activity.is_spinning(), "still within its window");
                stop.cancel();
                task.await.unwrap();
            });
            thread_cpu() - start
        })
        .join()
        .unwrap();
        done.store(true, Ordering::Relaxed);
        let neighbour_cpu = neighbour.join().unwrap();
        eprintln!("one CPU for 600 ms: spinner {spinner_cpu:?}, neighbour {neighbour_cpu:?}");
        assert!(
            spinner_cpu * 3 < neighbour_cpu,
            "the spinner took {spinner_cpu:?} of the CPU its neighbour wanted (neighbour: {neighbour_cpu:?})"
        );
    }

    #[tokio::test]
    async fn an_aborted_spinner_leaves_no_spinning_flag_behind() {
        let activity = Activity::new();
        let task = spawn(
            activity.clone(),
            Duration::from_secs(60),
            CancellationToken::new(),
            |_| {},
        );
        activity.note_read();
        for _ in 0..1000 {
            if activity.is_spinning() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(activity.is_spinning());
        task.abort();
        let _ = task.await;
        assert!(!activity.is_spinning());
    }
}
