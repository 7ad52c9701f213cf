//! The loop engine's control side: what runs beside the loop, on the broker's control
//! runtime, and what it tells the loop.
//!
//! The providers file is read here, by the Tokio engine's rules (`crate::membership`):
//! again on SIGHUP ([`Reload`]) and when its stamp changes (looked at every
//! [`FILE_POLL`]); a file that cannot be read, does not parse, or lists no provider
//! (unless `--allow-empty-providers`) is kept out, logged with its line numbers and
//! counted, and the providers stay as they were. A list that reads well goes to the loop
//! whole ([`Command::Providers`], `super::members` applies it); it is counted applied,
//! and logged, once the loop routes to it (its joiners settled).
//!
//! Commands reach the loop through a list under a lock and the loop's waker: the loop
//! looks at one flag per round, and takes the list only when it is set. With several
//! workers (`super::workers`) each gets every list, and a list counts as applied once
//! every worker routes to it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use rpcmesh_common::retry::Idempotent;
use tokio::sync::Notify;

use super::LoopHandle;
use crate::config::BrokerConfig;
use crate::membership::{FILE_POLL, Reload, read_off_runtime, stamp_of};
use crate::metrics::BrokerMetrics;
use crate::providers_file::{self, FileStamp};
use crate::upstream_spec::UpstreamSpec;

/// What the control side tells the loop.
#[derive(Debug)]
pub(super) enum Command {
    /// Serve these providers, marking these calls idempotent (the providers file's);
    /// `seq` is told back once the loop routes to them.
    Providers {
        specs: Vec<UpstreamSpec>,
        idempotent: Idempotent,
        seq: u64,
    },
    /// Serve this client connection, which the listening worker dealt to this one, or
    /// (`true`) another worker moved to it (`super::workers`).
    Adopt(Box<super::session::Session>, bool),
    /// Move sessions: about half the calls to this worker, or (`None`) all of them to
    /// the others open (the placement's `super::workers::place`).
    Move(Option<usize>),
}

/// The commands on their way to the loop, and what the loop has applied.
#[derive(Debug, Default)]
pub(super) struct Control {
    commands: Mutex<Vec<Command>>,
    pending: AtomicBool,
    /// The last list of providers the loop routes to (its `seq`), and a wake-up for the
    /// side that waits for it.
    applied: AtomicU64,
    applied_changed: Notify,
}

impl Control {
    /// Queues `command` (the caller wakes the loop).
    pub fn send(&self, command: Command) {
        self.commands
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(command);
        self.pending.store(true, Ordering::Release);
    }

    /// The commands queued since the last look, if any: one flag read when none.
    pub fn take(&self) -> Option<Vec<Command>> {
        if !self.pending.swap(false, Ordering::Acquire) {
            return None;
        }
        let mut commands = self.commands.lock().unwrap_or_else(PoisonError::into_inner);
        Some(std::mem::take(&mut *commands))
    }

    /// The loop routes to the list numbered `seq`.
    pub fn applied(&self, seq: u64) {
        self.applied.fetch_max(seq, Ordering::Release);
        self.applied_changed.notify_one();
    }

    /// Resolves once the loop routes to the list numbered `seq` or a later one.
    pub async fn until_applied(&self, seq: u64) {
        while self.applied.load(Ordering::Acquire) < seq {
            self.applied_changed.notified().await;
        }
    }
}

/// What a change of the providers did, for the log.
#[derive(Debug, Default)]
struct Change {
    joined: usize,
    left: usize,
    kept: usize,
}

/// The change from `served` to `specs`: the same provider is the same address, of the
/// same kind.
fn change(served: &[UpstreamSpec], specs: &[UpstreamSpec]) -> Change {
    let same = |a: &UpstreamSpec, b: &UpstreamSpec| a.addr == b.addr && a.kind == b.kind;
    let kept = specs
        .iter()
        .filter(|s| served.iter().any(|o| same(o, s)))
        .count();
    Change {
        joined: specs.len() - kept,
        left: served.len().saturating_sub(kept),
        kept,
    }
}

/// Serves reloads for the engine `handle` runs, for ever (the caller stops it): reads the
/// providers file when `reload` is pulled and when its stamp changes, and hands the loop
/// each list that reads well (see the module's doc). `served` and `text`: the providers
/// served at the start and the file's text then.
pub(super) async fn watch(
    handle: &LoopHandle,
    config: &BrokerConfig,
    metrics: &BrokerMetrics,
    mut served: Vec<UpstreamSpec>,
    mut text: Option<String>,
    reload: Reload,
) {
    let path: Option<PathBuf> = config.providers_file.clone();
    // No stamp yet: the first poll reads the file and compares its text with the text
    // served, so a change made during the start is applied, and an unchanged file
    // changes nothing.
    let mut stamp: Option<FileStamp> = None;
    let mut poll = tokio::time::interval(FILE_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.reset();
    let mut seq = 0;
    loop {
        let asked = tokio::select! {
            () = reload.requested() => true,
            _ = poll.tick(), if path.is_some() => false,
        };
        let Some(path) = &path else {
            tracing::info!(
                "reload asked for, but the broker has no --providers-file: nothing to read"
            );
            continue;
        };
        if asked {
            tracing::info!(file = %path.display(), "reload asked for: reading the providers file");
            stamp = stamp_of(path.clone()).await;
        } else {
            let now = stamp_of(path.clone()).await;
            if now == stamp {
                continue;
            }
            stamp = now;
        }
        let read = read_off_runtime(path).await;
        // A change of the stamp alone (touched, rewritten alike) changes nothing.
        if !asked && read.as_ref().ok() == text.as_ref() {
            continue;
        }
        let parsed = read.and_then(|t| {
            let specs =
                providers_file::providers_of(path, &t, &config.upstreams, config.if_empty())?;
            Ok((specs, t))
        });
        match parsed {
            Ok((specs, t)) => {
                let change = change(&served, &specs);
                seq += 1;
                let idempotent = providers_file::idempotent(&t);
                handle.command(|| Command::Providers {
                    specs: specs.clone(),
                    idempotent: idempotent.clone(),
                    seq,
                });
                handle.until_applied(seq).await;
                metrics.reloads_ok.increment(1);
                tracing::info!(file = %path.display(), providers = specs.len(), joined = change.joined, left = change.left, kept = change.kept, "providers file applied");
                served = specs;
                text = Some(t);
            }
            Err(e) => {
                metrics.reloads_error.increment(1);
                tracing::error!(error = %e, providers = served.len(), "providers file kept out; the providers stay as they were");
            }
        }
    }
}
