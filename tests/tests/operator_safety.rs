//! Operator mistakes the node and the CLI catch, with real processes: membership changes naming a
//! member nobody can reach or an address in use, a second process started from a copy of a
//! node's configuration, a store started with another cluster's genesis, a removed node the
//! members refuse, and `keyhome dev` keeping the cluster up when one node is killed.

use keyhome_sim::cluster as harness;

use std::net::UdpSocket;
use std::process::{Child, Stdio};
use std::time::Duration;

use harness::{Cluster, Options, PATIENCE};
use keyhome::config::{GenesisFile, NodeConfig, write_toml};
use keyhome::pki::{self, Role};
use keyhome_epoch::{Change, NodeId};

async fn started() -> Cluster {
    let cluster = Cluster::start(Options::default());
    cluster.wait_ready(&cluster.ids(), 1).await;
    cluster
}

/// Kills node 3 and waits until node 1 sees it down.
async fn kill_node_3(cluster: &mut Cluster) {
    cluster.kill(3);
    cluster.wait_status(1, "node 3 seen down", |s| s.members.iter().any(|m| m.id == 3 && !m.connected)).await;
}

/// A child process killed if the test ends first.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback UDP port nothing listens on (bound, read, released).
fn unused_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free port").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_changes_naming_unreachable_members_are_refused() {
    let cluster = started().await;
    let profile = cluster.profile_file(&Role::Operator, 1);
    let profile = profile.to_str().unwrap();
    let propose = |args: &[&str]| {
        let mut all = vec!["epoch", "propose", "--profile", profile];
        all.extend(args);
        let out = cluster.cli(&all);
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };

    let (code, stderr) = propose(&["--add", "4=notanaddress"]);
    assert_eq!(code, Some(2), "a malformed address is a usage error: {stderr}");
    assert!(stderr.contains("is not HOST:PORT"), "{stderr}");

    let nobody = format!("6=127.0.0.1:{}", unused_port());
    let (code, stderr) = propose(&["--add", &nobody]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("node 6 does not answer at"), "{stderr}");
    // Something answers with node 2's certificate at a free address: it proves it is node 2, not
    // node 7.
    let node2 = keyhome::setup::identity_dir(&cluster.dir, &Role::Node(NodeId(2)));
    let identity = pki::Identity::load(node2.join("cert.pem"), node2.join("key.pem")).unwrap();
    let ca = pki::load_ca(cluster.dir.join("ca.pem")).unwrap();
    let server = pki::server_config(&identity, &ca).unwrap();
    let impostor = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let answering = tokio::spawn({
        let endpoint = impostor.clone();
        async move {
            while let Some(incoming) = endpoint.accept().await {
                let _ = incoming.await;
            }
        }
    });
    let replace = format!("3=7={}", impostor.local_addr().unwrap());
    let (code, stderr) = propose(&["--replace", &replace]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("node 7 does not answer at") && stderr.contains("certificate is not node 7's"),
        "{stderr}"
    );
    answering.abort();

    // An address a member has is refused by the epoch's rule, naming that member, before any
    // probe, and with --force too.
    let taken = format!("8={}", cluster.addr(2));
    for force in [&[][..], &["--force"]] {
        let (code, stderr) = propose(&[&["--add", &taken][..], force].concat());
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("is already used by node 2"), "{stderr}");
    }

    let status = cluster.status(1).await;
    assert_eq!(status.epoch, 1, "nothing was proposed: {status:?}");
}

