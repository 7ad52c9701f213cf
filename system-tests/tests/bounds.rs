//! Bounds that hold under attack, against the broker and the provider as real processes on
//! 127.0.0.1: one test per attack of issue 34's table. Clients play several hosts by
//! binding 127.0.0.2, 127.0.0.3… as their source (`testkit::connect_from`). The tests that
//! compare throughputs do so within one run, in short slots taking turns, and assert
//! ratios with margin; they hold [`MEASURING`] so that no other test of this file loads
//! the machine meanwhile.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rpcmesh_common::net::budget::{RSS_OVERHEAD, SHED_AFTER};
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{self as testkit, Spawned};
use rpcmesh_wire::Status;

/// The broker's engines, for the tests that hold both to a bound (the others hold the
/// default engine to theirs; `RPCMESH_BROKER_ENGINE=loop` runs them on the loop engine).
const ENGINES: [&str; 2] = ["tokio", "loop"];

/// Held by the tests that measure throughput or load the machine hard, one at a time.
static MEASURING: Mutex<()> = Mutex::new(());

fn measuring() -> std::sync::MutexGuard<'static, ()> {
    MEASURING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn inbound(reason: &str) -> [(&'static str, &str); 2] {
    [("side", "inbound"), ("reason", reason)]
}

/// A call of 256 KiB: large enough to be refused past the budget's high mark.
fn large_echo() -> rpcmesh_wire::proto::rpc::EchoRequest {
    rpcmesh_wire::proto::rpc::EchoRequest {
        message: "x".repeat(256 << 10),
    }
}

/// A [`large_echo`] call on a fresh connection to `broker` succeeds: the budget is back
/// under its high mark.
async fn large_call_is_served(broker: SocketAddr) {
    let client = Client::connect(broker, ClientConfig::default())
        .await
        .unwrap();
    let r = client
        .call("EchoService", "Echo", &large_echo())
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success, "{}", r.error_msg);
}

/// Callers in the paused-partial-bodies test, each sending part of a large frame.
const PARTIAL_BODIES: usize = 100;
/// Bytes of its frame each sends (of the 10 MiB its header claims), then nothing: 100 of
/// them are past the pause mark of a 64 MiB budget, as 100 × 3 MiB are of 512 MiB.
const PARTIAL_BODY: usize = 1 << 20;

