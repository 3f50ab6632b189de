//! The checker of a chaos run: the guarantees, judged from outside on the test process's one clock
//! against what the clients saw.
//!
//! - **Exclusive windows:** no two admissions of a key have overlapping windows
//!   ([`Admission::window`]: from the admission the client received to the earlier of the deadline
//!   it was told and its unlock).
//! - **Token order:** if an admission of a key was received before another was requested, its
//!   token is lower. No two admissions of a key share a token.
//! - **Clean handoffs:** an admission flagged `recovered: false` follows (in token order, among the
//!   admissions the clients saw) one whose holder unlocked cleanly, and carries that unlock's note;
//!   the first admission of a key carries no note. (An admission nobody saw — its answer lost — has
//!   no unlock, so the one after it must be `recovered`.)

use std::collections::BTreeMap;
use std::fmt;

use super::history::{Admission, Unlock, show_note};

/// One broken guarantee.
#[derive(Clone, Debug)]
pub struct Violation {
    pub kind: &'static str,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.detail)
    }
}

fn show(a: &Admission) -> String {
    let (start, end) = a.window();
    format!(
        "[c{} n{} token {} sent {:.6} window {:.6}..{:.6} recovered {} note {}]",
        a.client,
        a.node,
        a.token,
        a.sent.as_secs_f64(),
        start.as_secs_f64(),
        end.as_secs_f64(),
        a.recovered,
        show_note(a.note.as_deref())
    )
}

/// Every violation among `admissions`.
pub fn check(admissions: &[Admission]) -> Vec<Violation> {
    let mut by_key: BTreeMap<&str, Vec<&Admission>> = BTreeMap::new();
    for a in admissions {
        by_key.entry(&a.key).or_default().push(a);
    }
    let mut violations = Vec::new();
    for (key, list) in by_key {
        overlaps(key, &list, &mut violations);
        token_order(key, &list, &mut violations);
        handoffs(key, &list, &mut violations);
    }
    violations
}

fn overlaps(key: &str, list: &[&Admission], out: &mut Vec<Violation>) {
    let mut windows: Vec<&Admission> = list.iter().copied().filter(|a| a.window().0 < a.window().1).collect();
    windows.sort_by_key(|a| a.window());
    let mut latest: Option<&Admission> = None;
    for a in windows {
        if let Some(l) = latest
            && a.window().0 < l.window().1
        {
            out.push(Violation {
                kind: "overlap",
                detail: format!("key {key}: {} begins inside {}", show(a), show(l)),
            });
        }
        if latest.is_none_or(|l| a.window().1 > l.window().1) {
            latest = Some(a);
        }
    }
}

fn token_order(key: &str, list: &[&Admission], out: &mut Vec<Violation>) {
    let mut by_admitted: Vec<&Admission> = list.to_vec();
    by_admitted.sort_by_key(|a| a.admitted);
    let mut by_sent: Vec<&Admission> = list.to_vec();
    by_sent.sort_by_key(|a| a.sent);
    // The highest token among the admissions received before the current one was requested.
    let mut highest: Option<&Admission> = None;
    let mut next = 0;
    for b in by_sent {
        while next < by_admitted.len() && by_admitted[next].admitted < b.sent {
            let a = by_admitted[next];
            if highest.is_none_or(|h| a.token > h.token) {
                highest = Some(a);
            }
            next += 1;
        }
        if let Some(h) = highest
            && h.token >= b.token
        {
            out.push(Violation {
                kind: "token order",
                detail: format!("key {key}: {} was requested after {} was admitted", show(b), show(h)),
            });
        }
    }
    let mut by_token: Vec<&Admission> = list.to_vec();
    by_token.sort_by_key(|a| a.token);
    for pair in by_token.windows(2) {
        if pair[0].token == pair[1].token {
            out.push(Violation {
                kind: "token reused",
                detail: format!("key {key}: {} and {}", show(pair[0]), show(pair[1])),
            });
        }
    }
}

