//! The status page (`GET /`): one node's [`Status`] and the recent [`Sample`]s as plain HTML with
//! inline CSS and SVG sparklines; it reloads itself every few seconds (a `<meta>` refresh, no
//! script). [`render`] is a pure function of its inputs.

use std::fmt::Write;
use std::time::Duration;

use crate::duration::Human;
use crate::metrics::{SAMPLE_EVERY, Sample};
use crate::status::Status;

/// How often the page reloads itself, in seconds.
pub const REFRESH_SECS: u32 = 2;

/// `s` with the five HTML-special characters escaped.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "
body{font:14px/1.4 system-ui,-apple-system,'DejaVu Sans',sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:12px 20px;display:flex;gap:16px;align-items:baseline}
header h1{font-size:20px;margin:0}header .sub{opacity:.75}
main{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:14px;padding:14px 20px}
section{background:#fff;border-radius:8px;padding:10px 14px;box-shadow:0 1px 2px rgba(0,0,0,.12)}
section.wide{grid-column:1/-1}
h2{font-size:13px;text-transform:uppercase;letter-spacing:.05em;color:#5a6275;margin:2px 0 8px}
table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:3px 6px;border-bottom:1px solid #eceef2}
th{font-weight:600;color:#5a6275;font-size:12px}td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#0a7a3a;font-weight:600}.bad{color:#b3261e;font-weight:600}.muted{color:#8a91a2}
.alert{background:#fdecea;border:1px solid #f5c2bd;color:#8c1d18;padding:8px 12px;border-radius:6px;margin:6px 0}
code{background:#eef0f4;padding:1px 4px;border-radius:3px}
.kv{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px}.kv b{font-weight:600}
.spark{display:flex;align-items:center;gap:10px;margin:4px 0}.spark svg{background:#f7f8fa;border-radius:4px}
.spark .label{width:150px}.spark .v{font-variant-numeric:tabular-nums;min-width:70px;text-align:right}
";

/// The page for `status` with the sparklines of `samples` (oldest first).
pub fn render(status: &Status, samples: &[Sample]) -> String {
    let mut h = String::new();
    let _ = write_page(&mut h, status, samples);
    h
}

fn write_page(h: &mut String, s: &Status, samples: &[Sample]) -> std::fmt::Result {
    write!(
        h,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\">\
         <title>keyhome node {id} · epoch {epoch}</title><style>{STYLE}</style></head><body>\
         <header><h1>keyhome node {id}</h1><span class=\"sub\" id=\"epoch\">epoch {epoch}</span>\
         <span class=\"sub\">incarnation {inc}</span><span class=\"sub\">refreshes every {REFRESH_SECS} s</span></header><main>",
        id = s.id,
        epoch = s.epoch,
        inc = s.incarnation,
    )?;
    write_alerts(h, s)?;
    write_members(h, s)?;
    write_node(h, s)?;
    write_sparklines(h, samples)?;
    write_hot_keys(h, s)?;
    write_lock_delay(h, s)?;
    write_epochs(h, s)?;
    write_counters(h, s)?;
    h.push_str("</main></body></html>\n");
    Ok(())
}

fn write_alerts(h: &mut String, s: &Status) -> std::fmt::Result {
    if !s.member {
        write!(
            h,
            "<section class=\"wide\"><div class=\"alert\">This node is <b>not a member</b> of epoch {}: \
             it homes and grants nothing.</div></section>",
            s.epoch
        )?;
    }
    let stalled: Vec<_> = s.waiting.iter().filter(|w| w.stalled).collect();
    if !stalled.is_empty() {
        h.push_str("<section class=\"wide\"><h2>Stalled keys</h2><div class=\"alert\">These keys wait for a home this node cannot reach.</div><table><tr><th>key</th><th>home</th><th>locks</th><th>waiting</th><th>if the home is gone for good</th></tr>");
        for w in stalled {
            let home = w.home.unwrap_or_default();
            write!(
                h,
                "<tr><td>{}</td><td>{home}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
                 <td><code>keyhome epoch propose --remove {home}</code></td></tr>",
                esc(&w.key),
                w.locks,
                Human(w.waiting_for)
            )?;
        }
        h.push_str("</table></section>");
    }
    Ok(())
}

fn write_members(h: &mut String, s: &Status) -> std::fmt::Result {
    write!(
        h,
        "<section><h2>Epoch {} members</h2><table id=\"members\"><tr><th>id</th><th>address</th><th>link</th></tr>",
        s.epoch
    )?;
    for m in &s.members {
        let state = match (m.id == s.id, m.connected, m.unreachable_for, &m.refused) {
            (true, ..) => "<span class=\"ok\">this node</span>".to_string(),
            (_, true, ..) => "<span class=\"ok\">connected</span>".to_string(),
            (_, false, _, Some(why)) => format!("<span class=\"bad\">refuses this node: {}</span>", esc(why)),
            (_, false, Some(d), None) => format!("<span class=\"bad\">unreachable for {}</span>", Human(d)),
            (_, false, None, None) => "<span class=\"muted\">not tried yet</span>".to_string(),
        };
        write!(
            h,
            "<tr data-member=\"{}\"><td>{}</td><td>{}</td><td>{state}</td></tr>",
            m.id,
            m.id,
            esc(&m.addr)
        )?;
    }
    h.push_str("</table></section>");
    Ok(())
}

fn write_node(h: &mut String, s: &Status) -> std::fmt::Result {
    let lease = match s.home_lease_left {
        Some(left) => format!("<span class=\"ok\">{} left</span>", Human(left)),
        None => "<span class=\"bad\">none: grants nothing</span>".to_string(),
    };
    let quarantine = if s.quarantine_left.is_zero() {
        "<span class=\"ok\">over</span>".to_string()
    } else {
        format!("<span class=\"bad\">{} left</span>", Human(s.quarantine_left))
    };
    let pending: usize = s.waiting.iter().map(|w| w.locks).sum();
    write!(
        h,
        "<section><h2>This node</h2><div class=\"kv\">\
         <b>home lease</b><span>{lease}</span><b>restart quarantine</b><span>{quarantine}</span>\
         <b>delegations held</b><span>{}</span><b>delegations homed</b><span>{}</span>\
         <b>keys in lock-delay</b><span>{}</span><b>pending locks</b><span>{pending}</span>\
         <b>locks</b><span>{} ({} with no message)</span></div></section>",
        s.holder_keys, s.homed_delegations, s.lock_delay_keys, s.counters.locks, s.counters.locks_immediate
    )
}

/// One sparkline: the series as an SVG polyline, scaled to its own maximum.
fn sparkline(h: &mut String, label: &str, unit: &str, values: &[f64]) -> std::fmt::Result {
    const W: f64 = 220.0;
    const HT: f64 = 36.0;
    let max = values.iter().copied().fold(0.0, f64::max);
    let step = if values.len() > 1 { W / (values.len() - 1) as f64 } else { 0.0 };
    let points: Vec<String> = (values.iter().enumerate())
        .map(|(i, v)| {
            let y = if max > 0.0 { HT - 2.0 - (v / max) * (HT - 4.0) } else { HT - 2.0 };
            format!("{:.1},{:.1}", i as f64 * step, y)
        })
        .collect();
    let last = values.last().copied().unwrap_or_default();
    write!(
        h,
        "<div class=\"spark\"><span class=\"label\">{label}</span>\
         <svg width=\"{W}\" height=\"{HT}\" viewBox=\"0 0 {W} {HT}\" role=\"img\" aria-label=\"{label}\">\
         <polyline fill=\"none\" stroke=\"#2f6fdf\" stroke-width=\"1.5\" points=\"{}\"/></svg>\
         <span class=\"v\">{last:.1} {unit}</span><span class=\"muted\">max {max:.1}</span></div>",
        points.join(" ")
    )
}

fn write_sparklines(h: &mut String, samples: &[Sample]) -> std::fmt::Result {
    let span = SAMPLE_EVERY * u32::try_from(samples.len().saturating_sub(1)).unwrap_or(u32::MAX);
    write!(h, "<section class=\"wide\"><h2>Last {}</h2>", Human(span))?;
    if samples.len() < 2 {
        h.push_str("<p class=\"muted\">collecting samples…</p></section>");
        return Ok(());
    }
    let rate = |f: fn(&Sample) -> u64| -> Vec<f64> {
        (samples.windows(2))
            .map(|w| {
                let secs =
                    w[1].at.saturating_duration_since(w[0].at).max(Duration::from_millis(1)).as_secs_f64();
                f(&w[1]).saturating_sub(f(&w[0])) as f64 / secs
            })
            .collect()
    };
    let level = |f: fn(&Sample) -> usize| -> Vec<f64> { samples.iter().map(|s| f(s) as f64).collect() };
    sparkline(h, "locks", "/s", &rate(|s| s.locks))?;
    sparkline(h, "locks needing a message", "/s", &rate(|s| s.locks - s.locks_immediate.min(s.locks)))?;
    sparkline(h, "messages sent", "/s", &rate(|s| s.peer_sent))?;
    sparkline(h, "frames dropped", "/s", &rate(|s| s.peer_dropped))?;
    sparkline(h, "delegations held", "", &level(|s| s.delegations_held))?;
    sparkline(h, "delegations homed", "", &level(|s| s.delegations_homed))?;
    sparkline(h, "pending locks", "", &level(|s| s.pending_locks))?;
    h.push_str("</section>");
    Ok(())
}

fn write_hot_keys(h: &mut String, s: &Status) -> std::fmt::Result {
    h.push_str("<section><h2>Hot keys</h2>");
    if s.hot_keys.is_empty() {
        h.push_str("<p class=\"muted\">no contention seen</p></section>");
        return Ok(());
    }
    h.push_str("<table id=\"hot\"><tr><th>key</th><th>waits</th><th>recalls</th></tr>");
    for k in &s.hot_keys {
        write!(
            h,
            "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(&k.key),
            k.waits,
            k.recalls
        )?;
    }
    h.push_str("</table></section>");
    Ok(())
}

fn write_lock_delay(h: &mut String, s: &Status) -> std::fmt::Result {
    write!(h, "<section><h2>Keys in lock-delay ({})</h2>", s.lock_delay_keys)?;
    if s.lock_delayed.is_empty() {
        h.push_str("<p class=\"muted\">none</p></section>");
        return Ok(());
    }
    h.push_str("<table><tr><th>key</th><th>left</th></tr>");
    for d in &s.lock_delayed {
        write!(h, "<tr><td>{}</td><td class=\"n\">{}</td></tr>", esc(&d.key), Human(d.left))?;
    }
    h.push_str("</table></section>");
    Ok(())
}

fn write_epochs(h: &mut String, s: &Status) -> std::fmt::Result {
    h.push_str("<section><h2>Recent epoch changes</h2><table id=\"epochs\"><tr><th>epoch</th><th>members</th><th>learned</th></tr>");
    for e in &s.recent_epochs {
        let members: Vec<String> = e.members.iter().map(u64::to_string).collect();
        write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{} ago</td></tr>",
            e.epoch,
            members.join(", "),
            Human(e.ago)
        )?;
    }
    h.push_str("</table></section>");
    Ok(())
}

fn write_counters(h: &mut String, s: &Status) -> std::fmt::Result {
    h.push_str("<section><h2>Counters</h2><table>");
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(s.counters) {
        for (name, value) in fields {
            write!(h, "<tr><td>{}</td><td class=\"n\">{value}</td></tr>", esc(&name))?;
        }
    }
    h.push_str("</table></section>");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keyhome_epoch::Instant;

    #[test]
    fn the_page_shows_the_state_and_escapes_keys() {
        let samples: Vec<Sample> = (0..5u64)
            .map(|i| Sample {
                at: Instant::from_nanos(i * 2_000_000_000),
                locks: i * 10,
                locks_immediate: i * 5,
                peer_sent: i,
                peer_dropped: 0,
                delegations_held: i as usize,
                delegations_homed: 1,
                pending_locks: 0,
            })
            .collect();
        let page = render(&crate::status::example(), &samples);
        assert!(page.contains("epoch 7"));
        assert!(page.contains("unreachable for 42 s"));
        assert!(page.contains("not a member"));
        assert!(page.contains("keyhome epoch propose --remove 2"));
        assert!(page.contains("&lt;script&gt;") && !page.contains("<script>"), "keys are escaped");
        assert_eq!(page.matches("<polyline").count(), 7);
        assert!(page.contains("5.0 /s"), "the lock rate: 10 locks per 2 s");
    }
}