/// Members {1, 2, 3} with node 3 dead: removing node 2 by mistake would leave epoch 2 = {1, 3}
/// with one member reachable, unable to serve or change again (review). It is refused, naming the
/// unreachable member, whichever way it is asked: the Rust client and the CLI (the node checks,
/// not the CLI; HTTP in `http_api`). The intended removal goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_leaves_no_reachable_majority_is_refused() {
    let mut cluster = started().await;
    kill_node_3(&mut cluster).await;
    let refused = cluster.operator(1).await.propose(Change::Remove(NodeId(2))).await.expect_err("refused");
    let text = refused.to_string();
    assert!(text.contains("would need 2 of its members 1, 3") && text.contains("unreachable: 3"), "{text}");
    let profile = cluster.profile_file(&Role::Operator, 1);
    let propose = |change: &str| {
        let out =
            cluster.cli(&["epoch", "propose", "--profile", profile.to_str().unwrap(), "--remove", change]);
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, stderr) = propose("2");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("would need 2 of its members 1, 3") && stderr.contains("unreachable: 3"),
        "{stderr}"
    );
    assert_eq!(cluster.status(1).await.epoch, 1, "nothing was proposed");
    let (code, stderr) = propose("3");
    assert_eq!(code, Some(0), "the removal of the dead node goes through: {stderr}");
    assert_eq!(cluster.status(1).await.epoch, 2);
}

/// A node removed while it was down, started again after the rest of the cluster restarted too:
/// the members no longer know its address, so they cannot tell it of its removal, and they refuse
/// its connections. It says why, in `keyhome status` and its log: each member's reason, naming the
/// epoch that removed it. (Before, its status showed the members as merely unreachable.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_node_started_after_a_full_restart_says_the_members_refuse_it() {
    let mut cluster = started().await;
    kill_node_3(&mut cluster).await;
    let epoch = cluster.operator(1).await.propose(Change::Remove(NodeId(3))).await.expect("node 3 removed");
    assert_eq!(epoch, 2);
    // Both learn epoch 2 before they restart (a node that had only accepted it would start in
    // epoch 1, still knowing node 3, and tell it of epoch 2 when it learns it).
    cluster.wait_ready(&[1, 2], 2).await;
    for id in [1, 2] {
        cluster.kill(id);
    }
    for id in [1, 2] {
        cluster.start_node(id);
    }
    cluster.wait_ready(&[1, 2], 2).await;
    cluster.start_node(3);
    let removed = "was removed from the cluster: epoch 2 retires it";
    let status = cluster
        .wait_status(3, "nodes 1 and 2 refuse node 3, saying why", |s| {
            let refuses = |id: u64| {
                s.members
                    .iter()
                    .any(|m| m.id == id && m.refused.as_deref().is_some_and(|r| r.contains(removed)))
            };
            refuses(1) && refuses(2)
        })
        .await;
    assert_eq!(status.epoch, 1, "node 3 has not heard of epoch 2");
    let shown = status.to_string();
    assert!(shown.contains(&format!("REFUSES THIS NODE: node 3 {removed}")), "{shown}");
    let log = std::fs::read_to_string(cluster.node_dir(3).join("node.log")).unwrap_or_default();
    assert!(log.contains(&format!("node 1 refuses this node: node 3 {removed}")), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_nodes_configuration_does_not_run_as_that_node() {
    let cluster = started().await;
    // A second process for node 1: its configuration copied, with a fresh data directory and
    // another port (its real port is taken).
    let mut copy = NodeConfig::load(&cluster.node_config(1)).unwrap();
    copy.listen = format!("127.0.0.1:{}", unused_port()).parse().unwrap();
    copy.data_dir = cluster.dir.join("copy-data");
    let path = cluster.dir.join("copy.toml");
    write_toml(&path, &copy).unwrap();
    let stderr = refused_start(&cluster, &path).await;
    assert!(stderr.contains("epoch 1 places it at"), "{stderr}");

    // A process that gets past that check (here: a bare connection with node 1's certificate,
    // from another socket) while node 1 is connected is reported loudly by the peer it reaches.
    let node1 = keyhome::setup::identity_dir(&cluster.dir, &Role::Node(NodeId(1)));
    let identity = pki::Identity::load(node1.join("cert.pem"), node1.join("key.pem")).unwrap();
    let ca = pki::load_ca(cluster.dir.join("ca.pem")).unwrap();
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let config = pki::client_config(&identity, &ca, pki::ALPN_PEER).unwrap();
    let conn = endpoint
        .connect_with(config, cluster.addr(2), &pki::server_name(NodeId(2)))
        .unwrap()
        .await
        .expect("connect as node 1");
    let log = cluster.node_dir(2).join("node.log");
    harness::eventually(PATIENCE, "node 2 reports two processes claiming node 1", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        std::future::ready(text.contains("TWO PROCESSES CLAIM TO BE NODE 1").then_some(()))
    })
    .await;
    drop(conn);
}

