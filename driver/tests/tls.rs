//! Mutual TLS on both hops, end to end on 127.0.0.1: the driver calls through a broker of
//! two cells to a provider, each hop mutual TLS with certificates of one test CA. A driver
//! with a valid certificate gets every call through; one with no certificate, another
//! CA's, or none of TLS at all gets none through, each refusal counted with its reason by the broker; an
//! identity the policy denies is answered "permission denied", by the broker for its own
//! policy and by the provider for the caller's identity the broker forwarded, and the
//! counts add up.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use rpcmesh_broker::{BrokerConfig, CellPlacement, EngineKind, PlacementTuning};
use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::catalogue::{AUTHZ_DENIED_TOTAL, TLS_HANDSHAKE_FAILURES_TOTAL};
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::tls::{
    ClientAuth, ClientTlsSettings, DEFAULT_HANDSHAKE_TIMEOUT, ServerTlsSettings, TlsFiles,
};
use rpcmesh_driver::config::ProgressMode;

use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_driver::{DriverConfig, Report, Stop, WorkloadKind};
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{InProcess, Leaf, Pki};

const PROVIDER_POLICY: &str = r#"
forwarders = ["spiffe://rpcmesh.test/broker/*"]

[[allow]]
callers = ["spiffe://rpcmesh.test/driver/d1"]
calls = ["EchoService.*"]
"#;

/// The broker lets every driver through (the provider decides for d2), no one else.
const BROKER_POLICY: &str = r#"
[[allow]]
callers = ["spiffe://rpcmesh.test/driver/*"]
calls = ["*"]
"#;

struct Mesh {
    dir: PathBuf,
    pki: Pki,
    provider: InProcess<ServeSummary>,
    broker: InProcess<ServeSummary>,
}

