//! Counting the heap allocations a program's hot path makes: the system allocator with a
//! count per thread (`densa-alloc`), and [`Counted`], a future that adds up what its own
//! polls allocated.
//!
//! A program opts in from its `main.rs`:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: rpcmesh_common::alloc::Counting = rpcmesh_common::alloc::Counting::system();
//! ```
//!
//! and wraps the tasks of its hot path in [`Counted`]. The broker does, for its sessions
//! and its upstream connections: forwarding a call in steady state allocates nothing, and
//! `rpcmesh_forwarding_allocations_total` is how a bench or a test holds it to that. Counting
//! by poll, not by process, leaves out what is not per call (the scrapes, `/proc`, the
//! pool keepers' health checks), which would otherwise hide a per-call allocation in their
//! noise. The count is a thread-local add per allocation, and per poll two thread-local
//! reads; the shared counter is touched only by a poll that allocated. The allocator under
//! it stays glibc's, which gives large buffers back to the system (`docs/architecture.md`,
//! "Memory").

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The counting allocator's type.
pub type Counting = densa_alloc::CountingAllocator;

/// Whether the program installed [`Counting`] as its global allocator (else nothing is
/// counted, and a count of zero would prove nothing).
pub fn counting() -> bool {
    densa_alloc::is_active()
}

/// Runs `f`, and returns what it gave and the heap allocations (and reallocations) it
/// made on this thread: how a program without tasks (the broker's loop engine) counts the
/// allocations of its hot path, a round at a time.
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let (out, stats) = densa_alloc::measure(f);
    (out, stats.allocs + stats.reallocs)
}

/// A future whose polls' heap allocations (and reallocations) are added to `to`.
#[derive(Debug)]
pub struct Counted<F> {
    inner: Pin<Box<F>>,
    to: metrics::Counter,
}

impl<F: Future> Counted<F> {
    /// Counts `inner`'s allocations into `to` (a no-op counter counts nothing).
    pub fn new(inner: F, to: metrics::Counter) -> Self {
        Counted {
            inner: Box::pin(inner),
            to,
        }
    }
}

impl<F: Future> Future for Counted<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let (out, n) = measure(|| this.inner.as_mut().poll(cx));
        if n > 0 {
            this.to.increment(n);
        }
        out
    }
}
