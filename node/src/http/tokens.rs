//! Bearer tokens of the HTTP API: issued beside each client and operator certificate, stored by
//! the node only as BLAKE3 hashes.
//!
//! A token reads `NAME.SECRET`: `NAME` is the client name (or `operator`), for humans and logs
//! only; `SECRET` is 32 random bytes, base64url. `keyhome certs issue --client NAME` (and
//! `--operator`) writes the token to `<identity dir>/http-token` (mode 0600) and its hash, with
//! the identity it stands for, to the cluster's [`TOKENS_FILE`]. Issuing again for the same
//! identity replaces its hash (the old token stops working). A token stands for exactly the
//! identity of its certificate: the same role, and the same handles.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::pki::Role;

/// The tokens file in a cluster directory.
pub const TOKENS_FILE: &str = "http-tokens.toml";
/// The token file in an identity directory.
pub const TOKEN_FILE: &str = "http-token";
/// Largest tokens file read (about 5 000 identities).
const MAX_FILE: u64 = 1 << 20;
/// How often the node looks whether the tokens file changed.
const RECHECK: Duration = Duration::from_secs(1);

/// Why a tokens file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is larger than the {MAX_FILE}-byte limit")]
    TooLarge { path: PathBuf },
    #[error("{path} is not a valid tokens file: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("cannot draw a random secret: {0}")]
    Random(String),
}

/// The tokens file's contents: one entry per identity.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensFile {
    #[serde(default, rename = "token")]
    pub tokens: Vec<TokenEntry>,
}

/// One identity's token, as its hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// The identity, spelled as in its certificate's SAN: `client-NAME.keyhome` or
    /// `operator.keyhome`.
    pub identity: String,
    /// BLAKE3 of the whole token text, hex.
    pub blake3: String,
}

