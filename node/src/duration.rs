//! Durations as people read and write them, in one place for the CLI, the files and the output:
//!
//! - **Input** (command-line options, and the `_ms` fields of `node.toml` and `genesis.toml` when
//!   given as a string): humantime's spelling, `1.5s`, `1m30s`, `250ms`, `2h`; a bare number
//!   is refused on the command line (is `10` seconds or milliseconds?), and is milliseconds in
//!   a file's `_ms` field, as it always was.
//! - **Text output**: [`Human`], rounded for reading (`250 ms`, `7.14 s`, `1m 30s`).
//! - **JSON output**: whole milliseconds in fields named `…_ms` ([`millis`], [`millis_opt`]),
//!   never serde's `{"secs":…,"nanos":…}`.

use std::fmt;
use std::time::Duration;

use serde::{Deserializer, Serializer};

/// Parses a duration written like `1.5s`, `1m30s`, `250ms` or `2h` (see the module docs).
pub fn parse(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!("{s:?} has no unit: write {s}s, {s}ms or {s}m"));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 1.5s, 1m30s or 250ms ({e})"))
}

/// Whole milliseconds in `d`, rounded down (saturating).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A duration shown to a person, rounded: `0 ms` to `999 ms`, then seconds with at most two
/// decimals (`7.14 s`, `2 s`) below a minute, then whole seconds in humantime's spelling
/// (`1m 30s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Human(pub Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d < Duration::from_millis(1000) {
            // Round to the nearest millisecond, but never show a non-zero duration as zero.
            let ms = (d.as_micros() + 500) / 1000;
            return write!(f, "{} ms", if ms == 0 && !d.is_zero() { 1 } else { ms });
        }
        if d < Duration::from_secs(60) {
            let hundredths = (d.as_millis() + 5) / 10;
            let text = format!("{}.{:02}", hundredths / 100, hundredths % 100);
            return write!(f, "{} s", text.trim_end_matches('0').trim_end_matches('.'));
        }
        let secs = d.as_secs().saturating_add(u64::from(d.subsec_millis() >= 500));
        write!(f, "{}", humantime::format_duration(Duration::from_secs(secs)))
    }
}

/// `#[serde(with = "crate::duration::as_millis")]`: a [`Duration`] as whole milliseconds.
pub mod as_millis {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(millis(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms: u64 = serde::Deserialize::deserialize(d)?;
        Ok(Duration::from_millis(ms))
    }
}

/// [`as_millis`] for an optional duration (`null` for none).
pub mod as_millis_opt {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&millis(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let ms: Option<u64> = serde::Deserialize::deserialize(d)?;
        Ok(ms.map(Duration::from_millis))
    }
}

/// Reads a file's `…_ms` field: an integer (milliseconds) or a string duration (`"5s"`), as
/// milliseconds. For `#[serde(deserialize_with = "crate::duration::ms_or_text")]`.
pub fn ms_or_text<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    struct Visitor;
    impl serde::de::Visitor<'_> for Visitor {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("milliseconds (an integer) or a duration like \"5s\" or \"1m30s\"")
        }

        fn visit_u64<E: serde::de::Error>(self, ms: u64) -> Result<u64, E> {
            Ok(ms)
        }

        fn visit_i64<E: serde::de::Error>(self, ms: i64) -> Result<u64, E> {
            u64::try_from(ms).map_err(|_| E::custom(format!("{ms} ms: a duration cannot be negative")))
        }

        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<u64, E> {
            humantime::parse_duration(s.trim())
                .map(millis)
                .map_err(|e| E::custom(format!("{s:?} is not a duration like \"5s\" or \"1m30s\" ({e})")))
        }
    }
    d.deserialize_any(Visitor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_people_write() {
        let ms = Duration::from_millis;
        for (text, d) in
            [("1.5s", ms(1500)), ("1m30s", ms(90_000)), ("250ms", ms(250)), ("2h", ms(7_200_000))]
        {
            assert_eq!(parse(text), Ok(d), "{text}");
        }
        for bad in ["10", "", "1.5", "ten seconds", "-1s", "5 parsecs"] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse("10").unwrap_err().contains("10s"), "a bare number says which units to add");
    }

    #[test]
    fn text_output_is_rounded() {
        let ms = Duration::from_millis;
        for (d, text) in [
            (Duration::ZERO, "0 ms"),
            (Duration::from_micros(200), "1 ms"),
            (ms(250), "250 ms"),
            (Duration::from_nanos(7_141_414_142), "7.14 s"),
            (ms(2000), "2 s"),
            (ms(1500), "1.5 s"),
            (ms(59_999), "60 s"),
            (ms(60_000), "1m"),
            (ms(90_400), "1m 30s"),
        ] {
            assert_eq!(Human(d).to_string(), text, "{d:?}");
        }
        // The longest duration a caller can pass (a timeout of `Duration::MAX`) shows, rather
        // than overflow as it rounds up (a panic: the node stops).
        assert!(Human(Duration::MAX).to_string().ends_with('s'));
    }

    #[test]
    fn file_fields_take_integers_and_durations() {
        #[derive(serde::Deserialize)]
        struct F {
            #[serde(deserialize_with = "ms_or_text")]
            lease_ms: u64,
        }
        let read = |text: &str| toml::from_str::<F>(text).map(|f| f.lease_ms).map_err(|e| e.to_string());
        assert_eq!(read("lease_ms = 5000"), Ok(5000));
        assert_eq!(read("lease_ms = \"5s\""), Ok(5000));
        assert_eq!(read("lease_ms = \"1m30s\""), Ok(90_000));
        assert!(read("lease_ms = -1").unwrap_err().contains("negative"));
        assert!(read("lease_ms = \"soon\"").unwrap_err().contains("not a duration"));
    }
}
