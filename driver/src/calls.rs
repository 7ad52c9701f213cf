//! The calls one worker has issued and that have no outcome yet ([`Calls`]): each in a
//! slot keyed by its request id (`rpcmesh_common::net::slots`), written on a connection or
//! parked until there is one ([`Place`]). A reply counts for a call only on the connection
//! the call is written on; a call leaves the table exactly once: answered, timed out, lost
//! with its connection, failed to encode, or failed when the worker gives up.
//!
//! Pure: no I/O, no clock (instants are passed in). What a call's end means (its outcome,
//! its user's next call) is the worker's.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rpcmesh_common::net::slots::SlotTable;

/// Where a call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Not written: waiting for a connection (or about to be written).
    Parked,
    /// Written on the connection with this serial.
    On(u32),
}

/// A call issued and waiting for its outcome (its request id is its key in the table).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    /// When the call was meant to start: its request's intended start for the first call
    /// (every call with `--parallel`), its own start for the next ones. Latency runs from
    /// here, through every re-send.
    pub intended: Instant,
    /// When the call was issued (the round's time): the uncorrected latency and the call
    /// timeout run from here (a re-send does not move them).
    pub sent: Instant,
    /// The user whose request it is part of.
    pub user: u32,
    /// The measured step it belongs to (`None`: warm-up).
    pub step: Option<usize>,
    pub place: Place,
    /// Where its frame starts in the byte stream of the connection it is written on
    /// (when written): what tells a call lost unsent from one lost in flight.
    pub at: u64,
    /// Times it was sent again (retries).
    pub tries: u8,
    /// Stage stamps (stages on only): encoding began, encoding ended, write returned.
    pub encoding: Option<Instant>,
    pub encoded: Option<Instant>,
    pub written: Option<Instant>,
}

impl Slot {
    /// A call of user `user` meant to start at `intended`, issued at `now`, not written
    /// yet.
    pub fn new(user: usize, intended: Instant, step: Option<usize>, now: Instant) -> Self {
        Slot {
            intended,
            sent: now,
            user: user as u32,
            step,
            place: Place::Parked,
            at: 0,
            tries: 0,
            encoding: None,
            encoded: None,
            written: None,
        }
    }

    /// The same call, to send again (its start and deadline kept, its stages timed anew).
    pub fn retry(self) -> Self {
        Slot {
            place: Place::Parked,
            at: 0,
            tries: self.tries + 1,
            encoding: None,
            encoded: None,
            written: None,
            ..self
        }
    }
}

/// The worker's calls without an outcome, on every connection and parked.
#[derive(Debug)]
pub(crate) struct Calls {
    table: SlotTable<Slot>,
    /// Ids of the parked calls, oldest first (bounded by the table: each is a user's call).
    parked: VecDeque<u64>,
}

impl Calls {
    /// Room for `n` calls at once (the worker's users' calls).
    pub fn with_capacity(n: usize) -> Self {
        Calls {
            table: SlotTable::with_capacity(n),
            parked: VecDeque::new(),
        }
    }

    /// Takes `slot` in; returns its id (the request id its frame carries).
    pub fn issue(&mut self, slot: Slot) -> u64 {
        self.table.insert(slot)
    }

