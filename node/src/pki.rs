//! The cluster's certificate authority and its QUIC/TLS set-up.
//!
//! # Identity model
//!
//! Every party in a keyhome cluster is identified **only** by the certificate it presents
//! during the TLS handshake; nothing a peer says later can change who it is. The role is
//! encoded in exactly one subjectAltName DNS name under the `keyhome` pseudo-TLD:
//!
//! | role                  | SAN DNS name            | extended key usage        |
//! |-----------------------|-------------------------|---------------------------|
//! | [`Role::Node`]`(id)`  | `node-<id>.keyhome`     | serverAuth + clientAuth   |
//! | [`Role::Operator`]    | `operator.keyhome`      | clientAuth                |
//! | [`Role::Client`]`(n)` | `client-<n>.keyhome`    | clientAuth                |
//!
//! The subject CN is for humans only and is never consulted. Because operator and client
//! certificates lack serverAuth, only nodes can accept connections, and because a client
//! dials a node by [`server_name`], the TLS layer itself proves that the far end of an
//! outgoing connection is the node that was meant.
//!
//! # Crypto
//!
//! All keys are ECDSA P-256 with SHA-256 signatures (verified by rustls + *ring*). Every
//! rustls object here is built with the *ring* provider passed explicitly
//! ([`crypto_provider`]); the process-wide default provider is never installed or consulted.
//! Only TLS 1.3 is offered (QUIC requires it). 0-RTT and session resumption are disabled so
//! that every connection performs a full handshake with full certificate verification.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use keyhome_ring::NodeId;
use quinn::crypto::rustls::{NoInitialCipherSuite, QuicClientConfig, QuicServerConfig};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::RootCertStore;
use rustls::client::{Resumption, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::version::TLS13;
use x509_parser::extensions::GeneralName;

/// ALPN protocol spoken between nodes.
pub const ALPN_PEER: &[u8] = b"keyhome/1";
/// ALPN protocol spoken by clients and operators to a node.
pub const ALPN_CLIENT: &[u8] = b"keyhome-client/1";

/// The pseudo top-level domain under which every role name lives.
pub const DOMAIN: &str = "keyhome";

/// Longest accepted client name.
///
/// The client's SAN label is `client-<name>`, and a DNS label holds at most 63 octets, so the
/// name itself may hold at most `63 - "client-".len() = 56` characters. Keeping every SAN a
/// valid DNS name means the certificates stay valid under stricter verifiers (for instance
/// if the CA later gains a name constraint on `.keyhome`).
pub const MAX_CLIENT_NAME_LEN: usize = 63 - "client-".len();

/// How far before "now" a certificate's validity starts, to absorb clock skew between the
/// issuing machine and the machines verifying it.
pub const BACKDATE: Duration = Duration::from_secs(24 * 60 * 60);

/// Default lifetime of a leaf certificate issued by [`issue`] (ten years: development-grade;
/// production deployments should issue shorter-lived certificates with
/// [`issue_with_validity`]).
pub const LEAF_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// Lifetime of a CA created by [`generate_ca`] (twenty years, so that it outlives every leaf
/// issued with the default [`LEAF_LIFETIME`] during its first ten years).
pub const CA_LIFETIME: Duration = Duration::from_secs(20 * 365 * 24 * 60 * 60);

/// Interval at which an idle connection sends QUIC PINGs, keeping it (and NAT bindings)
/// alive. Must stay well below [`MAX_IDLE_TIMEOUT`].
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);

/// A connection that hears nothing from its peer for this long is closed. With keep-alives
/// every [`KEEP_ALIVE_INTERVAL`], this is how quickly a dead or partitioned peer is noticed.
/// The effective timeout is the minimum of both endpoints' values.
pub const MAX_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest PEM file [`Identity::load`] and [`load_ca`] will read.
pub const MAX_PEM_FILE_LEN: u64 = 1024 * 1024;

/// Most certificates accepted in one identity chain or CA bundle.
pub const MAX_CHAIN_LEN: usize = 16;

