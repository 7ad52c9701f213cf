//! The hostile-client tests that measure over wall-clock windows, against the broker and
//! the provider as real processes on 127.0.0.1: the reconnect rate and CPU of a broker
//! whose provider accepts and closes at once, how soon a stalled provider is out of
//! service, the peak memory of a broker under large-frame floods, the CPU and log lines of
//! a provider out of descriptors, and the CPU that metadata bombs cost. Their bounds are
//! rates and shares of a core, which a loaded machine can push past: they are the system
//! tier's, not the fast tier's. The hostile tests that prove facts by counts stay in
//! `broker/tests/hostile.rs` and `provider/tests/hostile.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{self as testkit, Launch, Spawned};
use rpcmesh_wire::Status;

/// How long the reconnect rate is watched.
const RECONNECT_WATCH: Duration = Duration::from_secs(3);
/// Connects per second per pooled connection the broker may make to a provider that
/// accepts and closes at once: its pauses between attempts reach 1 s, so a few a second
/// is back-off working, and thousands a second is none.
const MAX_RECONNECTS_PER_SECOND_PER_CONN: f64 = 4.0;
/// The most CPU the broker may use meanwhile, as a share of one core.
const MAX_IDLE_CPU: f64 = 0.2;

#[tokio::test]
async fn a_provider_that_accepts_and_closes_sees_a_bounded_reconnect_rate() {
    // A provider whose one connection slot is held by an idle socket refuses every
    // other connection: accepted, then closed at once.
    let full = Spawned::start("provider", &["--threads", "1", "--max-connections", "1"]);
    let _slot = TcpStream::connect(full.rpc).unwrap();
    testkit::wait_until("the slot is taken", || {
        full.metric("rpcmesh_connections_open", &[("side", "inbound")]) == 1.0
    })
    .await;
    let healthy = Spawned::start("provider", &["--threads", "1"]);
    let (a, b) = (full.rpc.to_string(), healthy.rpc.to_string());
    let pool = 4;
    let broker = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--pool-size",
            &pool.to_string(),
            "--upstream",
            &a,
            "--upstream",
            &b,
        ],
    );
    // Past the first, short pauses.
    tokio::time::sleep(RECONNECT_WATCH).await;
    let refused = || full.metric("rpcmesh_connections_refused_total", &[("side", "inbound")]);
    let (before, cpu_before) = (refused(), broker.cpu_seconds());
    tokio::time::sleep(RECONNECT_WATCH).await;
    let (rate, cpu) = (
        (refused() - before) / RECONNECT_WATCH.as_secs_f64(),
        (broker.cpu_seconds() - cpu_before) / RECONNECT_WATCH.as_secs_f64(),
    );
    eprintln!("accept-and-close provider: {rate:.1} reconnects/s, broker CPU {cpu:.3} of a core");
    assert!(
        rate <= MAX_RECONNECTS_PER_SECOND_PER_CONN * f64::from(pool),
        "{rate:.1} reconnects a second to a provider that closes at once"
    );
    assert!(cpu <= MAX_IDLE_CPU, "the broker used {cpu:.2} of a core");
    assert!(
        broker.call_succeeds().await,
        "the healthy provider still serves"
    );
}

/// The broker's health checks in the stalled-provider test: short, so that the bound
/// under test (interval + timeout) is far from the one a pool whose heartbeats ran one
/// after another would have (interval + pool size × timeout).
const HEALTH: Duration = Duration::from_millis(200);
/// Calls sent after the stall, 10 ms apart.
const STALL_CALLS: usize = 300;
/// Slack over interval + timeout for a loaded machine (still below the old bound).
const STALL_SLACK: Duration = Duration::from_millis(600);

