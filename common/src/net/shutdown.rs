//! Shutdown plumbing shared by the three programs: waiting for SIGTERM / SIGINT, a
//! cancellation token that `run` hands to every task it starts, and [`Cancelled`], the wait
//! for a token that a task polls every round at the price of one flag read.
//!
//! Each program's `run(config, listener, shutdown)` takes any future as its shutdown
//! trigger; tests pass a oneshot receiver, `main` passes [`signal`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

pub use tokio_util::sync::CancellationToken;
use tokio_util::sync::WaitForCancellationFutureOwned;

/// A boxed shutdown trigger, as a server's `run` is handed one by `cli::startup::serve`
/// (SIGTERM or SIGINT) or by `rpcmesh_testkit::InProcess` (the test's stop).
pub type ShutdownSignal = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Resolves on the first SIGTERM or SIGINT (Ctrl-C).
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops this");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A token cancelled when `trigger` resolves (or when the token is cancelled otherwise).
pub fn token_from(trigger: impl Future<Output = ()> + Send + 'static) -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = trigger => t.cancel(),
            () = t.cancelled() => {}
        }
    });
    token
}

/// Resolves when `token` is cancelled, as `token.cancelled()` does, but asks the token only
/// when the token itself woke the task (and on the first poll). A session races its
/// signals against its socket every round, and each poll of `cancelled()` locks the token
/// twice (its cancelled flag and its waiter list are behind one mutex); this one reads a
/// flag instead (measured: docs/performance.md, "What each optimisation bought").
///
/// It hands the token a waker of its own, which sets the flag and wakes the task.
#[derive(Debug)]
pub struct Cancelled {
    wait: Pin<Box<WaitForCancellationFutureOwned>>,
    relay: Arc<Relay>,
    /// The task's waker the relay holds (a copy, to see whether the task changed).
    task: Option<Waker>,
    /// The token holds the relay's waker: until the relay fires, it has nothing new.
    registered: bool,
}

/// The waker a [`Cancelled`] gives its token.
#[derive(Debug, Default)]
struct Relay {
    /// The token woke it since the last look.
    fired: AtomicBool,
    /// The task to wake.
    task: Mutex<Option<Waker>>,
}

impl Wake for Relay {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        let task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = task.as_ref() {
            w.wake_by_ref();
        }
    }
}

impl Cancelled {
    /// Waits for `token` (a clone of it is kept).
    pub fn new(token: &CancellationToken) -> Self {
        Cancelled {
            wait: Box::pin(token.clone().cancelled_owned()),
            relay: Arc::default(),
            task: None,
            registered: false,
        }
    }
}

impl Future for Cancelled {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if !this.task.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            let w = cx.waker().clone();
            *this
                .relay
                .task
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(w.clone());
            this.task = Some(w);
        }
        if this.registered && !this.relay.fired.load(Ordering::Acquire) {
            return Poll::Pending;
        }
        // The first poll, or the token woke us: ask it (a wake-up while it is asked sets
        // the flag again and is seen at the next poll).
        this.relay.fired.store(false, Ordering::Relaxed);
        let waker = Waker::from(this.relay.clone());
        match this.wait.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(()) => Poll::Ready(()),
            Poll::Pending => {
                this.registered = true;
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn count() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count::default());
        (c.clone(), Waker::from(c))
    }

    #[test]
    fn resolves_once_cancelled_and_wakes_the_task_that_waits() {
        let token = CancellationToken::new();
        let mut wait = Cancelled::new(&token);
        let (woken, waker) = count();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut wait).poll(&mut cx).is_pending());
        assert!(
            Pin::new(&mut wait).poll(&mut cx).is_pending(),
            "still waiting"
        );
        assert_eq!(woken.0.load(Ordering::Relaxed), 0);
        token.cancel();
        assert_eq!(woken.0.load(Ordering::Relaxed), 1, "the task is woken");
        assert!(Pin::new(&mut wait).poll(&mut cx).is_ready());
    }

    #[test]
    fn a_token_cancelled_before_the_first_poll_resolves_at_once() {
        let token = CancellationToken::new();
        let child = token.child_token();
        let mut wait = Cancelled::new(&child);
        token.cancel();
        let (_, waker) = count();
        assert!(
            Pin::new(&mut wait)
                .poll(&mut Context::from_waker(&waker))
                .is_ready()
        );
    }

    #[test]
    fn the_latest_task_to_poll_is_the_one_woken() {
        let token = CancellationToken::new();
        let mut wait = Cancelled::new(&token);
        let (first, w1) = count();
        let (second, w2) = count();
        assert!(
            Pin::new(&mut wait)
                .poll(&mut Context::from_waker(&w1))
                .is_pending()
        );
        assert!(
            Pin::new(&mut wait)
                .poll(&mut Context::from_waker(&w2))
                .is_pending()
        );
        token.cancel();
        assert_eq!(first.0.load(Ordering::Relaxed), 0);
        assert_eq!(second.0.load(Ordering::Relaxed), 1);
        assert!(
            Pin::new(&mut wait)
                .poll(&mut Context::from_waker(&w2))
                .is_ready()
        );
    }

    #[tokio::test]
    async fn works_in_a_select_loop_woken_by_other_events() {
        let token = CancellationToken::new();
        let wait = Cancelled::new(&token);
        tokio::pin!(wait);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let t = token.clone();
        tokio::spawn(async move {
            for i in 0..100 {
                tx.send(i).unwrap();
                tokio::task::yield_now().await;
            }
            t.cancel();
            // The sender stays open: only the cancellation can end the loop below.
            std::future::pending::<()>().await;
        });
        let mut got = 0;
        loop {
            tokio::select! {
                biased;
                Some(_) = rx.recv() => got += 1,
                () = &mut wait => break,
            }
        }
        assert_eq!(got, 100, "every event before the cancellation was seen");
    }
}
