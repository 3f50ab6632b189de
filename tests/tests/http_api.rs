//! The HTTP/JSON API against real `keyhome run` processes, driven by real HTTP clients: `curl`
//! and a Python program using only the standard library (tests/http/client.py). Also: bad input
//! gets a clear 4xx while the node keeps serving, and docs/openapi.json matches the server.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use keyhome::pki::Role;
use keyhome_sim::cluster::{Cluster, Options, PATIENCE, eventually};
use serde_json::{Value, json};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// What one `curl` call got back.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: Value,
    /// The response headers, lower-cased.
    headers: String,
}

impl Reply {
    fn kind(&self) -> &str {
        self.body["error"]["kind"].as_str().unwrap_or("")
    }
}

/// `curl URL` with `args`, presenting `token` as the bearer token when given.
fn curl(token: Option<&str>, url: &str, args: &[&str]) -> Reply {
    let headers = tempfile::NamedTempFile::new().expect("temp file");
    let mut command = Command::new("curl");
    command.args(["-sS", "--max-time", "60", "-w", "\n%{http_code}", "-D"]).arg(headers.path());
    if let Some(token) = token {
        command.arg("-H").arg(format!("Authorization: Bearer {token}"));
    }
    let out = command.args(args).arg(url).output().expect("run curl (is it installed?)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    Reply {
        status: status.trim().parse().unwrap_or(0),
        body: serde_json::from_str(body).unwrap_or(Value::Null),
        headers: std::fs::read_to_string(headers.path()).unwrap_or_default().to_lowercase(),
    }
}

fn post(token: &str, url: &str, body: &Value) -> Reply {
    curl(Some(token), url, &["-d", &body.to_string()])
}

fn get(token: &str, url: &str) -> Reply {
    curl(Some(token), url, &[])
}