fn handoffs(key: &str, list: &[&Admission], out: &mut Vec<Violation>) {
    let mut by_token: Vec<&Admission> = list.to_vec();
    by_token.sort_by_key(|a| a.token);
    let mut previous: Option<&Admission> = None;
    for b in by_token {
        if !b.recovered {
            let expected = match previous.map(|a| &a.unlock) {
                None => Some(None),
                Some(Unlock::Clean(note) | Unlock::Unknown(note)) => Some(Some(note.as_slice())),
                Some(_) => None,
            };
            if expected != Some(b.note.as_deref()) {
                let after = previous.map_or_else(
                    || "the first admission".to_string(),
                    |a| format!("after {} whose unlock was {}", show(a), a.unlock),
                );
                out.push(Violation {
                    kind: "recovered: false",
                    detail: format!("key {key}: {} {after}", show(b)),
                });
            }
        }
        previous = Some(b);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use keyhome_delegation::FencingToken;

    use super::*;

    fn admission(token: u64, sent: u64, admitted: u64, deadline: u64, end: u64) -> Admission {
        let ms = Duration::from_millis;
        Admission {
            key: "k".into(),
            client: 0,
            node: 1,
            token: FencingToken { epoch: 1, incarnation: 1, counter: token, local_seq: 0 },
            sent: ms(sent),
            admitted: ms(admitted),
            deadline: ms(deadline),
            end: Some(ms(end)),
            recovered: true,
            note: None,
            unlock: Unlock::Refused,
        }
    }

    fn kinds(admissions: &[Admission]) -> Vec<&'static str> {
        check(admissions).iter().map(|v| v.kind).collect()
    }

    #[test]
    fn disjoint_windows_in_token_order_pass() {
        let a = admission(1, 0, 10, 100, 50);
        // Admitted before the first's deadline, but after its unlock.
        let b = admission(2, 40, 60, 200, 150);
        // Answered after its own deadline: an empty window overlaps nothing.
        let c = admission(3, 100, 400, 300, 500);
        let d = admission(4, 410, 420, 600, 450);
        assert!(kinds(&[a, b, c, d]).is_empty());
    }

    #[test]
    fn an_admission_inside_another_window_is_an_overlap() {
        let a = admission(1, 0, 10, 100, 90);
        let b = admission(2, 20, 80, 200, 150);
        assert_eq!(kinds(&[a, b]), ["overlap"]);
    }

    #[test]
    fn a_lower_token_requested_later_is_out_of_order() {
        let a = admission(2, 0, 10, 100, 20);
        let b = admission(1, 30, 40, 200, 50);
        assert_eq!(kinds(&[a, b]), ["token order"]);
        // Concurrent requests may be admitted in either order.
        let a = admission(2, 0, 10, 100, 20);
        let b = admission(1, 5, 40, 200, 50);
        assert!(kinds(&[a, b]).is_empty());
    }

    #[test]
    fn not_recovered_needs_the_previous_clean_unlock_and_its_note() {
        let mut a = admission(1, 0, 10, 100, 20);
        a.recovered = false;
        a.unlock = Unlock::Clean(b"a".to_vec());
        let mut b = admission(2, 30, 40, 200, 50);
        b.recovered = false;
        b.note = Some(b"a".to_vec());
        assert!(kinds(&[a.clone(), b.clone()]).is_empty());
        // With another note.
        b.note = Some(b"x".to_vec());
        assert_eq!(kinds(&[a.clone(), b.clone()]), ["recovered: false"]);
        // After an unlock the node refused.
        b.note = Some(b"a".to_vec());
        a.unlock = Unlock::Refused;
        assert_eq!(kinds(&[a.clone(), b.clone()]), ["recovered: false"]);
        // After an unlock whose answer was lost: the note shows it was applied.
        a.unlock = Unlock::Unknown(b"a".to_vec());
        assert!(kinds(&[a, b]).is_empty());
    }
}
