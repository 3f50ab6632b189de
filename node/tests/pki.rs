//! The cluster PKI: issuing, role extraction, PEM round trips, and real mutual-TLS QUIC
//! handshakes on loopback.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime};

use keyhome::pki::{self, ALPN_CLIENT, ALPN_PEER, CaKeyPair, Identity, IssuedCert, PkiError, Role, Validity};
use keyhome_ring::NodeId;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Safety net only: every handshake here completes or fails in milliseconds.
const SAFETY: Duration = Duration::from_secs(10);

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn der(issued: &IssuedCert) -> Result<CertificateDer<'static>, PkiError> {
    Ok(pki::ca_from_pem(&issued.cert_pem)?.remove(0))
}

fn all_roles() -> Vec<Role> {
    vec![
        Role::Node(NodeId(0)),
        Role::Node(NodeId(7)),
        Role::Node(NodeId(u64::MAX)),
        Role::Operator,
        Role::Client("a".into()),
        Role::Client("billing-7".into()),
        Role::Client("x".repeat(pki::MAX_CLIENT_NAME_LEN)),
    ]
}

#[test]
fn issued_roles_round_trip() -> TestResult {
    let ca = pki::generate_ca("test CA")?;
    for role in all_roles() {
        let issued = pki::issue(&ca, &role)?;
        assert_eq!(pki::role_of(&der(&issued)?)?, role);
        let identity = issued.identity()?;
        assert_eq!(identity.chain.len(), 1);
        assert_eq!(identity.role()?, role);
        assert_eq!(Role::from_dns_name(&role.dns_name()).transpose()?, Some(role));
    }
    Ok(())
}

#[test]
fn server_name_is_the_node_san() {
    assert_eq!(pki::server_name(NodeId(42)), "node-42.keyhome");
    assert_eq!(Role::Node(NodeId(42)).dns_name(), "node-42.keyhome");
    assert_eq!(Role::Node(NodeId(42)).to_string(), "node 42", "how a role reads in messages");
    assert_eq!(Role::Client("web".into()).to_string(), "client web");
    assert_eq!(Role::Operator.dns_name(), "operator.keyhome");
    assert_eq!(Role::Client("web".into()).dns_name(), "client-web.keyhome");
}

#[test]
fn invalid_client_names_are_refused() -> TestResult {
    let ca = pki::generate_ca("test CA")?;
    let too_long = "x".repeat(pki::MAX_CLIENT_NAME_LEN + 1);
    for name in ["", "Upper", "under_score", "dot.ted", "-lead", "trail-", "é", &too_long] {
        let err = pki::issue(&ca, &Role::Client(name.into())).err();
        assert!(matches!(err, Some(PkiError::InvalidClientName(_))), "{name:?}: {err:?}");
    }
    Ok(())
}

#[test]
fn role_names_are_parsed_strictly() {
    // Not under .keyhome: not a role at all.
    for other in ["example.com", "node-1.keyhome.example", "keyhomes", "xkeyhome"] {
        assert!(Role::from_dns_name(other).is_none(), "{other}");
    }
    // Under .keyhome but malformed.
    for bad in [
        "keyhome",
        ".keyhome",
        "node-.keyhome",
        "node-01.keyhome",
        "node-+1.keyhome",
        "node--1.keyhome",
        "node-18446744073709551616.keyhome",
        "client-.keyhome",
        "client-A.keyhome",
        "operators.keyhome",
        "NODE-1.keyhome",
        "a.b.keyhome",
    ] {
        assert!(matches!(Role::from_dns_name(bad), Some(Err(PkiError::MalformedRole(_)))), "{bad}");
    }
    assert!(matches!(Role::from_dns_name("node-3.KEYHOME."), Some(Ok(Role::Node(NodeId(3))))));
}