/// Waits until every node's `/readyz` says ready (and `/healthz` answers).
async fn wait_http_ready(cluster: &Cluster) {
    for id in cluster.ids() {
        let url = cluster.http_url(id);
        eventually(PATIENCE, &format!("node {id} answers /readyz 200"), || {
            let ready = curl(None, &format!("{url}/readyz"), &[]);
            async move { (ready.status == 200 && ready.body["ready"] == json!(true)).then_some(()) }
        })
        .await;
        let health = curl(None, &format!("{url}/healthz"), &[]);
        assert_eq!((health.status, &health.body), (200, &json!({ "ok": true })));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_locks_contends_renews_and_unlocks_with_a_note() {
    let cluster = Cluster::start(Options::default());
    cluster.wait_ready(&cluster.ids(), 1).await;
    wait_http_ready(&cluster).await;
    let app = cluster.http_token(&Role::Client("app".into()));
    let (n1, n2) = (cluster.http_url(1), cluster.http_url(2));

    let held = post(&app, &format!("{n1}/v1/lock"), &json!({"key": "k", "ttl_ms": 30000, "wait_ms": 5000}));
    assert_eq!(held.status, 200, "{held:?}");
    let handle = held.body["handle"].as_u64().expect("handle");
    let token = held.body["token"].as_str().expect("token text").to_string();
    let parts = held.body["token_parts"].clone();
    assert!(held.body["valid_for_ms"].as_u64().is_some_and(|v| v > 0 && v <= 30000), "{held:?}");

    // Contention on the same node (a recall from another node would cut the handle short to its
    // delegation's end: client.py sees that).
    let busy = post(&app, &format!("{n1}/v1/try-lock"), &json!({"key": "k", "ttl_ms": 1000}));
    assert_eq!((busy.status, busy.kind()), (409, "Timeout"), "{busy:?}");
    let busy = post(&app, &format!("{n1}/v1/lock"), &json!({"key": "k", "ttl_ms": 1000, "wait_ms": 200}));
    assert_eq!((busy.status, busy.kind()), (409, "Timeout"), "{busy:?}");

    let renewed = post(&app, &format!("{n1}/v1/renew"), &json!({"handle": handle, "ttl_ms": 30000}));
    assert!(renewed.status == 200 && renewed.body["valid_for_ms"].is_u64(), "{renewed:?}");
    for token in [json!(token), parts] {
        let checked = post(&app, &format!("{n2}/v1/check"), &json!({"key": "k", "token": token}));
        assert_eq!((checked.status, &checked.body), (200, &json!({"answer": "HeldNow", "held": true})));
    }

    // A second client identity, issued while the nodes run: its token works once the nodes
    // re-read the tokens file, and it may not touch app's handle.
    let issued =
        cluster.cli(&["certs", "issue", "--dir", cluster.dir.to_str().expect("utf-8"), "--client", "other"]);
    assert!(issued.status.success(), "{}", String::from_utf8_lossy(&issued.stderr));
    let other = cluster.http_token(&Role::Client("other".into()));
    eventually(PATIENCE, "node 1 accepts the new token", || {
        let status = get(&other, &format!("{n1}/v1/status"));
        async move { (status.status == 200).then_some(()) }
    })
    .await;
    let stolen = post(&other, &format!("{n1}/v1/unlock"), &json!({"handle": handle}));
    assert_eq!((stolen.status, stolen.kind()), (403, "Forbidden"), "{stolen:?}");
    let change = json!({"remove": {"id": 3}});
    let refused = post(&other, &format!("{n1}/v1/epoch/propose"), &change);
    assert_eq!((refused.status, refused.kind()), (403, "Forbidden"), "{refused:?}");

    // The unsafe recovery's guards (review): a bad address, a recovery that leaves nobody out,
    // and one run while a majority renews this node's home lease are all refused.
    let op = cluster.http_token(&Role::Operator);
    let member = |id: u64| json!({"id": id, "addr": cluster.member_addr(id)});
    let recover = |members: serde_json::Value, stopped: serde_json::Value| {
        post(&op, &format!("{n1}/v1/epoch/recover"), &json!({"members": members, "confirm_stopped": stopped}))
    };
    let bad = recover(json!([member(1), {"id": 2, "addr": "nonsense"}]), json!([3]));
    assert_eq!((bad.status, bad.kind()), (400, "Invalid"), "{bad:?}");
    let none_out = recover(json!([member(1), member(2), member(3)]), json!([]));
    assert_eq!((none_out.status, none_out.kind()), (400, "Invalid"), "{none_out:?}");
    let alive = recover(json!([member(1), member(2)]), json!([3]));
    assert_eq!((alive.status, alive.kind()), (409, "Epoch"), "{alive:?}");
    assert!(alive.body["error"]["message"].as_str().is_some_and(|m| m.contains("home lease")), "{alive:?}");
    assert_eq!(get(&op, &format!("{n1}/v1/epoch")).body["number"], json!(1), "nothing was installed");

    let unlocked =
        post(&app, &format!("{n1}/v1/unlock"), &json!({"handle": handle, "note": "done up to row 1200"}));
    assert_eq!((unlocked.status, &unlocked.body), (200, &json!({"unlocked": true})));
    let next = post(&app, &format!("{n2}/v1/lock"), &json!({"key": "k", "ttl_ms": 5000, "wait_ms": 10000}));
    assert_eq!(next.status, 200, "{next:?}");
    assert_eq!((&next.body["note"], &next.body["recovered"]), (&json!("done up to row 1200"), &json!(false)));
    let again = post(&app, &format!("{n1}/v1/unlock"), &json!({"handle": handle}));
    assert_eq!((again.status, again.kind()), (410, "Lost"), "{again:?}");

    // A handle given back (its lock answer came after its caller left) hands on what it got.
    let lock_k = json!({"key": "k", "ttl_ms": 5000, "wait_ms": 10000});
    let given = post(&app, &format!("{n2}/v1/give-back"), &json!({"handle": next.body["handle"]}));
    assert_eq!((given.status, &given.body), (200, &json!({"unlocked": true})), "{given:?}");
    let third = post(&app, &format!("{n2}/v1/lock"), &lock_k);
    assert_eq!(third.status, 200, "{third:?}");
    assert_eq!(
        (&third.body["note"], &third.body["recovered"]),
        (&json!("done up to row 1200"), &json!(false))
    );
    // A relock refused for its lock's values unlocks nothing (the relock below still finds the
    // handle held); one that passes unlocks with a note and locks another key in one request.
    let zero = json!({"handle": third.body["handle"], "key": "k2", "ttl_ms": 0, "wait_ms": 0});
    let refused = post(&app, &format!("{n2}/v1/relock"), &zero);
    assert_eq!((refused.status, refused.kind()), (400, "Invalid"), "{refused:?}");
    let relock = json!({"handle": third.body["handle"], "note": "moved on", "key": "k2", "ttl_ms": 5000, "wait_ms": 10000});
    let moved = post(&app, &format!("{n2}/v1/relock"), &relock);
    assert!(moved.status == 200 && moved.body["handle"].is_u64(), "{moved:?}");
    let fourth = post(&app, &format!("{n2}/v1/lock"), &lock_k);
    assert_eq!((fourth.status, &fourth.body["note"]), (200, &json!("moved on")), "{fourth:?}");

    // A client that disconnects while its lock waits withdraws it: once the key is free it is
    // not admitted to the departed client (which would hold it for its 60 s ttl).
    let blocker =
        post(&app, &format!("{n1}/v1/lock"), &json!({"key": "w", "ttl_ms": 30000, "wait_ms": 5000}));
    assert_eq!(blocker.status, 200, "{blocker:?}");
    let body = json!({"key": "w", "ttl_ms": 60000, "wait_ms": 20000}).to_string();
    let gave_up = curl(Some(&other), &format!("{n1}/v1/lock"), &["-d", &body, "--max-time", "1"]);
    assert_eq!(gave_up.status, 0, "curl gave up after 1 s: {gave_up:?}");
    let blocker_handle = blocker.body["handle"].as_u64().expect("handle");
    let freed = post(&app, &format!("{n1}/v1/unlock"), &json!({"handle": blocker_handle}));
    assert_eq!(freed.status, 200, "{freed:?}");
    let taken = post(&app, &format!("{n1}/v1/lock"), &json!({"key": "w", "ttl_ms": 1000, "wait_ms": 5000}));
    assert_eq!(taken.status, 200, "the withdrawn lock kept the key: {taken:?}");

    // Lost-lock events with `curl -N`: a lock left to expire, then its key's next holder is told
    // `recovered`.
    let mut stream = Command::new("curl")
        .args(["-isSN", "--max-time", "60", "-H", &format!("Authorization: Bearer {app}")])
        .arg(format!("{n1}/v1/events"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("curl -N");
    let mut lines = std::io::BufReader::new(stream.stdout.take().expect("stdout")).lines();
    // The status line comes once the node has subscribed the stream (`-i`: headers included).
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let short = post(&app, &format!("{n1}/v1/lock"), &json!({"key": "x", "ttl_ms": 300, "wait_ms": 5000}));
    assert_eq!(short.status, 200, "{short:?}");
    let expired = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|line| {
            let data: Value = serde_json::from_str(line.strip_prefix("data:")?).ok()?;
            (data["handle"] == short.body["handle"]).then_some(data)
        })
        .expect("an event for the short lock");
    assert_eq!((&expired["kind"], &expired["key"]), (&json!("expired"), &json!("x")), "{expired}");
    let _ = stream.kill();
    let _ = stream.wait();
    let after = post(&app, &format!("{n1}/v1/lock"), &json!({"key": "x", "ttl_ms": 1000, "wait_ms": 5000}));
    assert_eq!((after.status, &after.body["recovered"]), (200, &json!(true)), "{after:?}");

    let status = get(&app, &format!("{n2}/v1/status"));
    assert!(status.status == 200 && status.body["id"] == json!(2), "{status:?}");
    let epoch = get(&app, &format!("{n2}/v1/epoch"));
    assert!(epoch.status == 200 && epoch.body["number"] == json!(1), "{epoch:?}");
    // The JSON of `keyhome epoch show --json`: durations in milliseconds.
    assert!(epoch.body["home_lease_ms"].is_u64() && epoch.body["retired"] == json!([]), "{epoch:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_stdlib_client_sees_recalls_expiries_and_recovered() {
    let cluster = Cluster::start(Options::default());
    cluster.wait_ready(&cluster.ids(), 1).await;
    wait_http_ready(&cluster).await;
    let out = Command::new("python3")
        .arg(workspace().join("tests/http/client.py"))
        .arg(cluster.http_url(1))
        .arg(cluster.http_url(2))
        .arg(cluster.http_token_file(&Role::Client("app".into())))
        .output()
        .expect("run python3");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "client.py failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sends `bytes` on a new connection to `addr`, then reads until the node answers or closes.
fn raw_exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
    stream.write_all(bytes).expect("write");
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_4xx_and_the_node_keeps_serving() {
    let mut cluster = Cluster::layout(Options { nodes: 1, ..Options::default() });
    let socket = cluster.node_dir(1).join("http.sock");
    cluster.edit_config(1, |c| {
        let http = c.http.as_mut().expect("[http]");
        http.request_timeout_ms = 1000;
        http.unix = Some(socket.clone());
    });
    cluster.start_node(1);
    cluster.wait_ready(&[1], 1).await;
    wait_http_ready(&cluster).await;
    let app = cluster.http_token(&Role::Client("app".into()));
    let url = cluster.http_url(1);
    let lock = format!("{url}/v1/lock");

    let cases: Vec<(&str, Reply, u16, &str)> = vec![
        ("malformed JSON", curl(Some(&app), &lock, &["-d", "{\"key\": "]), 400, "Invalid"),
        ("a misspelt field", post(&app, &lock, &json!({"key": "k", "ttl": 1, "wait_ms": 0})), 400, "Invalid"),
        ("a zero ttl", post(&app, &lock, &json!({"key": "k", "ttl_ms": 0, "wait_ms": 0})), 400, "Invalid"),
        ("an unknown route", get(&app, &format!("{url}/v1/nothing")), 404, "NotFound"),
        ("the wrong method", get(&app, &lock), 405, "Invalid"),
        ("no token", curl(None, &format!("{url}/v1/status"), &[]), 401, "Unauthenticated"),
        ("a wrong token", get("app.not-the-secret", &format!("{url}/v1/status")), 401, "Unauthenticated"),
        (
            "a bad token text",
            post(&app, &format!("{url}/v1/check"), &json!({"key": "k", "token": "1.2"})),
            400,
            "Invalid",
        ),
    ];
    for (what, reply, status, kind) in cases {
        assert_eq!((reply.status, reply.kind()), (status, kind), "{what}: {reply:?}");
        assert!(reply.body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {reply:?}");
    }
    let unauthorised = curl(None, &format!("{url}/v1/status"), &[]);
    assert!(unauthorised.headers.contains("www-authenticate: bearer"), "{unauthorised:?}");

    let huge = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(huge.path(), format!("{{\"key\": \"{}\"}}", "x".repeat(100_000))).expect("write");
    let too_big = curl(Some(&app), &lock, &["--data-binary", &format!("@{}", huge.path().display())]);
    assert_eq!((too_big.status, too_big.kind()), (413, "Invalid"), "{too_big:?}");

    // Slow clients: headers that never end get the connection closed; a body that never ends is
    // answered 408. The node serves others meanwhile.
    let addr = cluster.addr(1);
    let head = format!("POST /v1/lock HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {app}\r\n");
    let slow_headers = std::thread::spawn({
        let head = head.clone();
        move || raw_exchange(addr, head.as_bytes())
    });
    let slow_body = std::thread::spawn(move || {
        raw_exchange(addr, format!("{head}Content-Length: 100\r\n\r\n{{\"key\"").as_bytes())
    });
    let meanwhile = post(&app, &lock, &json!({"key": "k", "ttl_ms": 1000, "wait_ms": 5000}));
    assert_eq!(meanwhile.status, 200, "{meanwhile:?}");
    assert!(!slow_headers.join().expect("thread").starts_with("HTTP/1.1 200"), "slow headers were served");
    let answer = slow_body.join().expect("thread");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1000 ms"), "{answer}");

    let still = post(&app, &lock, &json!({"key": "k2", "ttl_ms": 1000, "wait_ms": 5000}));
    assert_eq!(still.status, 200, "the node keeps serving: {still:?}");

    // The Unix socket: owner-only, and tokens are required on it too.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket).expect("socket").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode");
    let via_socket = socket.to_str().expect("utf-8");
    let status = curl(Some(&app), "http://node/v1/status", &["--unix-socket", via_socket]);
    assert!(status.status == 200 && status.body["id"] == json!(1), "{status:?}");
    let refused = curl(None, "http://node/v1/status", &["--unix-socket", via_socket]);
    assert_eq!(refused.status, 401, "{refused:?}");
}

/// A membership change over HTTP gets the checks the CLI's gets, since the node makes them:
/// adding a node nothing answers for is refused, and `"force": true` skips that check (the node
/// then joins the epoch on paper); with node 3 dead, removing node 2 (epoch {1, 3, 6}, one member
/// reachable) is refused naming the unreachable ones. A body naming two changes is refused before
/// anything is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_changes_over_http_are_checked_as_the_clis_are() {
    let mut cluster = Cluster::start(Options::default());
    cluster.wait_ready(&cluster.ids(), 1).await;
    wait_http_ready(&cluster).await;
    let op = cluster.http_token(&Role::Operator);
    let url = cluster.http_url(1);
    let propose = |body: Value| post(&op, &format!("{url}/v1/epoch/propose"), &body);
    let message = |reply: &Reply| reply.body["error"]["message"].as_str().unwrap_or_default().to_string();

    let free = std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free port");
    let nobody = json!({"id": 6, "addr": free.to_string()});
    let absent = propose(json!({"add": nobody}));
    assert_eq!((absent.status, absent.kind()), (409, "Epoch"), "{absent:?}");
    assert!(message(&absent).contains("node 6 does not answer at"), "{absent:?}");
    let two = propose(json!({"remove": {"id": 3}, "add": nobody}));
    assert_eq!((two.status, two.kind()), (400, "Invalid"), "{two:?}");
    assert_eq!(cluster.status(1).await.epoch, 1, "nothing was proposed");
    let forced = propose(json!({"add": nobody, "force": true}));
    assert_eq!((forced.status, &forced.body), (200, &json!({"epoch": 2})), "{forced:?}");

    cluster.kill(3);
    cluster.wait_status(1, "node 3 seen down", |s| s.members.iter().any(|m| m.id == 3 && !m.connected)).await;
    let stuck = propose(json!({"remove": {"id": 2}}));
    assert_eq!((stuck.status, stuck.kind()), (409, "Epoch"), "{stuck:?}");
    let text = message(&stuck);
    assert!(
        text.contains("would need 2 of its members 1, 3, 6") && text.contains("unreachable: 3, 6"),
        "{stuck:?}"
    );
    assert_eq!(cluster.status(1).await.epoch, 2, "nothing more was proposed");
}

/// Every `.route("PATH", ...)` in the source files of the HTTP server (node/src/http/).
fn routes_in_source() -> Vec<String> {
    let mut routes = Vec::new();
    for entry in std::fs::read_dir(workspace().join("node/src/http")).expect("node/src/http") {
        let text = std::fs::read_to_string(entry.expect("entry").path()).expect("read source");
        for piece in text.split(".route(\"").skip(1) {
            routes.push(piece.split('"').next().unwrap_or_default().to_string());
        }
    }
    routes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_description_matches_the_server() {
    let spec: Value = serde_json::from_str(
        &std::fs::read_to_string(workspace().join("docs/openapi.json")).expect("read spec"),
    )
    .expect("docs/openapi.json is JSON");
    let paths = spec["paths"].as_object().expect("paths");
    let mut in_source = routes_in_source();
    in_source.sort();
    let mut in_spec: Vec<String> = paths.keys().cloned().collect();
    in_spec.sort();
    assert_eq!(in_source, in_spec, "the routes the server has are the routes the spec describes");

    let cluster = Cluster::start(Options { nodes: 1, ..Options::default() });
    cluster.wait_ready(&[1], 1).await;
    wait_http_ready(&cluster).await;
    let url = cluster.http_url(1);
    let client = cluster.http_token(&Role::Client("app".into()));
    let operator = cluster.http_token(&Role::Operator);
    let error_kinds =
        spec["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["kind"]["enum"]
            .as_array()
            .expect("error kinds")
            .clone();
    for (path, ops) in paths {
        for (method, op) in ops.as_object().expect("operations") {
            let what = format!("{method} {path}");
            let token = match op["x-keyhome-role"].as_str() {
                Some("operator") => Some(operator.as_str()),
                Some("client") => Some(client.as_str()),
                _ => None,
            };
            let example = &op["requestBody"]["content"]["application/json"]["example"];
            let mut args: Vec<String> = vec!["-X".into(), method.to_uppercase()];
            if !example.is_null() {
                args.extend(["-d".into(), example.to_string()]);
            }
            if op["responses"]["200"]["content"]["text/event-stream"].is_object() {
                // A stream: read its headers, then give up on it.
                args.extend(["--max-time".into(), "1".into()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let reply = curl(token, &format!("{url}{path}"), &args);
            let declared = &op["responses"][reply.status.to_string()];
            let streamed = reply.status == 0 && reply.headers.contains("content-type: text/event-stream");
            if streamed {
                continue;
            }
            assert!(
                declared.is_object(),
                "{what}: answered {}, which the spec does not declare: {reply:?}",
                reply.status
            );
            let schema = &declared["content"]["application/json"]["schema"];
            let schema = match schema["$ref"].as_str() {
                Some(r) => &spec["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
                None => schema,
            };
            for field in schema["required"].as_array().into_iter().flatten() {
                let field = field.as_str().expect("field name");
                assert!(!reply.body[field].is_null(), "{what}: answer lacks required {field:?}: {reply:?}");
            }
            if reply.status >= 400 {
                assert!(error_kinds.contains(&json!(reply.kind())), "{what}: undeclared kind: {reply:?}");
            }
        }
    }
    let unknown = get(&client, &format!("{url}/v1/not-in-the-spec"));
    assert_eq!(unknown.status, 404);
    // Every route is taken only as the spec says: a request with no token is refused on each
    // route that names a role.
    for (path, ops) in paths {
        for (method, op) in ops.as_object().expect("operations") {
            if op["x-keyhome-role"].is_string() {
                let reply = curl(None, &format!("{url}{path}"), &["-X", &method.to_uppercase(), "-d", "{}"]);
                assert_eq!(reply.status, 401, "{method} {path} without a token: {reply:?}");
            }
        }
    }
}

/// Connections past `http.max_connections` are answered at once and closed: the probes as usual,
/// any other route 503 saying why, so connections that hold their slot (idle here, or waiting on
/// a lock) cannot make the probes fail or leave other clients hanging. Once a slot frees, the API
/// serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_still_get_the_probes_and_a_clear_503() {
    let mut cluster = Cluster::layout(Options { nodes: 1, ..Options::default() });
    cluster.edit_config(1, |config| {
        let http = config.http.as_mut().expect("an [http] table");
        http.max_connections = 2;
        // The held connections below send nothing: they must not be closed for it meanwhile.
        http.request_timeout_ms = 600_000;
    });
    cluster.start_node(1);
    cluster.wait_ready(&[1], 1).await;
    wait_http_ready(&cluster).await;
    let app = cluster.http_token(&Role::Client("app".into()));
    let url = cluster.http_url(1);

    let held: Vec<std::net::TcpStream> =
        (0..2).map(|_| std::net::TcpStream::connect(cluster.addr(1)).expect("connect")).collect();
    let busy = eventually(PATIENCE, "the API answers 503 once both slots are held", || {
        let reply = get(&app, &format!("{url}/v1/status"));
        async move { (reply.status == 503).then_some(reply) }
    })
    .await;
    assert_eq!(busy.kind(), "Unavailable", "{busy:?}");
    let message = busy.body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("http.max_connections"), "the answer says why: {busy:?}");
    assert!(busy.headers.contains("connection: close"), "and closes the connection: {busy:?}");
    let health = curl(None, &format!("{url}/healthz"), &[]);
    assert_eq!((health.status, &health.body), (200, &json!({ "ok": true })), "{health:?}");
    let ready = curl(None, &format!("{url}/readyz"), &[]);
    assert_eq!((ready.status, &ready.body["ready"]), (200, &json!(true)), "{ready:?}");

    drop(held);
    eventually(PATIENCE, "the API serves again once the slots are free", || {
        let reply = get(&app, &format!("{url}/v1/status"));
        async move { (reply.status == 200).then_some(()) }
    })
    .await;
}
