//! The pacer's task: one for the whole run, so that one timer, not one per connection,
//! decides when each request is due. It wakes at each intended start on a `PreciseTimer`
//! (never before it, a few µs after it at most when nothing else runs; with exact pacing
//! it spins through the last [`EXACT_SPIN`] before it rather than let the thread halt),
//! and hands the instant to the connections in turn; each connection starts the request
//! at once (or, when every slot is busy or it has no connection, between one target and
//! the next, backlogs it, or counts it not sent), timed from that instant: a request held
//! back by a fail-over shows its wait in the latency. One timer for the run, because
//! timers of their own per connection wake and spin over one another, and the start
//! lag's tail grows with the number of connections.
//!
//! Owns the waking and the handing out; when requests are due is [`crate::pacer`]'s, what
//! a connection does with one is the worker's.

use std::sync::Arc;
use std::time::Instant;

use rpcmesh_common::net::timer::{Aim, PreciseTimer};
use tokio::sync::mpsc::UnboundedSender;

use crate::pacer::{EXACT_SPIN, Pacer, Pacing};
use crate::shared::RunShared;

/// Hands every due request of `pacer` to one of `connections` in turn, until the run
/// ends (the schedule's end, the budget, Ctrl-C) or every connection is gone; then closes
/// the connections' queues, which tells them the schedule is over.
pub(crate) async fn run(
    mut pacer: Pacer,
    shared: Arc<RunShared>,
    mut connections: Vec<UnboundedSender<Instant>>,
) {
    let mut timer = PreciseTimer::new();
    let aim = match shared.config.pacing {
        Pacing::Exact => Aim::Spinning(EXACT_SPIN),
        Pacing::Lean => Aim::Sleeping,
    };
    let mut turn = 0usize;
    // Made once and kept registered with the token, not once per request (see the
    // session loop in `rpcmesh_common::net::session`).
    let stopped = shared.stop.cancelled();
    tokio::pin!(stopped);
    loop {
        let due = pacer.next_due();
        // The run ends before the next request is due: do not wait for it.
        if shared.until.is_some_and(|u| due >= u) {
            return;
        }
        tokio::select! {
            () = timer.wait_until(due, aim) => {}
            () = &mut stopped => return,
        }
        if !dispatch(&mut pacer, &shared, &mut connections, &mut turn) {
            return;
        }
        // Let the connections start what was handed to them before the timer is armed
        // again: arming it is a syscall (on a VM, an exit), which would otherwise delay
        // every request just handed over.
        tokio::task::yield_now().await;
    }
}

/// Hands every request due by now to a connection; false when the run is over (no more
/// may start, or no connection is left).
fn dispatch(
    pacer: &mut Pacer,
    shared: &RunShared,
    connections: &mut Vec<UnboundedSender<Instant>>,
    turn: &mut usize,
) -> bool {
    let now = Instant::now();
    while let Some(due) = pacer.take_due(now) {
        if !shared.may_start(due) {
            return false;
        }
        // The next connection in turn that is still there.
        loop {
            if connections.is_empty() {
                return false;
            }
            *turn %= connections.len();
            if connections[*turn].send(due).is_ok() {
                *turn += 1;
                break;
            }
            // That connection gave up (it could not reconnect): the others take its share.
            connections.swap_remove(*turn);
        }
    }
    true
}