/// Largest DER certificate [`role_of`] will parse.
pub const MAX_CERT_DER_LEN: usize = 16 * 1024;

/// Most subjectAltName entries [`role_of`] will examine.
pub const MAX_SAN_ENTRIES: usize = 64;

/// Everything that can go wrong in this module.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// rcgen failed to build, sign or parse a certificate or key.
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A file could not be read.
    #[error("reading {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file exceeds [`MAX_PEM_FILE_LEN`].
    #[error("{} is larger than {max} bytes", path.display())]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// PEM text was malformed.
    #[error("malformed PEM: {0}")]
    Pem(#[from] rustls::pki_types::pem::Error),
    /// PEM text held no section of the expected kind.
    #[error("no PEM {0} found")]
    MissingPem(&'static str),
    /// PEM text held more certificates than allowed.
    #[error("{found} certificates found where at most {max} are allowed")]
    TooManyCertificates {
        /// How many were found (counting stops just past the limit).
        found: usize,
        /// The limit.
        max: usize,
    },
    /// The CA certificate is not a CA (no basicConstraints cA=true).
    #[error("the CA certificate is not marked as a certificate authority")]
    NotACa,
    /// The CA private key does not belong to the CA certificate.
    #[error("the CA private key does not match the CA certificate")]
    CaKeyMismatch,
    /// A certificate is larger than [`MAX_CERT_DER_LEN`].
    #[error("certificate is {len} bytes, more than the {max} allowed")]
    CertTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A certificate could not be parsed as X.509.
    #[error("malformed certificate: {0}")]
    MalformedCertificate(String),
    /// A certificate has more than [`MAX_SAN_ENTRIES`] subjectAltName entries.
    #[error("certificate has more than {0} subjectAltName entries")]
    TooManySans(usize),
    /// A certificate carries no keyhome role.
    #[error("certificate carries no keyhome role (no subjectAltName DNS name under .keyhome)")]
    NoRole,
    /// A certificate carries more than one keyhome role.
    #[error("certificate carries {0} keyhome roles; exactly one is required")]
    MultipleRoles(usize),
    /// A name under `.keyhome` is not a well-formed role name.
    #[error("malformed keyhome role name {0:?}")]
    MalformedRole(String),
    /// A client name breaks the naming rule.
    #[error(
        "invalid client name {0:?}: 1..={MAX_CLIENT_NAME_LEN} characters of [a-z0-9-], \
         not starting or ending with '-'"
    )]
    InvalidClientName(String),
    /// The requested validity period is empty or not representable in a certificate.
    #[error("invalid validity period: not_before must precede not_after, both within years 1..=9999")]
    InvalidValidity,
    /// No CA certificates were given to trust.
    #[error("no CA certificates to trust")]
    NoTrustAnchors,
    /// A CA certificate could not be used as a trust anchor.
    #[error("unusable CA certificate: {0}")]
    TrustAnchor(rustls::Error),
    /// The identity given to [`server_config`] is not a node's.
    #[error("only node certificates can serve, but the identity is {0}")]
    NotANode(Role),
    /// The ALPN protocol id is empty or longer than 255 bytes.
    #[error("ALPN protocol ids must be 1..=255 bytes")]
    InvalidAlpn,
    /// rustls rejected the configuration (e.g. the key does not match the certificate).
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// rustls could not build a certificate verifier.
    #[error("certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// quinn rejected the rustls configuration.
    #[error("QUIC crypto configuration: {0}")]
    Quic(#[from] NoInitialCipherSuite),
    /// A connection has no peer certificate chain (not built with this module's configs).
    #[error("the connection has no verified peer certificate")]
    NoPeerCertificate,
}

/// Who a certificate belongs to.
///
/// Invariant: a `Role` obtained from [`role_of`] came from the single keyhome SAN of the
/// certificate, and [`Role::dns_name`] / [`Role::from_dns_name`] are exact inverses on valid
/// roles (names are canonical: lowercase, decimal node ids without leading zeros).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A cluster node.
    Node(NodeId),
    /// An operator (administrative client).
    Operator,
    /// A named application client; the name matches `[a-z0-9]([a-z0-9-]*[a-z0-9])?` and has
    /// at most [`MAX_CLIENT_NAME_LEN`] characters.
    Client(String),
}

