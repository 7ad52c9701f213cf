//! The users of one connection and their request state machine: a user starts a request
//! of `fanout` calls (all at once with `--parallel`, else one after another), and each
//! call's end says what comes next: another call, nothing yet (calls of the request still
//! out), or the end of the request. Closed loop, a user then starts its next request; open
//! loop, it frees its slot for the pacer.
//!
//! Pure: no I/O, no clock (instants are passed in). The worker runs it and makes the calls.

use std::time::Instant;

use crate::connection::Reach;

/// What a user is doing.
#[derive(Debug, Clone, Copy)]
struct User {
    /// When the request was meant to start (the schedule's instant in the open loop).
    intended: Instant,
    started: Instant,
    replies: u32,
    failed: bool,
    step: Option<usize>,
    timed: bool,
}

/// A request that ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// When it was meant to start: its latency runs from here.
    pub intended: Instant,
    /// When it started.
    pub started: Instant,
    /// At least one of its calls failed (or could not be made).
    pub failed: bool,
    /// The measured step it belongs to (`None`: warm-up).
    pub step: Option<usize>,
    /// Its `request` stage is timed.
    pub timed: bool,
}

/// What follows a call's end for its user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Make the request's next call.
    Call,
    /// Other calls of the request are still out.
    Wait,
    /// The request is over.
    Done(Finished),
}

/// The users of one connection.
#[derive(Debug)]
pub struct Users {
    users: Vec<User>,
    fanout: u32,
    parallel: bool,
    /// Users with a request under way.
    active: usize,
    /// Open loop: users without a request, waiting for the pacer.
    free: Vec<usize>,
}

impl Users {
    /// `n` users making requests of `fanout` calls, at once when `parallel`.
    pub fn new(n: usize, fanout: u32, parallel: bool, now: Instant) -> Self {
        let idle = User {
            intended: now,
            started: now,
            replies: 0,
            failed: false,
            step: None,
            timed: false,
        };
        Users {
            users: vec![idle; n],
            fanout,
            parallel,
            active: 0,
            free: Vec::new(),
        }
    }

    /// How many users.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// Users with a request under way.
    pub fn active(&self) -> usize {
        self.active
    }

    /// Open loop: every user waits for the pacer (the lowest-numbered is taken first).
    pub fn free_all(&mut self) {
        self.free = (0..self.users.len()).rev().collect();
    }

    /// Open loop: a user without a request, if any.
    pub fn take_free(&mut self) -> Option<usize> {
        self.free.pop()
    }

    /// Open loop: user `u` waits for the pacer again.
    pub fn release(&mut self, u: usize) {
        self.free.push(u);
    }

    /// User `u` starts at `now` a request meant to start at `intended`; returns how many
    /// of its calls to make now.
    pub fn start(
        &mut self,
        u: usize,
        intended: Instant,
        now: Instant,
        step: Option<usize>,
        timed: bool,
    ) -> u32 {
        self.active += 1;
        self.users[u] = User {
            intended,
            started: now,
            replies: 0,
            failed: false,
            step,
            timed,
        };
        if self.parallel { self.fanout } else { 1 }
    }

    /// A call of user `u` ended (`ok` or not). While the worker reaches (or tries to
    /// reach) a target the request goes on; once it gave up, the request ends at once,
    /// failed, its remaining calls not made (with `--parallel`, once the calls already out
    /// have ended too).
    pub fn call_done(&mut self, u: usize, ok: bool, reach: Reach) -> Next {
        let fanout = self.fanout;
        let parallel = self.parallel;
        let user = &mut self.users[u];
        user.replies += 1;
        user.failed |= !ok;
        let finished = user.replies == fanout;
        if reach == Reach::GaveUp {
            if !finished && parallel {
                return Next::Wait;
            }
            user.failed = true;
        } else if !finished {
            return if parallel { Next::Wait } else { Next::Call };
        }
        self.active -= 1;
        Next::Done(Finished {
            intended: user.intended,
            started: user.started,
            failed: user.failed,
            step: user.step,
            timed: user.timed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ON: Reach = Reach::Reachable;
    const GAVE_UP: Reach = Reach::GaveUp;

    #[test]
    fn a_request_in_a_row_makes_its_calls_one_after_another() {
        let t0 = Instant::now();
        let mut u = Users::new(2, 3, false, t0);
        assert_eq!(u.start(1, t0, t0, Some(0), false), 1);
        assert_eq!(u.active(), 1);
        assert_eq!(u.call_done(1, true, ON), Next::Call);
        assert_eq!(u.call_done(1, true, ON), Next::Call);
        let done = u.call_done(1, true, ON);
        assert_eq!(
            done,
            Next::Done(Finished {
                intended: t0,
                started: t0,
                failed: false,
                step: Some(0),
                timed: false
            })
        );
        assert_eq!(u.active(), 0);
    }

    #[test]
    fn a_parallel_request_waits_for_all_its_calls_and_one_failure_fails_it() {
        let t0 = Instant::now();
        let mut u = Users::new(1, 3, true, t0);
        assert_eq!(u.start(0, t0, t0, None, true), 3);
        assert_eq!(u.call_done(0, true, ON), Next::Wait);
        assert_eq!(u.call_done(0, false, ON), Next::Wait);
        match u.call_done(0, true, ON) {
            Next::Done(f) => assert!(f.failed && f.timed && f.step.is_none()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn once_the_worker_gave_up_a_request_in_a_row_ends_at_once_failed() {
        let t0 = Instant::now();
        let mut u = Users::new(1, 5, false, t0);
        u.start(0, t0, t0, Some(0), false);
        assert_eq!(u.call_done(0, true, ON), Next::Call);
        // The worker gives up with the second call out: the last three are not made.
        match u.call_done(0, false, GAVE_UP) {
            Next::Done(f) => assert!(f.failed),
            other => panic!("{other:?}"),
        }
        assert_eq!(u.active(), 0);
    }

    #[test]
    fn once_the_worker_gave_up_a_parallel_request_ends_with_its_last_call_out() {
        let t0 = Instant::now();
        let mut u = Users::new(1, 2, true, t0);
        u.start(0, t0, t0, Some(0), false);
        assert_eq!(u.call_done(0, true, GAVE_UP), Next::Wait);
        assert!(matches!(u.call_done(0, true, GAVE_UP), Next::Done(f) if f.failed));
    }

    #[test]
    fn open_loop_slots_are_taken_lowest_first_and_given_back() {
        let mut u = Users::new(3, 1, false, Instant::now());
        u.free_all();
        assert_eq!(u.take_free(), Some(0));
        assert_eq!(u.take_free(), Some(1));
        u.release(0);
        assert_eq!(u.take_free(), Some(0));
        assert_eq!(u.take_free(), Some(2));
        assert_eq!(u.take_free(), None);
    }
}
