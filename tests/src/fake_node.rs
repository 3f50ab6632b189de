//! What the tests of the Rust client share where a fake node plays the node's side of its calls
//! (tests/tests/local_socket.rs, tests/tests/cluster.rs): a lock answer to send, and a lock call
//! held pending until the fake node has its request.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use keyhome::wire::{Locked, Response};
use keyhome_delegation::FencingToken;
use tokio::sync::oneshot;

/// A lock answer naming `handle` (its token's counter too), valid for `valid_for`.
pub fn locked(handle: u64, valid_for: Duration) -> Response {
    let token = FencingToken { epoch: 1, incarnation: 1, counter: handle, local_seq: 0 };
    Response::Locked(Locked { handle, token, valid_for, note: None, recovered: false })
}

/// Polls `call` until `seen` says the fake node has its request, and leaves it pending there, so
/// that the test drops it, or stops polling it, at a known point. Panics if the call is answered
/// first, or if the fake node went without saying.
pub async fn pending_until_seen<T, E, F>(call: Pin<&mut F>, seen: oneshot::Receiver<()>)
where
    F: Future<Output = Result<T, E>>,
{
    tokio::select! {
        biased;
        seen = seen => seen.expect("the fake node saw the call"),
        r = call => panic!("the fake node answered before it was told to (ok: {})", r.is_ok()),
    }
}
