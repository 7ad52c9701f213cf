//! [`ChildGuard`]: a child process that a failing test cannot leave behind, signalled by
//! PID through the kernel (no `kill` command).

use std::time::Duration;

pub use rustix::process::Signal;

use crate::wait::WAIT_POLL;

/// A child process killed (SIGKILL) and reaped when dropped, so that a failing test leaves
/// nothing behind.
#[derive(Debug)]
pub struct ChildGuard(pub Option<std::process::Child>);

impl ChildGuard {
    /// Starts `program` with `args`, stdout and stderr inherited.
    pub fn spawn(program: &std::path::Path, args: &[&str]) -> std::io::Result<ChildGuard> {
        let child = std::process::Command::new(program).args(args).spawn()?;
        Ok(ChildGuard(Some(child)))
    }

    /// The process id (0 once it has been reaped).
    pub fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, std::process::Child::id)
    }

    /// Sends `signal` (e.g. [`Signal::TERM`]) to the process, if it has not been reaped.
    pub fn signal(&self, signal: Signal) {
        let pid = i32::try_from(self.pid())
            .ok()
            .and_then(rustix::process::Pid::from_raw);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }

    /// Waits for the process to exit, up to `timeout`; returns its exit status.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.0.as_mut()?;
        // Wall time on purpose: the deadline stops a hung child.
        let end = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                self.0 = None;
                return Some(st);
            }
            if std::time::Instant::now() >= end {
                return None;
            }
            std::thread::sleep(WAIT_POLL);
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
