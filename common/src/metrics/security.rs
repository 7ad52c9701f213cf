//! The handles of what TLS and authorization do: handshakes made and refused
//! ([`TlsCounters`], the observer of `net::tls`), the certificates' expiry, calls the
//! policy denied ([`DeniedCounters`]) and the files read again ([`FileReloads`]).

use std::sync::Arc;

use metrics::{Counter, Gauge};

use crate::metrics::Telemetry;
use crate::metrics::catalogue::{
    AUTHZ_DENIED_TOTAL, FILE_RELOADS_TOTAL, Role, TLS_CERT_EXPIRY_TIMESTAMP_SECONDS,
    TLS_HANDSHAKE_FAILURES_TOTAL, TLS_HANDSHAKES_TOTAL,
};
use crate::net::tls::{CertKind, Refusal, TlsObserver};

/// `rpcmesh_tls_handshakes_total`, `rpcmesh_tls_handshake_failures_total` and the expiry
/// gauges of one side of a program.
pub struct TlsCounters {
    telemetry: Telemetry,
    role: Role,
    done: Counter,
    /// By [`Refusal::index`].
    failed: [Counter; Refusal::ALL.len()],
}

impl std::fmt::Debug for TlsCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCounters")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl TlsCounters {
    /// The counters of `role`'s handshakes on `side` (`inbound`, `upstream`, `outbound`).
    /// The expiry gauges appear once files are read (only a program with TLS has them).
    pub fn new(t: &Telemetry, role: Role, side: &'static str) -> Arc<TlsCounters> {
        let l = [("role", role.label()), ("side", side)];
        Arc::new(TlsCounters {
            telemetry: t.clone(),
            role,
            done: t.counter(&TLS_HANDSHAKES_TOTAL, &l),
            failed: Refusal::ALL.map(|r| {
                t.counter(
                    &TLS_HANDSHAKE_FAILURES_TOTAL,
                    &[l[0], l[1], ("reason", r.label())],
                )
            }),
        })
    }

    /// The expiry gauge of `kind`'s certificate.
    fn expiry_gauge(&self, kind: CertKind) -> Gauge {
        self.telemetry.gauge(
            &TLS_CERT_EXPIRY_TIMESTAMP_SECONDS,
            &[("role", self.role.label()), ("cert", kind.label())],
        )
    }
}

impl TlsObserver for TlsCounters {
    fn handshake_done(&self) {
        self.done.increment(1);
    }
    fn handshake_failed(&self, reason: Refusal) {
        self.failed[reason.index()].increment(1);
    }
    fn expires(&self, kind: CertKind, unix_seconds: i64) {
        self.expiry_gauge(kind).set(unix_seconds as f64);
    }
}

/// `rpcmesh_authz_denied_total{role, service, method}`: one counter per known method,
/// registered when first denied, and `_other`.
#[derive(Clone, Debug)]
pub struct DeniedCounters {
    telemetry: Telemetry,
    role: Role,
    other: Counter,
}

impl DeniedCounters {
    /// The counters of `role` (the `_other` series registered now, so the family shows).
    pub fn new(t: &Telemetry, role: Role) -> Self {
        DeniedCounters {
            other: t.counter(
                &AUTHZ_DENIED_TOTAL,
                &[
                    ("role", role.label()),
                    ("service", "_other"),
                    ("method", "_other"),
                ],
            ),
            telemetry: t.clone(),
            role,
        }
    }

    /// Counts a denied call of `service.method`, labelled with the names only when the
    /// caller says they are known (else `_other`: names a caller invents must not make
    /// series).
    pub fn deny(&self, known: Option<(&str, &str)>) {
        match known {
            Some((service, method)) => self
                .telemetry
                .counter(
                    &AUTHZ_DENIED_TOTAL,
                    &[
                        ("role", self.role.label()),
                        ("service", service),
                        ("method", method),
                    ],
                )
                .increment(1),
            None => self.other.increment(1),
        }
    }
}

/// `rpcmesh_file_reloads_total{role, file, result}` of one file.
#[derive(Clone, Debug)]
pub struct FileReloads {
    ok: Counter,
    error: Counter,
}

impl FileReloads {
    /// The counters of `role`'s `file` (`tls`, `policy`).
    pub fn new(t: &Telemetry, role: Role, file: &'static str) -> Self {
        let c = |result| {
            t.counter(
                &FILE_RELOADS_TOTAL,
                &[("role", role.label()), ("file", file), ("result", result)],
            )
        };
        FileReloads {
            ok: c("ok"),
            error: c("error"),
        }
    }

    /// Counts a read: in force (`true`) or kept out.
    pub fn read(&self, ok: bool) {
        if ok {
            self.ok.increment(1);
        } else {
            self.error.increment(1);
        }
    }
}
