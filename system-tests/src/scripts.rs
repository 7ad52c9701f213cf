//! Running the workspace's own commands from a test: the measurement scripts
//! (`scripts/bench`, `scripts/accuracy`, `scripts/capacity-lab`, `scripts/faults`) in their
//! smoke mode and the deployment rehearsal (`deploy/rehearse`), from the workspace root,
//! their output to files (nothing blocks on a full pipe), killed if they hang.

use std::time::Duration;

/// The folder of provider, broker and driver built in the profile the tests run in (each
/// through [`rpcmesh_testkit::bin_path`], which builds it if needed): what the measurement
/// scripts' smoke runs and the deployment rehearsal get as `--bin-dir`.
/// Their full runs use release builds; a smoke run checks that everything runs, and a
/// release build from scratch would cost CI about five minutes.
pub fn program_dir() -> std::path::PathBuf {
    for name in ["provider", "broker"] {
        rpcmesh_testkit::bin_path(name);
    }
    let driver = rpcmesh_testkit::bin_path("driver");
    driver
        .parent()
        .expect("a binary sits in its profile's folder")
        .to_path_buf()
}

/// What a script run by [`run_script`] did.
#[derive(Debug)]
pub struct ScriptRun {
    /// Its exit status.
    pub status: std::process::ExitStatus,
    /// What it printed on stdout.
    pub stdout: String,
    /// Both outputs, labelled, for assertion messages.
    pub output: String,
}

/// Runs `scripts/<name> args...` from the workspace root, its output to files (nothing can
/// block on a full pipe), and kills it if it runs past `timeout` (a hang detector: the
/// scripts bound their own waits). Panics if it cannot be started (python3 missing).
pub fn run_script(name: &str, args: &[&std::ffi::OsStr], timeout: Duration) -> ScriptRun {
    run_repo_command(&format!("scripts/{name}"), args, timeout)
}

/// Runs the workspace's command at `path` (relative to the workspace root, e.g.
/// `deploy/rehearse`) with `args`, as [`run_script`] does: from the root, output to files,
/// killed past `timeout`.
pub fn run_repo_command(path: &str, args: &[&std::ffi::OsStr], timeout: Duration) -> ScriptRun {
    let root = rpcmesh_testkit::workspace_root();
    let name = path.rsplit('/').next().unwrap_or(path);
    let dir = std::env::temp_dir().join(format!("rpcmesh-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder for the script's output");
    let (out, err) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    let mut child = std::process::Command::new(root.join(path))
        .args(args)
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("run {path} (python3 must be installed): {e}"));
    // Wall time on purpose: the deadline stops a hung script.
    let deadline = std::time::Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the script") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{path} still running after {timeout:?}; killed");
        }
        std::thread::sleep(rpcmesh_testkit::WAIT_POLL);
    };
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let output = format!(
        "--- stdout\n{stdout}\n--- stderr\n{}",
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
    ScriptRun {
        status,
        stdout,
        output,
    }
}

/// A measurement script's smoke run: what it did, and the folder it wrote its reports to
/// (removed when this is dropped).
#[derive(Debug)]
pub struct SmokeRun {
    /// The run, which exited 0.
    pub run: ScriptRun,
    /// Where its reports are.
    pub out: std::path::PathBuf,
}

impl SmokeRun {
    /// The report it wrote whose name starts with `prefix` and ends in `.ext`, read as text;
    /// panics, with the script's output, if there is none.
    pub fn report(&self, prefix: &str, ext: &str) -> String {
        let path = std::fs::read_dir(&self.out)
            .expect("the reports' folder")
            .map(|e| e.expect("a folder entry").path())
            .find(|p| {
                p.extension().is_some_and(|e| e == ext)
                    && p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
            })
            .unwrap_or_else(|| {
                panic!(
                    "no {prefix}*.{ext} in {}\n{}",
                    self.out.display(),
                    self.run.output
                )
            });
        std::fs::read_to_string(path).expect("read the report")
    }

    /// The servers' logs the run kept (`<run>/logs/<server>-<n>.err`) whose names start with
    /// one of `prefixes`, each under its name: for a failed assertion's message (the folder
    /// goes with the run).
    pub fn logs(&self, prefixes: &[&str]) -> String {
        let mut found: Vec<std::path::PathBuf> = std::fs::read_dir(&self.out)
            .into_iter()
            .flatten()
            .flatten()
            .map(|run| run.path().join("logs"))
            .filter_map(|dir| std::fs::read_dir(dir).ok())
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
                name.is_some_and(|n| {
                    n.ends_with(".err") && prefixes.iter().any(|pre| n.starts_with(pre))
                })
            })
            .collect();
        found.sort();
        found
            .iter()
            .map(|p| {
                let text = std::fs::read_to_string(p).unwrap_or_default();
                format!("--- {}\n{text}", p.display())
            })
            .collect()
    }
}

impl Drop for SmokeRun {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// Runs `scripts/<name> --smoke --bin-dir BINS --out DIR` on the tests' build of the
/// programs ([`program_dir`]), DIR a fresh folder under `tmp` (a test's
/// `CARGO_TARGET_TMPDIR`), and asserts that it exited 0; `timeout` as in [`run_script`].
pub fn smoke_script(name: &str, tmp: &std::path::Path, timeout: Duration) -> SmokeRun {
    let bins = program_dir();
    let out = tmp.join(format!("{name}-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("a folder for the reports");
    let run = run_script(
        name,
        &[
            "--smoke".as_ref(),
            "--bin-dir".as_ref(),
            bins.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        timeout,
    );
    assert!(
        run.status.success(),
        "scripts/{name} --smoke failed ({})\n{}",
        run.status,
        run.output
    );
    SmokeRun { run, out }
}

/// The network namespaces a lab script (`capacity-lab`: `rpcm`, `faults`: `rpcf`) left
/// behind: those named `<prefix><pid>-<host>`. Only the lab's own are looked for: a
/// deployment rehearsal's (`rpcm-<machine>`) may exist meanwhile.
pub fn lab_namespaces_left(prefix: &str) -> Vec<String> {
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list (iproute2: scripts/deps)");
    String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| {
            name.strip_prefix(prefix)
                .and_then(|rest| rest.split_once('-'))
                .is_some_and(|(pid, _)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
        .collect()
}