#[tokio::test]
async fn a_stalled_provider_is_out_of_service_within_a_health_interval_and_timeout() {
    let stalled = Spawned::start("provider", &["--threads", "1"]);
    let healthy = Spawned::start("provider", &["--threads", "1"]);
    let (a, b) = (stalled.rpc.to_string(), healthy.rpc.to_string());
    let health = format!("{}ms", HEALTH.as_millis());
    let broker = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--pool-size",
            "8",
            "--balance",
            "round-robin",
            "--health-interval",
            &health,
            "--health-timeout",
            &health,
            "--call-timeout",
            "3s",
            "--upstream",
            &a,
            "--upstream",
            &b,
        ],
    );
    testkit::wait_until("both providers are pooled", || {
        broker.metric("rpcmesh_pool_healthy_connections", &[]) == 16.0
    })
    .await;
    let client = Client::connect(broker.rpc, ClientConfig::default())
        .await
        .unwrap();
    stalled.child.signal(testkit::Signal::STOP);
    let stalled_at = std::time::Instant::now();
    // STALL_CALLS calls 10 ms apart (about three bounds' worth, counted, not timed); round
    // robin sends every other one to the stalled provider while it is in service, and
    // those never succeed. What is timed is only when each left: the bound under test.
    let bound = HEALTH * 2 + STALL_SLACK;
    let mut calls = Vec::with_capacity(STALL_CALLS);
    for _ in 0..STALL_CALLS {
        calls.push((
            stalled_at.elapsed(),
            testkit::echo_call(&client, "who answers"),
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut last_stuck = Duration::ZERO;
    for (sent, call) in calls {
        let ok = matches!(call.await, Ok(Ok(r)) if r.status == Status::Success);
        if !ok {
            last_stuck = last_stuck.max(sent);
        }
    }
    stalled.child.signal(testkit::Signal::CONT);
    eprintln!("stalled provider: last call routed to it {last_stuck:?} after the stall");
    assert!(
        last_stuck > Duration::ZERO,
        "calls reached the stalled provider at first"
    );
    assert!(
        last_stuck <= bound,
        "calls still went to the stalled provider {last_stuck:?} after it stalled \
         (health interval {HEALTH:?}, timeout {HEALTH:?})"
    );
}

/// The memory budget of the broker in the flood test ([`testkit::budgeted_broker`]'s).
const BUDGET_MIB: usize = testkit::BROKER_BUDGET_MIB;
/// Frames of the flooders in the budget test.
const FLOOD_FRAME: usize = 1 << 20;
/// Frames each flooder sends at most (its writes also stop once the broker stops reading).
const FLOOD_FRAMES: usize = 400;
/// Small calls made while the flood goes on.
const SMALL_CALLS: usize = 100;
/// How far above the budget resident memory may peak: a write backlog that grows past
/// its room is copied into one twice as large, and both live for that moment.
const RSS_FACTOR: u64 = 2;
/// What the broker may keep resident once the flood is over, above where it started: the
/// budget. glibc's malloc gives most of the peak back, but how much it keeps varies from
/// run to run (measured 1-41 MiB after peaks of 75-86 MiB); it never grows with the
/// flood's size.
const AFTER_FLOOD_MIB: u64 = BUDGET_MIB as u64;

#[tokio::test]
async fn large_frame_flooders_stay_under_the_budget_while_small_calls_are_served() {
    let (_provider, broker) = testkit::budgeted_broker().await;
    let base = broker.status_kib("VmRSS");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two callers pipelining 1 MiB echo requests and never reading a reply.
    let flooders: Vec<_> = (0..2)
        .map(|f| {
            let to = broker.rpc;
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(to).unwrap();
                s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
                let big = "x".repeat(FLOOD_FRAME);
                let mut sent = 0;
                while sent < FLOOD_FRAMES && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if s.write_all(&testkit::echo_request((f * 10_000 + sent) as u64, &big))
                        .is_err()
                    {
                        break;
                    }
                    sent += 1;
                }
                (s, sent)
            })
        })
        .collect();
    let peak = broker.watch_rss();
    testkit::wait_until("the flood fills the budget", || {
        broker.metric("rpcmesh_buffered_bytes", &[]) >= (BUDGET_MIB << 20) as f64 * 0.5
    })
    .await;
    let client = Client::connect(broker.rpc, ClientConfig::default())
        .await
        .unwrap();
    let mut buffered_peak: f64 = 0.0;
    for i in 0..SMALL_CALLS {
        let r = testkit::echo_call(&client, "small").await.unwrap().unwrap();
        assert_eq!(r.status, Status::Success, "small call {i}: {}", r.error_msg);
        buffered_peak = buffered_peak.max(broker.metric("rpcmesh_buffered_bytes", &[]));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sockets, sent): (Vec<TcpStream>, Vec<usize>) =
        flooders.into_iter().map(|f| f.join().unwrap()).unzip();
    let peak = peak.stop();
    let shed = broker.metric("rpcmesh_errors_total", &[("kind", "overloaded")]);
    eprintln!(
        "flooders sent {sent:?} MiB; broker RSS {base} → peak {peak} KiB; buffered at most {:.1} MiB; {shed} calls shed",
        buffered_peak / f64::from(1 << 20)
    );
    assert!(
        buffered_peak <= (BUDGET_MIB << 20) as f64,
        "the broker buffered {buffered_peak} bytes"
    );
    assert!(
        peak.saturating_sub(base) < (RSS_FACTOR * BUDGET_MIB as u64) << 10,
        "the flood took the broker from {base} to {peak} KiB"
    );
    // The flooders leave: what they held is released and returned to the system.
    drop(sockets);
    testkit::wait_until("the flooders' buffers are released", || {
        broker.metric("rpcmesh_buffered_bytes", &[]) < (1 << 20) as f64
    })
    .await;
    let after = broker.status_kib("VmRSS");
    eprintln!("after the flood: broker RSS {after} KiB");
    assert!(
        after.saturating_sub(base) < AFTER_FLOOD_MIB << 10,
        "the broker kept {after} KiB resident after the flood (from {base})"
    );
}

