//! [`NotifySocket`]: the service manager's side of sd_notify(3), for a test that runs a
//! program as systemd would (`NOTIFY_SOCKET` in its environment) and reads what it says:
//! `READY=1`, `STOPPING=1`, `WATCHDOG=1`. A Unix datagram socket at a fresh path in the
//! temporary folder, removed when dropped.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;

use crate::wait::{WAIT_POLL, WAIT_TIMEOUT};

/// Largest notification read: sd_notify messages are a few lines of `KEY=value`.
const MAX_MESSAGE: usize = 4096;

/// A socket a program under test sends its notifications to.
#[derive(Debug)]
pub struct NotifySocket {
    socket: UnixDatagram,
    path: PathBuf,
}

impl NotifySocket {
    /// Binds a socket at a path no other test uses.
    pub fn bind() -> NotifySocket {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "rpcmesh-notify-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
        socket
            .set_nonblocking(true)
            .expect("a non-blocking notify socket");
        NotifySocket { socket, path }
    }

    /// The value of `NOTIFY_SOCKET` for the program.
    pub fn path(&self) -> &str {
        self.path.to_str().expect("a UTF-8 temporary path")
    }

    /// The messages received so far and not yet read (each a datagram's text), without
    /// waiting.
    pub fn received(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut buf = [0u8; MAX_MESSAGE];
        while let Ok(n) = self.socket.recv(&mut buf) {
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        out
    }

    /// Waits for a message with the line `line` (e.g. `READY=1`) and returns it with the
    /// messages that came before it; fails the test after [`WAIT_TIMEOUT`] (a hang
    /// detector). Blocking: call it from a test thread, not a runtime's worker.
    pub fn wait_for_line(&self, line: &str) -> (String, Vec<String>) {
        let give_up = std::time::Instant::now() + WAIT_TIMEOUT;
        let mut before = Vec::new();
        loop {
            for m in self.received() {
                if m.lines().any(|l| l == line) {
                    return (m, before);
                }
                before.push(m);
            }
            assert!(
                std::time::Instant::now() < give_up,
                "no {line} on the notify socket within {WAIT_TIMEOUT:?}; got {before:?}"
            );
            std::thread::sleep(WAIT_POLL);
        }
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