impl Role {
    /// The subjectAltName DNS name that encodes this role.
    ///
    /// Does not validate a client name; see [`Role::validate`].
    pub fn dns_name(&self) -> String {
        match self {
            Role::Node(id) => format!("node-{}.{DOMAIN}", id.0),
            Role::Operator => format!("operator.{DOMAIN}"),
            Role::Client(name) => format!("client-{name}.{DOMAIN}"),
        }
    }

    /// Checks the role can be put in a certificate (only client names can be invalid).
    pub fn validate(&self) -> Result<(), PkiError> {
        match self {
            Role::Client(name) if !valid_client_name(name) => Err(PkiError::InvalidClientName(name.clone())),
            _ => Ok(()),
        }
    }

    /// Parses a SAN DNS name under `.keyhome` back into a role.
    ///
    /// Returns `None` if the name is not under `.keyhome` at all (it is some other SAN), and
    /// `Some(Err(_))` if it is under `.keyhome` but malformed. Only the canonical spelling
    /// produced by [`Role::dns_name`] is accepted.
    pub fn from_dns_name(name: &str) -> Option<Result<Role, PkiError>> {
        let label = strip_domain(name)?;
        let malformed = || PkiError::MalformedRole(name.to_owned());
        let role = if label == "operator" {
            Ok(Role::Operator)
        } else if let Some(id) = label.strip_prefix("node-") {
            parse_canonical_u64(id).map(|id| Role::Node(NodeId(id))).ok_or_else(malformed)
        } else if let Some(client) = label.strip_prefix("client-") {
            if valid_client_name(client) { Ok(Role::Client(client.to_owned())) } else { Err(malformed()) }
        } else {
            Err(malformed())
        };
        Some(role)
    }

    /// A human-readable common name for the certificate subject (never used for identity).
    fn common_name(&self) -> String {
        match self {
            Role::Node(id) => format!("keyhome node {}", id.0),
            Role::Operator => "keyhome operator".to_owned(),
            Role::Client(name) => format!("keyhome client {name}"),
        }
    }
}

/// How a role reads in messages: `node 3`, `operator`, `client billing` (its certificate name is
/// [`Role::dns_name`]).
impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Node(id) => write!(f, "node {id}"),
            Role::Operator => f.write_str("operator"),
            Role::Client(name) => write!(f, "client {name}"),
        }
    }
}

/// Whether a failed handshake's reason says the peer's certificate names another node than the
/// one dialled (rustls: the certificate is not valid for [`server_name`]).
pub fn names_another_node(reason: &str) -> bool {
    reason.contains("not valid for name")
}

/// The TLS server name under which node `id` is dialled (`node-<id>.keyhome`); the node's
/// certificate carries exactly this SAN, so a successful handshake proves the identity.
pub fn server_name(id: NodeId) -> String {
    Role::Node(id).dns_name()
}

/// Returns the label before `.keyhome` if `name` is (ASCII case-insensitively) under the
/// keyhome domain, including the bare domain itself (yielding an empty label).
fn strip_domain(name: &str) -> Option<&str> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.eq_ignore_ascii_case(DOMAIN) {
        return Some("");
    }
    let split = name.len().checked_sub(DOMAIN.len() + 1)?;
    let (label, suffix) = (name.get(..split)?, name.get(split..)?);
    let domain = suffix.strip_prefix('.')?;
    domain.eq_ignore_ascii_case(DOMAIN).then_some(label)
}

fn valid_client_name(name: &str) -> bool {
    (1..=MAX_CLIENT_NAME_LEN).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Decimal u64 without sign or leading zeros, so each id has exactly one spelling.
fn parse_canonical_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse().ok()
}

/// The explicit *ring* crypto provider used by every TLS object in this module.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The period during which a certificate is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// First instant of validity.
    pub not_before: SystemTime,
    /// Last instant of validity.
    pub not_after: SystemTime,
}