    /// The call `id`, if it is still out.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut Slot> {
        self.table.get_mut(id)
    }

    /// Takes out the call `id` (it has its outcome).
    pub fn take(&mut self, id: u64) -> Option<Slot> {
        self.table.take(id)
    }

    /// Takes out the call `id` answered on the connection `serial`, if it is written
    /// there (`None`: a late reply, its call timed out, or not this connection's).
    pub fn take_answered(&mut self, id: u64, serial: u32) -> Option<Slot> {
        let ours = self
            .table
            .get_mut(id)
            .is_some_and(|s| s.place == Place::On(serial));
        ours.then(|| self.table.take(id)).flatten()
    }

    /// The call `id` waits for a connection.
    pub fn park(&mut self, id: u64) {
        self.parked.push_back(id);
    }

    /// How many calls are parked.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// The oldest parked call, to write.
    pub fn unpark(&mut self) -> Option<u64> {
        self.parked.pop_front()
    }

    /// How many calls are written and unanswered.
    pub fn written(&self) -> usize {
        self.table.len().saturating_sub(self.parked.len())
    }

    /// True when no call is out.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Takes out every call written on the connection `serial` (it is lost), into `into`.
    pub fn take_on(&mut self, serial: u32, into: &mut Vec<(u64, Slot)>) {
        self.table
            .take_where(|s| s.place == Place::On(serial), into);
    }

    /// Takes out every call issued `timeout` or longer before `now`, written or parked,
    /// into `into`.
    pub fn take_expired(&mut self, now: Instant, timeout: Duration, into: &mut Vec<(u64, Slot)>) {
        let from = into.len();
        self.table
            .take_where(|s| now.duration_since(s.sent) >= timeout, into);
        if into[from..].iter().any(|(_, s)| s.place == Place::Parked) {
            let table = &mut self.table;
            self.parked.retain(|&id| table.get_mut(id).is_some());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn written_on(calls: &mut Calls, serial: u32, now: Instant) -> u64 {
        let id = calls.issue(Slot::new(0, now, None, now));
        calls.get_mut(id).unwrap().place = Place::On(serial);
        id
    }

    #[test]
    fn a_reply_counts_only_on_the_connection_its_call_is_written_on() {
        let t0 = Instant::now();
        let mut calls = Calls::with_capacity(4);
        let id = written_on(&mut calls, 1, t0);
        assert!(calls.take_answered(id, 2).is_none(), "another connection's");
        assert!(calls.take_answered(id, 1).is_some());
        assert!(calls.take_answered(id, 1).is_none(), "answered once");
        assert!(calls.is_empty());
    }

    #[test]
    fn a_lost_connection_takes_out_its_calls_and_no_other() {
        let t0 = Instant::now();
        let mut calls = Calls::with_capacity(4);
        let a = written_on(&mut calls, 1, t0);
        let b = written_on(&mut calls, 2, t0);
        let parked = calls.issue(Slot::new(1, t0, None, t0));
        calls.park(parked);
        let mut lost = Vec::new();
        calls.take_on(1, &mut lost);
        assert_eq!(lost.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [a]);
        assert!(calls.get_mut(b).is_some() && calls.get_mut(parked).is_some());
        assert_eq!((calls.written(), calls.parked()), (1, 1));
    }

    #[test]
    fn calls_past_the_timeout_are_taken_out_written_or_parked_and_leave_the_parked_queue() {
        let t0 = Instant::now();
        let mut calls = Calls::with_capacity(4);
        let old = calls.issue(Slot::new(0, t0, None, t0));
        calls.park(old);
        let written = written_on(&mut calls, 1, t0);
        let young = calls.issue(Slot::new(1, t0, None, t0 + 5 * MS));
        calls.park(young);
        let mut expired = Vec::new();
        calls.take_expired(t0 + 10 * MS, 10 * MS, &mut expired);
        let mut ids: Vec<u64> = expired.iter().map(|(id, _)| *id).collect();
        ids.sort_unstable();
        let mut want = vec![old, written];
        want.sort_unstable();
        assert_eq!(ids, want);
        assert_eq!(calls.parked(), 1, "the expired parked call is forgotten");
        assert_eq!(calls.unpark(), Some(young));
    }

    #[test]
    fn a_retried_call_keeps_its_start_and_deadline_and_is_timed_anew() {
        let t0 = Instant::now();
        let mut slot = Slot::new(3, t0, Some(1), t0 + MS);
        slot.place = Place::On(7);
        slot.written = Some(t0 + 2 * MS);
        let again = slot.retry();
        assert_eq!((again.intended, again.sent, again.user), (t0, t0 + MS, 3));
        assert_eq!(
            (again.place, again.tries, again.written),
            (Place::Parked, 1, None)
        );
    }
}