/// File descriptors the provider may hold in the out-of-descriptors test: a few dozen
/// connections fill them.
const FEW_FDS: u64 = 64;
/// Connections opened against it: more than its descriptors allow.
const FLOOD: usize = 100;
/// How long the starved provider is watched.
const STARVED_WATCH: std::time::Duration = std::time::Duration::from_secs(1);
/// The most CPU a starved provider may use while watched, as a share of one core (a
/// spinning accept loop uses all of it).
const MAX_STARVED_CPU: f64 = 0.2;
/// The most lines it may log meanwhile (an exporter spinning on a failed accept logs
/// hundreds of thousands a second).
const MAX_STARVED_LOG_LINES: usize = 50;

#[test]
fn a_provider_out_of_descriptors_does_not_spin_and_serves_metrics_once_they_are_back() {
    use std::io::Read;
    let dir = std::env::temp_dir().join(format!("rpcmesh-starved-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("stderr");
    let provider = Spawned::start_with(
        "provider",
        &["--threads", "1"],
        Launch {
            stderr: Some(&log),
            ..Launch::default()
        },
    );
    // Its descriptor limit lowered once it listens, before the flood.
    let few = rustix::process::Rlimit {
        current: Some(FEW_FDS),
        maximum: Some(FEW_FDS),
    };
    let pid = rustix::process::Pid::from_raw(i32::try_from(provider.pid()).unwrap()).unwrap();
    rustix::process::prlimit(Some(pid), rustix::process::Resource::Nofile, few).unwrap();
    let flood: Vec<TcpStream> = (0..FLOOD)
        .map(|_| TcpStream::connect(provider.rpc).unwrap())
        .collect();
    // A scrape waits behind the descriptors the flood took.
    let mut scrape = TcpStream::connect(provider.metrics.unwrap()).unwrap();
    write!(
        scrape,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    std::thread::sleep(STARVED_WATCH / 4);
    let lines_before = std::fs::read_to_string(&log).unwrap().lines().count();
    let cpu_before = provider.cpu_seconds();
    std::thread::sleep(STARVED_WATCH);
    let cpu = provider.cpu_seconds() - cpu_before;
    let lines = std::fs::read_to_string(&log).unwrap().lines().count() - lines_before;
    assert!(
        cpu <= MAX_STARVED_CPU * STARVED_WATCH.as_secs_f64(),
        "out of descriptors, the provider used {cpu:.3} s of CPU in {STARVED_WATCH:?}"
    );
    assert!(
        lines <= MAX_STARVED_LOG_LINES,
        "out of descriptors, the provider logged {lines} lines in {STARVED_WATCH:?}"
    );
    drop(flood);
    scrape
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let mut answer = String::new();
    scrape.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("rpcmesh_"),
        "the scrape was answered once descriptors were back: {answer:.200}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Metadata entries of each bomb in the bomb test (the reported attack had 873,796).
const BOMB_ENTRIES: usize = 100_000;
/// Bombs sent.
const BOMBS: usize = 20;
/// The most CPU the provider may spend on all of them (and 100 small calls): refusing one
/// costs a scan of its bytes, hundredths of a second for all 20; decoding them (the limit
/// raised out of the way) costs seconds, and the commit that set the limit gives the
/// figures.
const MAX_BOMBS_CPU_SECONDS: f64 = 0.5;

#[tokio::test]
async fn metadata_bombs_are_refused_for_a_scan_of_their_bytes_while_small_calls_go_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let bomb = testkit::metadata_bomb(BOMB_ENTRIES);
    let mut bombs = bytes::BytesMut::new();
    for id in 0..BOMBS as u64 {
        testkit::put_echo_with_metadata(&mut bombs, id, &bomb);
    }
    let client = Client::connect(provider.rpc, ClientConfig::default())
        .await
        .unwrap();
    assert!(testkit::echo_call(&client, "before").await.unwrap().is_ok());
    let cpu_before = provider.cpu_seconds();
    let mut s = tokio::net::TcpStream::connect(provider.rpc).await.unwrap();
    let (mut rd, mut wr) = s.split();
    let send = async {
        wr.write_all(&bombs).await.unwrap();
    };
    // Every bomb is answered (bad request) before the socket goes quiet.
    let answers = async {
        let codec = rpcmesh_wire::codec::FrameCodec::default();
        let mut buf = bytes::BytesMut::new();
        let mut n = 0;
        while n < BOMBS {
            assert!(rd.read_buf(&mut buf).await.unwrap() > 0, "closed early");
            while let Some(f) = codec.decode_frame(&mut buf).unwrap() {
                assert_eq!(f.body[0], Status::BadRequest as u8);
                n += 1;
            }
        }
    };
    // Small calls on another connection meanwhile.
    let small = async {
        for _ in 0..100 {
            let r = testkit::echo_call(&client, "small").await.unwrap().unwrap();
            assert_eq!(r.status, Status::Success);
        }
    };
    tokio::join!(send, answers, small);
    let cpu = provider.cpu_seconds() - cpu_before;
    eprintln!("{BOMBS} metadata bombs of {BOMB_ENTRIES} entries: {cpu:.3} s of provider CPU");
    assert!(
        cpu <= MAX_BOMBS_CPU_SECONDS,
        "{BOMBS} bombs cost the provider {cpu:.3} s of CPU"
    );
}
