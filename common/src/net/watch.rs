//! Files read again while a program runs (TLS certificates and keys, the authorization
//! policy): when asked (SIGHUP, through a [`Trigger`]) and when they change, which is
//! seen by their [`FileStamp`]s, looked at every [`FILE_POLL`].
//!
//! Owns when a file is read again; what a read does with it, and what happens when it
//! fails (the previous contents stay in force, the failure is logged), is the caller's
//! `read` closure's.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;

use crate::net::shutdown::CancellationToken;

/// How often the files' stamps are looked at: a change is in force within a second, for
/// a `stat` a second per file.
pub const FILE_POLL: Duration = Duration::from_secs(1);

/// A request to read files again (SIGHUP's), shared by whoever pulls it and one watcher.
#[derive(Clone, Debug, Default)]
pub struct Trigger(Arc<Notify>);

impl Trigger {
    /// A trigger nobody has pulled yet.
    pub fn new() -> Self {
        Trigger::default()
    }

    /// Asks the watcher to read its files now.
    pub fn pull(&self) {
        self.0.notify_one();
    }
}

/// What identifies a version of a file: its modification time, length and inode (an
/// editor that writes a new file and renames it over the old one changes the inode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileStamp(Option<(SystemTime, u64, u64)>);

impl FileStamp {
    /// The stamp of `path` now (a missing file has a stamp of its own).
    pub fn of(path: &Path) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        FileStamp(std::fs::metadata(path).ok().map(|m| {
            (
                m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                m.len(),
                m.ino(),
            )
        }))
    }
}

/// Calls `read` whenever `trigger` is pulled or one of `paths` changes, until `stop`.
/// `read` is told which: `true` when asked.
pub async fn watch(
    paths: Vec<PathBuf>,
    trigger: Trigger,
    stop: CancellationToken,
    mut read: impl FnMut(bool) + Send,
) {
    let stamps = |paths: &[PathBuf]| paths.iter().map(|p| FileStamp::of(p)).collect::<Vec<_>>();
    let mut seen = stamps(&paths);
    let mut poll = tokio::time::interval(FILE_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.reset();
    loop {
        let asked = tokio::select! {
            () = stop.cancelled() => return,
            () = trigger.0.notified() => true,
            _ = poll.tick() => false,
        };
        let now = stamps(&paths);
        if asked || now != seen {
            seen = now;
            read(asked);
        }
    }
}