impl Validity {
    /// `now - BACKDATE ..= now + lifetime`.
    pub fn starting_now(lifetime: Duration) -> Result<Validity, PkiError> {
        let now = SystemTime::now();
        Ok(Validity {
            not_before: now.checked_sub(BACKDATE).ok_or(PkiError::InvalidValidity)?,
            not_after: now.checked_add(lifetime).ok_or(PkiError::InvalidValidity)?,
        })
    }

    fn apply(&self, params: &mut CertificateParams) -> Result<(), PkiError> {
        let (not_before, not_after) = (to_datetime(self.not_before)?, to_datetime(self.not_after)?);
        if not_before >= not_after {
            return Err(PkiError::InvalidValidity);
        }
        params.not_before = not_before;
        params.not_after = not_after;
        Ok(())
    }
}

/// Whole seconds since the epoch as an X.509-encodable date (years 1..=9999), without the
/// panic of `OffsetDateTime::from(SystemTime)` on out-of-range values.
fn to_datetime(t: SystemTime) -> Result<time::OffsetDateTime, PkiError> {
    let secs = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_secs()).ok(),
        Err(before) => i64::try_from(before.duration().as_secs()).ok().map(|s| -s),
    }
    .ok_or(PkiError::InvalidValidity)?;
    time::OffsetDateTime::from_unix_timestamp(secs).map_err(|_| PkiError::InvalidValidity)
}

/// The cluster CA: its certificate and signing key.
///
/// Invariant: `issuer` signs with the private key that belongs to `cert_der`, and
/// `cert_der` is a CA certificate (checked by [`CaKeyPair::from_pem`]; true by construction
/// for [`generate_ca`]).
pub struct CaKeyPair {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
}

impl fmt::Debug for CaKeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaKeyPair")
            .field("cert_der_len", &self.cert_der.len())
            .field("key", &"<redacted>")
            .finish()
    }
}

impl CaKeyPair {
    /// The CA certificate, PEM-encoded (distribute this to every node and client).
    pub fn cert_pem(&self) -> String {
        self.cert_pem.clone()
    }

    /// The CA private key, PKCS#8 PEM (keep this secret, off the nodes if possible).
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// The CA certificate in DER, ready to be a trust anchor for [`server_config`] and
    /// [`client_config`].
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    /// Loads a CA previously written out with [`CaKeyPair::cert_pem`] / [`CaKeyPair::key_pem`].
    ///
    /// Checks that the PEM holds exactly one certificate, that it is a CA, and that the key
    /// belongs to it.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<CaKeyPair, PkiError> {
        let mut certs = certs_from_pem(cert_pem)?;
        if certs.len() != 1 {
            return Err(PkiError::TooManyCertificates { found: certs.len(), max: 1 });
        }
        let cert_der = certs.remove(0);
        let key = KeyPair::from_pem(key_pem)?;
        check_len(&cert_der)?;
        let (_, x509) = x509_parser::parse_x509_certificate(&cert_der)
            .map_err(|e| PkiError::MalformedCertificate(e.to_string()))?;
        let is_ca = x509
            .basic_constraints()
            .map_err(|e| PkiError::MalformedCertificate(e.to_string()))?
            .is_some_and(|bc| bc.value.ca);
        if !is_ca {
            return Err(PkiError::NotACa);
        }
        if x509.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(PkiError::CaKeyMismatch);
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)?;
        Ok(CaKeyPair { issuer, cert_der, cert_pem: cert_pem.to_owned() })
    }
}

/// Creates a fresh self-signed cluster CA (ECDSA P-256), valid for [`CA_LIFETIME`].
///
/// The CA may only issue end-entity certificates (path length 0).
pub fn generate_ca(common_name: &str) -> Result<CaKeyPair, PkiError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "keyhome");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Validity::starting_now(CA_LIFETIME)?.apply(&mut params)?;
    let cert = params.self_signed(&key)?;
    Ok(CaKeyPair { cert_der: cert.der().clone(), cert_pem: cert.pem(), issuer: Issuer::new(params, key) })
}

