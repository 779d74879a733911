//! Certificates for TLS tests, made by `openssl` at test time (nothing
//! secret is committed), and `openssl s_client` as a TLS client no one
//! here wrote.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A directory of certificates, removed when dropped.
pub struct Certs {
    /// The directory the files are in.
    pub dir: PathBuf,
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `openssl ARGS` in `dir`; panics when it fails.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl is installed (.ci/run installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed EC P-256 CA valid two days in `dir`: `{ca}.pem` and
/// `{ca}-key.pem`, named `/CN=test {ca}`.
fn make_ca(dir: &Path, ca: &str) {
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
            "-days",
            "2",
            "-subj",
            &format!("/CN=test {ca}"),
            "-keyout",
            &format!("{ca}-key.pem"),
            "-out",
            &format!("{ca}.pem"),
        ],
    );
}

/// A leaf certificate `{leaf}.pem` (key `{leaf}-key.pem`, CN `leaf`) in
/// `dir`, signed by the CA `ca` with the extensions file `ext`.
fn make_leaf(dir: &Path, leaf: &str, ca: &str, ext: &str) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            &format!("/CN={leaf}"),
            "-keyout",
            &format!("{leaf}-key.pem"),
            "-out",
            &format!("{leaf}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{leaf}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}-key.pem"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            ext,
            "-out",
            &format!("{leaf}.pem"),
        ],
    );
}

impl Certs {
    /// Two CAs (`ca`, `other`), a server certificate for localhost and
    /// 127.0.0.1 from `ca`, two client certificates from `ca` (`client`,
    /// `client2`: two identities) and one from `other` (`stranger`).
    #[must_use]
    pub fn make(name: &str) -> Certs {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ticketd-tls-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let certs = Certs { dir };
        let d = &certs.dir;
        std::fs::write(
            d.join("server.ext"),
            "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n\
             extendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(
            d.join("client.ext"),
            "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        for ca in ["ca", "other"] {
            make_ca(d, ca);
        }
        for (leaf, ca, ext) in [
            ("server", "ca", "server.ext"),
            ("client", "ca", "client.ext"),
            ("client2", "ca", "client.ext"),
            ("stranger", "other", "client.ext"),
        ] {
            make_leaf(d, leaf, ca, ext);
        }
        certs
    }

    /// The path of `file` in the directory.
    #[must_use]
    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// `--tls-cert` and `--tls-key` of the server certificate.
    #[must_use]
    pub fn server_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.path("server.pem"),
            "--tls-key".into(),
            self.path("server-key.pem"),
        ]
    }
}

/// Runs `openssl s_client` against `addr` with `extra` flags, writes
/// `input`, and returns what it printed on stdout once `want` bytes came
/// (or it exited or 10 s passed), and its stderr.
#[must_use]
pub fn s_client(addr: &str, extra: &[&str], input: &[u8], want: usize) -> (Vec<u8>, String) {
    let mut child = Command::new("openssl")
        .args(["s_client", "-connect", addr, "-brief"])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("openssl s_client");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input).unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while got.len() < want {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        got
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(stdin);
    let _ = child.kill();
    let got = reader.join().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let _ = child.wait();
    (got, err)
}
