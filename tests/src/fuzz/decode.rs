//! Decoder targets: peer frames, client requests, epoch records and certificate roles.
//!
//! Each input either is raw bytes or builds a valid value and encodes it, then mutates the
//! encoding (bit flips, overwritten and inserted bytes, truncation, appended bytes, varint length
//! fields made huge). Whatever comes out must decode to a clear error or to a value whose own
//! checks hold; an unmutated encoding must decode back to what was encoded.

use std::fmt::Debug;
use std::sync::OnceLock;

use keyhome::pki::{self, Role};
use keyhome::wire::{self, MAX_CLIENT_FRAME, MAX_PEER_FRAME, PeerFrame, Request, WireError};
use keyhome_epoch::{Change, EpochRecord, MAX_EPOCH};
use quinn::rustls::pki_types::CertificateDer;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::values::Gen;

/// Applies up to eight random mutations to `bytes`; returns how many it applied.
pub fn mutate(g: &mut Gen<'_>, bytes: &mut Vec<u8>) -> usize {
    let n = g.pick(&[0, 1, 1, 1, 2, 3, 8]);
    for _ in 0..n {
        let at = g.index(bytes.len() + 1);
        match g.index(7) {
            0 if at < bytes.len() => bytes[at] ^= 1 << g.index(8),
            1 if at < bytes.len() => bytes[at] = g.u8(),
            2 => bytes.truncate(at),
            3 => bytes.extend(g.bytes(8)),
            4 => bytes.insert(at, g.u8()),
            5 if at < bytes.len() => {
                bytes.remove(at);
            }
            // A varint length or count made huge: continuation bytes, then a high final byte.
            _ => bytes.splice(at..at, [0xff, 0xff, 0xff, 0x0f]).for_each(drop),
        }
    }
    n
}

/// The body of `value`'s frame, or an error if encoding fails (it must not, within `max`).
fn encode_body<T: Serialize>(value: &T, max: usize) -> Result<Vec<u8>, String> {
    let frame = wire::encode(value, max).map_err(|e| format!("encoding a generated value failed: {e}"))?;
    Ok(frame[4..].to_vec())
}

/// Decodes `bytes` as a frame body. A value that decodes must re-encode to bytes that decode to
/// the same value (compared by its re-encoding). `exact` says `bytes` is an unmutated encoding,
/// which must decode.
fn decode_checked<T: Serialize + DeserializeOwned + Debug>(
    bytes: &[u8],
    max: usize,
    exact: bool,
) -> Result<Option<T>, String> {
    let value = match wire::decode::<T>(bytes) {
        Ok(v) => v,
        Err(e) if exact => return Err(format!("a valid encoding did not decode: {e}")),
        Err(WireError::Decode(_) | WireError::TrailingBytes(_)) => return Ok(None),
        Err(e) => return Err(format!("unexpected decode error: {e}")),
    };
    let again = encode_body(&value, max.max(bytes.len()))?;
    let round =
        wire::decode::<T>(&again).map_err(|e| format!("a re-encoded {value:?} did not decode: {e}"))?;
    if encode_body(&round, max.max(bytes.len()))? != again {
        return Err(format!("{value:?} does not survive a round trip"));
    }
    if exact && again != bytes {
        return Err(format!("{value:?} re-encodes differently"));
    }
    Ok(Some(value))
}

