//! Member and node addresses, in one place: `HOST:PORT` where HOST is an IP address (IPv6 in
//! brackets) or a DNS name (`node-1.keyhome.svc:7100`, `localhost:7601`).
//!
//! A name is kept as written (in the genesis, in epochs, in profiles) and resolved each time it
//! is dialled: a peer link re-resolves on every reconnection, a client on every connection, so a
//! node that moves to a new IP under the same name (a rescheduled Kubernetes pod) is found
//! again. What proves who answers is the certificate, never the address: every dial checks the
//! far end's certificate against the node id it meant (`pki::server_name`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// How long a name may take to resolve before a dial gives up on it.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Checks that `addr` reads as `HOST:PORT`: the host an IP address (IPv6 in brackets) or a DNS
/// name, the port from 1 to 65535. Says what is wrong otherwise.
pub fn check(addr: &str) -> Result<(), String> {
    let port_ok = |port: u16| {
        if port == 0 { Err(format!("{addr:?}: port 0 is not a port to listen on")) } else { Ok(()) }
    };
    if let Ok(sock) = addr.parse::<SocketAddr>() {
        return port_ok(sock.port());
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("{addr:?} is not HOST:PORT"));
    };
    let port: u16 = port.parse().map_err(|_| format!("{addr:?}: {port:?} is not a port number"))?;
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || host.len() > 253 || !host.trim_end_matches('.').split('.').all(label_ok) {
        return Err(format!("{addr:?}: {host:?} is neither an IP address nor a host name"));
    }
    port_ok(port)
}

/// Resolves `addr` (see [`check`]) now, within [`RESOLVE_TIMEOUT`]; an IP address resolves to
/// itself without a lookup. Never empty on success.
pub async fn resolve(addr: &str) -> Result<Vec<SocketAddr>, String> {
    if let Ok(sock) = addr.parse::<SocketAddr>() {
        return Ok(vec![sock]);
    }
    check(addr)?;
    let found: Vec<SocketAddr> = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(addr))
        .await
        .map_err(|_| format!("{addr:?} did not resolve within {}", crate::duration::Human(RESOLVE_TIMEOUT)))?
        .map_err(|e| format!("{addr:?} does not resolve: {e}"))?
        .collect();
    if found.is_empty() {
        return Err(format!("{addr:?} resolves to no address"));
    }
    Ok(found)
}

/// The first of `resolved` that a UDP socket bound to `local` can send to: an IPv4 socket
/// reaches only IPv4 addresses, an IPv6 one both (IPv4 as mapped addresses).
pub fn reachable_from(resolved: &[SocketAddr], local: SocketAddr) -> Option<SocketAddr> {
    resolved.iter().copied().find(|a| local.is_ipv6() || a.is_ipv4())
}

/// The socket a node whose peers reach it at `addr` listens on: `addr` itself when it is an IP
/// address; for a name that resolves here to loopback addresses only (`localhost`), the first
/// of them; for any other name (one that names this host on the network, or resolves only
/// where the node runs, as a Kubernetes Service name does), every interface (`0.0.0.0`) with
/// its port. The client API stays on loopback either way (`NodeConfig::client_endpoint`).
pub fn listen_for(addr: &str) -> Result<SocketAddr, String> {
    check(addr)?;
    if let Ok(sock) = addr.parse::<SocketAddr>() {
        return Ok(sock);
    }
    let port = addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .ok_or_else(|| format!("{addr:?}: no port"))?;
    let resolved: Vec<SocketAddr> = addr.to_socket_addrs().map(Iterator::collect).unwrap_or_default();
    let loopback_only = !resolved.is_empty() && resolved.iter().all(|a| a.ip().is_loopback());
    Ok(match resolved.iter().find(|a| a.is_ipv4()).or(resolved.first()) {
        Some(first) if loopback_only => *first,
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_host_and_port() {
        for ok in
            ["127.0.0.1:7100", "[::1]:7100", "node-4.example:7100", "localhost:1", "node-1.keyhome.svc:7100"]
        {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        for bad in ["notanaddress", "127.0.0.1", "10.0.0.1:0", "host:99999", ":7100", "::1", "a b:1", "-x:1"]
        {
            assert!(check(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn a_node_listens_where_its_address_points() {
        assert_eq!(listen_for("10.0.0.1:7100"), Ok("10.0.0.1:7100".parse().unwrap()));
        assert_eq!(listen_for("localhost:7601").map(|a| (a.ip().is_loopback(), a.port())), Ok((true, 7601)));
        assert_eq!(listen_for("node-1.keyhome.invalid:7100"), Ok("0.0.0.0:7100".parse().unwrap()));
        assert!(listen_for("node-1:0").is_err());
    }

    #[test]
    fn an_ipv4_socket_dials_ipv4_addresses() {
        let (v4, v6): (SocketAddr, SocketAddr) = ("127.0.0.1:1".parse().unwrap(), "[::1]:1".parse().unwrap());
        let local4: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let local6: SocketAddr = "[::]:7000".parse().unwrap();
        assert_eq!(reachable_from(&[v6, v4], local4), Some(v4));
        assert_eq!(reachable_from(&[v6, v4], local6), Some(v6));
        assert_eq!(reachable_from(&[v6], local4), None);
    }
}
