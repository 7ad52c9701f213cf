//! Headless Chromium for the tests that check what a browser makes of a page (the
//! capacity report's charts): the DOM after the page's scripts ran.

use std::time::Duration;

/// How long [`headless_dom`] lets Chromium run before it kills it: a hang detector (one
/// run takes about a second).
pub const HEADLESS_TIMEOUT: Duration = Duration::from_secs(60);

/// The DOM of the HTML file `html` as headless Chromium serialises it after the page's
/// scripts ran (`chromium --headless --dump-dom`; Debian package `chromium`, which
/// `scripts/deps` installs; `$CHROMIUM` names another binary). Each run has a throwaway
/// profile, cache and config folder under the temporary folder, removed afterwards.
/// Chromium runs in its own process group, killed (SIGKILL, by its id) with every helper
/// process it started if it runs past [`HEADLESS_TIMEOUT`]; that is a `TimedOut` error.
/// What it says on stderr (D-Bus and crash-reporter complaints, in a container) is only
/// quoted in errors, never a failure by itself.
pub fn headless_dom(html: &std::path::Path) -> std::io::Result<String> {
    use std::os::unix::process::CommandExt as _;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let html = std::fs::canonicalize(html)?;
    let dir = std::env::temp_dir().join(format!(
        "rpcmesh-chromium-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (out, err) = (dir.join("dom.html"), dir.join("stderr.txt"));
    let program = std::env::var_os("CHROMIUM").unwrap_or_else(|| "chromium".into());
    let spawned = std::process::Command::new(&program)
        .args([
            "--headless",
            // Root in a container: Chromium's sandbox needs user namespaces it lacks.
            "--no-sandbox",
            "--disable-gpu",
            // A container's /dev/shm is often 64 MB, too small for the renderer.
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
        ])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .arg("--dump-dom")
        .arg(file_url(&html))
        .env("HOME", &dir)
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::fs::File::create(&err)?)
        .process_group(0)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(std::io::Error::new(
                e.kind(),
                format!(
                    "run {}: {e} (run scripts/deps: Debian package chromium)",
                    program.to_string_lossy()
                ),
            ));
        }
    };
    // Wall time on purpose: the deadline stops a hung browser.
    let deadline = std::time::Instant::now() + HEADLESS_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(rpcmesh_testkit::WAIT_POLL)
            }
            Ok(None) => {
                // The group's id is the child's PID (process_group(0)): this ends the
                // browser and the helper processes it forked, nothing else.
                let group = i32::try_from(child.id())
                    .ok()
                    .and_then(rustix::process::Pid::from_raw);
                if let Some(group) = group {
                    let _ =
                        rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
                }
                let _ = child.kill();
                let _ = child.wait();
                break Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("chromium still running after {HEADLESS_TIMEOUT:?}; killed"),
                ));
            }
            Err(e) => break Err(e),
        }
    };
    let dom = std::fs::read_to_string(&out);
    let said = std::fs::read_to_string(&err).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    let status = status.map_err(|e| std::io::Error::new(e.kind(), format!("{e}\n{said}")))?;
    let dom = dom?;
    if !status.success() || dom.trim().is_empty() {
        return Err(std::io::Error::other(format!(
            "chromium --dump-dom {}: {status}, {} bytes of DOM\n--- stderr\n{said}",
            html.display(),
            dom.len()
        )));
    }
    Ok(dom)
}

/// The `file://` URL of the absolute path `path`, bytes other than unreserved ones and `/`
/// percent-encoded.
fn file_url(path: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt as _;
    let mut url = String::from("file://");
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            url.push(char::from(b));
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}