/// A node whose store was created from another genesis than the one its configuration names (a
/// data directory of another cluster, or a genesis file rewritten since) refuses to start, naming
/// both; with its own genesis back it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_from_another_genesis_is_refused() {
    let mut cluster = Cluster::layout(Options::default());
    cluster.start_node(1);
    cluster.status(1).await; // its store is created and committed
    cluster.terminate(1);

    let own = NodeConfig::load(&cluster.node_config(1)).unwrap().genesis;
    let mut other = GenesisFile::load(&own).unwrap();
    other.members.pop();
    let other_path = cluster.dir.join("other-genesis.toml");
    write_toml(&other_path, &other).unwrap();
    cluster.edit_config(1, |c| c.genesis = other_path.clone());
    let stderr = refused_start(&cluster, &cluster.node_config(1)).await;
    assert!(stderr.contains("was created from another genesis"), "{stderr}");
    assert!(stderr.contains("other-genesis.toml"), "{stderr}");

    cluster.edit_config(1, |c| c.genesis = own);
    cluster.start_node(1);
    cluster.status(1).await;
}

/// Runs `keyhome run --config config`, expects it to exit unsuccessfully, and returns its stderr.
async fn refused_start(cluster: &Cluster, config: &std::path::Path) -> String {
    let run =
        cluster.cli_command(&["run", "--config", config.to_str().unwrap()]).stderr(Stdio::piped()).spawn();
    let mut run = Proc(run.expect("start keyhome run"));
    let status =
        harness::eventually(PATIENCE, "the node exits", || std::future::ready(run.0.try_wait().unwrap()))
            .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(run.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    stderr
}

/// `keyhome dev`: a node killed with SIGKILL is started again; the others keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_restarts_a_killed_node_and_keeps_the_others() {
    let layout = Cluster::layout(Options::default());
    let dir = layout.dir.with_file_name("dev");
    let port = layout.addr(1).port();
    layout.release_ports();
    let args =
        ["dev", "--dir", dir.to_str().unwrap(), "--port", &port.to_string(), "--restart-after", "500ms"];
    let dev = layout.cli_command(&args).stdout(Stdio::null()).stderr(Stdio::null()).spawn();
    let dev = Proc(dev.expect("start keyhome dev"));
    let node_pid = |id: u64| {
        let config = dir.join(format!("node-{id}/node.toml"));
        children_of(dev.0.id()).into_iter().find(|&pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(config.to_str().unwrap()))
        })
    };
    let ready = |id: u64| {
        let profile = keyhome::config::ClientProfile {
            node: id,
            addr: layout.addr(id).to_string(),
            ca: dir.join("ca.pem"),
            cert: dir.join("client-app/cert.pem"),
            key: dir.join("client-app/key.pem"),
            socket: None,
            node_uid: None,
        };
        async move {
            let client =
                tokio::time::timeout(Duration::from_secs(2), keyhome::client::Client::connect(&profile))
                    .await
                    .ok()?
                    .ok()?;
            let status = client.status().await.ok()?;
            harness::ready(&status, 1).then_some(())
        }
    };
    for id in 1..=3 {
        harness::eventually(PATIENCE, &format!("dev node {id} serves"), || ready(id)).await;
    }
    let first = node_pid(2).expect("node 2's process");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let restarted = harness::eventually(PATIENCE, "node 2 started again", || {
        std::future::ready(node_pid(2).filter(|&p| p != first))
    })
    .await;
    assert_ne!(restarted, first);
    for id in 1..=3 {
        harness::eventually(PATIENCE, &format!("dev node {id} serves after the restart"), || ready(id)).await;
    }
}

/// The process ids whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1));
            ppid.and_then(|p| p.parse::<u32>().ok()) == Some(parent)
        })
        .collect()
}