/// A freshly issued end-entity certificate and its private key, both PEM.
#[derive(Clone)]
pub struct IssuedCert {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PKCS#8 PEM. Secret.
    pub key_pem: String,
}

impl fmt::Debug for IssuedCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedCert")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl IssuedCert {
    /// The certificate and key as an [`Identity`] (the chain is just the leaf: peers trust
    /// the CA directly).
    pub fn identity(&self) -> Result<Identity, PkiError> {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }
}

/// Issues a certificate for `role`, valid from now - [`BACKDATE`] for [`LEAF_LIFETIME`].
pub fn issue(ca: &CaKeyPair, role: &Role) -> Result<IssuedCert, PkiError> {
    issue_with_validity(ca, role, Validity::starting_now(LEAF_LIFETIME)?)
}

/// Issues a certificate for `role` with an explicit validity period, under a fresh ECDSA
/// P-256 key.
///
/// The certificate has exactly one SAN ([`Role::dns_name`]), a CN for humans, key usage
/// digitalSignature, and EKU serverAuth+clientAuth for nodes or clientAuth otherwise.
pub fn issue_with_validity(ca: &CaKeyPair, role: &Role, validity: Validity) -> Result<IssuedCert, PkiError> {
    role.validate()?;
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, role.common_name());
    dn.push(DnType::OrganizationName, "keyhome");
    params.distinguished_name = dn;
    params.subject_alt_names = vec![SanType::DnsName(role.dns_name().try_into()?)];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = match role {
        Role::Node(_) => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        Role::Operator | Role::Client(_) => vec![ExtendedKeyUsagePurpose::ClientAuth],
    };
    params.use_authority_key_identifier_extension = true;
    validity.apply(&mut params)?;
    let cert = params.signed_by(&key, &ca.issuer)?;
    Ok(IssuedCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

fn check_len(cert: &[u8]) -> Result<(), PkiError> {
    if cert.len() > MAX_CERT_DER_LEN {
        return Err(PkiError::CertTooLarge { len: cert.len(), max: MAX_CERT_DER_LEN });
    }
    Ok(())
}

/// Extracts the keyhome role from a certificate.
///
/// Exactly one subjectAltName DNS name under `.keyhome` must be present and well formed;
/// other SANs are ignored, and the CN is never consulted. This only *parses*: call it on
/// certificates that were already verified against the cluster CA, such as the peer
/// certificate of a connection built with [`server_config`] / [`client_config`] (see
/// [`peer_role`]). Parsing is bounded by [`MAX_CERT_DER_LEN`] and [`MAX_SAN_ENTRIES`], and
/// trailing bytes after the certificate are rejected.
pub fn role_of(cert: &CertificateDer<'_>) -> Result<Role, PkiError> {
    check_len(cert)?;
    let (rest, x509) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| PkiError::MalformedCertificate(e.to_string()))?;
    if !rest.is_empty() {
        return Err(PkiError::MalformedCertificate(format!(
            "{} trailing bytes after the certificate",
            rest.len()
        )));
    }
    let Some(san) =
        x509.subject_alternative_name().map_err(|e| PkiError::MalformedCertificate(e.to_string()))?
    else {
        return Err(PkiError::NoRole);
    };
    let names = &san.value.general_names;
    if names.len() > MAX_SAN_ENTRIES {
        return Err(PkiError::TooManySans(MAX_SAN_ENTRIES));
    }
    let mut roles = names.iter().filter_map(|name| match name {
        GeneralName::DNSName(dns) => Role::from_dns_name(dns),
        _ => None,
    });
    let first = roles.next().ok_or(PkiError::NoRole)?;
    let extra = roles.count();
    if extra > 0 {
        return Err(PkiError::MultipleRoles(extra + 1));
    }
    first
}

