//! TLS against openssl, the tool operators have: certificates issued with `openssl` as
//! docs/security.md shows (a CA, a provider with a SPIFFE ID and 127.0.0.1, a client), a
//! provider serving them, and `openssl s_client` negotiating TLS 1.3 with it with a client
//! certificate; then the provider's files replaced by a new certificate and SIGHUP: the
//! next handshake gets the new one, and a torn key file is kept out, counted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rpcmesh_system_tests::tools::need_tool;
use rpcmesh_testkit::{Signal, Spawned, wait_until_blocking};

/// Runs openssl with `args` in `dir`; fails the test with what it said unless it exits 0.
fn openssl(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(need_tool("openssl", "openssl"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "openssl {args:?}: {said}");
    said
}

/// A key and a certificate `name` signed by the CA in `dir`, with `ext` as its extensions.
fn issue(dir: &Path, name: &str, cn: &str, ext: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    let (key, csr, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "30",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

fn pki(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "365",
            "-subj",
            "/CN=rpcmesh CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    let server = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=URI:spiffe://rpcmesh.test/provider/p1,DNS:localhost,IP:127.0.0.1\n";
    issue(dir, "provider", "p1", server);
    issue(
        dir,
        "driver",
        "d1",
        "extendedKeyUsage=clientAuth\nsubjectAltName=URI:spiffe://rpcmesh.test/driver/d1\n",
    );
}

/// `openssl s_client` to `addr` with the driver's certificate: what it printed.
fn s_client(dir: &Path, addr: &str) -> String {
    openssl(
        dir,
        &[
            "s_client",
            "-connect",
            addr,
            "-CAfile",
            "ca.pem",
            "-cert",
            "driver.pem",
            "-key",
            "driver.key",
            "-verify_return_error",
        ],
    )
}

fn file(dir: &Path, name: &str) -> String {
    let p: PathBuf = dir.join(name);
    p.to_str().unwrap().to_string()
}

#[test]
fn openssl_s_client_negotiates_tls_1_3_with_the_provider_and_a_rotation_serves_the_new_certificate()
{
    let dir = std::env::temp_dir().join(format!("rpcmesh-tls-openssl-{}", std::process::id()));
    pki(&dir);
    let provider = Spawned::start(
        "provider",
        &[
            "--threads",
            "1",
            "--tls-cert",
            &file(&dir, "provider.pem"),
            "--tls-key",
            &file(&dir, "provider.key"),
            "--tls-ca",
            &file(&dir, "ca.pem"),
        ],
    );
    let addr = provider.rpc.to_string();
    let said = s_client(&dir, &addr);
    assert!(said.contains("TLSv1.3"), "{said}");
    assert!(said.contains("Verify return code: 0 (ok)"), "{said}");
    assert!(said.contains("CN=p1") || said.contains("CN = p1"), "{said}");
    assert!(
        provider.metric("rpcmesh_tls_handshakes_total", &[("side", "inbound")]) >= 1.0,
        "the handshake is counted"
    );
    assert!(
        provider.metric(
            "rpcmesh_tls_cert_expiry_timestamp_seconds",
            &[("cert", "own")]
        ) > 0.0
    );

    // Rotation: a new certificate (another name) written over the files, then SIGHUP.
    issue(
        &dir,
        "provider",
        "p1-rotated",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=URI:spiffe://rpcmesh.test/provider/p1,DNS:localhost,IP:127.0.0.1\n",
    );
    provider.child.signal(Signal::HUP);
    let ok = || {
        provider.metric(
            "rpcmesh_file_reloads_total",
            &[("file", "tls"), ("result", "ok")],
        )
    };
    wait_until_blocking("the rotated files to be read", || ok() >= 1.0);
    let said = s_client(&dir, &addr);
    assert!(
        said.contains("p1-rotated"),
        "the new certificate is served: {said}"
    );
    assert!(said.contains("TLSv1.3"), "{said}");

    // A torn key is kept out: counted, and the rotated certificate still served.
    std::fs::write(
        dir.join("provider.key"),
        b"-----BEGIN PRIVATE KEY-----\nnot one\n",
    )
    .unwrap();
    provider.child.signal(Signal::HUP);
    let errors = || {
        provider.metric(
            "rpcmesh_file_reloads_total",
            &[("file", "tls"), ("result", "error")],
        )
    };
    wait_until_blocking("the torn key to be refused", || errors() >= 1.0);
    let said = s_client(&dir, &addr);
    assert!(said.contains("p1-rotated"), "{said}");
    drop(provider);
    let _ = std::fs::remove_dir_all(&dir);
}
