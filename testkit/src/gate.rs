//! [`Gate`]: holds calls in a handler until the test opens it, so that "answered while that
//! call was still in flight" is a fact of the test rather than a race against a timer.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

/// Holds calls until the test opens it: a slow server whose calls finish when the test
/// says, not after a sleep. A handler calls [`Gate::hold`] and awaits what it returns
/// before answering; the test waits for [`Gate::arrived`] to know the calls are in
/// flight, and [`Gate::open`]s it to let them (and all later ones) through.
#[derive(Debug)]
pub struct Gate {
    /// No permits, ever: waiters pass when it is closed.
    shut: Semaphore,
    arrived: AtomicUsize,
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            shut: Semaphore::new(0),
            arrived: AtomicUsize::new(0),
        })
    }

    /// Counts a call as arrived, now, and returns what it awaits: resolves once the gate
    /// is open.
    pub fn hold(self: &Arc<Self>) -> impl Future<Output = ()> + Send + use<> {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let gate = Arc::clone(self);
        async move {
            // Never a permit: an error is the gate opening.
            let _ = gate.shut.acquire().await;
        }
    }

    /// What a handler calls for each call it holds (a `hold` for provider's `Held`): the
    /// call counts as arrived and waits for the gate.
    pub fn holder(
        self: &Arc<Self>,
    ) -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync + 'static
    {
        let gate = Arc::clone(self);
        move || Box::pin(gate.hold())
    }

    /// Calls that have reached the gate so far (held, or let through since).
    pub fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }

    /// Lets every held call through, and every later one straight through.
    pub fn open(&self) {
        self.shut.close();
    }
}