/// The keyhome role of the peer of an established connection.
///
/// Sound only for connections built with [`server_config`] / [`client_config`], where the
/// handshake has verified the peer's chain against the cluster CA (a connection cannot
/// complete otherwise). The leaf is the first certificate of the peer's chain.
pub fn peer_role(conn: &quinn::Connection) -> Result<Role, PkiError> {
    let identity = conn.peer_identity().ok_or(PkiError::NoPeerCertificate)?;
    let chain =
        identity.downcast::<Vec<CertificateDer<'static>>>().map_err(|_| PkiError::NoPeerCertificate)?;
    let leaf = chain.first().ok_or(PkiError::NoPeerCertificate)?;
    role_of(leaf)
}

/// Whether a handshake this node accepted failed because the client's certificate was missing
/// or refused (a TLS alert about certificates). The client had answered the node's first flight
/// by then, so the failure is its address's own: a spoofed source address cannot cause it.
pub fn refused_certificate(error: &quinn::ConnectionError) -> bool {
    use rustls::AlertDescription as A;
    let quinn::ConnectionError::TransportError(error) = error else { return false };
    [
        A::CertificateRequired,
        A::BadCertificate,
        A::UnsupportedCertificate,
        A::CertificateRevoked,
        A::CertificateExpired,
        A::CertificateUnknown,
        A::UnknownCA,
        A::DecryptError,
    ]
    .into_iter()
    .any(|alert| error.code == quinn::TransportErrorCode::crypto(u8::from(alert)))
}

/// The ALPN protocol negotiated on an established connection (one of [`ALPN_PEER`] or
/// [`ALPN_CLIENT`] for connections accepted with [`server_config`]).
pub fn negotiated_alpn(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?.downcast::<quinn::crypto::rustls::HandshakeData>().ok()?.protocol
}

/// A certificate chain (leaf first) and its private key, presented in TLS handshakes.
///
/// Invariant: `chain` holds 1..=[`MAX_CHAIN_LEN`] certificates. The key is checked to match
/// the leaf when a config is built from the identity.
pub struct Identity {
    /// The chain, leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity { chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity").field("chain_len", &self.chain.len()).field("key", &"<redacted>").finish()
    }
}

impl Identity {
    /// Reads the chain (PEM, leaf first) and the private key (PEM: PKCS#8, SEC1 or PKCS#1)
    /// from files of at most [`MAX_PEM_FILE_LEN`] bytes.
    pub fn load(cert_path: impl AsRef<Path>, key_path: impl AsRef<Path>) -> Result<Identity, PkiError> {
        let cert_pem = read_pem_file(cert_path.as_ref())?;
        let key_pem = read_pem_file(key_path.as_ref())?;
        Identity::from_pem(&cert_pem, &key_pem)
    }

    /// Parses the chain (leaf first) and the first private key from PEM text.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Identity, PkiError> {
        let chain = certs_from_pem(cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => PkiError::MissingPem("private key"),
            e => PkiError::Pem(e),
        })?;
        Ok(Identity { chain, key })
    }

    /// The role in the leaf certificate.
    pub fn role(&self) -> Result<Role, PkiError> {
        let leaf = self.chain.first().ok_or(PkiError::MissingPem("certificate"))?;
        role_of(leaf)
    }
}

/// Reads the cluster CA certificate(s) (PEM) from a file of at most [`MAX_PEM_FILE_LEN`]
/// bytes, for use as trust anchors.
pub fn load_ca(path: impl AsRef<Path>) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    ca_from_pem(&read_pem_file(path.as_ref())?)
}

/// Parses the cluster CA certificate(s) from PEM text, for use as trust anchors.
///
/// Several certificates are allowed so that a CA can be rolled over (trust old and new).
pub fn ca_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    certs_from_pem(pem)
}

/// 1..=[`MAX_CHAIN_LEN`] certificates from PEM text; other PEM sections are skipped.
fn certs_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let mut certs = Vec::new();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        if certs.len() == MAX_CHAIN_LEN {
            return Err(PkiError::TooManyCertificates { found: MAX_CHAIN_LEN + 1, max: MAX_CHAIN_LEN });
        }
        certs.push(cert?);
    }
    if certs.is_empty() {
        return Err(PkiError::MissingPem("certificate"));
    }
    Ok(certs)
}

