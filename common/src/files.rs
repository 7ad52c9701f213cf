//! Opening a file a program reads while it runs (the broker's providers file, the
//! authorization policy, TLS certificates and keys): opened without blocking, and only if
//! it is a regular file. A named pipe would block `open` until someone wrote to it (and
//! with it the reload, and the process's SIGTERM), a device or `/proc` file could stream
//! without end: each is refused with an error that says what the path is, and the caller
//! keeps what it had. Each caller then reads at most its own bound.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Opens `path` for reading without blocking (`O_NONBLOCK`, which a regular file ignores),
/// and refuses it unless it is a regular file.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_fifo() {
        "a named pipe"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file: refused"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_pipe_is_refused_without_blocking_and_a_file_is_opened() {
        let dir = std::env::temp_dir().join(format!("rpcmesh-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pipe = dir.join("pipe");
        let _ = std::fs::remove_file(&pipe);
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &pipe,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        )
        .unwrap();
        let e = open_regular(&pipe).unwrap_err();
        assert!(e.to_string().contains("named pipe"), "{e}");
        let e = open_regular(&dir).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        let file = dir.join("file");
        std::fs::write(&file, "a:1\n").unwrap();
        assert!(open_regular(&file).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
