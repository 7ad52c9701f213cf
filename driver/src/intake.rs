//! Where one worker's requests come from ([`Intake`]). Closed loop: its users, each
//! starting its next request when its last ends, from the first connection on. Open loop:
//! the run's pacer hands over each request's intended start, connected or not; a request
//! that finds no free slot (or no connection) waits in the bounded [`Backlog`], still timed
//! from its intended start, and beyond the bound is counted not sent. Every request handed
//! over is counted due and ends started or not sent, also when the worker gives up.
//!
//! Owns the intake's state and its not-sent counting; starting a request (the users, the
//! calls, their figures) is the worker's.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::connection::Reach;
use crate::pacer::{Backlog, Offered};
use crate::stats::Books;

/// Where a worker's requests come from.
#[derive(Debug)]
pub(crate) enum Intake {
    /// Closed loop, before the first connection: the users begin once it is up.
    Waiting,
    /// Closed loop: each user starts its next request when its last ends.
    Closed,
    /// Open loop: the pacer hands over the requests' intended starts.
    Open {
        /// `None` once the schedule is over, or the worker gave up.
        dues: Option<UnboundedReceiver<Instant>>,
        /// The requests due while every slot was busy, or while there was no connection.
        backlog: Backlog,
    },
}

impl Intake {
    /// Open loop: requests handed over on `dues`, up to `bound` of them waiting for a slot.
    pub fn open(dues: UnboundedReceiver<Instant>, bound: usize) -> Self {
        Intake::Open {
            dues: Some(dues),
            backlog: Backlog::new(bound),
        }
    }

    /// Whether requests come on a schedule (and latency has a second, uncorrected figure).
    pub fn is_open(&self) -> bool {
        matches!(self, Intake::Open { .. })
    }

    /// No request waits or is to come: open loop, once the schedule is over and the
    /// backlog empty; closed loop, once the users began, or the worker gave up before.
    pub fn is_over(&self, reach: Reach) -> bool {
        match self {
            Intake::Waiting => reach == Reach::GaveUp,
            Intake::Closed => true,
            Intake::Open { dues, backlog } => dues.is_none() && backlog.is_empty(),
        }
    }

    /// Closed loop, the first connection is up: whether the users begin now (only the
    /// first time).
    pub fn begin(&mut self) -> bool {
        let waiting = matches!(self, Intake::Waiting);
        if waiting {
            *self = Intake::Closed;
        }
        waiting
    }

    /// The next intended start handed over (pending for ever in the closed loop; `None`
    /// once the schedule is over).
    pub async fn next_due(&mut self) -> Option<Instant> {
        match self {
            Intake::Open { dues: Some(rx), .. } => rx.recv().await,
            _ => std::future::pending().await,
        }
    }

    /// An intended start already handed over, without waiting for one.
    pub fn try_due(&mut self) -> Option<Instant> {
        match self {
            Intake::Open { dues: Some(rx), .. } => rx.try_recv().ok(),
            _ => None,
        }
    }

    /// The pacer hands over no more.
    pub fn schedule_over(&mut self) {
        if let Intake::Open { dues, .. } = self {
            *dues = None;
        }
    }

    /// A request due at `due` (of measured step `step`) found no free slot: it waits in
    /// the backlog, or, beyond its bound, is counted not sent.
    pub fn wait_for_slot(&mut self, due: Instant, step: Option<usize>, books: &mut Books) {
        let offered = match self {
            Intake::Open { backlog, .. } => backlog.offer(due),
            Intake::Waiting | Intake::Closed => Offered::NotSent,
        };
        if offered == Offered::NotSent {
            books.not_sent(step);
        }
    }

    /// The oldest request in the backlog, to start.
    pub fn take_backlogged(&mut self) -> Option<Instant> {
        match self {
            Intake::Open { backlog, .. } => backlog.take(),
            Intake::Waiting | Intake::Closed => None,
        }
    }

    /// Whether requests wait in the backlog.
    pub fn has_backlog(&self) -> bool {
        matches!(self, Intake::Open { backlog, .. } if !backlog.is_empty())
    }

    /// The worker gave up: the requests in the backlog, and those handed over but not yet
    /// taken (counted due first), are counted not sent, each in the step `step_of` gives;
    /// the pacer hands no more to this worker.
    pub fn abandon(&mut self, books: &mut Books, step_of: impl Fn(Instant) -> Option<usize>) {
        let Intake::Open { dues, backlog } = self else {
            return;
        };
        for due in backlog.drain() {
            books.not_sent(step_of(due));
        }
        if let Some(mut dues) = dues.take() {
            dues.close();
            while let Ok(due) = dues.try_recv() {
                let step = step_of(due);
                books.due(step);
                books.not_sent(step);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::mpsc::unbounded_channel;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_closed_loop_begins_once_and_is_over_once_begun_or_given_up() {
        let mut i = Intake::Waiting;
        assert!(!i.is_over(Reach::Reachable), "its users have not begun");
        assert!(i.is_over(Reach::GaveUp), "it gave up before they could");
        assert!(i.begin());
        assert!(!i.begin(), "only the first connection begins them");
        assert!(i.is_over(Reach::Reachable) && !i.is_open());
    }

    #[test]
    fn beyond_the_backlog_a_request_due_is_counted_not_sent() {
        let (tx, rx) = unbounded_channel();
        let mut i = Intake::open(rx, 1);
        let mut books = Books::default();
        let t0 = Instant::now();
        i.wait_for_slot(t0, None, &mut books);
        i.wait_for_slot(t0 + MS, None, &mut books);
        assert_eq!(books.interval.requests_not_sent, 1);
        assert!(i.has_backlog());
        assert_eq!(
            i.take_backlogged(),
            Some(t0),
            "the one that waits keeps its start"
        );
        drop(tx);
        let over = i.is_over(Reach::Reachable);
        assert!(!over, "the schedule is not over until the worker hears it");
        i.schedule_over();
        assert!(i.is_over(Reach::Reachable));
    }

    #[test]
    fn giving_up_counts_every_request_waiting_or_handed_over_not_sent() {
        let (tx, rx) = unbounded_channel();
        let mut i = Intake::open(rx, 8);
        let mut books = Books::default();
        let t0 = Instant::now();
        for k in 0..2 {
            // Counted due when taken, as the worker does.
            books.due(None);
            i.wait_for_slot(t0 + k * MS, None, &mut books);
        }
        for k in 2..5 {
            tx.send(t0 + k * MS).unwrap();
        }
        i.abandon(&mut books, |_| None);
        let t = &books.interval;
        assert_eq!((t.requests_due, t.requests_not_sent), (5, 5));
        assert!(i.is_over(Reach::GaveUp));
        assert!(tx.send(t0).is_err(), "the pacer hands no more");
    }
}