/// Reads a PEM file of at most [`MAX_PEM_FILE_LEN`] bytes.
pub(crate) fn read_pem_file(path: &Path) -> Result<String, PkiError> {
    crate::readfile::text(path, MAX_PEM_FILE_LEN)
        .map_err(|source| PkiError::Io { path: path.to_owned(), source })?
        .ok_or_else(|| PkiError::FileTooLarge { path: path.to_owned(), max: MAX_PEM_FILE_LEN })
}

fn root_store(ca: &[CertificateDer<'static>]) -> Result<Arc<RootCertStore>, PkiError> {
    if ca.is_empty() {
        return Err(PkiError::NoTrustAnchors);
    }
    let mut roots = RootCertStore::empty();
    for cert in ca {
        roots.add(cert.clone()).map_err(PkiError::TrustAnchor)?;
    }
    Ok(Arc::new(roots))
}

/// Ack-eliciting packets the accepting side may receive before it must acknowledge.
pub const ACK_ELICITING_THRESHOLD: u32 = 16;
/// Bidirectional streams a client connection may have open at once: requests in flight and its
/// event subscription.
pub const CLIENT_STREAMS: u32 = 64;
/// Unidirectional streams a peer connection may have open at once: a link uses one.
pub const PEER_STREAMS: u32 = 4;
/// Bytes a sender may have in flight on one stream: a whole largest client request
/// (64 KiB and its prefix) in one flight, with room to spare.
pub const STREAM_WINDOW: u32 = 128 << 10;
/// Bytes a client connection may have in flight across its streams (also every connection until
/// the node knows its role): with [`STREAM_WINDOW`], what QUIC buffers for one client connection.
pub const CLIENT_WINDOW: u32 = 256 << 10;
/// Bytes a peer connection may have in flight: several largest peer frames (1 MiB).
pub const PEER_WINDOW: u32 = 4 << 20;

fn idle_timeout() -> quinn::IdleTimeout {
    let idle_ms = u32::try_from(MAX_IDLE_TIMEOUT.as_millis()).unwrap_or(u32::MAX);
    quinn::IdleTimeout::from(quinn::VarInt::from_u32(idle_ms))
}

/// The QUIC transport of connections a node accepts, chosen for hostile load (docs/operations.md,
/// "Limits and hostile load"): the client protocol's limits ([`CLIENT_STREAMS`] bidirectional and
/// [`PEER_STREAMS`] unidirectional streams, [`STREAM_WINDOW`], [`CLIENT_WINDOW`]) until the role
/// is known ([`fit_to_role`]), idle timeout [`MAX_IDLE_TIMEOUT`], and no keep-alives of its own:
/// the dialling side keeps a connection alive, so one whose dialer goes silent ends.
pub fn accept_transport() -> quinn::TransportConfig {
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(CLIENT_STREAMS.into())
        .max_concurrent_uni_streams(PEER_STREAMS.into())
        .stream_receive_window(STREAM_WINDOW.into())
        .receive_window(CLIENT_WINDOW.into())
        .keep_alive_interval(None)
        .max_idle_timeout(Some(idle_timeout()));
    transport
}

/// The QUIC transport of connections a node or client dials: keep-alive every
/// [`KEEP_ALIVE_INTERVAL`], idle timeout [`MAX_IDLE_TIMEOUT`], and no stream the other side may
/// open (neither protocol has the accepting side open one).
pub fn dial_transport() -> quinn::TransportConfig {
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(0u32.into())
        .max_concurrent_uni_streams(0u32.into())
        .stream_receive_window(STREAM_WINDOW.into())
        .receive_window(CLIENT_WINDOW.into())
        .keep_alive_interval(Some(KEEP_ALIVE_INTERVAL))
        .max_idle_timeout(Some(idle_timeout()))
        .ack_frequency_config(Some(ack_frequency()));
    transport
}

/// What a dialling side asks the accepting side to acknowledge by (the QUIC ACK frequency
/// extension, which quinn speaks on both sides): after [`ACK_ELICITING_THRESHOLD`] packets, within
/// the accepting side's own ACK delay (left as it is: 25 ms, QUIC's default, so loss is detected as
/// fast as before), or at once when packets arrive 2 out of order (quinn's default reordering
/// threshold, one below QUIC's loss threshold of 3 packets). A peer link sends one way only, so
/// every ACK the other side sends is a datagram of its own and a wake-up of this node; with the
/// default (every second packet) a hot-key handoff sent 3.1 datagrams, with this 2.2
/// (docs/benchmarks.md).
fn ack_frequency() -> quinn::AckFrequencyConfig {
    let mut config = quinn::AckFrequencyConfig::default();
    config.ack_eliciting_threshold(ACK_ELICITING_THRESHOLD.into());
    config
}

/// Narrows an accepted connection's limits to its role's protocol once it is known: a peer
/// connection opens no bidirectional stream and gets [`PEER_WINDOW`]; a client connection opens
/// no unidirectional stream. (Credit already given cannot be taken back; what it allows is
/// bounded by the connection window.)
pub fn fit_to_role(conn: &quinn::Connection, role: &Role) {
    match role {
        Role::Node(_) => {
            conn.set_max_concurrent_bi_streams(0u32.into());
            conn.set_receive_window(PEER_WINDOW.into());
        }
        Role::Client(_) | Role::Operator => conn.set_max_concurrent_uni_streams(0u32.into()),
    }
}

/// The QUIC server configuration of a node.
///
/// - presents `identity`, which must be a node certificate ([`PkiError::NotANode`]
///   otherwise: other roles lack the serverAuth EKU and no client would accept them);
/// - **requires** a client certificate chaining to one of `ca` (webpki, *ring*);
/// - offers ALPN [`ALPN_PEER`] and [`ALPN_CLIENT`]; a client offering neither is refused;
/// - TLS 1.3 only, no 0-RTT, no session resumption (every handshake fully verifies);
/// - transport as in [`accept_transport`].
///
/// Authorisation (which roles may use which ALPN) is the caller's: use [`peer_role`] and
/// [`negotiated_alpn`] on the accepted connection.
pub fn server_config(
    identity: &Identity,
    ca: &[CertificateDer<'static>],
) -> Result<quinn::ServerConfig, PkiError> {
    let role = identity.role()?;
    if !matches!(role, Role::Node(_)) {
        return Err(PkiError::NotANode(role));
    }
    let provider = crypto_provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(root_store(ca)?, provider.clone()).build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain.clone(), identity.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN_PEER.to_vec(), ALPN_CLIENT.to_vec()];
    tls.max_early_data_size = 0;
    tls.session_storage = Arc::new(NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    config.transport_config(Arc::new(accept_transport()));
    Ok(config)
}

/// The QUIC client configuration for dialling nodes.
///
/// - verifies the server's chain against `ca` (webpki, *ring*) and its name against the
///   name passed to `quinn::Endpoint::connect` — use [`server_name`] so the handshake proves
///   the node id;
/// - presents `identity` as the client certificate (it must carry a keyhome role);
/// - offers the single ALPN protocol `alpn` ([`ALPN_PEER`] or [`ALPN_CLIENT`]);
/// - TLS 1.3 only, no 0-RTT, no session resumption; transport as in [`dial_transport`].
pub fn client_config(
    identity: &Identity,
    ca: &[CertificateDer<'static>],
    alpn: &[u8],
) -> Result<quinn::ClientConfig, PkiError> {
    if alpn.is_empty() || alpn.len() > 255 {
        return Err(PkiError::InvalidAlpn);
    }
    // Every party is identified by its certificate: refuse to present one without a role.
    identity.role()?;
    let provider = crypto_provider();
    let verifier = WebPkiServerVerifier::builder_with_provider(root_store(ca)?, provider.clone()).build()?;
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&TLS13])?
        .with_webpki_verifier(verifier)
        .with_client_auth_cert(identity.chain.clone(), identity.key.clone_key())?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    tls.enable_early_data = false;
    tls.resumption = Resumption::disabled();
    let mut config = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    config.transport_config(Arc::new(dial_transport()));
    Ok(config)
}
