//! Golden vectors: the routing algorithm, frozen.
//!
//! `golden_vectors.txt` (written by `examples/golden_vectors.rs`) lists member
//! sets, keys and their expected home and top-3 replicas; they must match
//! exactly. `FINGERPRINTS` additionally pins, per released `ROUTING_VERSION`,
//! a digest of the rankings of a fixed probe workload. Rows are append-only:
//! regenerating the vectors after an algorithm change leaves the current
//! version's row failing, so the change cannot land without a version bump.

mod support;

use keyhome_ring::{NodeId, ROUTING_VERSION, Ring};
use support::vectors::{decode_key, encode_hex};

const VECTORS: &str = include_str!("golden_vectors.txt");

/// (routing version, BLAKE3 hex of `probe_rankings()`). Append a row when
/// bumping `ROUTING_VERSION`; never edit or remove one.
const FINGERPRINTS: &[(u32, &str)] =
    &[(1, "15b847a3ed89b05f458e12a88ba3b8efc3fec9609aba7d81af2192e1abbf3327")];

/// One `case` line.
struct Case {
    line: usize,
    set: String,
    key: Vec<u8>,
    home: NodeId,
    top: Vec<NodeId>,
}

struct Vectors {
    version: u32,
    sets: Vec<(String, Vec<NodeId>)>,
    cases: Vec<Case>,
}

fn parse_id(token: &str, line: usize) -> NodeId {
    match token.parse() {
        Ok(id) => NodeId(id),
        Err(e) => panic!("line {line}: bad id {token:?}: {e}"),
    }
}

fn parse(text: &str) -> Vectors {
    let mut version = None;
    let mut sets = Vec::new();
    let mut cases = Vec::new();
    for (at, raw) in text.lines().enumerate() {
        let line = at + 1;
        let fields: Vec<&str> = raw.split_whitespace().collect();
        match fields.as_slice() {
            [] => {}
            [first, ..] if first.starts_with('#') => {}
            ["routing_version", v] => {
                let v = v.parse().unwrap_or_else(|e| panic!("line {line}: {e}"));
                assert!(version.replace(v).is_none(), "line {line}: second version");
            }
            ["set", name, ids @ ..] => {
                let ids = ids.iter().map(|t| parse_id(t, line)).collect();
                sets.push((name.to_string(), ids));
            }
            ["case", set, key, home, top] => cases.push(Case {
                line,
                set: set.to_string(),
                key: decode_key(key).unwrap_or_else(|e| panic!("line {line}: {e}")),
                home: parse_id(home, line),
                top: top.split(',').map(|t| parse_id(t, line)).collect(),
            }),
            _ => panic!("line {line}: unrecognised: {raw}"),
        }
    }
    Vectors { version: version.expect("the vectors declare no routing_version"), sets, cases }
}

#[test]
fn vectors_are_for_this_routing_version() {
    let vectors = parse(VECTORS);
    assert_eq!(
        vectors.version, ROUTING_VERSION,
        "golden_vectors.txt was generated for another ROUTING_VERSION; regenerate it"
    );
}

#[test]
fn golden_vectors_match_exactly() {
    let vectors = parse(VECTORS);
    assert!(vectors.cases.len() >= 50, "too few golden cases");
    for (name, _) in &vectors.sets {
        assert!(vectors.cases.iter().any(|c| &c.set == name), "set {name} has no case");
    }
    for case in &vectors.cases {
        let members = match vectors.sets.iter().find(|(name, _)| *name == case.set) {
            Some((_, members)) => members,
            None => panic!("line {}: unknown set {}", case.line, case.set),
        };
        let ring = Ring::new(members);
        let at = format!("golden_vectors.txt line {}", case.line);
        assert_eq!(ring.home(&case.key), Some(case.home), "{at}: home");
        assert_eq!(ring.homes(&case.key, 3), case.top, "{at}: top 3");
        assert_eq!(keyhome_ring::home(&case.key, members), Some(case.home), "{at}: free home");
        assert_eq!(keyhome_ring::homes(&case.key, members, 3), case.top, "{at}: free homes");
    }
}

/// A fixed workload covering several ring shapes and key kinds; its digest
/// identifies the routing algorithm.
fn probe_rankings() -> String {
    let rings: Vec<Ring> = [1u64, 2, 3, 5, 16, 64, 256]
        .iter()
        .map(|&n| {
            let ids: Vec<NodeId> = (0..n)
                .map(|i| NodeId(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n))
                .chain([NodeId(u64::MAX)])
                .collect();
            Ring::new(&ids)
        })
        .collect();
    let mut digest = blake3::Hasher::new();
    for i in 0u32..1_000 {
        let text = format!("probe/{i}");
        for key in [text.as_bytes(), &i.to_le_bytes()[..], &vec![0u8; i as usize % 70]] {
            for ring in &rings {
                for id in ring.homes(key, 4) {
                    digest.update(&id.0.to_le_bytes());
                }
                digest.update(b";");
            }
        }
    }
    digest.finalize().to_hex().to_string()
}

#[test]
fn routing_algorithm_matches_its_version() {
    let actual = probe_rankings();
    match FINGERPRINTS.iter().find(|(v, _)| *v == ROUTING_VERSION) {
        Some((_, frozen)) => assert_eq!(
            actual, *frozen,
            "routing for ROUTING_VERSION {ROUTING_VERSION} changed: bump ROUTING_VERSION, \
             regenerate golden_vectors.txt and append a FINGERPRINTS row"
        ),
        None => panic!(
            "no fingerprint for ROUTING_VERSION {ROUTING_VERSION}: append ({ROUTING_VERSION}, \"{actual}\")"
        ),
    }
    let mut versions: Vec<u32> = FINGERPRINTS.iter().map(|(v, _)| *v).collect();
    versions.sort_unstable();
    versions.dedup();
    assert_eq!(versions.len(), FINGERPRINTS.len(), "duplicate FINGERPRINTS row");
}

#[test]
fn key_encoding_round_trips() {
    let bytes = [0x00, 0x7f, 0x80, 0xff];
    assert_eq!(encode_hex(&bytes), "hex:007f80ff");
    assert_eq!(decode_key(&encode_hex(&bytes)), Ok(bytes.to_vec()));
    assert_eq!(decode_key("hex:"), Ok(Vec::new()));
    assert_eq!(decode_key("str:a/b"), Ok(b"a/b".to_vec()));
    assert_eq!(decode_key("rep:61:3"), Ok(b"aaa".to_vec()));
    assert_eq!(decode_key("seq:253").map(|k| k[250..].to_vec()), Ok(vec![250, 0, 1]));
    assert!(decode_key("hex:0").is_err());
    assert!(decode_key("raw:x").is_err());
}