/// Certificates not made by `issue`: zero or several keyhome SANs must be rejected.
#[test]
fn role_of_requires_exactly_one_keyhome_san() -> TestResult {
    fn self_signed(sans: &[&str]) -> Result<CertificateDer<'static>, rcgen::Error> {
        let key = rcgen::KeyPair::generate()?;
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        Ok(rcgen::CertificateParams::new(sans)?.self_signed(&key)?.der().clone())
    }
    assert!(matches!(pki::role_of(&self_signed(&[])?), Err(PkiError::NoRole)));
    assert!(matches!(pki::role_of(&self_signed(&["example.com", "127.0.0.1"])?), Err(PkiError::NoRole)));
    assert!(matches!(
        pki::role_of(&self_signed(&["node-1.keyhome", "operator.keyhome"])?),
        Err(PkiError::MultipleRoles(2))
    ));
    assert!(matches!(
        pki::role_of(&self_signed(&["node-1.keyhome", "node-1.keyhome"])?),
        Err(PkiError::MultipleRoles(2))
    ));
    assert!(matches!(pki::role_of(&self_signed(&["node-x.keyhome"])?), Err(PkiError::MalformedRole(_))));
    assert_eq!(
        pki::role_of(&self_signed(&["example.com", "client-c1.keyhome"])?)?,
        Role::Client("c1".into())
    );
    Ok(())
}

#[test]
fn role_of_rejects_garbage() -> TestResult {
    assert!(matches!(
        pki::role_of(&CertificateDer::from(vec![0x30, 0x03, 0x01, 0x02])),
        Err(PkiError::MalformedCertificate(_))
    ));
    assert!(matches!(
        pki::role_of(&CertificateDer::from(Vec::new())),
        Err(PkiError::MalformedCertificate(_))
    ));
    assert!(matches!(
        pki::role_of(&CertificateDer::from(vec![0u8; pki::MAX_CERT_DER_LEN + 1])),
        Err(PkiError::CertTooLarge { .. })
    ));
    let ca = pki::generate_ca("test CA")?;
    let mut trailing = der(&pki::issue(&ca, &Role::Operator)?)?.to_vec();
    trailing.push(0);
    assert!(matches!(pki::role_of(&CertificateDer::from(trailing)), Err(PkiError::MalformedCertificate(_))));
    Ok(())
}

#[test]
fn ca_pem_round_trip_issues_verifiable_certs() -> TestResult {
    let ca = pki::generate_ca("test CA")?;
    let reloaded = CaKeyPair::from_pem(&ca.cert_pem(), &ca.key_pem())?;
    assert_eq!(reloaded.cert_der(), ca.cert_der());
    assert_eq!(reloaded.key_pem(), ca.key_pem());
    // A certificate issued by the reloaded CA verifies against the original CA certificate
    // (checked with webpki through rustls, the same verifier the handshake uses).
    let issued = pki::issue(&reloaded, &Role::Node(NodeId(5)))?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca.cert_der())?;
            roots.into()
        },
        pki::crypto_provider(),
    )
    .build()?;
    verifier.verify_client_cert(&der(&issued)?, &[], rustls::pki_types::UnixTime::now())?;
    Ok(())
}

#[test]
fn ca_from_pem_rejects_mismatches() -> TestResult {
    let ca = pki::generate_ca("test CA")?;
    let other = pki::generate_ca("other CA")?;
    assert!(matches!(CaKeyPair::from_pem(&ca.cert_pem(), &other.key_pem()), Err(PkiError::CaKeyMismatch)));
    let leaf = pki::issue(&ca, &Role::Operator)?;
    assert!(matches!(CaKeyPair::from_pem(&leaf.cert_pem, &leaf.key_pem), Err(PkiError::NotACa)));
    let two = format!("{}{}", ca.cert_pem(), other.cert_pem());
    assert!(matches!(CaKeyPair::from_pem(&two, &ca.key_pem()), Err(PkiError::TooManyCertificates { .. })));
    assert!(matches!(CaKeyPair::from_pem("", &ca.key_pem()), Err(PkiError::MissingPem(_))));
    assert!(CaKeyPair::from_pem(&ca.cert_pem(), "not a key").is_err());
    Ok(())
}