impl TokensFile {
    /// Reads `path`; a file that does not exist is empty.
    pub fn load(path: &Path) -> Result<TokensFile, TokensError> {
        let read = |source| TokensError::Read { path: path.to_path_buf(), source };
        match crate::readfile::text(path, MAX_FILE) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TokensFile::default()),
            Err(e) => Err(read(e)),
            Ok(None) => Err(TokensError::TooLarge { path: path.to_path_buf() }),
            Ok(Some(text)) => TokensFile::parse(path, &text),
        }
    }

    /// Parses the text of the tokens file at `path`.
    fn parse(path: &Path, text: &str) -> Result<TokensFile, TokensError> {
        toml::from_str(text)
            .map_err(|e| TokensError::Invalid { path: path.to_path_buf(), message: e.to_string() })
    }

    /// The identities by token hash; refuses node identities and malformed entries.
    fn by_hash(&self, path: &Path) -> Result<HashMap<blake3::Hash, Role>, TokensError> {
        let invalid = |message: String| TokensError::Invalid { path: path.to_path_buf(), message };
        let mut map = HashMap::new();
        for entry in &self.tokens {
            let role = match Role::from_dns_name(&entry.identity) {
                Some(Ok(role @ (Role::Client(_) | Role::Operator))) => role,
                _ => return Err(invalid(format!("{:?} is no client or operator identity", entry.identity))),
            };
            let hash = blake3::Hash::from_hex(&entry.blake3)
                .map_err(|e| invalid(format!("hash of {}: {e}", entry.identity)))?;
            map.insert(hash, role);
        }
        Ok(map)
    }

    /// The file's text, with a header saying what it holds. Callers write it whole, by renaming
    /// a complete temporary file over it, so that a node re-reading it never sees half of it.
    fn text(&self, path: &Path) -> Result<String, TokensError> {
        let text = toml::to_string(self)
            .map_err(|e| TokensError::Invalid { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(format!("# keyhome HTTP API tokens: hashes only (keyhome certs issue)\n{text}"))
    }
}

/// A token drawn for an identity, and the tokens file's new contents with its hash.
pub struct Drawn {
    pub token: String,
    /// The whole tokens file, the identity's earlier hash replaced: written by the caller, whole.
    pub file: String,
}

/// Draws a new token for `role` (a client or the operator) and returns it with the new contents of
/// the tokens file at `tokens` (the identity's earlier hash replaced); the caller writes both.
/// `current` is the file's text if the caller has a newer one than the disk's (not yet written).
pub fn draw(tokens: &Path, current: Option<&str>, role: &Role) -> Result<Drawn, TokensError> {
    let name = match role {
        Role::Client(name) => name.as_str(),
        _ => "operator",
    };
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| TokensError::Random(e.to_string()))?;
    let token = format!("{name}.{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret));
    let identity = role.dns_name();
    let mut file = match current {
        Some(text) => TokensFile::parse(tokens, text)?,
        None => TokensFile::load(tokens)?,
    };
    file.tokens.retain(|e| e.identity != identity);
    file.tokens.push(TokenEntry { identity, blake3: blake3::hash(token.as_bytes()).to_hex().to_string() });
    Ok(Drawn { token, file: file.text(tokens)? })
}

/// The tokens a node accepts: the tokens file as last read, re-read when it changes (looked at
/// no more often than every [`RECHECK`]). A file that cannot be read or parsed leaves the tokens
/// read before in force (the error is logged).
pub struct Tokens {
    path: PathBuf,
    state: Mutex<Loaded>,
}

struct Loaded {
    by_hash: HashMap<blake3::Hash, Role>,
    /// When the file was last looked at (this process's monotonic clock); `None`: never.
    looked: Option<std::time::Instant>,
    /// A hash of the file's contents when last read.
    stamp: Option<blake3::Hash>,
}

impl Tokens {
    /// Checks that the tokens file at `path` can be used (a missing one holds no tokens yet).
    pub fn check(path: &Path) -> Result<(), TokensError> {
        if TokensFile::load(path)?.by_hash(path)?.is_empty() {
            tracing::warn!(
                path = %path.display(),
                "no HTTP tokens yet: every API request is refused until `keyhome certs issue` writes one"
            );
        }
        Ok(())
    }

    /// The tokens in the file at `path`, read on first use.
    pub fn new(path: &Path) -> Tokens {
        let state = Loaded { by_hash: HashMap::new(), looked: None, stamp: None };
        Tokens { path: path.to_path_buf(), state: Mutex::new(state) }
    }

    /// The identity `token` stands for, if any.
    pub fn identify(&self, token: &str) -> Option<Role> {
        let mut state = crate::runtime::lock(&self.state);
        if state.looked.is_none_or(|at| at.elapsed() >= RECHECK) {
            state.looked = Some(std::time::Instant::now());
            let now = stamp(&self.path);
            if now != state.stamp {
                match TokensFile::load(&self.path).and_then(|f| f.by_hash(&self.path)) {
                    Ok(by_hash) => {
                        tracing::info!(path = %self.path.display(), tokens = by_hash.len(), "HTTP tokens read");
                        state.by_hash = by_hash;
                        state.stamp = now;
                    }
                    Err(e) => tracing::error!("keeping the HTTP tokens read before: {e}"),
                }
            }
        }
        state.by_hash.get(&blake3::hash(token.as_bytes())).cloned()
    }
}

/// What tells one version of the tokens file from the next: a hash of its contents (at most
/// [`MAX_FILE`] bytes read; a larger file is refused when loaded). A re-issue may leave the
/// file's length, its inode number (reused) and, within the filesystem's time resolution, its
/// mtime as they were.
fn stamp(path: &Path) -> Option<blake3::Hash> {
    use std::io::Read;
    let mut bytes = Vec::new();
    let file = std::fs::File::open(path).ok()?;
    file.take(MAX_FILE + 1).read_to_end(&mut bytes).ok()?;
    Some(blake3::hash(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws a token and writes the tokens file at once.
    fn issue(path: &Path, role: &Role) -> Result<String, TokensError> {
        let drawn = draw(path, None, role)?;
        std::fs::write(path, drawn.file).expect("write the tokens file");
        Ok(drawn.token)
    }

    #[test]
    fn an_issued_token_stands_for_its_identity_until_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TOKENS_FILE);
        let app = issue(&path, &Role::Client("app".into())).unwrap();
        let op = issue(&path, &Role::Operator).unwrap();
        assert!(app.starts_with("app.") && op.starts_with("operator."));
        Tokens::check(&path).unwrap();
        let tokens = Tokens::new(&path);
        assert_eq!(tokens.identify(&app), Some(Role::Client("app".into())));
        assert_eq!(tokens.identify(&op), Some(Role::Operator));
        assert_eq!(tokens.identify("app.wrong"), None);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(app.split_once('.').unwrap().1), "only hashes are stored");
        let again = issue(&path, &Role::Client("app".into())).unwrap();
        let reread = Tokens::new(&path);
        assert_eq!(reread.identify(&app), None, "reissuing replaces the old token");
        assert_eq!(reread.identify(&again), Some(Role::Client("app".into())));
    }

    #[test]
    fn a_reissue_is_seen_though_its_length_and_mtime_are_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TOKENS_FILE);
        let app = Role::Client("app".into());
        let first = issue(&path, &app).unwrap();
        let tokens = Tokens::new(&path);
        assert_eq!(tokens.identify(&first), Some(app.clone()));
        let before = std::fs::metadata(&path).unwrap();
        // As `keyhome certs` writes it: a new file renamed into place, here within the same
        // mtime tick (a coarse-grained filesystem) and of the same length (its inode number
        // could be one freed since, too).
        let drawn = draw(&path, None, &app).unwrap();
        let staged = dir.path().join("staged");
        std::fs::write(&staged, &drawn.file).unwrap();
        let file = std::fs::File::options().write(true).open(&staged).unwrap();
        file.set_modified(before.modified().unwrap()).unwrap();
        std::fs::rename(&staged, &path).unwrap();
        let after = std::fs::metadata(&path).unwrap();
        assert_eq!((after.len(), after.modified().unwrap()), (before.len(), before.modified().unwrap()));
        crate::runtime::lock(&tokens.state).looked = None; // as once RECHECK has passed
        assert_eq!(tokens.identify(&first), None, "the replaced token is refused");
        assert_eq!(tokens.identify(&drawn.token), Some(app));
    }

    #[test]
    fn node_identities_and_bad_hashes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TOKENS_FILE);
        for (identity, hash) in [("node-1.keyhome", "00".repeat(32)), ("client-app.keyhome", "zz".into())] {
            let file = TokensFile { tokens: vec![TokenEntry { identity: identity.into(), blake3: hash }] };
            std::fs::write(&path, file.text(&path).unwrap()).unwrap();
            assert!(matches!(Tokens::check(&path), Err(TokensError::Invalid { .. })), "{identity}");
        }
    }
}
