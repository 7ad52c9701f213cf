//! Services: the handler interface and the registry that maps (service, method) names to
//! handlers. A service never sees a frame: it gets the decoded `rpc.RpcRequest` and
//! writes its encoded application message; framing, compression and statuses are the
//! session's.
//!
//! Handlers answer inline (the common case: the built-in services build a fixed answer),
//! inline but for a later instant (a simulated service time, [`time`]), or return a future
//! for work that waits; the session keeps the held answers and the futures and writes each
//! answer as it is due, so many calls are in flight per connection.

pub mod echo;
pub mod platform;
pub mod time;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rpcmesh_common::metrics::ErrorKind;
use rpcmesh_wire::Status;
use rpcmesh_wire::envelope::service_not_found;
use rpcmesh_wire::proto::rpc::RpcRequest;

use time::Timed;
pub use time::{ServiceMode, ServiceTime};

/// An answer still being worked on: resolves to the encoded application message.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<Bytes, ServiceError>> + Send>>;

/// What a handler did with a call.
pub enum Outcome {
    /// Answered now; on success the response message was appended to `out`.
    Ready(Result<(), ServiceError>),
    /// Answered now, as `Ready`, but the answer is to go out at this instant (a simulated
    /// service time: the session holds it on a fine-grained timer).
    At(std::time::Instant, Result<(), ServiceError>),
    /// Will answer when the future resolves.
    Later(HandlerFuture),
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Ready(r) => f.debug_tuple("Ready").field(r).finish(),
            Outcome::At(at, r) => f.debug_tuple("At").field(at).field(r).finish(),
            Outcome::Later(_) => f.write_str("Later(..)"),
        }
    }
}

/// One method's implementation.
pub trait Handler: Send + Sync + 'static {
    /// Handles a call. `out` is empty on entry; a successful inline answer appends the
    /// encoded response message to it.
    fn call(&self, request: RpcRequest, out: &mut BytesMut) -> Outcome;
}

impl<F> Handler for F
where
    F: Fn(RpcRequest, &mut BytesMut) -> Result<(), ServiceError> + Send + Sync + 'static,
{
    fn call(&self, request: RpcRequest, out: &mut BytesMut) -> Outcome {
        Outcome::Ready(self(request, out))
    }
}

/// Why a handler could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The application message in the payload did not decode.
    #[error("payload does not decode as {message}: {source}")]
    BadPayload {
        /// The expected message type.
        message: &'static str,
        /// The protobuf error.
        source: prost::DecodeError,
    },
    /// The handler failed.
    #[error("{0}")]
    Failed(String),
}

impl ServiceError {
    /// The status the caller gets.
    pub fn status(&self) -> Status {
        match self {
            ServiceError::BadPayload { .. } => Status::BadRequest,
            ServiceError::Failed(_) => Status::Failed,
        }
    }
}

/// The `error_msg` of every call a provider run with `--fail-calls` answers.
pub const INJECTED_FAULT: &str = "injected fault: this provider fails every call (--fail-calls)";

/// Index of a registered method, for per-method metrics without a lookup per call.
pub type MethodId = usize;

/// Result of looking a call's names up.
#[allow(missing_debug_implementations)]
pub enum Lookup<'a> {
    /// The handler and its method index.
    Found(&'a Arc<dyn Handler>, MethodId),
    /// No service of that name.
    NoService,
    /// The service exists but has no such method.
    NoMethod,
}

impl Lookup<'_> {
    /// For a call that found no handler: the error kind it counts as and its
    /// `error_msg` (status 1, worded as v1 peers word it). `None` when it was found.
    pub fn not_found(&self, service: &str, method: &str) -> Option<(ErrorKind, String)> {
        match self {
            Lookup::Found(..) => None,
            Lookup::NoService => Some((ErrorKind::UnknownService, service_not_found(service))),
            Lookup::NoMethod => Some((
                ErrorKind::UnknownMethod,
                format!("method not found: {service}.{method}"),
            )),
        }
    }
}

/// The methods of one service: name → index into the registry's handlers.
type Methods = HashMap<Box<[u8]>, MethodId>;

/// (service, method) → handler.
#[derive(Default)]
pub struct Registry {
    /// service → method → index into `handlers` and `names`.
    services: HashMap<Box<[u8]>, Methods>,
    handlers: Vec<Arc<dyn Handler>>,
    names: Vec<(String, String)>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("methods", &self.names)
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// The built-in services: `EchoService.Echo` and `PlatformService.doQuery`.
    pub fn builtin() -> Self {
        let mut r = Registry::new();
        r.register(echo::SERVICE, echo::METHOD, echo::echo);
        r.register(platform::SERVICE, platform::METHOD, platform::do_query);
        r
    }