#[test]
fn identity_and_ca_load_from_files() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ca = pki::generate_ca("test CA")?;
    let issued = pki::issue(&ca, &Role::Client("files".into()))?;
    let (ca_path, cert_path, key_path) =
        (dir.path().join("ca.pem"), dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&ca_path, ca.cert_pem())?;
    std::fs::write(&cert_path, &issued.cert_pem)?;
    std::fs::write(&key_path, &issued.key_pem)?;

    assert_eq!(pki::load_ca(&ca_path)?, vec![ca.cert_der()]);
    let identity = Identity::load(&cert_path, &key_path)?;
    assert_eq!(identity.role()?, Role::Client("files".into()));
    assert_eq!(
        identity.key.secret_der(),
        rustls::pki_types::PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes())?.secret_der()
    );

    assert!(matches!(Identity::load(dir.path().join("missing"), &key_path), Err(PkiError::Io { .. })));
    assert!(matches!(Identity::load(&key_path, &key_path), Err(PkiError::MissingPem("certificate"))));
    assert!(matches!(Identity::load(&cert_path, &cert_path), Err(PkiError::MissingPem("private key"))));
    let big = dir.path().join("big.pem");
    std::fs::write(&big, vec![b'a'; pki::MAX_PEM_FILE_LEN as usize + 1])?;
    assert!(matches!(pki::load_ca(&big), Err(PkiError::FileTooLarge { .. })));
    Ok(())
}

#[test]
fn config_builders_validate_inputs() -> TestResult {
    let ca = pki::generate_ca("test CA")?;
    let roots = vec![ca.cert_der()];
    let node = pki::issue(&ca, &Role::Node(NodeId(1)))?.identity()?;
    let operator = pki::issue(&ca, &Role::Operator)?.identity()?;
    assert!(matches!(pki::server_config(&operator, &roots), Err(PkiError::NotANode(Role::Operator))));
    assert!(matches!(pki::server_config(&node, &[]), Err(PkiError::NoTrustAnchors)));
    assert!(matches!(pki::client_config(&node, &roots, b""), Err(PkiError::InvalidAlpn)));
    // A key that does not belong to the certificate.
    let mismatched = Identity { chain: node.chain.clone(), key: operator.key.clone_key() };
    assert!(matches!(pki::server_config(&mismatched, &roots), Err(PkiError::Tls(_))));
    assert!(matches!(pki::client_config(&mismatched, &roots, ALPN_PEER), Err(PkiError::Tls(_))));
    assert!(matches!(
        pki::issue_with_validity(
            &ca,
            &Role::Operator,
            Validity { not_before: SystemTime::now(), not_after: SystemTime::now() - Duration::from_secs(1) }
        ),
        Err(PkiError::InvalidValidity)
    ));
    // Past year 9999: not encodable, and must not panic.
    let far = SystemTime::UNIX_EPOCH + Duration::from_secs(300_000_000_000);
    assert!(matches!(
        pki::issue_with_validity(
            &ca,
            &Role::Operator,
            Validity { not_before: SystemTime::now(), not_after: far }
        ),
        Err(PkiError::InvalidValidity)
    ));
    // A client identity without a keyhome role is refused.
    let bare = {
        let key = rcgen::KeyPair::generate()?;
        let cert = rcgen::CertificateParams::new(vec!["example.com".to_string()])?.self_signed(&key)?;
        Identity::from_pem(&cert.pem(), &key.serialize_pem())?
    };
    assert!(matches!(pki::client_config(&bare, &roots, ALPN_CLIENT), Err(PkiError::NoRole)));
    Ok(())
}

/// What the two ends saw of one handshake attempt.
struct Outcome {
    /// The client's view: the server's role and the negotiated ALPN, or why it failed.
    client: Result<(Role, Option<Vec<u8>>), String>,
    /// The server's view, likewise.
    server: Result<(Role, Option<Vec<u8>>), String>,
}

