//! What the broker and the provider log, read from their stderr as an operator reads it:
//! the start-up lines docs/broker.md promises (a provider that accepts and never answers is
//! named as "still connecting", and said not to answer, with why), and every field in the
//! form a person reads (an address, "any service", "heartbeat not answered within 500ms"),
//! never Rust's debug form (`Some(…)`, `[…]`, `TimedOut`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use rpcmesh_testkit::{Launch, Signal, Spawned, WAIT_TIMEOUT, wait_until};

fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rpcmesh-logs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn log_of(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The line of `log` with `message`, failing the test with the whole log if there is none.
fn line<'a>(log: &'a str, message: &str) -> &'a str {
    log.lines()
        .find(|l| l.contains(message))
        .unwrap_or_else(|| panic!("no line with {message:?} in:\n{log}"))
}

/// No field of any line is in Rust's debug form.
fn assert_display_form(log: &str) {
    for l in log.lines() {
        for debug in ["Some(", "None", "=[", "TimedOut", "{ "] {
            assert!(!l.contains(debug), "{debug:?} in {l:?}");
        }
    }
}

fn stop(name: &str, mut p: Spawned) {
    p.child.signal(Signal::TERM);
    let status = p
        .child
        .wait_timeout(WAIT_TIMEOUT)
        .unwrap_or_else(|| panic!("{name} did not exit on SIGTERM"));
    assert!(status.success(), "{name}: {status}");
}

/// On both engines: the lines are the broker's, not an engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_and_stop_lines_say_what_the_docs_say_in_the_form_people_read() {
    for engine in ["tokio", "loop"] {
        start_and_stop_lines(engine).await;
    }
}

async fn start_and_stop_lines(engine: &str) {
    let dir = test_dir(&format!("start-{engine}"));
    let (plog, blog) = (dir.join("provider.log"), dir.join("broker.log"));
    // Never accepted: the kernel completes the broker's connects in the backlog, and
    // nothing ever answers on them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let provider = Spawned::start_with(
        "provider",
        &["--threads", "1"],
        Launch {
            stderr: Some(&plog),
            ..Launch::default()
        },
    );
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
            "--upstream",
            &format!("SilentService={silent_addr}"),
            "--connect-timeout",
            "500ms",
            "--health-timeout",
            "500ms",
        ],
        Launch {
            stderr: Some(&blog),
            ..Launch::default()
        },
    );
    broker.wait_serving().await;
    wait_until(
        "the broker's listening line, and the silent provider's",
        || {
            let log = log_of(&blog);
            log.contains("broker listening") && log.contains("provider not answering")
        },
    )
    .await;
    stop("broker", broker);
    stop("provider", provider);
    drop(silent);

    let log = log_of(&blog);
    let connecting = line(&log, "providers still connecting");
    assert!(connecting.contains("WARN"), "{connecting}");
    assert!(
        connecting.contains(&format!("providers={silent_addr}")),
        "{connecting}"
    );
    assert!(!connecting.contains(&upstream), "{connecting}");
    let silent_line = line(&log, "provider not answering");
    assert!(
        silent_line.contains("error=heartbeat not answered within 500ms"),
        "{silent_line}"
    );
    let listening = line(&log, "broker listening");
    assert!(
        listening.contains(&format!(
            "upstreams=\"{upstream} SilentService={silent_addr}\""
        )),
        "{listening}"
    );
    assert!(
        listening.contains(" addr=127.0.0.1:")
            && listening.contains(" balance=peak-ewma")
            && listening.contains(&format!(" engine={engine}")),
        "{listening}"
    );
    let draining = line(&log, "listener closed; draining");
    assert!(draining.contains(" addr=127.0.0.1:"), "{draining}");
    assert!(listening.contains(" busy_poll=50us"), "{listening}");
    let stopped = line(&log, "broker stopped");
    assert!(stopped.contains(" refused=0 cut=0 aborted=0"), "{stopped}");
    assert_display_form(&log);

    let log = log_of(&plog);
    let listening = line(&log, "provider listening");
    assert!(
        listening.contains(" addr=127.0.0.1:")
            && listening.contains("services=EchoService,PlatformService")
            && listening.contains("service_mode=sleep"),
        "{listening}"
    );
    line(&log, "provider stopped");
    assert_display_form(&log);
    let _ = std::fs::remove_dir_all(&dir);
}
