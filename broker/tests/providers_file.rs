//! The broker's providers file (`--providers-file`), with the broker as a real process
//! (its SIGHUP, its log): a provider added to the file takes calls, by SIGHUP and by the
//! change alone, once its connections are ready; a change made while the broker waits
//! for its providers at the start is applied; one removed takes no new call and finishes the one it holds before its
//! connections close; a bad file is kept out with a log line naming the file and the
//! line, and the providers stay as they were; and a provider stopped by SIGTERM under load
//! beside a healthy one costs the callers nothing (the calls it refused `NOT_RUN` go to
//! the other), then takes calls again once restarted on the same port. Every test runs on
//! both engines (`--engine`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rpcmesh_common::metrics::catalogue::{
    CALLS_REROUTED_TOTAL, CALLS_TOTAL, CONFIG_RELOADS_TOTAL, CONNECTIONS_OPEN, UPSTREAM_CALLS_TOTAL,
};
use rpcmesh_common::net::client::Client;
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{self as testkit, ChildGuard, Gate, Launch, Spawned, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use support::*;

/// A fresh directory for one test's files.
fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rpcmesh-pfile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces the file as Ansible and editors do: a new file renamed over the old one.
fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Rewrites the file in place with text of the same length and puts its modification
/// time back: its stamp is unchanged, so only a SIGHUP can make the broker read it.
fn rewrite_unseen(path: &Path, text: &str) {
    let before = std::fs::metadata(path).unwrap();
    assert_eq!(before.len(), text.len() as u64, "same length");
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
}

/// The broker's engines (`--engine`): every test here runs on both.
const ENGINES: [&str; 2] = ["tokio", "loop"];

/// The broker on `engine` as a process serving the providers of `file`, with
/// test-friendly health checks, its log written to `log`.
fn broker_process(engine: &str, file: &Path, log: &Path) -> Spawned {
    broker_process_with(engine, file, log, "500ms")
}

/// As [`broker_process`], with `health_timeout` for one heartbeat.
fn broker_process_with(engine: &str, file: &Path, log: &Path, health_timeout: &str) -> Spawned {
    broker_process_on(engine, file, log, health_timeout, "1")
}

/// As [`broker_process_with`], on `threads` threads (cells, or the loop engine's workers),
/// each dealt connections from the start.
fn broker_process_on(
    engine: &str,
    file: &Path,
    log: &Path,
    health_timeout: &str,
    threads: &str,
) -> Spawned {
    Spawned::start_with(
        "broker",
        &[
            "--engine",
            engine,
            "--providers-file",
            file.to_str().unwrap(),
            "--health-interval",
            "100ms",
            "--connect-timeout",
            "500ms",
            "--health-timeout",
            health_timeout,
            "--threads",
            threads,
            // Every cell serves connections from the start (a gathering broker would keep
            // a light load on one).
            "--cell-placement",
            "spread",
            "--busy-poll",
            "off",
        ],
        Launch {
            stderr: Some(log),
            ..Launch::default()
        },
    )
}

fn reloads(b: &Spawned, result: &str) -> f64 {
    b.metric(CONFIG_RELOADS_TOTAL.name, &[("result", result)])
}

/// Calls of the broker's provider `addr` that it answered `ok`.
fn upstream_ok(b: &Spawned, addr: SocketAddr) -> f64 {
    b.metric(
        UPSTREAM_CALLS_TOTAL.name,
        &[("upstream", &addr.to_string()), ("status", "ok")],
    )
}

async fn echo_ok(c: &Client, message: &str) {
    let r = c
        .call(
            "EchoService",
            "Echo",
            &EchoRequest {
                message: message.into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success, "{}", r.error_msg);
    assert_eq!(r.decode::<EchoResponse>().unwrap().message, message);
}

/// Makes echo calls until `provider` has answered one more, at most [`MAX_PROBES`].
async fn until_served_by(c: &Client, provider: &Running) {
    let before = provider.calls("ok");
    for i in 0..MAX_PROBES {
        echo_ok(c, &format!("probe {i}")).await;
        if provider.calls("ok") > before {
            return;
        }
        tokio::time::sleep(testkit::WAIT_POLL).await;
    }
    panic!("{} took no call in {MAX_PROBES} calls", provider.addr);
}

/// Calls made while waiting for a provider to be routed to: with two providers each call
/// has even odds, so 3,000 (30 s of polling) only fail when the provider is not served.
const MAX_PROBES: usize = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_added_to_the_file_takes_calls_after_a_sighup_and_after_a_change_alone() {
    for engine in ENGINES {
        a_provider_added_to_the_file_takes_calls_after_a_sighup_and_after_a_change_alone_on(engine)
            .await;
    }
}

/// [`a_provider_added_to_the_file_takes_calls_after_a_sighup_and_after_a_change_alone`] on `engine`.
async fn a_provider_added_to_the_file_takes_calls_after_a_sighup_and_after_a_change_alone_on(
    engine: &str,
) {
    let dir = test_dir(&format!("join-{engine}"));
    let (pa, pb, pc) = (
        provider(ProviderConfig::default()).await,
        provider(ProviderConfig::default()).await,
        provider(ProviderConfig::default()).await,
    );
    let file = dir.join("providers");
    let b_line = pb.addr.to_string();
    // A comment as long as B's line, for B to take its place unseen.
    let pad = format!("#{}", "x".repeat(b_line.len() - 1));
    std::fs::write(&file, format!("{}\n{pad}\n", pa.addr)).unwrap();
    let b = broker_process(engine, &file, &dir.join("broker.log"));
    let c = client(b.rpc).await;
    until_ready(&c).await;
    for i in 0..20 {
        echo_ok(&c, &format!("a{i}")).await;
    }
    assert_eq!(pb.calls("ok"), 0.0, "B is not in the file yet");

    // B replaces the comment; the file's stamp does not change, so the SIGHUP is what
    // makes the broker read it.
    rewrite_unseen(&file, &format!("{}\n{b_line}\n", pa.addr));
    b.child.signal(testkit::Signal::HUP);
    wait_until("the SIGHUP's read to be applied", || {
        reloads(&b, "ok") >= 1.0
    })
    .await;
    until_served_by(&c, &pb).await;

    // C joins by the change of the file alone.
    replace_file(&file, &format!("{}\n{b_line}\n{}\n", pa.addr, pc.addr));
    wait_until("the changed file to be applied", || {
        reloads(&b, "ok") >= 2.0
    })
    .await;
    until_served_by(&c, &pc).await;
    assert_eq!(reloads(&b, "error"), 0.0);
    // A, listed all along, kept its pool: the broker made no connection to it since.
    let a_conns = pa.metric(CONNECTIONS_OPEN.name, &[("side", "inbound")]);
    assert_eq!(
        a_conns,
        f64::from(rpcmesh_broker::config::DEFAULT_POOL_SIZE)
    );
    let a_opened = pa.metric("rpcmesh_connections_opened_total", &[("side", "inbound")]);
    assert_eq!(a_opened, a_conns, "A's connections were not remade");

    drop(b);
    for p in [pa, pb, pc] {
        p.stop().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A provider that joins is offered calls once its first connections are ready: until
/// then the read is not applied (the broker goes on with the providers it had), so a call
/// to a service only the newcomer serves is answered "service not found", then served,
/// and never "unavailable" because the newcomer's pool was still connecting. The newcomer
/// here answers nothing, heartbeats included, until the test sends it a request of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_joins_is_offered_calls_once_its_connections_are_ready() {
    for engine in ENGINES {
        a_provider_that_joins_is_offered_calls_once_its_connections_are_ready_on(engine).await;
    }
}

/// [`a_provider_that_joins_is_offered_calls_once_its_connections_are_ready`] on `engine`.
async fn a_provider_that_joins_is_offered_calls_once_its_connections_are_ready_on(engine: &str) {
    let dir = test_dir(&format!("join-ready-{engine}"));
    let pa = provider(ProviderConfig::default()).await;
    let newcomer = V1Server::start(true).await;
    newcomer.hold_replies_until(1);
    let file = dir.join("providers");
    std::fs::write(&file, format!("EchoService={}\n", pa.addr)).unwrap();
    // Heartbeats may wait long: the newcomer's pool settles when the test lets it answer.
    let b = broker_process_with(engine, &file, &dir.join("broker.log"), "30s");
    let c = client(b.rpc).await;
    until_ready(&c).await;
    let other = || async {
        c.call(
            "OtherService",
            "Echo",
            &EchoRequest {
                message: "to the newcomer".into(),
            },
        )
        .await
        .unwrap()
    };
    let r = other().await;
    assert_eq!(r.error_msg, "service not found: OtherService");

    let text = format!("EchoService={}\nOtherService={}\n", pa.addr, newcomer.addr);
    replace_file(&file, &text);
    b.child.signal(testkit::Signal::HUP);
    // The read has found the newcomer once the newcomer's pool has connected and asked
    // for a heartbeat (which the newcomer holds); a broker that published it before its
    // connections were ready answers "unavailable" now.
    wait_until("the newcomer's pool to ask for a heartbeat", || {
        newcomer.heartbeats() >= 1
    })
    .await;
    let r = other().await;
    assert_ne!(r.status, Status::Unavailable, "{}", r.error_msg);
    assert_eq!(r.error_msg, "service not found: OtherService");
    assert_eq!(
        reloads(&b, "ok"),
        0.0,
        "applied before the newcomer settled"
    );

    // The test's own request lets the newcomer answer its heartbeats.
    newcomer.release().await;
    wait_until("the read to be applied", || reloads(&b, "ok") >= 1.0).await;
    let r = other().await;
    assert_eq!(r.status, Status::Success, "{}", r.error_msg);
    assert_eq!(
        r.decode::<EchoResponse>().unwrap().message,
        "to the newcomer"
    );

    drop(b);
    pa.stop().await;
    newcomer.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A change of the file made while the broker waits, at its start, for its providers'
/// first connections is applied once it serves (the file's text read at the start is
/// what the first look compares with, not the file as it is when the wait ends). The held
/// provider answers nothing until the test sends it a request of its own, so the change
/// falls inside the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_the_file_during_the_start_is_applied() {
    for engine in ENGINES {
        a_change_of_the_file_during_the_start_is_applied_on(engine).await;
    }
}

/// [`a_change_of_the_file_during_the_start_is_applied`] on `engine`.
async fn a_change_of_the_file_during_the_start_is_applied_on(engine: &str) {
    let dir = test_dir(&format!("start-change-{engine}"));
    let (pa, pc) = (
        provider(ProviderConfig::default()).await,
        provider(ProviderConfig::default()).await,
    );
    let held = V1Server::start(true).await;
    held.hold_replies_until(1);
    let file = dir.join("providers");
    std::fs::write(
        &file,
        format!("EchoService={}\nHeldService={}\n", pa.addr, held.addr),
    )
    .unwrap();
    let b = broker_process_with(engine, &file, &dir.join("broker.log"), "30s");
    // The broker has read the file (its pools connect) and waits for the held provider.
    wait_until("the broker to connect to the held provider", || {
        !held.counts().is_empty()
    })
    .await;
    replace_file(
        &file,
        &format!(
            "EchoService={}\nHeldService={}\nPlatformService={}\n",
            pa.addr, held.addr, pc.addr
        ),
    );
    held.release().await;
    let c = client(b.rpc).await;
    until_ready(&c).await;
    testkit::wait_for("PlatformService to be served", || async {
        let r = c
            .call(
                "PlatformService",
                "doQuery",
                &rpcmesh_wire::proto::platform::reference_query(),
            )
            .await
            .unwrap();
        (r.status == Status::Success).then_some(())
    })
    .await;
    assert_eq!(pc.calls("ok"), 1.0);

    drop(b);
    for p in [pa, pc] {
        p.stop().await;
    }
    held.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_removed_from_the_file_takes_no_new_call_and_finishes_the_one_it_holds() {
    for engine in ENGINES {
        a_provider_removed_from_the_file_takes_no_new_call_and_finishes_the_one_it_holds_on(engine)
            .await;
    }
}

/// [`a_provider_removed_from_the_file_takes_no_new_call_and_finishes_the_one_it_holds`] on `engine`.
async fn a_provider_removed_from_the_file_takes_no_new_call_and_finishes_the_one_it_holds_on(
    engine: &str,
) {
    let dir = test_dir(&format!("leave-{engine}"));
    let gate = Gate::new();
    let held = held_provider(&gate).await;
    let other = provider(ProviderConfig::default()).await;
    let file = dir.join("providers");
    let log = dir.join("broker.log");
    std::fs::write(
        &file,
        format!(
            "{HELD_SERVICE},EchoService={}\nEchoService={}\n",
            held.addr, other.addr
        ),
    )
    .unwrap();
    let b = broker_process(engine, &file, &log);
    let c = client(b.rpc).await;
    until_ready(&c).await;
    until_served_by(&c, &held).await;

    let call = held_call(&c, "held through the leave");
    wait_until("the held call to reach its provider", || {
        gate.arrived() == 1
    })
    .await;
    replace_file(&file, &format!("EchoService={}\n", other.addr));
    wait_until("the smaller file to be applied", || {
        reloads(&b, "ok") >= 1.0
    })
    .await;

    let held_before = held.calls("ok");
    for i in 0..50 {
        echo_ok(&c, &format!("after {i}")).await;
    }
    assert_eq!(
        held.calls("ok"),
        held_before,
        "no new call went to the provider that left"
    );
    let r = c
        .call(
            HELD_SERVICE,
            "Echo",
            &EchoRequest {
                message: "late".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(r.error_msg, format!("service not found: {HELD_SERVICE}"));
    assert_eq!(gate.arrived(), 1, "the late call did not reach it");

    // Its connections stay open for the call they carry, and the broker still exports
    // its series (the draining pool)...
    let open = || held.metric(CONNECTIONS_OPEN.name, &[("side", "inbound")]);
    assert!(open() >= 1.0);
    let its_label = format!("upstream=\"{}\"", held.addr);
    let exported = |label: &str| b.scrape().lines().any(|l| l.contains(label));
    assert!(exported(&its_label), "{}", b.scrape());
    gate.open();
    let r = call.await.unwrap().unwrap();
    assert_eq!(r.status, Status::Success, "{}", r.error_msg);
    assert_eq!(
        r.decode::<EchoResponse>().unwrap().message,
        "held through the leave"
    );
    // ...and close once it is answered.
    wait_until("the connections to the provider that left to close", || {
        open() == 0.0
    })
    .await;
    wait_until("the broker to log the provider gone", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("provider gone"))
    })
    .await;
    // ...and, once they are closed, no series of it is exported (its pool gauges would
    // read zero healthy connections for ever and fire RpcmeshPoolUnhealthy), while the
    // provider that stays keeps all of its own.
    wait_until("the series of the provider that left to go", || {
        !exported(&its_label)
    })
    .await;
    let others = format!("upstream=\"{}\"", other.addr);
    assert!(exported(&others), "{}", b.scrape());
    assert!(upstream_ok(&b, other.addr) >= 50.0);

    drop(b);
    held.stop().await;
    other.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_providers_file_is_kept_out_with_its_line_logged_and_the_providers_stay() {
    for engine in ENGINES {
        a_bad_providers_file_is_kept_out_with_its_line_logged_and_the_providers_stay_on(engine)
            .await;
    }
}

/// [`a_bad_providers_file_is_kept_out_with_its_line_logged_and_the_providers_stay`] on `engine`.
async fn a_bad_providers_file_is_kept_out_with_its_line_logged_and_the_providers_stay_on(
    engine: &str,
) {
    let dir = test_dir(&format!("bad-{engine}"));
    let (pa, pb) = (
        provider(ProviderConfig::default()).await,
        provider(ProviderConfig::default()).await,
    );
    let file = dir.join("providers");
    let log = dir.join("broker.log");
    std::fs::write(&file, format!("{}\n", pa.addr)).unwrap();
    let b = broker_process(engine, &file, &log);
    let c = client(b.rpc).await;
    until_ready(&c).await;

    replace_file(
        &file,
        &format!("{}\nnot an address\n{}\n", pa.addr, pb.addr),
    );
    wait_until("the bad file to be kept out", || {
        reloads(&b, "error") >= 1.0
    })
    .await;
    let expected = format!(
        "providers file {}: line 2: \"not an address\": \"not an address\" has no port: write HOST:PORT; the form is",
        file.display()
    );
    // Logs are written by a thread of their own: the line follows the count.
    let logged_line = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .find(|l| l.contains(&expected))
            .map(str::to_string)
    };
    wait_until("the log line naming the bad line", || {
        logged_line().is_some()
    })
    .await;
    let line = logged_line().unwrap();
    assert!(
        line.contains("ERROR") && line.contains("kept out"),
        "{line}"
    );
    // The previous providers stay: A serves, B (on the bad file's third line) does not.
    for i in 0..30 {
        echo_ok(&c, &format!("kept {i}")).await;
    }
    assert_eq!(pb.calls("ok"), 0.0);
    // A SIGHUP reads it again, and keeps it out again.
    b.child.signal(testkit::Signal::HUP);
    wait_until("the SIGHUP's read to be kept out", || {
        reloads(&b, "error") >= 2.0
    })
    .await;
    assert_eq!(reloads(&b, "ok"), 0.0);

    // Fixed, it is applied.
    replace_file(&file, &format!("{}\n{}\n", pa.addr, pb.addr));
    wait_until("the fixed file to be applied", || reloads(&b, "ok") >= 1.0).await;
    until_served_by(&c, &pb).await;

    drop(b);
    pa.stop().await;
    pb.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Calls at most, in each load phase of the drain test: a hang detector for the loop.
const MAX_LOAD_CALLS: usize = 100_000;
/// Callers making calls one after the other during the drain test.
const LOAD_WORKERS: usize = 8;

/// Echo calls from [`LOAD_WORKERS`] callers until `stop` (at most [`MAX_LOAD_CALLS`]):
/// how many were made, and what every call that did not succeed got.
fn load(c: &Client, stop: &Arc<AtomicBool>) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    let (c, stop) = (c.clone(), stop.clone());
    tokio::spawn(async move {
        let issued = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..LOAD_WORKERS)
            .map(|w| {
                let (c, stop, issued) = (c.clone(), stop.clone(), issued.clone());
                tokio::spawn(async move {
                    let mut bad = Vec::new();
                    while !stop.load(Ordering::Relaxed)
                        && issued.fetch_add(1, Ordering::Relaxed) < MAX_LOAD_CALLS
                    {
                        let message = format!("w{w}");
                        match c
                            .call(
                                "EchoService",
                                "Echo",
                                &EchoRequest {
                                    message: message.clone(),
                                },
                            )
                            .await
                        {
                            Ok(r)
                                if r.status == Status::Success
                                    && r.decode::<EchoResponse>()
                                        .is_ok_and(|e| e.message == message) => {}
                            Ok(r) => bad.push(format!("{:?}: {}", r.status, r.error_msg)),
                            Err(e) => bad.push(e.to_string()),
                        }
                    }
                    bad
                })
            })
            .collect();
        let mut bad = Vec::new();
        for w in workers {
            bad.extend(w.await.unwrap());
        }
        let made = issued.load(Ordering::Relaxed).min(MAX_LOAD_CALLS);
        (made, bad)
    })
}

fn spawn_provider(addr: SocketAddr) -> ChildGuard {
    let listen = addr.to_string();
    ChildGuard::spawn(
        &testkit::bin_path("provider"),
        &[
            "--listen",
            &listen,
            "--metrics-listen",
            "off",
            "--threads",
            "1",
        ],
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_drained_by_sigterm_under_load_costs_the_callers_nothing_and_comes_back() {
    for engine in ["tokio", "loop"] {
        drained_by_sigterm_under_load(engine).await;
    }
}

async fn drained_by_sigterm_under_load(engine: &str) {
    let dir = test_dir(&format!("sigterm-{engine}"));
    let a_addr = SocketAddr::from(([127, 0, 0, 1], testkit::free_port()));
    let mut a = spawn_provider(a_addr);
    testkit::wait_listening(a_addr).await;
    let other = provider(ProviderConfig::default()).await;
    let file = dir.join("providers");
    std::fs::write(&file, format!("{a_addr}\n{}\n", other.addr)).unwrap();
    let b = broker_process(engine, &file, &dir.join("broker.log"));
    let c = client(b.rpc).await;
    until_ready(&c).await;
    let ok_before = b.metric(CALLS_TOTAL.name, &[("status", "ok")]);
    let all_before = b.metric(CALLS_TOTAL.name, &[]);

    // Load on both providers; A is stopped under it, once it has served some.
    let stop = Arc::new(AtomicBool::new(false));
    let running = load(&c, &stop);
    wait_until("A to serve calls under the load", || {
        upstream_ok(&b, a_addr) >= 200.0
    })
    .await;
    a.signal(testkit::Signal::TERM);
    let exit = tokio::task::block_in_place(|| a.wait_timeout(testkit::WAIT_TIMEOUT));
    assert!(
        exit.is_some_and(|s| s.success()),
        "A drained and exited 0: {exit:?}"
    );
    // The load goes on with A gone, until the other provider has served more.
    let other_at_exit = other.calls("ok");
    wait_until("the other provider to serve the load alone", || {
        other.calls("ok") >= other_at_exit + 500.0
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (made, bad) = running.await.unwrap();
    assert_all_ok(made, &bad);
    assert!(
        made < MAX_LOAD_CALLS,
        "the load ended on its stop, not its bound"
    );
    let rerouted = b.metric(CALLS_REROUTED_TOTAL.name, &[("reason", "not_run")]);
    // A told the broker of its drain (or refused calls `NOT_RUN`, which go to the other
    // provider): either way the broker knew it drained, not that it failed.
    let log = std::fs::read_to_string(dir.join("broker.log")).unwrap();
    assert!(log.contains("provider draining"), "{log}");
    // Every call made has exactly one outcome at the broker, and it is ok.
    let ok = b.metric(CALLS_TOTAL.name, &[("status", "ok")]) - ok_before;
    let all = b.metric(CALLS_TOTAL.name, &[]) - all_before;
    assert_eq!(
        (ok, all),
        (made as f64, made as f64),
        "{engine}: rerouted {rerouted}"
    );
    println!("{engine} engine, drain under load: {made} calls, all ok, {rerouted} rerouted");

    // A restarted on the same port is found again and takes calls.
    let a_served = upstream_ok(&b, a_addr);
    let _a2 = spawn_provider(a_addr);
    testkit::wait_listening(a_addr).await;
    let stop = Arc::new(AtomicBool::new(false));
    let running = load(&c, &stop);
    wait_until("the restarted A to take calls", || {
        upstream_ok(&b, a_addr) > a_served
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (made, bad) = running.await.unwrap();
    assert_all_ok(made, &bad);

    drop(b);
    other.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// docs/broker.md's own example: a provider named for the services beside one for any
/// service. The named one takes every call while it is healthy; drained by SIGTERM under
/// load, the calls it refuses and all after go to the one of any service, its fallback,
/// and none fails. The broker runs two cells, each with a client connection under load:
/// the drain one cell learns of is the other's too, and neither loses a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_provider_drained_under_load_falls_back_to_the_any_service_one() {
    for engine in ENGINES {
        a_named_provider_drained_under_load_falls_back_to_the_any_service_one_on(engine).await;
    }
}

/// [`a_named_provider_drained_under_load_falls_back_to_the_any_service_one`] on `engine`.
async fn a_named_provider_drained_under_load_falls_back_to_the_any_service_one_on(engine: &str) {
    let dir = test_dir(&format!("fallback-{engine}"));
    let named_addr = SocketAddr::from(([127, 0, 0, 1], testkit::free_port()));
    let mut named = spawn_provider(named_addr);
    testkit::wait_listening(named_addr).await;
    let any = provider(ProviderConfig::default()).await;
    let file = dir.join("providers");
    std::fs::write(
        &file,
        format!("EchoService,PlatformService={named_addr}\n{}\n", any.addr),
    )
    .unwrap();
    let b = broker_process_on(engine, &file, &dir.join("broker.log"), "500ms", "2");
    // Two connections: one per cell (of the Tokio engine).
    let (c, c2) = (client(b.rpc).await, client(b.rpc).await);
    until_ready(&c).await;
    until_ready(&c2).await;

    let stop = Arc::new(AtomicBool::new(false));
    let running = load(&c, &stop);
    let running2 = load(&c2, &stop);
    wait_until("the named provider to serve calls under the load", || {
        upstream_ok(&b, named_addr) >= 200.0
    })
    .await;
    assert_eq!(
        any.calls("ok"),
        0.0,
        "the named provider is healthy: the fallback takes nothing"
    );
    named.signal(testkit::Signal::TERM);
    let exit = tokio::task::block_in_place(|| named.wait_timeout(testkit::WAIT_TIMEOUT));
    assert!(exit.is_some_and(|s| s.success()), "drained: {exit:?}");
    wait_until("the fallback to serve the load", || {
        any.calls("ok") >= 500.0
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (made, bad) = running.await.unwrap();
    assert_all_ok(made, &bad);
    let (made2, bad2) = running2.await.unwrap();
    assert_all_ok(made2, &bad2);
    let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
    assert!(
        cell("0") >= 200.0 && cell("1") >= 200.0,
        "{engine}: both cells carried the load: {} and {}",
        cell("0"),
        cell("1")
    );
    println!(
        "{engine} engine, fallback under a drain: {} calls, all ok, {} by the fallback",
        made + made2,
        any.calls("ok")
    );
    drop(b);
    any.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Fails the test if any of the `made` calls failed, showing the first few failures.
fn assert_all_ok<T: std::fmt::Debug>(made: usize, bad: &[T]) {
    assert!(
        bad.is_empty(),
        "{} of {made} calls failed: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// A providers file replaced by a named pipe is refused when read, without blocking: the
/// broker logs why, counts the read kept out, goes on with the providers it had, and ends
/// on SIGTERM. Without it, the watcher blocked in `open` until someone wrote to the pipe:
/// reloads stopped silently and SIGTERM hung.
#[tokio::test]
async fn a_providers_file_replaced_by_a_named_pipe_is_refused_and_sigterm_still_ends_it() {
    for engine in ENGINES {
        a_providers_file_replaced_by_a_named_pipe_is_refused_and_sigterm_still_ends_it_on(engine)
            .await;
    }
}

/// [`a_providers_file_replaced_by_a_named_pipe_is_refused_and_sigterm_still_ends_it`] on `engine`.
async fn a_providers_file_replaced_by_a_named_pipe_is_refused_and_sigterm_still_ends_it_on(
    engine: &str,
) {
    let dir = test_dir(&format!("fifo-{engine}"));
    let pa = provider(ProviderConfig::default()).await;
    let file = dir.join("providers");
    let log = dir.join("broker.log");
    std::fs::write(&file, format!("{}\n", pa.addr)).unwrap();
    let mut b = broker_process(engine, &file, &log);
    let c = client(b.rpc).await;
    until_ready(&c).await;
    testkit::replace_with_fifo(&file);
    b.child.signal(testkit::Signal::HUP);
    wait_until("the pipe to be kept out", || reloads(&b, "error") >= 1.0).await;
    let logged = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("a named pipe")
    };
    wait_until("the log line naming the pipe", logged).await;
    echo_ok(&c, "still served").await;
    b.child.signal(testkit::Signal::TERM);
    let status = b
        .child
        .wait_timeout(std::time::Duration::from_secs(20))
        .expect("it ends on SIGTERM");
    assert!(status.success(), "{status}");
    pa.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