/// Runs one QUIC handshake on loopback between a server presenting `server_identity` and
/// trusting `server_trusts`, and a client presenting `client_identity`, trusting
/// `client_trusts` and offering `alpn`, dialling `server_name`.
async fn handshake(
    server_identity: &Identity,
    server_trusts: &CaKeyPair,
    client_identity: &Identity,
    client_trusts: &CaKeyPair,
    alpn: &[u8],
    server_name: &str,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    let server_config = pki::server_config(server_identity, &[server_trusts.cert_der()])?;
    let server = quinn::Endpoint::server(server_config, (Ipv4Addr::LOCALHOST, 0).into())?;
    let server_addr = server.local_addr()?;

    let mut client = quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
    client.set_default_client_config(pki::client_config(client_identity, &[client_trusts.cert_der()], alpn)?);

    let serve = async {
        let incoming = server.accept().await.ok_or("server endpoint closed")?;
        let conn = incoming.await.map_err(|e| e.to_string())?;
        let role = pki::peer_role(&conn).map_err(|e| e.to_string())?;
        let alpn = pki::negotiated_alpn(&conn);
        // Echo one message back, then wait for the client to close.
        let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
        let message = recv.read_to_end(16).await.map_err(|e| e.to_string())?;
        send.write_all(&message).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        conn.closed().await;
        Ok::<_, String>((role, alpn))
    };
    let connect = async {
        let connecting = client.connect(server_addr, server_name).map_err(|e| e.to_string())?;
        let conn = connecting.await.map_err(|e| e.to_string())?;
        // In TLS 1.3 the client completes its handshake before the server has checked the
        // client's certificate; an echo round trip proves the server accepted it.
        let echoed = async {
            let role = pki::peer_role(&conn).map_err(|e| e.to_string())?;
            let alpn = pki::negotiated_alpn(&conn);
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(b"ping").await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            let echo = recv.read_to_end(16).await.map_err(|e| e.to_string())?;
            if echo != b"ping" {
                return Err(format!("bad echo {echo:?}"));
            }
            Ok((role, alpn))
        }
        .await;
        conn.close(0u32.into(), b"done");
        echoed
    };
    let (server_result, client_result) =
        tokio::time::timeout(SAFETY, async { tokio::join!(serve, connect) }).await?;
    server.close(0u32.into(), b"done");
    client.close(0u32.into(), b"done");
    Ok(Outcome { client: client_result, server: server_result })
}

/// Asserts that both ends of a handshake failed, the refusing side for the expected reason.
fn assert_refused(outcome: &Outcome, refuser: &str, reason: &str) {
    let (mine, theirs) = match refuser {
        "server" => (&outcome.server, &outcome.client),
        _ => (&outcome.client, &outcome.server),
    };
    match mine {
        Err(e) => assert!(e.contains(reason), "{refuser} failed for another reason: {e}"),
        Ok(v) => panic!("{refuser} accepted the handshake: {v:?}"),
    }
    assert!(theirs.is_err(), "the other side succeeded: {theirs:?}");
}

struct Cluster {
    ca: CaKeyPair,
    node1: Identity,
    node2: Identity,
}

fn cluster() -> Result<Cluster, PkiError> {
    let ca = pki::generate_ca("cluster CA")?;
    Ok(Cluster {
        node1: pki::issue(&ca, &Role::Node(NodeId(1)))?.identity()?,
        node2: pki::issue(&ca, &Role::Node(NodeId(2)))?.identity()?,
        ca,
    })
}

#[tokio::test]
async fn mutual_tls_handshake_succeeds_and_yields_roles() -> TestResult {
    let c = cluster()?;
    let server_name = pki::server_name(NodeId(1));

    let outcome = handshake(&c.node1, &c.ca, &c.node2, &c.ca, ALPN_PEER, &server_name).await?;
    assert_eq!(outcome.client?, (Role::Node(NodeId(1)), Some(ALPN_PEER.to_vec())));
    assert_eq!(outcome.server?, (Role::Node(NodeId(2)), Some(ALPN_PEER.to_vec())));

    let client = pki::issue(&c.ca, &Role::Client("app".into()))?.identity()?;
    let outcome = handshake(&c.node1, &c.ca, &client, &c.ca, ALPN_CLIENT, &server_name).await?;
    assert_eq!(outcome.client?, (Role::Node(NodeId(1)), Some(ALPN_CLIENT.to_vec())));
    assert_eq!(outcome.server?, (Role::Client("app".into()), Some(ALPN_CLIENT.to_vec())));

    let operator = pki::issue(&c.ca, &Role::Operator)?.identity()?;
    let outcome = handshake(&c.node1, &c.ca, &operator, &c.ca, ALPN_CLIENT, &server_name).await?;
    assert_eq!(outcome.server?.0, Role::Operator);
    Ok(())
}

