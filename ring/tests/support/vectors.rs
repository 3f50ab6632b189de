//! Key encoding of `tests/golden_vectors.txt`, shared by its reader
//! (`tests/golden.rs`) and its writer (`examples/golden_vectors.rs`).
//!
//! A key is written as one whitespace-free token:
//! - `hex:<hex digits>`: the bytes, two lower-case hex digits each
//!   (`hex:` alone is the empty key);
//! - `str:<text>`: the UTF-8 bytes of a text without whitespace;
//! - `rep:<hex byte>:<len>`: `len` copies of one byte;
//! - `seq:<len>`: `len` bytes where byte `i` is `i % 251`.

/// Decodes a key token into the key's bytes.
pub fn decode_key(token: &str) -> Result<Vec<u8>, String> {
    if let Some(hex) = token.strip_prefix("hex:") {
        decode_hex(hex)
    } else if let Some(text) = token.strip_prefix("str:") {
        Ok(text.as_bytes().to_vec())
    } else if let Some(rest) = token.strip_prefix("rep:") {
        let (byte, len) = rest.split_once(':').ok_or_else(|| format!("rep key without length: {token}"))?;
        let byte = u8::from_str_radix(byte, 16).map_err(|e| format!("{token}: {e}"))?;
        Ok(vec![byte; parse_len(len, token)?])
    } else if let Some(len) = token.strip_prefix("seq:") {
        // `i % 251` is below 256, so the narrowing is exact.
        Ok((0..parse_len(len, token)?).map(|i| (i % 251) as u8).collect())
    } else {
        Err(format!("unknown key encoding: {token}"))
    }
}

/// Encodes bytes as the `hex:` form.
pub fn encode_hex(bytes: &[u8]) -> String {
    let mut token = String::from("hex:");
    for byte in bytes {
        token.push_str(&format!("{byte:02x}"));
    }
    token
}

fn decode_hex(hex: &str) -> Result<Vec<u8>, String> {
    if !hex.len().is_multiple_of(2) || !hex.is_ascii() {
        return Err(format!("bad hex key: {hex}"));
    }
    (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).map_err(|e| format!("{hex}: {e}")))
        .collect()
}

fn parse_len(len: &str, token: &str) -> Result<usize, String> {
    len.parse().map_err(|e| format!("{token}: {e}"))
}
