//! TLS on real sockets on 127.0.0.1: a framed connection over mutual TLS carries frames
//! both ways with the peers' identities known, and every hostile handshake is refused
//! with its own counted reason, without disturbing a connection already served.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rpcmesh_common::net::connection::{FramedIo, IoEvent};
use rpcmesh_common::net::tls::{
    ClientAuth, ClientTls, ClientTlsSettings, Refusal, ServerTls, ServerTlsSettings, TlsFiles,
    TlsObserver,
};
use rpcmesh_testkit::{Leaf, Pki, spiffe};
use rpcmesh_wire::body::Request;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::Flags;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Handshakes as the observer saw them.
#[derive(Default)]
struct Seen {
    done: Mutex<usize>,
    refused: Mutex<Vec<Refusal>>,
    changed: Notify,
}

impl TlsObserver for Seen {
    fn handshake_done(&self) {
        *self.done.lock().unwrap() += 1;
        self.changed.notify_waiters();
    }
    fn handshake_failed(&self, reason: Refusal) {
        self.refused.lock().unwrap().push(reason);
        self.changed.notify_waiters();
    }
}

impl Seen {
    /// Waits until `n` refusals were seen; returns them.
    async fn refusals(&self, n: usize) -> Vec<Refusal> {
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let wait = self.changed.notified();
                tokio::pin!(wait);
                wait.as_mut().enable();
                let r = self.refused.lock().unwrap().clone();
                if r.len() >= n {
                    return r;
                }
                wait.await;
            }
        })
        .await
        .expect("the refusals come")
    }
}

struct Mesh {
    dir: std::path::PathBuf,
    pki: Pki,
    server: Arc<ServerTls>,
    seen: Arc<Seen>,
    addr: std::net::SocketAddr,
    /// Identities of the connections served (`None`: anonymous).
    served: Arc<Mutex<Vec<Option<String>>>>,
}

fn dir(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("rpcmesh-tls-{name}-{}", std::process::id()))
}

/// A server that echoes every frame back, over TLS with client auth `auth`.
async fn mesh(name: &str, auth: ClientAuth, timeout: Duration, max: usize) -> Mesh {
    let dir = dir(name);
    let pki = Pki::new(&dir, "mesh");
    let files = pki.issue(&Leaf::spiffe("provider", "p1"));
    let seen = Arc::new(Seen::default());
    let server = ServerTls::new(
        ServerTlsSettings {
            files: TlsFiles {
                cert: Some(files.cert),
                key: Some(files.key),
                ca: Some(pki.ca_file.clone()),
            },
            client_auth: auth,
            handshake_timeout: timeout,
            max_handshakes: max,
        },
        seen.clone(),
    )
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let (s, list) = (server.clone(), served.clone());
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = listener.accept().await.unwrap();
            let (s, list) = (s.clone(), list.clone());
            tokio::spawn(async move {
                let Ok(secured) = s.accept(tcp, peer).await else {
                    return;
                };
                let id = secured.identity.map(|i| i.to_string());
                list.lock().unwrap().push(id);
                let mut io = FramedIo::over(secured.stream, FrameCodec::default());
                loop {
                    match io.wait_io(true).await {
                        Ok(IoEvent::Read) if io.is_eof() => return,
                        Ok(IoEvent::Read) => {
                            while let Ok(Some(f)) = io.next_frame() {
                                let mut b = BytesMut::new();
                                rpcmesh_wire::frame::put_frame(&mut b, &f.header, &f.body);
                                io.wbuf().extend_from_slice(&b);
                            }
                            if io.try_flush().is_err() {
                                return;
                            }
                        }
                        Ok(IoEvent::Wrote) => {}
                        Err(_) => return,
                    }
                }
            });
        }
    });
    Mesh {
        dir,
        pki,
        server,
        seen,
        addr,
        served,
    }
}

impl Mesh {
    fn client(&self, pki: &Pki, leaf: Option<&Leaf>) -> Arc<ClientTls> {
        let own = leaf.map(|l| pki.issue(l));
        ClientTls::new(
            ClientTlsSettings {
                files: TlsFiles {
                    cert: own.as_ref().map(|f| f.cert.clone()),
                    key: own.map(|f| f.key),
                    ca: Some(self.pki.ca_file.clone()),
                },
                server_name: None,
                handshake_timeout: Duration::from_secs(10),
            },
            Arc::new(rpcmesh_common::net::tls::NoTlsObserver),
        )
        .unwrap()
    }