/// Generated or raw bytes for a decoder; `true` when they are an unmutated encoding.
fn input<T: Serialize>(
    g: &mut Gen<'_>,
    max: usize,
    value: impl FnOnce(&mut Gen<'_>) -> T,
) -> Result<(Vec<u8>, bool), String> {
    if g.index(8) == 0 {
        return Ok((g.bytes(256), false));
    }
    let mut bytes = encode_body(&value(g), max)?;
    let mutations = mutate(g, &mut bytes);
    Ok((bytes, mutations == 0))
}

/// `peer-frame`: a peer frame body, then the checks the node runs on what it carries.
pub fn peer_frame(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    let (bytes, exact) = input(&mut g, MAX_PEER_FRAME, |g| g.peer_frame())?;
    match decode_checked::<PeerFrame>(&bytes, MAX_PEER_FRAME, exact)? {
        Some(PeerFrame::Epoch(message)) => {
            if message.validate().is_ok() {
                check_epoch_numbers(&message)?;
            }
        }
        Some(PeerFrame::Hello { .. } | PeerFrame::Delegation(_)) | None => {}
    }
    Ok(())
}

/// What [`keyhome_epoch::Message::validate`] promises: epoch and slot numbers within bounds.
fn check_epoch_numbers(message: &keyhome_epoch::Message) -> Result<(), String> {
    use keyhome_epoch::Body;
    let slot = match &message.body {
        Body::Prepare { slot, .. } | Body::Accept { slot, .. } | Body::Vote { slot, .. } => *slot,
        _ => 0,
    };
    if message.epoch > MAX_EPOCH || slot > MAX_EPOCH {
        return Err(format!("{message:?} passed validation"));
    }
    Ok(())
}

/// `request`: a client request body.
pub fn request(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    let (bytes, exact) = input(&mut g, MAX_CLIENT_FRAME, |g| g.request())?;
    decode_checked::<Request>(&bytes, MAX_CLIENT_FRAME, exact)?;
    Ok(())
}

/// `epoch-record`: a record decoded from (mutated) bytes or generated directly, validated; a
/// valid one must keep every invariant validation promises, and changes applied to it must give
/// a valid record or a clear error.
pub fn epoch_record(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    let record = if g.bool() {
        let (bytes, exact) = input(&mut g, MAX_PEER_FRAME, |g| g.record(1))?;
        match decode_checked::<EpochRecord>(&bytes, MAX_PEER_FRAME, exact)? {
            Some(record) => record,
            None => return Ok(()),
        }
    } else {
        let number = g.number_near(1, MAX_EPOCH);
        g.record(number)
    };
    if record.validate().is_err() {
        return Ok(());
    }
    check_valid_record(&record)?;
    for _ in 0..g.range(1, 3) {
        let change: Change = g.change();
        if let Ok(next) = change.apply(&record) {
            next.validate().map_err(|e| format!("{change:?} on {record:?} made an invalid record: {e}"))?;
            if next.number != record.number + 1 {
                return Err(format!("{change:?} on {record:?} numbered the next record {}", next.number));
            }
        }
    }
    Ok(())
}

/// The invariants [`EpochRecord::validate`] documents, checked independently.
fn check_valid_record(r: &EpochRecord) -> Result<(), String> {
    let sorted = r.members.windows(2).all(|w| w[0].id < w[1].id);
    let in_range = (1..=MAX_EPOCH).contains(&r.number) && !r.members.is_empty();
    let majority = r.majority();
    if !sorted || !in_range || majority == 0 || majority > r.members.len() || r.timing.validate().is_err() {
        return Err(format!("{r:?} passed validation"));
    }
    if !r.member_ids().all(|id| r.is_member(id)) || r.ring().len() != r.members.len() {
        return Err(format!("{r:?}: members and ring disagree"));
    }
    Ok(())
}

/// Certificates issued once per process, with the role each carries.
fn certificates() -> &'static [(Vec<u8>, Role)] {
    static CERTS: OnceLock<Vec<(Vec<u8>, Role)>> = OnceLock::new();
    CERTS.get_or_init(|| {
        let ca = pki::generate_ca("keyhome fuzz ca").expect("CA");
        let roles = [
            Role::Node(keyhome_epoch::NodeId(1)),
            Role::Node(keyhome_epoch::NodeId(u64::MAX)),
            Role::Operator,
            Role::Client("app-7".to_owned()),
        ];
        roles
            .into_iter()
            .map(|role| {
                let issued = pki::issue(&ca, &role).expect("certificate");
                let identity = issued.identity().expect("identity");
                (identity.chain[0].to_vec(), role)
            })
            .collect()
    })
}

/// `cert-role`: role parsing of mutated certificates and of SAN names.
///
/// An accepted role must be valid and spell back to the name it came from; an unmutated
/// certificate must give its own role.
pub fn cert_role(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    if g.bool() {
        let name = dns_name(&mut g);
        return check_name(&name);
    }
    let certs = certificates();
    let (der, role) = &certs[g.index(certs.len())];
    let mut bytes = der.clone();
    let mutations =
        if g.bool() { overwrite_name(&mut g, &mut bytes, role) } else { mutate(&mut g, &mut bytes) };
    match pki::role_of(&CertificateDer::from(bytes)) {
        Ok(found) if mutations == 0 && found != *role => {
            Err(format!("certificate of {role:?} gave {found:?}"))
        }
        Ok(found) => {
            found.validate().map_err(|e| format!("{found:?} accepted but invalid: {e}"))?;
            check_name(&found.dns_name())
        }
        Err(e) if mutations == 0 => Err(format!("certificate of {role:?} refused: {e}")),
        Err(_) => Ok(()),
    }
}

/// Overwrites some bytes of the role's SAN inside the DER (the lengths stay): the parser then
/// sees a well-formed certificate with another name. Returns the number of bytes changed.
fn overwrite_name(g: &mut Gen<'_>, der: &mut [u8], role: &Role) -> usize {
    let name = role.dns_name().into_bytes();
    let Some(start) = der.windows(name.len()).position(|w| w == name) else { return 0 };
    let mut changed = 0;
    for _ in 0..g.range(1, 4) {
        let at = start + g.index(name.len());
        let byte = g.pick(b"0123456789abcz-.AZ\0\xff");
        changed += usize::from(der[at] != byte);
        der[at] = byte;
    }
    changed
}

/// A name that is mostly close to a keyhome SAN.
fn dns_name(g: &mut Gen<'_>) -> String {
    const PARTS: [&str; 12] = [
        "node-",
        "client-",
        "operator",
        ".keyhome",
        ".KeyHome",
        ".",
        "-",
        "0",
        "1",
        "18446744073709551616",
        "a",
        "é",
    ];
    let mut name = String::new();
    for _ in 0..g.range(0, 6) {
        name.push_str(g.pick(&PARTS));
    }
    if g.bool() {
        name.push_str(".keyhome");
    }
    name
}

/// `from_dns_name` on `name`: an accepted role is valid and is spelled `name` (up to ASCII case
/// and a final dot).
fn check_name(name: &str) -> Result<(), String> {
    let Some(Ok(role)) = Role::from_dns_name(name) else { return Ok(()) };
    role.validate().map_err(|e| format!("{name:?} parsed to invalid {role:?}: {e}"))?;
    let canonical = role.dns_name();
    let plain = name.strip_suffix('.').unwrap_or(name);
    if !canonical.eq_ignore_ascii_case(plain)
        || !matches!(Role::from_dns_name(&canonical), Some(Ok(r)) if r == role)
    {
        return Err(format!("{name:?} parsed to {role:?}, which is spelled {canonical:?}"));
    }
    Ok(())
}