fn server_tls(pki: &Pki, leaf: &Leaf) -> ServerTlsSettings {
    let files = pki.issue(leaf);
    ServerTlsSettings {
        files: TlsFiles {
            cert: Some(files.cert),
            key: Some(files.key),
            ca: Some(pki.ca_file.clone()),
        },
        client_auth: ClientAuth::Required,
        handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        max_handshakes: 64,
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

async fn mesh(name: &str) -> Mesh {
    mesh_with(name, |_| {}).await
}

/// As [`mesh`], with the broker's settings changed by `tune`.
async fn mesh_with(name: &str, tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
    mesh_on(name, EngineKind::Tokio, tune).await
}

/// Both engines: the tests of what the loop engine does too run on each.
const ENGINES: [EngineKind; 2] = [EngineKind::Tokio, EngineKind::Loop];

/// As [`mesh_with`], with the broker on `engine`.
async fn mesh_on(name: &str, engine: EngineKind, tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
    let dir = std::env::temp_dir().join(format!(
        "rpcmesh-e2e-tls-{name}-{engine}-{}",
        std::process::id()
    ));
    let pki = Pki::new(&dir, "mesh");
    let provider_config = ProviderConfig {
        tls: Some(server_tls(&pki, &Leaf::spiffe("provider", "p1"))),
        authz_policy: Some(write(&dir, "provider.toml", PROVIDER_POLICY)),
        ..ProviderConfig::default()
    };
    let provider = InProcess::start(|l, t, s| async move {
        rpcmesh_provider::run_with(
            provider_config,
            rpcmesh_provider::Registry::builtin(),
            t,
            l,
            s,
        )
        .await
    })
    .await;
    let tls = server_tls(&pki, &Leaf::spiffe("broker", "b1"));
    let mut broker_config = BrokerConfig {
        upstream_tls: Some(ClientTlsSettings {
            files: tls.files.clone(),
            server_name: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }),
        tls: Some(tls),
        authz_policy: Some(write(&dir, "broker.toml", BROKER_POLICY)),
        // Two cells, both open from the start: each run's connection is dealt to one, in
        // turn, so that handshakes, the policy and TLS towards the provider are each
        // cell's own.
        cells: 2,
        cell_placement: CellPlacement::Spread,
        ..BrokerConfig::with_upstreams([provider.addr.to_string()])
    };
    tune(&mut broker_config);
    let broker = match engine {
        EngineKind::Tokio => {
            InProcess::start(|l, t, s| rpcmesh_broker::run_with(broker_config, t, l, s)).await
        }
        EngineKind::Loop => {
            InProcess::start(|l, t, s| async move {
                let summary = rpcmesh_broker::engine::run(broker_config, t, l, s)
                    .await
                    .unwrap();
                assert_eq!(
                    summary.calls,
                    summary.replied + summary.answered + summary.orphaned,
                    "every call read has one outcome: {summary:?}"
                );
                ServeSummary::default()
            })
            .await
        }
    };
    Mesh {
        dir,
        pki,
        provider,
        broker,
    }
}

impl Mesh {
    /// A driver's TLS as `leaf` (`None`: no certificate), trusting `ca`'s CA file.
    fn driver_tls(&self, issuer: &Pki, leaf: Option<&Leaf>) -> ClientTlsSettings {
        let own = leaf.map(|l| issuer.issue(l));
        ClientTlsSettings {
            files: TlsFiles {
                cert: own.as_ref().map(|f| f.cert.clone()),
                key: own.map(|f| f.key),
                ca: Some(self.pki.ca_file.clone()),
            },
            server_name: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }

    /// A run of `requests` echo calls (one a request) through the broker.
    async fn drive(&self, tls: Option<ClientTlsSettings>, requests: u64) -> Report {
        self.drive_over(tls, requests, 1).await
    }

    /// As [`Mesh::drive`], over `connections` connections.
    async fn drive_over(
        &self,
        tls: Option<ClientTlsSettings>,
        requests: u64,
        connections: usize,
    ) -> Report {
        let config = DriverConfig {
            targets: vec![self.broker.addr.to_string()],
            workload: WorkloadKind::Echo,
            stop: Stop::Requests(requests),
            warmup: Duration::ZERO,
            progress: ProgressMode::Off,
            fanout: 1,
            concurrency: 2 * connections,
            connections,
            call_timeout: Duration::from_secs(3),
            tls,
            ..DriverConfig::default()
        };
        rpcmesh_driver::run_with(config, Telemetry::new(), CancellationToken::new())
            .await
            .unwrap()
    }

    fn refused(&self, reason: &str) -> f64 {
        self.broker
            .metric(TLS_HANDSHAKE_FAILURES_TOTAL.name, &[("reason", reason)])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_with_a_valid_certificate_gets_every_call_through_mtls_on_both_hops() {
    for engine in ENGINES {
        let m = mesh_on("ok", engine, |_| {}).await;
        let tls = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
        let r = m.drive(Some(tls), 200).await;
        assert_eq!(
            (r.calls.sent, r.calls.ok),
            (200, 200),
            "{:?}",
            r.calls.errors
        );
        let denied = m.provider.metric(AUTHZ_DENIED_TOTAL.name, &[]);
        assert_eq!(denied, 0.0);
        let _ = std::fs::remove_dir_all(&m.dir);
    }
}

/// A TLS connection moves between the broker's cells with its session whole: with a
/// placement tuned to try a second cell at once and undo every trial, the run's
/// connections move to the second cell and back under load, and every call gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_move_between_cells_under_load_and_lose_no_call() {
    let m = mesh_with("moves", |c| {
        c.cell_placement = CellPlacement::Gather;
        c.placement_tuning = PlacementTuning {
            review: Duration::from_millis(20),
            spread_busy_pct: 0,
            spread_gain_pct: u32::MAX,
            steady_reviews: 0,
            ..PlacementTuning::default()
        };
    })
    .await;
    let tls = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    let moves = || m.broker.metric("rpcmesh_cell_moves_total", &[]);
    // Runs until connections have moved out and back during one (bounded: 20 runs).
    for run in 0.. {
        let r = m.drive_over(Some(tls.clone()), 2_000, 4).await;
        assert_eq!(
            (r.calls.sent, r.calls.ok),
            (2_000, 2_000),
            "run {run}: {:?}",
            r.calls.errors
        );
        if moves() >= 4.0 || run == 20 {
            break;
        }
    }
    assert!(
        moves() >= 4.0,
        "connections moved out and back: {}",
        moves()
    );
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_identity_gets_permission_denied_and_the_counts_add_up() {
    for engine in ENGINES {
        let m = mesh_on("denied", engine, |_| {}).await;
        // d2 passes the broker's policy; the provider, which believes the broker's word for
        // its caller, denies it.
        let d2 = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d2")));
        let r = m.drive(Some(d2), 50).await;
        assert_eq!(r.calls.ok, 0);
        assert_eq!(
            r.calls.errors.get("permission_denied"),
            Some(&50),
            "{:?}",
            r.calls.errors
        );
        let by_provider = m.provider.metric(
            AUTHZ_DENIED_TOTAL.name,
            &[("service", "EchoService"), ("method", "Echo")],
        );
        assert_eq!(by_provider, 50.0, "the provider counted each");
        // An identity the broker's own policy does not name never reaches the provider.
        let ops = m.driver_tls(&m.pki, Some(&Leaf::spiffe("ops", "o1")));
        let r = m.drive(Some(ops), 30).await;
        assert_eq!(
            r.calls.errors.get("permission_denied"),
            Some(&30),
            "{:?}",
            r.calls.errors
        );
        assert_eq!(m.broker.metric(AUTHZ_DENIED_TOTAL.name, &[]), 30.0);
        assert_eq!(m.provider.metric(AUTHZ_DENIED_TOTAL.name, &[]), 50.0);
        let _ = std::fs::remove_dir_all(&m.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_certificate_another_cas_or_plaintext_gets_no_call_through_each_counted() {
    for engine in ENGINES {
        let m = mesh_on("refused", engine, |_| {}).await;
        let other = Pki::new(&m.dir.join("other"), "other");
        let cases = [
            (Some(m.driver_tls(&m.pki, None)), "no_certificate"),
            (
                Some(m.driver_tls(&other, Some(&Leaf::spiffe("driver", "d1")))),
                "unknown_ca",
            ),
            (None, "not_tls"),
        ];
        for (tls, reason) in cases {
            let r = m.drive(tls, 3).await;
            assert_eq!(r.calls.ok, 0, "{reason}: {:?}", r.calls.errors);
            assert!(m.refused(reason) >= 1.0, "{reason} was not counted");
        }
        // And the valid driver still gets through afterwards.
        let tls = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
        assert_eq!(m.drive(Some(tls), 20).await.calls.ok, 20);
        let _ = std::fs::remove_dir_all(&m.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_is_read_again_when_it_changes_and_a_bad_file_is_kept_out() {
    let m = mesh("reload").await;
    let d2 = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d2")));
    let r = m.drive(Some(d2.clone()), 10).await;
    assert_eq!(r.calls.errors.get("permission_denied"), Some(&10));
    let reloads = |result: &str| {
        m.provider.metric(
            rpcmesh_common::metrics::catalogue::FILE_RELOADS_TOTAL.name,
            &[("file", "policy"), ("result", result)],
        )
    };
    // d2 is let in: the provider sees the file change and reads it.
    write(
        &m.dir,
        "provider.toml",
        &PROVIDER_POLICY.replace("driver/d1", "driver/d*"),
    );
    rpcmesh_testkit::wait_until("the new policy to be read", || reloads("ok") >= 1.0).await;
    assert_eq!(m.drive(Some(d2.clone()), 10).await.calls.ok, 10);
    // A file that does not parse is kept out: the policy before stays in force.
    write(&m.dir, "provider.toml", "[[allow]]\ncallers = [\n");
    rpcmesh_testkit::wait_until("the bad policy to be refused", || reloads("error") >= 1.0).await;
    assert_eq!(m.drive(Some(d2), 10).await.calls.ok, 10);
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_address_beside_tls_serves_callers_without_tls_as_anonymous() {
    let dir = std::env::temp_dir().join(format!("rpcmesh-e2e-tls-plain-{}", std::process::id()));
    let pki = Pki::new(&dir, "mesh");
    // The provider lets anonymous callers make echo calls only.
    let policy = "[[allow]]\ncallers = [\"anonymous\"]\ncalls = [\"EchoService.Echo\"]\n";
    let config = ProviderConfig {
        tls: Some(server_tls(&pki, &Leaf::spiffe("provider", "p1"))),
        authz_policy: Some(write(&dir, "policy.toml", policy)),
        ..ProviderConfig::default()
    };
    let main = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (tls_addr, plain_addr) = (main.local_addr().unwrap(), plain.local_addr().unwrap());
    let telemetry = Telemetry::new();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let listeners = rpcmesh_common::net::listener::Listeners {
        main,
        plain: Some(plain),
    };
    let server = tokio::spawn(rpcmesh_provider::run_with(
        config,
        rpcmesh_provider::Registry::builtin(),
        telemetry.clone(),
        listeners,
        async move { s.cancelled().await },
    ));
    let drive = |target: std::net::SocketAddr, workload| {
        let config = DriverConfig {
            targets: vec![target.to_string()],
            workload,
            stop: Stop::Requests(10),
            warmup: Duration::ZERO,
            progress: ProgressMode::Off,
            fanout: 1,
            concurrency: 1,
            connections: 1,
            call_timeout: Duration::from_secs(3),
            ..DriverConfig::default()
        };
        rpcmesh_driver::run_with(config, Telemetry::new(), CancellationToken::new())
    };
    let r = drive(plain_addr, WorkloadKind::Echo).await.unwrap();
    assert_eq!(
        r.calls.ok, 10,
        "plain v1 on the plain address: {:?}",
        r.calls.errors
    );
    let r = drive(plain_addr, WorkloadKind::Platform).await.unwrap();
    assert_eq!(
        r.calls.errors.get("permission_denied"),
        Some(&10),
        "{:?}",
        r.calls.errors
    );
    let r = drive(tls_addr, WorkloadKind::Echo).await.unwrap();
    assert_eq!(r.calls.ok, 0, "plaintext to the TLS address");
    let refused = rpcmesh_common::metrics::recorder::sample(
        &telemetry.render(),
        TLS_HANDSHAKE_FAILURES_TOTAL.name,
        &[("reason", "not_tls")],
    );
    assert!(refused.unwrap_or(0.0) >= 1.0);
    stop.cancel();
    server.await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_handshakes_beside_a_run_cost_it_no_call() {
    use tokio::io::AsyncWriteExt;
    let m = mesh("hostile").await;
    // Ten clients that open a TLS handshake and fall silent, holding ten of the broker's
    // 64 handshake slots, and fifty that send plaintext to its TLS port.
    let mut silent = Vec::new();
    for _ in 0..10 {
        let mut s = tokio::net::TcpStream::connect(m.broker.addr).await.unwrap();
        s.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
            .await
            .unwrap();
        silent.push(s);
    }
    let flood = {
        let addr = m.broker.addr;
        tokio::spawn(async move {
            for i in 0..50u64 {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                let _ = s.write_all(&rpcmesh_testkit::echo_request(i, "x")).await;
                let _ = tokio::io::AsyncReadExt::read(&mut s, &mut [0; 64]).await;
            }
        })
    };
    let tls = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    let r = m.drive(Some(tls), 300).await;
    flood.await.unwrap();
    assert_eq!(
        (r.calls.sent, r.calls.ok),
        (300, 300),
        "{:?}",
        r.calls.errors
    );
    rpcmesh_testkit::wait_until("the plaintext flood to be counted", || {
        m.refused("not_tls") >= 50.0
    })
    .await;
    drop(silent);
    rpcmesh_testkit::wait_until("the silent clients' leaving to be counted", || {
        m.refused("eof") >= 10.0
    })
    .await;
    let _ = std::fs::remove_dir_all(&m.dir);
}

/// The loop engine (`--engine loop`, two workers dealt connections in turn) serving mutual
/// TLS to its callers, plaintext to a provider: each handshake on a worker's loop. A driver with a valid certificate gets every call
/// through; one its policy does not name is answered "permission denied" by identity, as
/// is a plaintext caller on the plain address beside TLS (anonymous);
/// one without a certificate, another CA's, plaintext, or silent past the handshake
/// timeout gets nothing through, each refusal counted with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_engine_serves_mtls_callers_by_their_identity() {
    let dir = std::env::temp_dir().join(format!("rpcmesh-e2e-tls-loop-{}", std::process::id()));
    let pki = Pki::new(&dir, "mesh");
    let provider = InProcess::start(|l, t, s| async move {
        rpcmesh_provider::run_with(
            ProviderConfig::default(),
            rpcmesh_provider::Registry::builtin(),
            t,
            l,
            s,
        )
        .await
    })
    .await;
    let mut tls = server_tls(&pki, &Leaf::spiffe("broker", "b1"));
    tls.handshake_timeout = Duration::from_millis(300);
    let config = BrokerConfig {
        tls: Some(tls),
        authz_policy: Some(write(&dir, "broker.toml", BROKER_POLICY)),
        cells: 2,
        cell_placement: CellPlacement::Spread,
        ..BrokerConfig::with_upstreams([provider.addr.to_string()])
    };
    // A plain address beside TLS (`--listen-plain`): its callers are anonymous.
    let plain = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let plain_addr = plain.local_addr().unwrap();
    let broker = InProcess::start(|l, t, s| async move {
        plain.set_nonblocking(true).unwrap();
        let listeners = rpcmesh_common::net::listener::Listeners {
            main: l,
            plain: Some(tokio::net::TcpListener::from_std(plain).unwrap()),
        };
        let summary = rpcmesh_broker::engine::run(config, t, listeners, s)
            .await
            .unwrap();
        assert_eq!(
            summary.calls,
            summary.replied + summary.answered + summary.orphaned,
            "every call read has one outcome: {summary:?}"
        );
        ServeSummary::default()
    })
    .await;
    let m = Mesh {
        dir,
        pki,
        provider,
        broker,
    };
    let d1 = m.driver_tls(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    let r = m.drive_over(Some(d1.clone()), 40, 2).await;
    assert_eq!(r.calls.ok, 40, "{:?}", r.calls.errors);
    // Calls larger than a TLS record and than rustls's buffers, both ways.
    let large = DriverConfig {
        targets: vec![m.broker.addr.to_string()],
        workload: WorkloadKind::Echo,
        payload_size: 300_000,
        stop: Stop::Requests(6),
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        fanout: 1,
        concurrency: 3,
        connections: 1,
        call_timeout: Duration::from_secs(5),
        tls: Some(d1.clone()),
        ..DriverConfig::default()
    };
    let r = rpcmesh_driver::run_with(large, Telemetry::new(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.calls.ok, 6, "{:?}", r.calls.errors);
    // An identity the broker's policy does not name.
    let stranger = m.driver_tls(&m.pki, Some(&Leaf::spiffe("other", "x")));
    let r = m.drive(Some(stranger), 5).await;
    assert_eq!(r.calls.errors.get("permission_denied"), Some(&5));
    assert_eq!(m.broker.metric(AUTHZ_DENIED_TOTAL.name, &[]), 5.0);
    let other = Pki::new(&m.dir.join("other"), "other");
    let cases = [
        (Some(m.driver_tls(&m.pki, None)), "no_certificate"),
        (
            Some(m.driver_tls(&other, Some(&Leaf::spiffe("driver", "d1")))),
            "unknown_ca",
        ),
        (None, "not_tls"),
    ];
    for (tls, reason) in cases {
        let r = m.drive(tls, 3).await;
        assert_eq!(r.calls.ok, 0, "{reason}: {:?}", r.calls.errors);
        assert!(m.refused(reason) >= 1.0, "{reason} was not counted");
    }
    // The plain address serves plaintext callers, as anonymous: the policy names none.
    let plain_run = DriverConfig {
        targets: vec![plain_addr.to_string()],
        workload: WorkloadKind::Echo,
        stop: Stop::Requests(4),
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        fanout: 1,
        concurrency: 1,
        connections: 1,
        call_timeout: Duration::from_secs(3),
        ..DriverConfig::default()
    };
    let r = rpcmesh_driver::run_with(plain_run, Telemetry::new(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(
        r.calls.errors.get("permission_denied"),
        Some(&4),
        "{:?}",
        r.calls.errors
    );
    // A client that connects and says nothing is refused at the handshake timeout.
    let silent = tokio::net::TcpStream::connect(m.broker.addr).await.unwrap();
    rpcmesh_testkit::wait_until("the silent handshake to time out", || {
        m.refused("timeout") >= 1.0
    })
    .await;
    drop(silent);
    // And the valid driver still gets through afterwards.
    assert_eq!(m.drive(Some(d1), 20).await.calls.ok, 20);
    let ok = m.broker.metric(
        rpcmesh_common::metrics::catalogue::CALLS_TOTAL.name,
        &[("status", "ok")],
    );
    assert!(ok >= 66.0, "{ok}");
    let _ = std::fs::remove_dir_all(&m.dir);
}