    /// Connects with `client` and makes one echo round trip; the framed connection.
    async fn echo(&self, client: &ClientTls) -> std::io::Result<FramedIo> {
        let tcp = TcpStream::connect(self.addr).await?;
        let secured = client
            .connect(tcp, &self.addr.to_string())
            .await
            .map_err(std::io::Error::other)?;
        assert_eq!(
            secured.identity.map(|i| i.to_string()),
            Some(spiffe("provider", "p1")),
            "the server's identity"
        );
        let mut io = FramedIo::over(secured.stream, FrameCodec::default());
        round_trip(&mut io, 7).await?;
        Ok(io)
    }
}

/// Writes request `id` and reads it back.
async fn round_trip(io: &mut FramedIo, id: u64) -> std::io::Result<()> {
    Request {
        service: Bytes::from_static(b"EchoService"),
        method: Bytes::from_static(b"Echo"),
        payload: Bytes::from(vec![b'x'; 100_000]),
    }
    .put(io.wbuf(), Flags::NONE, id)
    .unwrap();
    io.flush().await?;
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            io.wait_io(true).await?;
            if let Some(f) = io.next_frame().map_err(std::io::Error::other)? {
                return Ok::<_, std::io::Error>(f);
            }
            if io.is_eof() {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    assert_eq!(got.header.req_id, id);
    Ok(())
}

#[tokio::test]
async fn frames_cross_mutual_tls_both_ways_and_each_side_knows_the_other() {
    let m = mesh("ok", ClientAuth::Required, Duration::from_secs(10), 16).await;
    let client = m.client(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    let mut io = m.echo(&client).await.unwrap();
    round_trip(&mut io, 8).await.unwrap();
    assert_eq!(
        *m.served.lock().unwrap(),
        [Some(spiffe("driver", "d1"))],
        "the server knows its caller"
    );
    assert!(m.seen.refused.lock().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[tokio::test]
async fn a_client_without_a_certificate_is_anonymous_when_optional_and_refused_when_required() {
    let m = mesh(
        "optional",
        ClientAuth::Optional,
        Duration::from_secs(10),
        16,
    )
    .await;
    m.echo(&m.client(&m.pki, None)).await.unwrap();
    assert_eq!(*m.served.lock().unwrap(), [None]);
    let r = mesh(
        "required",
        ClientAuth::Required,
        Duration::from_secs(10),
        16,
    )
    .await;
    // TLS 1.3: the client's handshake ends before the server judges its certificate, so
    // the refusal reaches the client as an alert on its first read.
    assert!(r.echo(&r.client(&r.pki, None)).await.is_err());
    assert_eq!(r.seen.refusals(1).await, [Refusal::NoCertificate]);
    assert!(r.served.lock().unwrap().is_empty());
    for d in [&m.dir, &r.dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[tokio::test]
async fn bad_certificates_are_refused_each_with_its_reason() {
    let m = mesh("bad", ClientAuth::Required, Duration::from_secs(10), 16).await;
    let other = Pki::new(&m.dir.join("other"), "other");
    let cases = [
        (
            m.client(&other, Some(&Leaf::spiffe("driver", "d1"))),
            Refusal::UnknownCa,
        ),
        (
            m.client(&m.pki, Some(&Leaf::spiffe("driver", "old").expired())),
            Refusal::Expired,
        ),
        (
            m.client(&m.pki, Some(&Leaf::anonymous("nobody"))),
            Refusal::NoIdentity,
        ),
    ];
    for (i, (client, reason)) in cases.iter().enumerate() {
        assert!(m.echo(client).await.is_err(), "{reason:?} got through");
        assert_eq!(m.seen.refusals(i + 1).await[i], *reason);
    }
    assert!(m.served.lock().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[tokio::test]
async fn plaintext_a_silent_client_and_one_that_leaves_mid_handshake_are_refused_and_others_go_on()
{
    let m = mesh(
        "hostile",
        ClientAuth::Required,
        Duration::from_millis(300),
        16,
    )
    .await;
    let client = m.client(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    // A connection being served throughout.
    let mut served = m.echo(&client).await.unwrap();
    // Plaintext RPCF to the TLS port: refused, the connection closed.
    let mut plain = TcpStream::connect(m.addr).await.unwrap();
    let mut frame = BytesMut::new();
    Request {
        service: Bytes::from_static(b"S"),
        method: Bytes::from_static(b"M"),
        payload: Bytes::new(),
    }
    .put(&mut frame, Flags::NONE, 1)
    .unwrap();
    plain.write_all(&frame).await.unwrap();
    let mut rest = Vec::new();
    let _ = plain.read_to_end(&mut rest).await;
    assert_eq!(m.seen.refusals(1).await, [Refusal::NotTls]);
    // Half a ClientHello, then silence: the handshake timeout closes it.
    let hello = client_hello(&m);
    let mut silent = TcpStream::connect(m.addr).await.unwrap();
    silent.write_all(&hello[..hello.len() / 2]).await.unwrap();
    let _ = silent.read_to_end(&mut rest).await;
    assert_eq!(m.seen.refusals(2).await[1], Refusal::Timeout);
    // Half a ClientHello, then the client leaves.
    let mut leaving = TcpStream::connect(m.addr).await.unwrap();
    leaving.write_all(&hello[..hello.len() / 2]).await.unwrap();
    drop(leaving);
    assert_eq!(m.seen.refusals(3).await[2], Refusal::Eof);
    // The connection served before is served still.
    round_trip(&mut served, 9).await.unwrap();
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[tokio::test]
async fn over_the_cap_on_handshakes_in_progress_a_connection_is_closed_at_once() {
    let m = mesh("cap", ClientAuth::Required, Duration::from_secs(30), 1).await;
    // One silent client holds the only handshake slot...
    let hello = client_hello(&m);
    let mut silent = TcpStream::connect(m.addr).await.unwrap();
    silent.write_all(&hello[..10]).await.unwrap();
    // ...so the next is refused "busy" at once, though it is a good one.
    let client = m.client(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    assert!(m.echo(&client).await.is_err());
    assert_eq!(m.seen.refusals(1).await, [Refusal::Busy]);
    // Once the silent one leaves, the good one gets in.
    drop(silent);
    m.seen.refusals(2).await;
    m.echo(&client).await.unwrap();
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[tokio::test]
async fn a_reload_serves_new_handshakes_with_the_new_files_and_open_connections_go_on() {
    let m = mesh("reload", ClientAuth::Required, Duration::from_secs(10), 16).await;
    let client = m.client(&m.pki, Some(&Leaf::spiffe("driver", "d1")));
    let mut before = m.echo(&client).await.unwrap();
    // The server's files are replaced by a certificate of another CA: new handshakes
    // present it (and the old client, which does not trust that CA, is refused).
    let other = Pki::new(&m.dir.join("new"), "new");
    let files = other.issue(&Leaf::spiffe("provider", "p1"));
    let pem = |p: &std::path::Path| std::fs::read(p).unwrap();
    let dir = m.dir.clone();
    std::fs::write(dir.join("provider-p1.pem"), pem(&files.cert)).unwrap();
    std::fs::write(dir.join("provider-p1.key"), pem(&files.key)).unwrap();
    m.server.reload().unwrap();
    assert!(
        m.echo(&client).await.is_err(),
        "the new certificate is served"
    );
    // The connection made before goes on with its keys.
    round_trip(&mut before, 10).await.unwrap();
    // A file that does not parse is kept out: the configuration stays.
    std::fs::write(dir.join("provider-p1.key"), b"not a key").unwrap();
    assert!(m.server.reload().is_err());
    let _ = std::fs::remove_dir_all(&m.dir);
}

/// The first flight of a real TLS 1.3 client of `m`'s CA.
fn client_hello(m: &Mesh) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(&m.pki.ca_file).unwrap();
    use rustls::pki_types::pem::PemObject;
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut conn =
        rustls::ClientConnection::new(Arc::new(config), "127.0.0.1".try_into().unwrap()).unwrap();
    let mut out = Vec::new();
    conn.write_tls(&mut out).unwrap();
    out
}

#[test]
fn an_identity_is_the_first_uri_san_else_the_first_dns_san_else_none() {
    use rpcmesh_common::net::tls::Identity;
    use rustls::pki_types::pem::PemObject;
    let dir = dir("identity");
    let pki = Pki::new(&dir, "id");
    let der = |leaf: &Leaf| {
        let files = pki.issue(leaf);
        rustls::pki_types::CertificateDer::from_pem_file(files.cert).unwrap()
    };
    let spiffe_and_dns = der(&Leaf::spiffe("driver", "d1"));
    assert_eq!(
        Identity::of_certificate(&spiffe_and_dns),
        Some(Identity::Uri(spiffe("driver", "d1").into()))
    );
    let dns_only = Leaf {
        uri: None,
        ..Leaf::spiffe("host", "h1")
    };
    assert_eq!(
        Identity::of_certificate(&der(&dns_only)),
        Some(Identity::Dns("localhost".into()))
    );
    assert_eq!(Identity::of_certificate(&der(&Leaf::anonymous("x"))), None);
    assert_eq!(Identity::of_certificate(b"not a certificate"), None);
    let _ = std::fs::remove_dir_all(&dir);
}
