//! Reading the files an operator or a command hands the node or the CLI (configuration, tokens,
//! PEM, a handoff note), with a bound on what is read: a device, a FIFO or a file that grows while
//! it is read (none of which its length metadata tells) is refused once it passes the bound, never
//! read whole.

use std::io::Read as _;
use std::path::Path;

/// Reads the file at `path`; `Ok(None)` if it holds more than `max` bytes. Reads at most
/// `max + 1` bytes, whatever the file is.
pub fn bytes(path: &Path, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut data = Vec::new();
    // One byte past the limit tells "exactly at the limit" from "over it".
    std::fs::File::open(path)?.take(max.saturating_add(1)).read_to_end(&mut data)?;
    Ok((data.len() as u64 <= max).then_some(data))
}

/// [`bytes`] as UTF-8 text; text that is not UTF-8 is an [`std::io::ErrorKind::InvalidData`] error.
pub fn text(path: &Path, max: u64) -> std::io::Result<Option<String>> {
    bytes(path, max)?
        .map(|data| {
            String::from_utf8(data).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_up_to_the_bound_and_refuses_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "abcd").unwrap();
        assert_eq!(text(&path, 4).unwrap().as_deref(), Some("abcd"));
        assert_eq!(text(&path, 3).unwrap(), None);
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert_eq!(text(&path, 4).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
        // A device reports length 0 and never ends: refused after max + 1 bytes.
        assert_eq!(bytes(Path::new("/dev/zero"), 1 << 16).unwrap(), None);
    }
}
