//! The throwaway CA of a local `--compare-tls` experiment: a CA and one certificate each
//! for the broker, the provider and the driver (a SPIFFE ID of their role and an IP name
//! for 127.0.0.1, which is where the local mesh listens), made with rcgen in a private
//! folder that is removed when the experiment ends. Against given targets the user's own
//! certificates are used instead (`--tls-ca`, `--tls-cert`, `--tls-key`).

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The trust domain of the local mesh's SPIFFE IDs (`spiffe://rpcmesh.local/ROLE/capacity`).
pub const LOCAL_TRUST_DOMAIN: &str = "rpcmesh.local";

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The PEM certificate, issued by the CA directly.
    pub cert: PathBuf,
    /// Its PEM private key (PKCS#8), readable by its owner only.
    pub key: PathBuf,
}

/// The CA and the three certificates; the folder goes when this is dropped.
#[derive(Debug)]
pub struct LocalPki {
    dir: PathBuf,
    /// The CA certificate every program trusts.
    pub ca: PathBuf,
    /// The broker's (server, and client to the provider).
    pub broker: CertFiles,
    /// The provider's.
    pub provider: CertFiles,
    /// The driver's (client).
    pub driver: CertFiles,
}

impl LocalPki {
    /// Makes the CA and the certificates in a new folder under the system's temporary
    /// one, mode 0700.
    pub fn new() -> anyhow::Result<LocalPki> {
        let dir = std::env::temp_dir().join(format!(
            "rpcmesh-capacity-tls-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("making {}", dir.display()))?;
        // From here on the folder is removed whatever happens.
        let mut pki = LocalPki {
            ca: dir.join("ca.pem"),
            broker: files(&dir, "broker"),
            provider: files(&dir, "provider"),
            driver: files(&dir, "driver"),
            dir,
        };
        pki.issue_all()?;
        Ok(pki)
    }

    fn issue_all(&mut self) -> anyhow::Result<()> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "rpcmesh capacity local CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate()?;
        let ca = params.self_signed(&ca_key)?;
        write(&self.ca, ca.pem().as_bytes(), 0o644)?;
        for (role, out) in [
            ("broker", &self.broker),
            ("provider", &self.provider),
            ("driver", &self.driver),
        ] {
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params.distinguished_name.push(DnType::CommonName, role);
            let id = format!("spiffe://{LOCAL_TRUST_DOMAIN}/{role}/capacity");
            params.subject_alt_names = vec![
                SanType::URI(id.as_str().try_into()?),
                SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ];
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca, &ca_key)?;
            write(&out.cert, cert.pem().as_bytes(), 0o644)?;
            write(&out.key, key.serialize_pem().as_bytes(), 0o600)?;
        }
        Ok(())
    }

    /// The folder the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for LocalPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn files(dir: &Path, role: &str) -> CertFiles {
    CertFiles {
        cert: dir.join(format!("{role}.pem")),
        key: dir.join(format!("{role}.key")),
    }
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    use std::io::Write as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn the_files_are_made_private_and_removed_at_the_end() {
        let pki = LocalPki::new().unwrap();
        let dir = pki.dir().to_path_buf();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&pki.driver.key), 0o600);
        assert!(
            std::fs::read_to_string(&pki.ca)
                .unwrap()
                .contains("BEGIN CERTIFICATE")
        );
        drop(pki);
        assert!(!dir.exists());
    }
}