/// Where `s` takes bytes without blocking: as much of `bytes` as the socket takes now.
fn send_what_goes(s: &mut std::net::TcpStream, bytes: &[u8]) {
    s.set_nonblocking(true).unwrap();
    let mut sent = 0;
    while sent < bytes.len() {
        match s.write(&bytes[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("send: {e}"),
        }
    }
}

/// Connects from `source` to `to` and sends a heartbeat and, in the same write, the
/// header of a call whose body would be 10 MiB ([`testkit::large_claim`]); returns once
/// the heartbeat is answered, so that the broker has read the header too. The call is
/// then one begun under the budget's high mark, whose body the broker takes under its
/// pauses: one whose header comes past the mark is answered "overloaded" at once, its
/// body dropped as it comes (the loop engine's `refuse_coming`).
fn claim_seen(source: std::net::Ipv4Addr, to: SocketAddr) -> std::net::TcpStream {
    use std::io::Read;
    let mut s = testkit::connect_from(source, to, testkit::WAIT_TIMEOUT).unwrap();
    let mut first = bytes::BytesMut::new();
    rpcmesh_wire::body::Heartbeat::put_now(&mut first, 1, "claim", "0").unwrap();
    first.extend_from_slice(&testkit::large_claim(0));
    s.write_all(&first).unwrap();
    s.set_read_timeout(Some(testkit::WAIT_TIMEOUT)).unwrap();
    let mut reply = [0u8; 64];
    assert!(s.read(&mut reply).unwrap() > 0, "the heartbeat is answered");
    s
}

/// A hundred callers each send part of a body whose header claims 10 MiB, then nothing:
/// past three quarters of the budget they are all paused. Paused, they are still closed:
/// those holding the budget when their frame timeout passes (counted `memory_budget`),
/// then the others, which read again, by their frame timeout; and a large call is served
/// again. Without it, none was ever closed and every large call was answered "overloaded"
/// until the broker restarted.
// The guard only keeps this file's heavy tests apart; the tests that wait for it run on
// threads of their own, so holding it across this runtime's awaits blocks nothing here.
/// On both engines.
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn partial_bodies_that_hold_the_budget_are_closed_and_large_calls_served_again() {
    let _measuring = measuring();
    for engine in ENGINES {
        partial_bodies(engine).await;
    }
}

async fn partial_bodies(engine: &str) {
    let (_provider, broker) = testkit::budgeted_broker_with(
        testkit::BROKER_BUDGET_MIB,
        &["--engine", engine, "--frame-timeout", "2s"],
    )
    .await;
    let header = testkit::large_claim(0).len();
    let mut part = testkit::large_claim(0);
    part.resize(PARTIAL_BODY, 7);
    // Every call begun while the budget is low, then their bodies sent.
    let mut held: Vec<std::net::TcpStream> = (0..PARTIAL_BODIES)
        .map(|_| claim_seen(std::net::Ipv4Addr::LOCALHOST, broker.rpc))
        .collect();
    for s in &mut held {
        send_what_goes(s, &part[header..]);
    }
    let closed = |reason| broker.metric("rpcmesh_connections_closed_total", &inbound(reason));
    testkit::wait_until("the partial bodies pass the pause mark", || {
        closed("memory_budget") >= 1.0
            || broker.metric("rpcmesh_buffered_bytes", &[])
                >= (testkit::BROKER_BUDGET_MIB << 20) as f64 * 0.75
    })
    .await;
    testkit::wait_until("every partial body is closed", || {
        closed("memory_budget") + closed("frame_timeout") >= PARTIAL_BODIES as f64
    })
    .await;
    let (by_budget, by_frame) = (closed("memory_budget"), closed("frame_timeout"));
    eprintln!(
        "{engine}: {PARTIAL_BODIES} partial bodies of {PARTIAL_BODY} bytes: {by_budget} closed holding the budget, {by_frame} by the frame timeout"
    );
    assert!(
        by_budget >= 1.0,
        "{engine}: the paused ones holding the budget were closed"
    );
    large_call_is_served(broker.rpc).await;
    drop(held);
}

/// Callers in the refused-at-its-header test, each holding 1 MiB of a call begun under
/// the high mark: 40 MiB, past the high mark of a 64 MiB budget and under its pause mark.
const HOLDERS: usize = 40;
/// The body of the call refused at its header: large enough to be refused past the mark.
const COMING_BODY: usize = 1 << 20;
/// What of that body is sent before its answer is awaited.
const COMING_SENT: usize = 64 << 10;

/// With the budget past its high mark, a caller begins a 1 MiB call: the loop engine
/// answers it "overloaded" once its header and first 64 KiB are there, before the rest
/// of its body is sent, and drops that rest as it comes (an invalid body, its CRC never
/// checked), so that the caller's next call on the same connection is served. Without it
/// the body was buffered whole only to be refused (or, with the budget past its pause
/// mark, its caller paused, unanswered, for as long as others held the budget): no
/// answer came before the rest was sent.
// The guard only keeps this file's heavy tests apart (as `partial_bodies`'s).
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn a_large_call_begun_past_the_high_mark_is_answered_at_its_header() {
    use std::io::Read;
    let _measuring = measuring();
    let (_provider, broker) = testkit::budgeted_broker_with(
        testkit::BROKER_BUDGET_MIB,
        &["--engine", "loop", "--frame-timeout", LONG_TIMEOUT],
    )
    .await;
    let header = testkit::large_claim(0).len();
    let mut part = testkit::large_claim(0);
    part.resize(1 << 20, 7);
    let mut held: Vec<std::net::TcpStream> = (0..HOLDERS)
        .map(|i| claim_seen(testkit::loopback_source(1 + (i % 4) as u16), broker.rpc))
        .collect();
    for s in &mut held {
        send_what_goes(s, &part[header..]);
    }
    let high = (testkit::BROKER_BUDGET_MIB << 20) as f64 * 0.5;
    testkit::wait_until("the holders pass the high mark", || {
        broker.metric("rpcmesh_buffered_bytes", &[]) >= high
    })
    .await;
    let mut call = bytes::BytesMut::new();
    rpcmesh_wire::frame::Header {
        msg_type: rpcmesh_wire::frame::MsgType::Request,
        flags: rpcmesh_wire::frame::Flags::EXT_STATUS,
        body_len: COMING_BODY as u32,
        req_id: 9,
    }
    .put(&mut call);
    call.resize(rpcmesh_wire::frame::FRAME_OVERHEAD + COMING_BODY, 7);
    let mut s = std::net::TcpStream::connect(broker.rpc).unwrap();
    s.set_read_timeout(Some(testkit::WAIT_TIMEOUT)).unwrap();
    s.write_all(&call[..COMING_SENT]).unwrap();
    let codec = rpcmesh_wire::codec::FrameCodec::default();
    let mut calls = rpcmesh_wire::envelope::CallCodec::new(None, 1 << 20);
    let mut buf = bytes::BytesMut::new();
    let mut next_reply = |s: &mut std::net::TcpStream| loop {
        if let Some(f) = codec.decode_frame(&mut buf).unwrap() {
            return (f.header.req_id, calls.decode_response(&f).unwrap().status);
        }
        let mut chunk = [0u8; 4096];
        let n = s
            .read(&mut chunk)
            .expect("an answer before the body is sent");
        assert!(n > 0, "the connection stays open");
        buf.extend_from_slice(&chunk[..n]);
    };
    assert_eq!(next_reply(&mut s), (9, Status::Overloaded));
    // The rest of its body is dropped as it comes; the next call is read and served.
    s.write_all(&call[COMING_SENT..]).unwrap();
    s.write_all(&testkit::echo_request(10, "after")).unwrap();
    assert_eq!(next_reply(&mut s), (10, Status::Success));
    drop(held);
}

/// The frame timeout in the paused-hang-up test, and the write and frame timeouts in the
/// stalled-readers test: longer than the tests wait, so that only what they test can end
/// the connections (a caller's hang-up noticed, the memory budget's own bound).
const LONG_TIMEOUT: &str = "120s";
/// Callers in the paused-hang-up test that hang up once paused.
const HANGING_UP: usize = 20;
/// What each of those sends of its frame first: past the pause floor (256 KiB), and
/// read whole while the budget is low; one byte more once it is past the mark pauses it.
const HANGING_UP_PART: usize = 320 << 10;
/// What each sends once paused, before it hangs up: left waiting in the broker's kernel
/// (its receive buffer takes it whole, so that the hang-up reaches the broker).
const WAITING: usize = 16 << 10;
/// Callers in that test that stay, each holding part of a frame under the pause floor:
/// never paused themselves, together they keep the budget (64 MiB) past its pause mark
/// and under its limit, whatever the others do.
const STAYING: usize = 336;
const STAYING_PART: usize = 120 << 10;

/// Twenty callers each send part of a body whose header claims 10 MiB, and are paused
/// once others, each holding less than the pause floor, have taken the budget past three
/// quarters; then they hang up. Paused, their sessions still notice it (the socket is
/// watched for the hang-up while its reads wait, and looked at each second): all twenty
/// end at once, each as a frame cut off (`bad_input`), long before their frame timeout.
/// Without it they stayed, their bytes held, until the frame timeout (before issue 34:
/// until the broker restarted). Once the others hang up too, a large call is served
/// again. (A caller whose kernel still has bytes to send when it hangs up is seen to leave
/// only by the frame timeout: its FIN waits behind them; see
/// `FramedIo::peer_left_mid_frame`.)
/// On both engines.
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn paused_callers_that_hang_up_end_their_sessions_at_once() {
    let _measuring = measuring();
    for engine in ENGINES {
        paused_hang_up(engine).await;
    }
}

async fn paused_hang_up(engine: &str) {
    let (_provider, broker) = testkit::budgeted_broker_with(
        testkit::BROKER_BUDGET_MIB,
        &["--engine", engine, "--frame-timeout", LONG_TIMEOUT],
    )
    .await;
    let buffered = || broker.metric("rpcmesh_buffered_bytes", &[]);
    let paused = || broker.metric("rpcmesh_paused_connections", &[]);
    let open = || broker.metric("rpcmesh_connections_open", &[("side", "inbound")]);
    let closed = |reason| broker.metric("rpcmesh_connections_closed_total", &inbound(reason));
    let header = testkit::large_claim(0).len();
    let mut part = testkit::large_claim(0);
    part.resize(HANGING_UP_PART + 1 + WAITING, 7);
    // The connection of the call that found the broker serving is gone first.
    testkit::wait_until("no connection open", || open() == 0.0).await;
    // Every call begun while the budget is low.
    let source = |i: usize| testkit::loopback_source(1 + (i % 4) as u16);
    let mut leaving: Vec<std::net::TcpStream> = (0..HANGING_UP)
        .map(|i| claim_seen(source(i), broker.rpc))
        .collect();
    let mut staying: Vec<std::net::TcpStream> = (0..STAYING)
        .map(|i| claim_seen(source(i), broker.rpc))
        .collect();
    // Those that will hang up first, read whole while the budget is low.
    for s in &mut leaving {
        send_what_goes(s, &part[header..HANGING_UP_PART]);
    }
    testkit::wait_until("their parts to be read", || {
        buffered() >= (HANGING_UP * HANGING_UP_PART) as f64
    })
    .await;
    for s in &mut staying {
        send_what_goes(s, &part[header..STAYING_PART]);
    }
    let mark = (testkit::BROKER_BUDGET_MIB << 20) as f64 * 0.75;
    testkit::wait_until(
        "the others' parts to take the budget past its pause mark",
        || buffered() >= mark,
    )
    .await;
    assert_eq!(paused(), 0.0, "under the pause floor, none paused");
    for s in &mut leaving {
        send_what_goes(s, &part[HANGING_UP_PART..HANGING_UP_PART + 1]);
    }
    testkit::wait_until("the leaving callers' readers to be paused", || {
        paused() == HANGING_UP as f64
    })
    .await;
    assert_eq!(open(), (HANGING_UP + STAYING) as f64, "none closed");
    // Bytes left waiting in the broker's kernel as they hang up: their sockets stay
    // readable, so the hang-up is found by the paused connection's own looks.
    for s in &mut leaving {
        send_what_goes(s, &part[HANGING_UP_PART + 1..]);
    }
    let before = closed("bad_input");
    drop(leaving);
    testkit::wait_until("the sessions of those that hung up to end", || {
        open() == STAYING as f64
    })
    .await;
    let (cut, timed_out) = (
        closed("bad_input") - before,
        closed("frame_timeout") + closed("memory_budget"),
    );
    eprintln!(
        "{HANGING_UP} paused callers hung up beside {STAYING} holding {:.1} MiB: {cut} sessions ended as a frame cut off, {timed_out} by a timeout",
        buffered() / (1 << 20) as f64
    );
    assert_eq!(
        cut, HANGING_UP as f64,
        "{engine}: each ended on its hang-up"
    );
    assert_eq!(timed_out, 0.0);
    drop(staying);
    testkit::wait_until("every session to end", || open() == 0.0).await;
    large_call_is_served(broker.rpc).await;
}

/// Callers in the stalled-readers test.
const STALLED_READERS: usize = 8;
/// Echo calls each stalled reader sends, of [`STALLED_READER_CALL`] bytes: 9.6 MB, of
/// which the sockets take about half and the broker holds the rest, so that eight of them
/// pass the high mark. Bounded, so that what is "as many as needed" is: with 12 MB each,
/// the readers left after a shedding grew past the mark again, and all eight could be
/// closed in two rounds.
const STALLED_READER_CALLS: usize = 2_400;
/// Under the 4 KiB from which calls are refused past the high mark: they are all served,
/// and their replies pile up.
const STALLED_READER_CALL: usize = 4_000;

/// Eight callers send thousands of echo calls just under the size refused past the high
/// mark, and read none of their replies, at a broker whose write and frame timeouts are
/// long: their backlogs hold its budget past the high mark, where large calls are refused.
/// The largest holders are closed once the budget has stayed past the mark for
/// `budget::SHED_AFTER`, counted `memory_budget`, and a large call is served again.
/// Without it every large call was refused "overloaded" until a timeout ended the
/// readers (here two minutes; the test waits 30 s).
#[test]
fn backlogs_holding_the_budget_past_its_mark_are_closed_largest_first() {
    /// Large calls tried while the mark is passed before one must have been refused.
    const MARK_TRIES: usize = 5;
    let _measuring = measuring();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_provider, broker) = rt.block_on(testkit::budgeted_broker_with(
        testkit::BROKER_BUDGET_MIB,
        &[
            "--write-timeout",
            LONG_TIMEOUT,
            "--frame-timeout",
            LONG_TIMEOUT,
        ],
    ));
    let client = rt
        .block_on(Client::connect(broker.rpc, ClientConfig::default()))
        .unwrap();
    let large = large_echo();
    let stop = Arc::new(AtomicBool::new(false));
    let readers = {
        let (to, stop) = (broker.rpc, stop.clone());
        std::thread::spawn(move || {
            let body = "r".repeat(STALLED_READER_CALL);
            let stream: Vec<u8> = (0..STALLED_READER_CALLS)
                .flat_map(|i| testkit::echo_request(i as u64, &body).to_vec())
                .collect();
            let mut callers: Vec<(std::net::TcpStream, usize)> = (0..STALLED_READERS)
                .map(|i| {
                    let source = testkit::loopback_source(1 + (i % 4) as u16);
                    let s = testkit::connect_from(source, to, testkit::WAIT_TIMEOUT).unwrap();
                    s.set_nonblocking(true).unwrap();
                    (s, 0)
                })
                .collect();
            // Bounded: the test ends it, or this does after a minute.
            for _ in 0..600 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                for (s, sent) in &mut callers {
                    // What the socket takes now; a closed one takes nothing more.
                    while *sent < stream.len() {
                        match s.write(&stream[*sent..]) {
                            Ok(n) => *sent += n,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(_) => *sent = stream.len(),
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            callers
        })
    };
    let high = (testkit::BROKER_BUDGET_MIB << 20) as f64 * 0.5;
    // Past the high mark a large call is refused. The shedding may close a holder between
    // a scrape that saw the mark passed and the call (the stalled readers fill it again
    // within 100 ms): each try waits for a scrape showing the mark passed now, and the
    // call right after it must be refused within a few tries (a broker that never
    // refuses fails them all).
    let mut outcomes = Vec::new();
    let mut peak: f64 = 0.0;
    for _ in 0..MARK_TRIES {
        rt.block_on(testkit::wait_until(
            "the stalled readers' backlogs pass the budget's high mark",
            || {
                let now = broker.metric("rpcmesh_buffered_bytes", &[]);
                peak = peak.max(now);
                now >= high
            },
        ));
        let r = rt
            .block_on(client.call("EchoService", "Echo", &large))
            .unwrap();
        if r.status == Status::Overloaded {
            break;
        }
        outcomes.push(format!("{:?} {}", r.status, r.error_msg));
    }
    assert!(
        outcomes.len() < MARK_TRIES,
        "past the high mark a large call is refused: {outcomes:?}"
    );
    let closed = |reason| broker.metric("rpcmesh_connections_closed_total", &inbound(reason));
    // The shedding starts SHED_AFTER past the mark and closes a holder a SHED_CHECK: the
    // wait allows for that on top of the usual one. Every attempt's outcome is kept, so
    // that a failure says what the broker answered and held.
    let refused_at = std::time::Instant::now();
    let give_up = refused_at + testkit::WAIT_TIMEOUT + SHED_AFTER;
    let mut attempts: Vec<String> = Vec::new();
    loop {
        let r = rt.block_on(client.call("EchoService", "Echo", &large));
        if matches!(&r, Ok(r) if r.status == Status::Success) {
            break;
        }
        attempts.push(match r {
            Ok(r) => format!("{:?} ({})", r.status, r.error_msg),
            Err(e) => format!("error: {e}"),
        });
        assert!(
            std::time::Instant::now() < give_up,
            "no large call served again: {} MiB buffered, {} closed for the budget, {} by the \
             write timeout; the last of {} answers: {:?}",
            broker.metric("rpcmesh_buffered_bytes", &[]) / (1 << 20) as f64,
            closed("memory_budget"),
            closed("write_timeout"),
            attempts.len(),
            &attempts[attempts.len().saturating_sub(5)..]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (shed, others) = (closed("memory_budget"), closed("write_timeout"));
    stop.store(true, Ordering::Relaxed);
    drop(readers.join().unwrap());
    eprintln!(
        "{STALLED_READERS} stalled readers: peak {:.1} MiB buffered (high mark {:.0} MiB), {shed} closed for the budget, {others} by the write timeout; a large call served again {:.1} s after the first refusal, {} refused meanwhile",
        peak / (1 << 20) as f64,
        high / (1 << 20) as f64,
        refused_at.elapsed().as_secs_f64(),
        attempts.len()
    );
    assert!(shed >= 1.0, "the largest holders were closed");
    assert!(shed < STALLED_READERS as f64, "only as many as needed");
    assert_eq!(others, 0.0, "no write timeout ended them");
}

/// Echo calls in flight at once from a [`Victim`].
const VICTIM_CALLS: usize = 8;

/// A well-behaved client: one connection, [`VICTIM_CALLS`] echo calls at a time, one
/// after another, counting those that succeed, until dropped.
struct Victim {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Victim {
    /// Connects to `to` and starts calling, on a thread of its own.
    fn start(to: SocketAddr) -> Victim {
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let (d, s, p) = (done.clone(), stop.clone(), paused.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let client = Client::connect(to, ClientConfig::default()).await.unwrap();
                let loops = (0..VICTIM_CALLS).map(|_| {
                    let (c, d, s, p) = (client.clone(), d.clone(), s.clone(), p.clone());
                    async move {
                        let msg = rpcmesh_wire::proto::rpc::EchoRequest {
                            message: "a well-behaved caller".into(),
                        };
                        while !s.load(Ordering::Relaxed) {
                            if p.load(Ordering::Relaxed) {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                                continue;
                            }
                            let r = c.call("EchoService", "Echo", &msg).await;
                            if matches!(r, Ok(r) if r.status == Status::Success) {
                                d.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
                futures_util::future::join_all(loops).await;
            });
        });
        Victim {
            done,
            stop,
            paused,
            thread: Some(thread),
        }
    }

    /// Stops making calls (those in flight finish) until [`Victim::resume`].
    fn pause(&self) {
        self.paused.store(true, Ordering::Relaxed);
    }

    fn resume(&self) {
        self.paused.store(false, Ordering::Relaxed);
    }

    /// Calls that succeeded so far.
    fn calls(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the load beside a victim does in a slot ([`Load`]).
const IDLE: u8 = 0;
const SPIN: u8 = 1;
const CHURN: u8 = 2;
const DONE: u8 = 3;

/// Connects the churner makes at most in one test (a bound, far beyond what it makes).
const MAX_CHURN: u64 = 1_000_000;

/// The loads of the churn test, on two threads of their own: a CPU-only control that
/// spins while the mode says [`SPIN`], and a churner that, while it says [`CHURN`],
/// connects from 127.0.0.2, sends one call and closes without reading, as fast as it can.
struct Load {
    mode: Arc<AtomicU8>,
    spinner: Option<std::thread::JoinHandle<()>>,
    churner: Option<std::thread::JoinHandle<u64>>,
}

impl Load {
    fn start(to: SocketAddr) -> Load {
        let mode = Arc::new(AtomicU8::new(IDLE));
        let m = mode.clone();
        let spinner = std::thread::spawn(move || {
            let mut n = 0u64;
            loop {
                match m.load(Ordering::Relaxed) {
                    SPIN => {
                        for _ in 0..10_000 {
                            n = std::hint::black_box(n.wrapping_mul(6_364_136_223_846_793_005) + 1);
                        }
                    }
                    DONE => return,
                    _ => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        let m = mode.clone();
        let churner = std::thread::spawn(move || {
            let call = testkit::echo_request(1, "and gone");
            let from = testkit::loopback_source(1);
            let mut n = 0u64;
            loop {
                match m.load(Ordering::Relaxed) {
                    CHURN if n < MAX_CHURN => {
                        let c = testkit::connect_from(from, to, Duration::from_millis(100));
                        if let Ok(mut s) = c {
                            let _ = s.write_all(&call);
                            n += 1;
                        }
                    }
                    DONE => return n,
                    _ => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        Load {
            mode,
            spinner: Some(spinner),
            churner: Some(churner),
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::Relaxed);
    }

    /// Stops both threads; returns how many calls the churner sent.
    fn stop(mut self) -> u64 {
        self.set(DONE);
        if let Some(t) = self.spinner.take() {
            t.join().unwrap();
        }
        self.churner.take().map_or(0, |t| t.join().unwrap())
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.set(DONE);
    }
}

/// Rounds of the churn test: each measures the victim alone, beside the CPU-only control
/// and beside the churner, for [`SLOT`] each.
const CHURN_ROUNDS: usize = 8;
/// How long each load is measured in a round: short, so that the machine's other work
/// falls alike on all three.
const SLOT: Duration = Duration::from_millis(250);
/// Left out at the start of each churn slot: the churner's source refilled part of its
/// bucket while it paused, and spends it first.
const CHURN_WARMUP: Duration = Duration::from_millis(150);
/// The least share of its throughput alone the victim keeps beside the churner (issue 34:
/// 0.7, where a CPU-only control keeps about 0.75; without the limits it kept 0.01-0.45).
const MIN_CHURN_SHARE: f64 = 0.7;
/// Sessions the broker may hold beside the victim's at a churn slot's end: those the
/// churner's rate admits, not yet ended.
const CHURN_SESSIONS_SLACK: f64 = 32.0;

/// One process that connects, sends a call and closes without reading, as fast as it
/// can, is held to its source's accept rate; a well-behaved client keeps its throughput
/// (as much as beside a load that only spins the CPU), and the broker's open sessions
/// stay near the number of live callers.
/// On both engines.
#[test]
fn a_connect_send_close_churner_leaves_other_clients_their_throughput() {
    let _measuring = measuring();
    for engine in ENGINES {
        churner(engine);
    }
}

fn churner(engine: &str) {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let args = [
        "--engine",
        engine,
        "--threads",
        "1",
        "--upstream",
        &upstream,
    ];
    let broker = Spawned::start("broker", &args);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(broker.wait_serving());
    let victim = Victim::start(broker.rpc);
    rt.block_on(testkit::wait_until("the victim's calls go through", || {
        victim.calls() > 0
    }));
    let load = Load::start(broker.rpc);
    let open = || broker.metric("rpcmesh_connections_open", &[("side", "inbound")]);
    // Calls in each slot, in order: alone, beside the spinner, beside the churner, round
    // after round, and alone once more at the end.
    let mut slots: Vec<f64> = Vec::new();
    let mut most_open: f64 = 0.0;
    for mode in [IDLE, SPIN, CHURN]
        .repeat(CHURN_ROUNDS)
        .into_iter()
        .chain([IDLE])
    {
        load.set(mode);
        if mode == CHURN {
            std::thread::sleep(CHURN_WARMUP);
        }
        let before = victim.calls();
        std::thread::sleep(SLOT);
        slots.push((victim.calls() - before) as f64);
        if mode == CHURN {
            most_open = most_open.max(open());
        }
    }
    let churned = load.stop();
    drop(victim);
    let refused = broker.metric("rpcmesh_connections_refused_total", &inbound("source_rate"));
    let admitted = broker.metric("rpcmesh_connections_opened_total", &[("side", "inbound")]);
    // Each loaded slot against the slots alone on either side of it (the machine's other
    // work drifts slowly); the median over the rounds.
    let share = |offset: usize| {
        let mut r: Vec<f64> = (0..CHURN_ROUNDS)
            .map(|k| slots[3 * k + offset] / ((slots[3 * k] + slots[3 * k + 3]) / 2.0))
            .collect();
        r.sort_by(f64::total_cmp);
        r[CHURN_ROUNDS / 2]
    };
    let (control, churn) = (share(1), share(2));
    eprintln!(
        "{engine}: victim's calls beside a spinning thread: {control:.2} of those alone, beside the churner: {churn:.2} (medians of {CHURN_ROUNDS} rounds; calls per slot {slots:?}); the churner sent {churned} calls, {refused} of its connections refused, {admitted} accepted in all; at most {most_open} sessions open"
    );
    assert!(
        refused > admitted,
        "{engine}: the churner was held to its rate: {refused} refused, {admitted} accepted"
    );
    assert!(
        churn >= MIN_CHURN_SHARE,
        "{engine}: beside the churner the victim kept {churn:.2} of its calls (beside a spinning thread: {control:.2})"
    );
    assert!(
        most_open <= 1.0 + CHURN_SESSIONS_SLACK,
        "{engine}: {most_open} sessions open for one live caller"
    );
}

/// The most heartbeat-only sockets the cap test holds (issue 34's attack: 9,998 of them
/// held a broker's 10,000 connections for 3.7 KB/s).
const HEARTBEATERS: usize = 9_998;
/// Heartbeat-only sockets opened from each source address: under the per-source cap
/// (1,024) and burst, so that only the connection cap and the idle timeout are at play.
const HEARTBEATERS_PER_SOURCE: usize = 1_000;
/// The broker's idle timeout in the heartbeat test: well beyond the time the sockets take
/// to fill the cap (about 2 s on a loaded 2-core machine, the other tests of this file
/// that load it kept out by [`MEASURING`]).
const HEARTBEAT_IDLE: Duration = Duration::from_secs(6);
/// How often each socket sends a heartbeat: six times per idle period.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// Rounds of heartbeats sent at most (a hang detector: 10 idle periods).
const HEARTBEAT_ROUNDS: usize = 60;
/// File descriptors the test and the broker keep beside the sockets.
const FD_SPARE: u64 = 1_024;

/// As many sockets as the machine's descriptor limit allows (up to [`HEARTBEATERS`]) fill
/// the broker's connection cap and send nothing but heartbeats, six per idle period: a
/// newcomer is refused while they hold the cap, and the idle timeout closes every one of
/// them all the same; then a newcomer is served.
#[test]
fn heartbeat_only_sockets_cannot_hold_the_connection_cap() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    use std::io::Read;
    let _measuring = measuring();
    // The test and the broker (its child) may hold as many descriptors as allowed.
    let limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard),
            maximum: limit.maximum,
        },
    )
    .unwrap();
    let n =
        HEARTBEATERS.min(usize::try_from(hard.saturating_sub(FD_SPARE)).unwrap_or(HEARTBEATERS));
    assert!(n >= 1_000, "{hard} descriptors allow only {n} sockets");
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let (cap, idle) = (n.to_string(), format!("{}ms", HEARTBEAT_IDLE.as_millis()));
    let broker = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--max-connections",
            &cap,
            "--idle-timeout",
            &idle,
            "--upstream",
            &upstream,
        ],
    );
    let mut beat = bytes::BytesMut::new();
    rpcmesh_wire::body::Heartbeat::put_now(&mut beat, 1, "hostile", "0").unwrap();
    let mut open: Vec<Option<std::net::TcpStream>> = (0..n)
        .map(|i| {
            let source = testkit::loopback_source(1 + (i / HEARTBEATERS_PER_SOURCE) as u16);
            let mut s = testkit::connect_from(source, broker.rpc, testkit::WAIT_TIMEOUT).unwrap();
            s.write_all(&beat).unwrap();
            Some(s)
        })
        .collect();
    let inbound_open = || broker.metric("rpcmesh_connections_open", &[("side", "inbound")]);
    let closed = || broker.metric("rpcmesh_connections_closed_total", &inbound("idle_timeout"));
    testkit::wait_until_blocking("the heartbeat sockets fill the cap", || {
        inbound_open() >= n as f64 || closed() > 0.0
    });
    assert_eq!(
        closed(),
        0.0,
        "the sockets filled the cap within the idle timeout"
    );
    // A newcomer is accepted and closed at once.
    let mut newcomer = std::net::TcpStream::connect(broker.rpc).unwrap();
    newcomer
        .set_read_timeout(Some(testkit::WAIT_TIMEOUT))
        .unwrap();
    assert!(
        matches!(newcomer.read(&mut [0; 1]), Ok(0) | Err(_)),
        "a newcomer is refused while the heartbeat sockets hold the cap"
    );
    let mut rounds = 0;
    while closed() < n as f64 && rounds < HEARTBEAT_ROUNDS {
        for slot in &mut open {
            if let Some(s) = slot {
                if s.write_all(&beat).is_err() {
                    *slot = None;
                }
            }
        }
        rounds += 1;
        std::thread::sleep(HEARTBEAT_EVERY);
    }
    let refused = broker.metric(
        "rpcmesh_connections_refused_total",
        &inbound("connection_cap"),
    );
    eprintln!(
        "{n} heartbeat-only sockets: {} closed idle after {rounds} rounds of heartbeats; {refused} newcomers refused at the cap meanwhile",
        closed()
    );
    assert!(refused >= 1.0, "the newcomer was refused at the cap");
    assert!(
        rounds as f64 >= HEARTBEAT_IDLE.as_secs_f64() / HEARTBEAT_EVERY.as_secs_f64() - 1.0,
        "heartbeats went on for an idle period"
    );
    assert_eq!(
        closed(),
        n as f64,
        "every heartbeat-only socket was closed idle"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert!(rt.block_on(broker.call_succeeds()), "a newcomer is served");
    drop(open);
}

/// Connections one source tries to open at once in the per-source test: beyond its share.
const ONE_SOURCE: usize = 1_100;
/// Connections it tries again at once, once it has closed its share: its bucket, spent by
/// the first ones, refills 64 a second, so that these would all get in only after about
/// 16 s.
const ONE_SOURCE_AGAIN: usize = 1_000;

/// With the default limits, one source that opens connections as fast as it can holds at
/// most its share of the broker's connections (1,024) and, its burst spent, opens them
/// no faster than its rate: the rest are accepted and closed at once, counted by reason
/// and logged (thinned), while another source is served throughout.
/// On both engines.
#[test]
fn one_source_cannot_hold_the_whole_cap_nor_open_connections_beyond_its_rate() {
    let _measuring = measuring();
    for engine in ENGINES {
        one_source(engine);
    }
}

fn one_source(engine: &str) {
    use std::io::Read;
    let dir = std::env::temp_dir().join(format!("rpcmesh-sources-{engine}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("stderr");
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let broker = Spawned::start_with(
        "broker",
        &[
            "--engine",
            engine,
            "--threads",
            "1",
            "--upstream",
            &upstream,
        ],
        testkit::Launch {
            stderr: Some(&log),
            ..testkit::Launch::default()
        },
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(broker.wait_serving());
    let (greedy, other) = (testkit::loopback_source(1), testkit::loopback_source(2));
    let other_is_served = || {
        let Ok(mut s) = testkit::connect_from(other, broker.rpc, testkit::WAIT_TIMEOUT) else {
            return false;
        };
        s.set_read_timeout(Some(testkit::WAIT_TIMEOUT)).unwrap();
        s.write_all(&testkit::echo_request(7, "another host"))
            .unwrap();
        let codec = rpcmesh_wire::codec::FrameCodec::default();
        let mut buf = bytes::BytesMut::new();
        let mut chunk = [0; 4096];
        loop {
            if let Ok(Some(f)) = codec.decode_frame(&mut buf) {
                return f.header.req_id == 7 && f.body[0] == Status::Success as u8;
            }
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let open_from = |n: usize| -> Vec<std::net::TcpStream> {
        (0..n)
            .map(|_| testkit::connect_from(greedy, broker.rpc, testkit::WAIT_TIMEOUT).unwrap())
            .collect()
    };
    let refused = |reason| broker.metric("rpcmesh_connections_refused_total", &inbound(reason));
    let inbound_open = || broker.metric("rpcmesh_connections_open", &[("side", "inbound")]);
    // Its share, and no more.
    let held = open_from(ONE_SOURCE);
    testkit::wait_until_blocking(
        "the greedy source's connections are taken or refused",
        || inbound_open() + refused("source_connections") >= ONE_SOURCE as f64,
    );
    let share = rpcmesh_common::net::sources::DEFAULT_MAX_CONNECTIONS_PER_SOURCE;
    assert_eq!(
        inbound_open(),
        share as f64,
        "the greedy source holds its share"
    );
    assert_eq!(refused("source_connections"), (ONE_SOURCE - share) as f64);
    assert!(other_is_served(), "another source is served beside it");
    // Its burst spent, it opens no faster than its rate.
    drop(held);
    testkit::wait_until_blocking("the greedy source's connections are closed", || {
        inbound_open() == 0.0
    });
    let again = open_from(ONE_SOURCE_AGAIN);
    testkit::wait_until_blocking("its new connections are taken or refused", || {
        inbound_open() + refused("source_rate") >= ONE_SOURCE_AGAIN as f64
    });
    let by_rate = refused("source_rate");
    assert!(other_is_served(), "another source is still served");
    drop(again);
    let lines = std::fs::read_to_string(&log).unwrap();
    let logged = lines
        .lines()
        .filter(|l| l.contains("connection refused: over its source's limits"))
        .count();
    eprintln!(
        "one source opening {ONE_SOURCE} at once: {share} held, {} refused; {ONE_SOURCE_AGAIN} more once closed: {by_rate} refused by rate; {logged} log lines",
        refused("source_connections")
    );
    assert!(
        by_rate >= 1.0,
        "none of {ONE_SOURCE_AGAIN} refused by its rate"
    );
    for reason in ["source_connections", "source_rate"] {
        assert!(
            lines.contains(&format!("reason=\"{reason}\"")),
            "the refusals are logged with their reason, {reason}: {lines:.2000}"
        );
    }
    assert!(
        (logged as f64) < refused("source_connections") + by_rate,
        "the log is thinned: {logged} lines"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Providers in the file that nothing listens at, in the unreachable-providers test
/// (issue 34: 1,022 halved the broker's throughput).
const DEAD_PROVIDERS: usize = 1_000;
/// Rounds of the unreachable-providers test: each measures both brokers for [`SLOT`].
const DEAD_ROUNDS: usize = 8;

/// The least share of the throughput of a broker whose providers file lists only its live
/// provider that one listing [`DEAD_PROVIDERS`] more keeps (issue 34: under 10 % lost;
/// margin for a loaded machine; without per-provider back-off and the routing past them,
/// the broker with the dead ones kept 0.07-0.2).
const MIN_DEAD_SHARE: f64 = 0.8;

/// A thousand providers in the file that nothing listens at cost little: their connects
/// back off per provider, one at a time, and the routing offers calls to the providers
/// with connections first. Two brokers before the same live provider, one listing the
/// dead ones too, are measured in turns, each by a caller of its own.
/// On both engines.
#[test]
fn a_thousand_unreachable_providers_cost_little_throughput() {
    let _measuring = measuring();
    for engine in ENGINES {
        unreachable_providers(engine);
    }
}

fn unreachable_providers(engine: &str) {
    let dir = Scratch::new(&format!("dead-{engine}"));
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let (live, dead) = (dir.path("live"), dir.path("dead"));
    std::fs::write(&live, format!("{}\n", provider.rpc)).unwrap();
    let mut listed = format!("{}\n", provider.rpc);
    for _ in 0..DEAD_PROVIDERS {
        // A port bound and let go: nothing listens there, and connects are refused.
        listed.push_str(&format!("127.0.0.1:{}\n", testkit::free_port()));
    }
    std::fs::write(&dead, listed).unwrap();
    let start = |file: &std::path::Path| {
        Spawned::start(
            "broker",
            &[
                "--engine",
                engine,
                "--threads",
                "1",
                "--providers-file",
                file.to_str().unwrap(),
            ],
        )
    };
    let brokers = [start(&live), start(&dead)];
    let rt = tokio::runtime::Runtime::new().unwrap();
    for b in &brokers {
        rt.block_on(b.wait_serving());
    }
    let victims = brokers.each_ref().map(|b| Victim::start(b.rpc));
    for v in &victims {
        v.pause();
    }
    let mut calls = [0u64; 2];
    let mut cpu = [0f64; 2];
    for _ in 0..DEAD_ROUNDS {
        for (i, (v, b)) in victims.iter().zip(&brokers).enumerate() {
            v.resume();
            std::thread::sleep(SLOT / 5);
            let (before, c) = (v.calls(), b.cpu_seconds());
            std::thread::sleep(SLOT);
            calls[i] += v.calls() - before;
            cpu[i] += b.cpu_seconds() - c;
            v.pause();
        }
    }
    let [alone, with_dead] = calls.map(|c| c as f64);
    let refused = brokers[1].metric("rpcmesh_upstream_connect_failures_total", &[]);
    eprintln!(
        "{engine}: calls through a broker of one live provider: {alone}; with {DEAD_PROVIDERS} dead ones too: {with_dead} ({:.2}); broker CPU per call {:.1} µs and {:.1} µs; {refused} connects refused in all",
        with_dead / alone,
        cpu[0] / alone * 1e6,
        cpu[1] / with_dead * 1e6,
    );
    assert!(
        with_dead >= MIN_DEAD_SHARE * alone,
        "{engine}: {with_dead} calls with the dead providers, {alone} without"
    );
}

/// Idle connections held open to `/metrics` in the scrape test (issue 34: behind 305 of
/// them, a Prometheus scrape took 43 s).
const IDLE_SCRAPERS: usize = 300;

/// With hundreds of connections to `/metrics` held open and idle, a scrape is answered:
/// each newcomer takes the place of the connection idle longest, and the scrape's own
/// answer shows that none was closed by a timeout before it (so it did not wait for
/// one), while the idle ones were closed to make room.
#[test]
fn a_scrape_is_answered_while_hundreds_of_idle_connections_are_held_open() {
    use std::io::Read;
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let metrics = provider.metrics.unwrap();
    let idle: Vec<std::net::TcpStream> = (0..IDLE_SCRAPERS)
        .map(|_| std::net::TcpStream::connect(metrics).unwrap())
        .collect();
    let mut scrape = std::net::TcpStream::connect(metrics).unwrap();
    scrape
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    scrape
        .set_read_timeout(Some(testkit::WAIT_TIMEOUT))
        .unwrap();
    let mut answer = String::new();
    scrape
        .read_to_string(&mut answer)
        .expect("the scrape is answered before the hang detector gives up");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:.200}");
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let closed = |reason| {
        rpcmesh_common::metrics::recorder::sample(
            body,
            "rpcmesh_scrape_connections_closed_total",
            &[("reason", reason)],
        )
        .unwrap_or(-1.0)
    };
    let (evicted, timed_out) = (closed("evicted"), closed("timeout"));
    eprintln!(
        "a scrape behind {IDLE_SCRAPERS} idle connections: answered with {evicted} idle ones evicted, {timed_out} timed out"
    );
    assert_eq!(timed_out, 0.0, "the scrape waited for no timeout");
    assert!(
        evicted >= 1.0,
        "idle connections made room for it: {evicted}"
    );
    drop(idle);
}

/// A scratch folder of one test, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("rpcmesh-bounds-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, file: &str) -> std::path::PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Replaces `path` with a file holding `text`, as Ansible and editors do (rename).
fn replace_file(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A providers file that lists no provider (left empty, or cut short to its comments) is
/// refused: a broker does not start on it, and one running keeps its providers, logs why
/// and counts the read kept out; with `--allow-empty-providers` it is taken.
#[test]
fn an_empty_providers_file_is_refused_unless_allowed() {
    let dir = Scratch::new("empty");
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let file = dir.path("providers");
    let log = dir.path("stderr");
    std::fs::write(&file, "").unwrap();
    // At the start: refused, saying why (a broker that starts is stopped by the guard).
    let started = std::process::Command::new(testkit::bin_path("broker"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "off"])
        .arg("--providers-file")
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let status = testkit::ChildGuard(Some(started)).wait_timeout(testkit::WAIT_TIMEOUT);
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        status.is_some_and(|s| !s.success()),
        "a broker started on an empty file ({status:?}): {said}"
    );
    assert!(said.contains("lists no provider"), "{said}");
    // Running: a file cut short is kept out, and the providers stay.
    std::fs::write(&file, format!("{}\n", provider.rpc)).unwrap();
    let broker = Spawned::start_with(
        "broker",
        &["--threads", "1", "--providers-file", file.to_str().unwrap()],
        testkit::Launch {
            stderr: Some(&log),
            ..testkit::Launch::default()
        },
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(broker.wait_serving());
    let reloads = |result| broker.metric("rpcmesh_config_reloads_total", &[("result", result)]);
    for (i, text) in ["", "# the providers\n"].into_iter().enumerate() {
        replace_file(&file, text);
        testkit::wait_until_blocking("the empty file to be kept out", || {
            reloads("error") >= (i + 1) as f64
        });
        assert!(
            rt.block_on(broker.call_succeeds()),
            "the provider still serves"
        );
    }
    testkit::wait_until_blocking("the refusal to be logged", || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .any(|l| l.contains("lists no provider") && l.contains("kept out"))
    });
    assert_eq!(reloads("ok"), 0.0);
    drop(broker);
    // Allowed: taken, and the provider leaves.
    std::fs::write(&file, format!("{}\n", provider.rpc)).unwrap();
    let broker = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--allow-empty-providers",
            "--providers-file",
            file.to_str().unwrap(),
        ],
    );
    rt.block_on(broker.wait_serving());
    replace_file(&file, "");
    testkit::wait_until_blocking("the empty file to be taken", || {
        broker.metric("rpcmesh_config_reloads_total", &[("result", "ok")]) >= 1.0
    });
    testkit::wait_until_blocking("no call to be served", || {
        !rt.block_on(broker.call_succeeds())
    });
}

/// CPU time that shows a provider's handler is burning its thread (an idle provider uses
/// none).
const BURNING: f64 = 0.3;

/// A provider whose only runtime thread is held by a handler (an hour of CPU work) still
/// ends on SIGTERM: not when the handler is done, but once its grace period and the exit
/// margin are over, by the deadline thread, which says so and exits 70 (`EX_SOFTWARE`).
#[test]
fn sigterm_ends_a_provider_whose_handler_holds_its_only_thread() {
    let _measuring = measuring();
    let dir = Scratch::new("burn");
    let log = dir.path("stderr");
    let mut provider = Spawned::start_with(
        "provider",
        &[
            "--threads",
            "1",
            "--service-work",
            "--service-time",
            "1h",
            "--grace",
            "1s",
        ],
        testkit::Launch {
            stderr: Some(&log),
            ..testkit::Launch::default()
        },
    );
    // The call that holds the thread (its answer never comes): the provider burns CPU.
    let cpu = provider.cpu_seconds();
    let mut held = std::net::TcpStream::connect(provider.rpc).unwrap();
    held.write_all(&testkit::echo_request(1, "an hour of work"))
        .unwrap();
    testkit::wait_until_blocking("the handler holds the thread", || {
        provider.cpu_seconds() > cpu + BURNING
    });
    provider.child.signal(testkit::Signal::TERM);
    let status = provider
        .child
        .wait_timeout(testkit::WAIT_TIMEOUT)
        .expect("it ends on SIGTERM, an hour before its handler would");
    let code = rpcmesh_common::cli::startup::EXIT_DEADLINE_STATUS;
    assert_eq!(status.code(), Some(code), "{status}");
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("past the grace period"), "{said}");
}

/// Calls the slow provider of the blocked-file test holds (each for a minute).
const HELD_AT_SIGTERM: usize = 4;

/// A broker whose providers file was replaced by a named pipe (which used to block its
/// reads and its SIGTERM) ends on SIGTERM once the calls it holds are answered "the grace
/// period ended", and exits 0.
#[test]
fn sigterm_ends_a_broker_on_a_blocked_file_at_its_grace_period() {
    let dir = Scratch::new("fifo");
    let slow = Spawned::start("provider", &["--threads", "1", "--service-time", "60s"]);
    let file = dir.path("providers");
    std::fs::write(&file, format!("{}\n", slow.rpc)).unwrap();
    let mut broker = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--grace",
            "1s",
            "--call-timeout",
            "120s",
            "--providers-file",
            file.to_str().unwrap(),
        ],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(testkit::wait_until("the slow provider is pooled", || {
        broker.metric("rpcmesh_pool_healthy_connections", &[]) >= 1.0
    }));
    testkit::replace_with_fifo(&file);
    broker.child.signal(testkit::Signal::HUP);
    rt.block_on(testkit::wait_until("the pipe to be kept out", || {
        broker.metric("rpcmesh_config_reloads_total", &[("result", "error")]) >= 1.0
    }));
    let client = rt
        .block_on(Client::connect(
            broker.rpc,
            ClientConfig {
                timeout: Duration::from_secs(120),
                ..ClientConfig::default()
            },
        ))
        .unwrap();
    let calls = rt.block_on(async { testkit::echo_calls(&client, HELD_AT_SIGTERM) });
    rt.block_on(testkit::wait_until("the calls are in flight", || {
        broker.metric("rpcmesh_calls_in_flight", &[]) == HELD_AT_SIGTERM as f64
    }));
    broker.child.signal(testkit::Signal::TERM);
    for call in calls {
        let reply = rt.block_on(call).unwrap().expect("an answer");
        assert_eq!(reply.status, Status::Unavailable);
        assert!(
            reply.error_msg.contains("grace period ended"),
            "{}",
            reply.error_msg
        );
    }
    let status = broker
        .child
        .wait_timeout(testkit::WAIT_TIMEOUT)
        .expect("it ends on SIGTERM");
    assert!(status.success(), "{status}");
}

/// The memory budget of the broker in the 128 KiB flood: small beside the flood, so that
/// the flood's excess shows beside the fixed overhead.
const SMALL_FLOOD_BUDGET_MIB: usize = 32;
/// Callers in the 128 KiB flood, each pipelining echo calls of [`SMALL_FLOOD_FRAME`]
/// without reading a reply: together four times the budget in frames under the pause
/// floor (256 KiB), which a connection alone is never paused for.
const SMALL_FLOODERS: usize = 1_000;
/// Threads sending the flood, each for its share of the callers.
const SMALL_FLOOD_THREADS: usize = 16;
/// Each flooder's frames: under the pause floor.
const SMALL_FLOOD_FRAME: usize = 128 << 10;
/// Frames each caller of the flood sends at most: 1 GiB in all, beyond what the broker
/// holds at once many times over.
const SMALL_FLOOD_FRAMES: usize = 8;
/// Small calls made while the flood goes on.
const FLOOD_SMALL_CALLS: usize = 20;

/// A thousand callers pipelining 128 KiB calls without reading a reply, four times the
/// budget in frames none of which is large enough for its connection to be paused alone:
/// what the broker buffers stays within its budget (every connection counts its base, and
/// reads on only while what its buffer must grow by fits), small calls on another
/// connection are all answered, and its resident memory stays within the budget and the
/// fixed overhead (`RSS_OVERHEAD`: a partial frame left after others were split off is
/// copied out under pressure, so that their allocation goes).
#[test]
fn a_flood_of_frames_under_the_pause_floor_stays_within_the_budget() {
    let _measuring = measuring();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_provider, broker) =
        rt.block_on(testkit::budgeted_broker_with(SMALL_FLOOD_BUDGET_MIB, &[]));
    let budget = SMALL_FLOOD_BUDGET_MIB << 20;
    // The caller of small calls is connected before the flood, not queued behind it.
    let client = rt
        .block_on(Client::connect(broker.rpc, ClientConfig::default()))
        .unwrap();
    let peak = broker.watch_rss();
    let stop = Arc::new(AtomicBool::new(false));
    let body = "x".repeat(SMALL_FLOOD_FRAME - 64);
    let flooders: Vec<_> = (0..SMALL_FLOOD_THREADS)
        .map(|t| {
            let (to, stop) = (broker.rpc, stop.clone());
            let request = testkit::echo_request(t as u64, &body);
            std::thread::spawn(move || {
                // Half the callers on each of two sources, within the per-source cap.
                let mut callers: Vec<(std::net::TcpStream, usize, usize)> = (t..SMALL_FLOODERS)
                    .step_by(SMALL_FLOOD_THREADS)
                    .map(|f| {
                        let source = testkit::loopback_source(1 + u16::from(f % 2 == 1));
                        let s = testkit::connect_from(source, to, testkit::WAIT_TIMEOUT).unwrap();
                        s.set_nonblocking(true).unwrap();
                        (s, 0, 0)
                    })
                    .collect();
                // Round after round, each caller sends what its socket takes of its next
                // frame, until every one has sent its frames or the broker takes no more.
                let mut sent = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut moved = false;
                    for (s, frames, at) in &mut callers {
                        if *frames == SMALL_FLOOD_FRAMES {
                            continue;
                        }
                        match s.write(&request[*at..]) {
                            Ok(n) => {
                                moved = true;
                                *at += n;
                                if *at == request.len() {
                                    (*frames, *at) = (*frames + 1, 0);
                                    sent += 1;
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            Err(_) => *frames = SMALL_FLOOD_FRAMES,
                        }
                    }
                    if !moved {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                (callers.into_iter().map(|c| c.0).collect::<Vec<_>>(), sent)
            })
        })
        .collect();
    // Past half the budget, where large calls are refused: the flood weighs on it.
    let mut buffered: f64 = 0.0;
    rt.block_on(testkit::wait_until(
        "the flood passes half the budget",
        || {
            buffered = buffered.max(broker.metric("rpcmesh_buffered_bytes", &[]));
            buffered >= budget as f64 * 0.5
        },
    ));
    for i in 0..FLOOD_SMALL_CALLS {
        let r = rt
            .block_on(async { testkit::echo_call(&client, "small").await })
            .unwrap()
            .unwrap();
        assert_eq!(r.status, Status::Success, "small call {i}: {}", r.error_msg);
        buffered = buffered.max(broker.metric("rpcmesh_buffered_bytes", &[]));
    }
    stop.store(true, Ordering::Relaxed);
    let (sockets, sent): (Vec<Vec<std::net::TcpStream>>, Vec<usize>) =
        flooders.into_iter().map(|f| f.join().unwrap()).unzip();
    let peak = peak.stop();
    let sent: usize = sent.iter().sum();
    eprintln!(
        "{SMALL_FLOODERS} callers sent {sent} calls of {SMALL_FLOOD_FRAME} B: buffered at most {:.1} MiB (budget {} MiB), RSS peaked at {:.1} MiB",
        buffered / f64::from(1 << 20),
        budget >> 20,
        peak as f64 / 1024.0,
    );
    assert!(
        buffered <= budget as f64,
        "the broker buffered {buffered} bytes"
    );
    assert!(
        peak << 10 <= (budget + RSS_OVERHEAD) as u64,
        "the broker's RSS peaked at {peak} KiB, past its budget and overhead"
    );
    drop(sockets);
}