    /// Makes every method fail at once with status 1 and [`INJECTED_FAULT`]
    /// (`--fail-calls`): a provider that answers its heartbeats and fails every call, the
    /// black hole outlier ejection is for (docs/resilience.md).
    pub fn fail_every_call(&mut self) {
        fn fail(_: RpcRequest, _: &mut BytesMut) -> Result<(), ServiceError> {
            Err(ServiceError::Failed(INJECTED_FAULT.to_owned()))
        }
        for h in &mut self.handlers {
            *h = Arc::new(fail);
        }
    }

    /// Adds (or replaces) a method.
    pub fn register(&mut self, service: &str, method: &str, handler: impl Handler) {
        self.register_arc(service, method, Arc::new(handler));
    }

    fn register_arc(&mut self, service: &str, method: &str, handler: Arc<dyn Handler>) {
        let methods = self.services.entry(service.as_bytes().into()).or_default();
        match methods.get(method.as_bytes()) {
            Some(id) => self.handlers[*id] = handler,
            None => {
                self.names.push((service.to_owned(), method.to_owned()));
                self.handlers.push(handler);
                methods.insert(method.as_bytes().into(), self.names.len() - 1);
            }
        }
    }

    /// Finds the handler for a call.
    pub fn lookup(&self, service: &[u8], method: &[u8]) -> Lookup<'_> {
        match self.services.get(service) {
            None => Lookup::NoService,
            Some(m) => match m.get(method) {
                Some(id) => Lookup::Found(&self.handlers[*id], *id),
                None => Lookup::NoMethod,
            },
        }
    }

    /// The handler of a method index (from an earlier [`Registry::lookup`]).
    pub fn handler(&self, id: MethodId) -> &Arc<dyn Handler> {
        &self.handlers[id]
    }

    /// The service and method names of method `id`.
    pub fn names_of(&self, id: MethodId) -> Option<(&str, &str)> {
        self.names.get(id).map(|(s, m)| (s.as_str(), m.as_str()))
    }

    /// Whether method index `id` is `service.method`.
    pub fn is_method(&self, id: MethodId, service: &[u8], method: &[u8]) -> bool {
        self.names
            .get(id)
            .is_some_and(|(s, m)| s.as_bytes() == service && m.as_bytes() == method)
    }

    /// (service, method) names by method index.
    pub fn methods(&self) -> &[(String, String)] {
        &self.names
    }

    /// Service names, sorted.
    pub fn services(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .services
            .keys()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        v.sort();
        v
    }

    /// Wraps every handler so that each call takes a service time drawn from `time`,
    /// spent as `mode` says (for capacity and timeout experiments). A zero time leaves the
    /// registry as it is.
    pub fn with_service_time(mut self, time: ServiceTime, mode: ServiceMode) -> Self {
        if time.is_zero() {
            return self;
        }
        for h in &mut self.handlers {
            *h = Arc::new(Timed {
                inner: h.clone(),
                time,
                mode,
            });
        }
        self
    }
}

/// A handler whose answers wait until `hold()` resolves: a call's answer is made at once
/// but goes out only then. Tests put calls in flight deterministically with it (the answer
/// waits on a gate the test opens), instead of racing a timer.
#[allow(missing_debug_implementations)]
pub struct Held<H, F> {
    /// The handler that makes the answer.
    pub inner: H,
    /// Called once per call; its future resolving lets the answer go.
    pub hold: F,
}

impl<H, F, W> Handler for Held<H, F>
where
    H: Handler,
    F: Fn() -> W + Send + Sync + 'static,
    W: Future<Output = ()> + Send + 'static,
{
    fn call(&self, request: RpcRequest, out: &mut BytesMut) -> Outcome {
        let held = (self.hold)();
        match self.inner.call(request, out) {
            Outcome::Ready(r) | Outcome::At(_, r) => {
                let r = r.map(|()| out.split().freeze());
                Outcome::Later(Box::pin(async move {
                    held.await;
                    r
                }))
            }
            Outcome::Later(f) => Outcome::Later(Box::pin(async move {
                held.await;
                f.await
            })),
        }
    }
}

/// Decodes a handler's request message, naming the type in the error.
pub fn decode<M: prost::Message + Default>(
    payload: Bytes,
    message: &'static str,
) -> Result<M, ServiceError> {
    M::decode(payload).map_err(|source| ServiceError::BadPayload { message, source })
}
