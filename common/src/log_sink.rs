//! Where every program's log lines go on their way to stderr, so that logging never fails
//! or blocks the process: a bounded queue, and one thread that writes it out.
//!
//! A log line is handed over with [`submit`], which never waits: it puts the line in a
//! queue of [`LOG_QUEUE_LINES`] and returns. The writer thread takes the lines in order
//! and writes each to stderr. A line is **dropped and counted** ([`dropped_lines`],
//! exported as `rpcmesh_log_lines_dropped_total`) when the queue is full (stderr takes
//! nothing: a pipe nobody reads, a journald that stopped reading) or when its write fails
//! (stderr is closed: `broker … 2>&1 | head` once `head` has gone, a journald restarted).
//! The process goes on serving either way, and a SIGTERM is handled as always: no task of
//! the runtime ever waits on stderr.
//!
//! Written here rather than taken from `tracing-appender`'s lossy non-blocking writer,
//! which does the queueing alike but (0.2) drops a line whose write fails without counting
//! it, and whose guard, when its queue is full at exit, prints to stdout (a foreign line on
//! the stdout that scripts parse, and a panic when stdout is closed too).
//!
//! The thread writes to its own duplicate of file descriptor 2, not through
//! `std::io::stderr()`, so a write blocked on a full pipe holds none of the standard
//! library's stderr lock (a panic message or an error printed at exit would wait on it
//! for ever). The lines still queued when the process exits are written first, for at most
//! [`LOG_FLUSH_WAIT`] ([`flush`], run at exit): what is left then is dropped.
//!
//! A leaf: it uses nothing of this crate. `cli::startup` installs it under `tracing`;
//! `metrics::system` exports its count.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Log lines the queue holds while stderr takes none. A reload of the largest providers
/// file logs a line for each provider that joins and each that leaves (2 × 1,024), and
/// such a burst is kept whole while journald is slow for a moment; at the usual 200 bytes
/// a line that is under 1 MiB, and no more is ever held.
pub const LOG_QUEUE_LINES: usize = 4096;

/// How long the lines still queued at exit may take to be written before the process
/// exits without them: far more than a few thousand lines take to a working stderr, and
/// short enough that a stderr that takes nothing delays a stop only that long (the
/// units' `TimeoutStopSec` leaves 8 s beyond the grace period and the last answers).
pub const LOG_FLUSH_WAIT: Duration = Duration::from_secs(1);

/// Log lines this process dropped: the queue was full, or the write failed.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The installed sink, once [`install`] has run.
static SINK: OnceLock<Sink> = OnceLock::new();

struct Sink {
    queue: SyncSender<Vec<u8>>,
    /// Lines accepted into the queue.
    queued: AtomicU64,
    /// Lines the writer is done with (written or dropped), and its wake-up for [`flush`].
    done: Mutex<u64>,
    done_changed: Condvar,
}

/// Log lines this process dropped so far (the queue was full, or stderr refused them).
pub fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Whether the writer thread runs: [`submit`] then queues lines rather than dropping them.
pub fn is_installed() -> bool {
    SINK.get().is_some()
}

/// Starts the writer thread, once per process; true when the sink
/// runs (after this call or an earlier one). False when stderr cannot be duplicated or the
/// thread cannot be started: [`submit`] then counts every line as dropped.
pub fn install() -> bool {
    if SINK.get().is_some() {
        return true;
    }
    let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    let (queue, lines) = std::sync::mpsc::sync_channel(LOG_QUEUE_LINES);
    let sink = Sink {
        queue,
        queued: AtomicU64::new(0),
        done: Mutex::new(0),
        done_changed: Condvar::new(),
    };
    if SINK.set(sink).is_err() {
        // Another thread installed it meanwhile; its writer serves.
        return true;
    }
    let out = File::from(fd);
    let started = std::thread::Builder::new()
        .name("rpcmesh-log".into())
        .spawn(move || write_out(out, lines));
    started.is_ok()
}

/// Hands one log line (its bytes, with the newline) to the writer; never waits and never
/// fails: a line that cannot be queued is counted as dropped.
pub fn submit(line: &[u8]) {
    let Some(sink) = SINK.get() else {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    };
    match sink.queue.try_send(line.to_vec()) {
        Ok(()) => {
            sink.queued.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits until the lines queued so far are written (or dropped), at most `wait`; true when
/// they are. Returns at once when no sink is installed.
pub fn flush(wait: Duration) -> bool {
    let Some(sink) = SINK.get() else {
        return true;
    };
    let target = sink.queued.load(Ordering::Relaxed);
    // Wall time on purpose: the bound is on how long an exit may wait for stderr.
    let until = Instant::now() + wait;
    let mut done = sink.done.lock().unwrap_or_else(|e| e.into_inner());
    while *done < target {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        done = sink
            .done_changed
            .wait_timeout(done, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    true
}

/// The writer thread: each line in order to `out`; a failed write drops the line.
fn write_out(mut out: File, lines: Receiver<Vec<u8>>) {
    while let Ok(line) = lines.recv() {
        if out.write_all(&line).is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(sink) = SINK.get() {
            let mut done = sink.done.lock().unwrap_or_else(|e| e.into_inner());
            *done += 1;
            sink.done_changed.notify_all();
        }
    }
}

/// What `tracing`'s formatter writes an event into: the whole line in one `write`, handed
/// to [`submit`]. Never fails, so the formatter never reports a write error (which it
/// would print to stderr itself, and panic if that fails).
#[derive(Debug, Clone, Copy, Default)]
pub struct LineWriter;

impl Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        submit(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_waits_for_the_lines_queued_before_it() {
        assert!(install());
        assert!(install(), "installing again keeps the one sink");
        for i in 0..100 {
            let mut w = LineWriter;
            w.write_all(format!("log sink test line {i}\n").as_bytes())
                .unwrap();
        }
        let sink = SINK.get().unwrap();
        let queued = sink.queued.load(Ordering::Relaxed);
        assert!(flush(Duration::from_secs(30)));
        assert!(*sink.done.lock().unwrap() >= queued);
    }
}