#[tokio::test]
async fn handshake_with_reloaded_ca_and_identity_files() -> TestResult {
    let ca = pki::generate_ca("cluster CA")?;
    let reloaded = CaKeyPair::from_pem(&ca.cert_pem(), &ca.key_pem())?;
    let server = pki::issue(&reloaded, &Role::Node(NodeId(9)))?;
    let server = Identity::from_pem(&server.cert_pem, &server.key_pem)?;
    let client = pki::issue(&ca, &Role::Node(NodeId(10)))?.identity()?;
    let outcome =
        handshake(&server, &ca, &client, &reloaded, ALPN_PEER, &pki::server_name(NodeId(9))).await?;
    assert_eq!(outcome.client?.0, Role::Node(NodeId(9)));
    assert_eq!(outcome.server?.0, Role::Node(NodeId(10)));
    Ok(())
}

#[tokio::test]
async fn client_cert_from_another_ca_is_refused() -> TestResult {
    let c = cluster()?;
    let rogue_ca = pki::generate_ca("rogue CA")?;
    // Claims to be node 2, but signed by a CA the server does not trust.
    let rogue = pki::issue(&rogue_ca, &Role::Node(NodeId(2)))?.identity()?;
    let outcome = handshake(&c.node1, &c.ca, &rogue, &c.ca, ALPN_PEER, &pki::server_name(NodeId(1))).await?;
    assert_refused(&outcome, "server", "UnknownIssuer");
    Ok(())
}

#[tokio::test]
async fn server_cert_from_another_ca_is_refused() -> TestResult {
    let c = cluster()?;
    let rogue_ca = pki::generate_ca("rogue CA")?;
    let rogue = pki::issue(&rogue_ca, &Role::Node(NodeId(1)))?.identity()?;
    // The rogue server trusts the cluster CA (so it would accept the client), but the
    // client does not trust the rogue server.
    let outcome = handshake(&rogue, &c.ca, &c.node2, &c.ca, ALPN_PEER, &pki::server_name(NodeId(1))).await?;
    assert_refused(&outcome, "client", "UnknownIssuer");
    Ok(())
}

#[tokio::test]
async fn wrong_node_is_refused_by_server_name() -> TestResult {
    let c = cluster()?;
    // Node 1 answers, but the client meant to dial node 3.
    let outcome =
        handshake(&c.node1, &c.ca, &c.node2, &c.ca, ALPN_PEER, &pki::server_name(NodeId(3))).await?;
    assert_refused(&outcome, "client", "not valid for name");
    Ok(())
}

#[tokio::test]
async fn expired_client_cert_is_refused() -> TestResult {
    let c = cluster()?;
    let day = Duration::from_secs(24 * 60 * 60);
    let now = SystemTime::now();
    let expired = pki::issue_with_validity(
        &c.ca,
        &Role::Node(NodeId(2)),
        Validity { not_before: now - 3 * day, not_after: now - day },
    )?
    .identity()?;
    let outcome =
        handshake(&c.node1, &c.ca, &expired, &c.ca, ALPN_PEER, &pki::server_name(NodeId(1))).await?;
    assert_refused(&outcome, "server", "expired");
    Ok(())
}

#[tokio::test]
async fn alpn_mismatch_is_refused() -> TestResult {
    let c = cluster()?;
    let outcome =
        handshake(&c.node1, &c.ca, &c.node2, &c.ca, b"not-keyhome/1", &pki::server_name(NodeId(1))).await?;
    assert_refused(&outcome, "server", "protocol");
    Ok(())
}
