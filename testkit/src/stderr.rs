//! Stderr sinks that take nothing, for the tests that prove logging never fails or blocks
//! a program: [`closed_pipe`] (its reader has gone: every write fails, as after
//! `program 2>&1 | head` once `head` has exited, or a journald restarted) and
//! [`full_pipe`] (its reader never reads and it is full already: every write waits for
//! ever). A child gets one through [`crate::Launch::stderr_fd`].

use std::os::fd::OwnedFd;

/// The size [`full_pipe`] gives its pipe: one page, the least the kernel allows, so that
/// the test fills it with one write.
const FULL_PIPE_BYTES: usize = 4096;

/// The write end of a pipe whose read end is closed already.
pub fn closed_pipe() -> OwnedFd {
    let (read, write) = rustix::pipe::pipe().expect("make a pipe");
    drop(read);
    write
}

/// A pipe that is full: `(read, write)`. Keep the read end open and never read it, and
/// every write to the pipe waits.
pub fn full_pipe() -> (OwnedFd, OwnedFd) {
    let (read, write) = rustix::pipe::pipe().expect("make a pipe");
    let size = rustix::pipe::fcntl_setpipe_size(&write, FULL_PIPE_BYTES).expect("size the pipe");
    // A write of the whole capacity into an empty pipe never waits; after it, any does.
    let fill = vec![b'#'; size];
    let written = rustix::io::write(&write, &fill).expect("fill the pipe");
    assert_eq!(written, size, "the pipe takes its capacity at once");
    (read, write)
}
