#!/usr/bin/env python3
"""A keyhome HTTP API client using only the Python standard library, run by
tests/tests/http_api.rs against a real cluster:

    client.py NODE1_URL NODE2_URL TOKEN_FILE

It locks a key through node 1, subscribes to node 1's lost-lock events, contends for the key
through node 2 (a blocking lock), sees the recall event, renews, unlocks with a note that the
contender receives, then lets a short lock expire and sees the `expired` event and the next
holder told `recovered`. Exits 0 and prints "ok" when every step behaved as documented.
"""

import json
import queue
import sys
import threading
import urllib.error
import urllib.request

TIMEOUT = 30  # seconds: generous, for a loaded machine


def call(base, token, path, body=None):
    """POSTs `body` as JSON (or GETs without one); returns (status, parsed JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST")
    req.add_header("Authorization", "Bearer " + token)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def ok(base, token, path, body=None):
    status, answer = call(base, token, path, body)
    if status != 200:
        sys.exit(f"{path} {body}: HTTP {status} {answer}")
    return answer


def events(base, token, into):
    """Subscribes to the identity's event stream; puts each event's data into `into`."""
    req = urllib.request.Request(base + "/v1/events")
    req.add_header("Authorization", "Bearer " + token)
    resp = urllib.request.urlopen(req, timeout=TIMEOUT)
    if resp.headers.get_content_type() != "text/event-stream":
        sys.exit(f"/v1/events answered {resp.headers.get_content_type()}")

    def read():
        kind, seq = None, 0
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                kind = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data = json.loads(line[len("data:"):])
                assert data["kind"] == kind, (data, kind)
                assert data["seq"] == seq + 1, f"event {data} after seq {seq}: a gap"
                seq = data["seq"]
                into.put(data)

    def guarded():
        try:
            read()
        except Exception as e:  # reported to the waiting test step
            into.put({"error": repr(e)})

    threading.Thread(target=guarded, daemon=True).start()


def next_event(q, handle, kind):
    while True:
        try:
            event = q.get(timeout=TIMEOUT)
        except queue.Empty:
            sys.exit(f"no {kind} event for handle {handle} within {TIMEOUT} s")
        if "error" in event:
            sys.exit(f"the event stream failed: {event['error']}")
        if event["handle"] == handle and event["kind"] == kind:
            return event


def token_tuple(t):
    return (t["epoch"], t["incarnation"], t["counter"], t["local_seq"])


def main():
    node1, node2, token_file = sys.argv[1:4]
    token = open(token_file).read().strip()
    q = queue.Queue()
    events(node1, token, q)

    first = ok(node1, token, "/v1/lock", {"key": "py-key", "ttl_ms": 30000, "wait_ms": 10000})
    assert first["token"] == ".".join(str(n) for n in token_tuple(first["token_parts"])), first
    assert first["valid_for_ms"] > 0, first
    held = ok(node1, token, "/v1/check", {"key": "py-key", "token": first["token"]})
    assert held == {"answer": "HeldNow", "held": True}, held

    # Contend through node 2: a blocking lock, answered once node 1's holder unlocks.
    contender = {}
    def contend():
        contender["answer"] = call(node2, token, "/v1/lock", {"key": "py-key", "ttl_ms": 30000, "wait_ms": 25000})
    thread = threading.Thread(target=contend)
    thread.start()

    recalled = next_event(q, first["handle"], "recalled")
    assert recalled["key"] == "py-key" and recalled["valid_for_ms"] >= 0, recalled
    renewed = ok(node1, token, "/v1/renew", {"handle": first["handle"], "ttl_ms": 30000})
    assert "valid_for_ms" in renewed, renewed
    assert ok(node1, token, "/v1/unlock", {"handle": first["handle"], "note": "from python"}) == {"unlocked": True}

    thread.join(TIMEOUT)
    status, second = contender["answer"]
    assert status == 200, (status, second)
    assert second["note"] == "from python" and second["recovered"] is False, second
    assert token_tuple(second["token_parts"]) > token_tuple(first["token_parts"]), (first, second)
    status, gone = call(node1, token, "/v1/renew", {"handle": first["handle"], "ttl_ms": 1000})
    assert status == 410 and gone["error"]["kind"] == "Lost", (status, gone)
    ok(node2, token, "/v1/unlock", {"handle": second["handle"]})

    # A lock left to expire: its event, then the next holder is told `recovered`.
    short = ok(node1, token, "/v1/lock", {"key": "py-expire", "ttl_ms": 300, "wait_ms": 10000})
    next_event(q, short["handle"], "expired")
    after = ok(node1, token, "/v1/lock", {"key": "py-expire", "ttl_ms": 5000, "wait_ms": 10000})
    assert after["recovered"] is True, after
    ok(node1, token, "/v1/unlock", {"handle": after["handle"]})
    print("ok")


if __name__ == "__main__":
    main()
