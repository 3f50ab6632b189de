//! Deployment: a cluster whose addresses are DNS names (resolved when dialled, the certificate
//! still proving each node's id), `keyhome certs issue` taking a node's address from the genesis
//! and writing all of an identity's files or none, and the examples in deploy/ (the systemd
//! unit checked by `systemd-analyze verify` where it exists, the configuration files they ship
//! loading as the node reads them), and the binary deploy/build.sh makes needing no dynamic loader.

use keyhome_sim::cluster as harness;

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};

use harness::{Cluster, Options, PATIENCE};
use keyhome::config::{ClientProfile, NodeConfig};

/// A child process killed if the test ends first.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_named_by_dns_names_locks_and_adds_a_member_by_name() {
    let mut cluster = Cluster::layout_named(Options::default());
    for id in cluster.ids() {
        cluster.start_node(id);
    }
    cluster.wait_ready(&cluster.ids(), 1).await;
    let genesis = std::fs::read_to_string(cluster.dir.join("genesis.toml")).unwrap();
    assert!(genesis.contains(&format!("addr = \"localhost:{}\"", cluster.addr(2).port())), "{genesis}");
    assert!(cluster.client_profile(1).addr.starts_with("localhost:"));

    // A handoff between nodes: peers dial each other by name.
    let key = harness::key_homed_on("named/", &[1, 2, 3], 3);
    let first =
        cluster.client(1).await.lock(&key, harness::PATIENCE, PATIENCE).await.expect("lock via node 1");
    first.unlock(Some(b"by name".to_vec())).await.unwrap();
    let second = cluster.client(2).await.lock(&key, PATIENCE, PATIENCE).await.expect("lock via node 2");
    assert_eq!(second.note(), Some(&b"by name"[..]));
    second.unlock(None).await.unwrap();

    // Node 4 at a name: its certificate and node.toml from `certs issue`, proposed by name.
    let ports = harness::PortBlock::reserve(1);
    let port = ports.base();
    let addr = format!("localhost:{port}");
    let out = cluster.cli(&["certs", "issue", "--dir", ".", "--node", "4", "--addr", &addr]);
    assert!(out.status.success(), "{out:?}");
    let config = NodeConfig::load(&cluster.dir.join("node-4/node.toml")).unwrap();
    assert_eq!(config.listen, format!("127.0.0.1:{port}").parse().unwrap(), "localhost: loopback");
    ports.release(0);
    let run = cluster.cli_command(&["run", "--config", "node-4/node.toml"]).stderr(Stdio::null()).spawn();
    let _node4 = Proc(run.expect("start node 4"));
    let operator = cluster.profile_file(&keyhome::pki::Role::Operator, 1);
    let out = cluster.cli(&[
        "epoch",
        "propose",
        "--add",
        &format!("4={addr}"),
        "--profile",
        operator.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains("part of epoch 2"), "{out:?}");
    let status = cluster
        .wait_status(1, "epoch 2 with node 4 connected", |s| {
            s.epoch == 2 && s.members.iter().any(|m| m.id == 4 && m.connected && m.addr == addr)
        })
        .await;
    assert_eq!(status.members.len(), 4);

    // A malformed name is refused as a usage error; a name nothing answers at, by the probe.
    let propose = |member: &str| {
        cluster.cli(&["epoch", "propose", "--add", member, "--profile", operator.to_str().unwrap()])
    };
    let out = propose("5=bad_name:7100");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(text(&out.stderr).contains("is neither an IP address nor a host name"), "{out:?}");
    let out = propose("5=nothing-here.invalid:7100");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("node 5 does not answer at nothing-here.invalid:7100"), "{out:?}");
}

#[test]
fn certs_issue_takes_the_genesis_address_and_writes_all_or_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let cli = |args: &[&str]| -> Output {
        std::process::Command::new(harness::keyhome_binary()).args(args).output().expect("run keyhome")
    };
    let d = dir.to_str().unwrap();
    let out =
        cli(&["init", "--dir", d, "--node", "1=localhost:7601", "--node", "2=node-2.keyhome.invalid:7100"]);
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains(&format!("next: keyhome certs issue --dir {d} --node ID")), "{out:?}");

    // The address comes from the genesis: a loopback name listens on loopback, any other name on
    // every interface.
    assert!(cli(&["certs", "issue", "--dir", d, "--node", "1"]).status.success());
    assert!(cli(&["certs", "issue", "--dir", d, "--node", "2"]).status.success());
    let listen = |id: u64| NodeConfig::load(&dir.join(format!("node-{id}/node.toml"))).unwrap().listen;
    assert_eq!(listen(1), "127.0.0.1:7601".parse().unwrap());
    assert_eq!(listen(2), "0.0.0.0:7100".parse().unwrap());

    // A node the genesis does not name needs --addr; nothing is written.
    let out = cli(&["certs", "issue", "--dir", d, "--node", "3"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("names no node 3 (its members are 1, 2)"), "{out:?}");
    assert!(!dir.join("node-3").exists(), "nothing written for node 3");

    // Issued before: refused, files untouched; --force replaces them.
    let cert = || std::fs::read(dir.join("node-1/cert.pem")).unwrap();
    let before = cert();
    let out = cli(&["certs", "issue", "--dir", d, "--node", "1"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).contains("exists already: a certificate for node 1 was issued before"),
        "{out:?}"
    );
    assert!(text(&out.stderr).contains("Give --force"), "{out:?}");
    assert_eq!(cert(), before, "untouched");
    // An edited node.toml (its store elsewhere) is kept: a fresh one would start a fresh store.
    let config = dir.join("node-1/node.toml");
    let edited =
        std::fs::read_to_string(&config).unwrap().replace("data_dir = \"data\"", "data_dir = \"/srv/kh\"");
    assert!(edited.contains("/srv/kh"), "{edited}");
    std::fs::write(&config, &edited).unwrap();
    assert!(cli(&["certs", "issue", "--dir", d, "--node", "1", "--force"]).status.success());
    assert_ne!(cert(), before, "replaced");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), edited, "node.toml kept");
    // ... so an --addr it would not follow is refused, not ignored.
    let out = cli(&["certs", "issue", "--dir", d, "--node", "1", "--force", "--addr", "127.0.0.1:7609"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("--force keeps it"), "{out:?}");

    // A bad profile address fails before the certificate is written.
    let out = cli(&["certs", "issue", "--dir", d, "--client", "app", "--addr", "1=bad address"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(!dir.join("client-app/cert.pem").exists(), "no certificate without its profile");
    // A profile may name the node by a DNS name.
    assert!(
        cli(&["certs", "issue", "--dir", d, "--client", "app", "--addr", "1=localhost:7601"])
            .status
            .success()
    );
    let profile = ClientProfile::load(&dir.join("client-app/profile.toml")).unwrap();
    assert_eq!((profile.node, profile.addr.as_str()), (1, "localhost:7601"));
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("client-app"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary files left: {leftovers:?}");
}

/// The binary deploy/build.sh makes (the one these tests run) starts without the dynamic loader
/// on glibc, where it is linked statically: its program headers name no interpreter.
#[test]
fn the_shipped_binary_needs_no_dynamic_loader() {
    if !cfg!(all(target_os = "linux", any(target_env = "gnu", target_env = "musl"))) {
        eprintln!("skipped: deploy/build.sh links statically on Linux (glibc, musl) only");
        return;
    }
    let binary = harness::keyhome_binary();
    let mut head = vec![0; 64 * 1024];
    let n = std::io::Read::read(&mut std::fs::File::open(&binary).unwrap(), &mut head).unwrap();
    head.truncate(n);
    assert_eq!(elf_interpreter(&head), Ok(None), "{} (see deploy/build.sh)", binary.display());
}

/// The program interpreter an ELF64 little-endian executable names (PT_INTERP), from its first
/// bytes (the program headers follow the ELF header there).
fn elf_interpreter(elf: &[u8]) -> Result<Option<String>, &'static str> {
    const PT_INTERP: u32 = 3;
    let bytes = |at: usize, len: usize| elf.get(at..at + len).ok_or("cut short");
    let uint = |at: usize, len: usize| -> Result<usize, &'static str> {
        let mut le = [0u8; 8];
        le[..len].copy_from_slice(bytes(at, len)?);
        usize::try_from(u64::from_le_bytes(le)).map_err(|_| "too large")
    };
    if bytes(0, 6)? != b"\x7fELF\x02\x01" {
        return Err("not an ELF64 little-endian file");
    }
    let (phoff, phentsize, phnum) = (uint(32, 8)?, uint(54, 2)?, uint(56, 2)?);
    for header in (0..phnum).map(|i| phoff + i * phentsize) {
        if uint(header, 4)? == PT_INTERP as usize {
            let path = bytes(uint(header + 8, 8)?, uint(header + 32, 8)?)?;
            return Ok(Some(String::from_utf8_lossy(path).trim_end_matches('\0').to_owned()));
        }
    }
    Ok(None)
}

#[test]
fn the_systemd_unit_verifies() {
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/keyhome.service")).unwrap();
    let Ok(version) = std::process::Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!(
            "skipped: systemd-analyze is not installed (check with: systemd-analyze verify deploy/systemd/keyhome.service)"
        );
        return;
    };
    assert!(version.status.success());
    // verify checks that ExecStart's program exists: point it at the built binary.
    let binary = harness::keyhome_binary();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("keyhome.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/keyhome", binary.to_str().unwrap())).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "systemd-analyze verify: {out:?}");
}

#[test]
fn the_shipped_configurations_load() {
    // The systemd example, as the node reads it.
    let config =
        NodeConfig::load(&repo().join("deploy/systemd/node.toml")).expect("deploy/systemd/node.toml");
    assert!(config.locks.delegation_lease_ms <= 5_000, "within the default genesis maximum");
    assert!(config.data_dir.starts_with("/var/lib/keyhome"), "the unit's StateDirectory");

    // The Kubernetes node.toml template: the pods' node.toml, probes on its HTTP port.
    let manifest = std::fs::read_to_string(repo().join("deploy/kubernetes/keyhome.yaml")).unwrap();
    let template: String = manifest
        .lines()
        .skip_while(|l| !l.contains("node.toml.in: |"))
        .skip(1)
        .take_while(|l| l.starts_with("    ") || l.is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    assert!(template.contains("[http]\nlisten = \"0.0.0.0:7180\""), "{template}");
    assert!(manifest.contains("httpGet: { path: /readyz, port: http }"));
    assert!(manifest.contains("{ name: http, containerPort: 7180, protocol: TCP }"));
    // Everything but the HTTP table (the HTTP API's own) loads as a node.toml.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("node.toml");
    let without_http = &template[..template.find("\n# The HTTP port").unwrap_or(template.len())];
    std::fs::write(&path, without_http.replace("@ID@", "2")).unwrap();
    let config = NodeConfig::load(&path).expect("the pods' node.toml");
    assert_eq!((config.id, config.listen.port()), (2, 7100));
    assert_eq!(config.client_endpoint(), Some("127.0.0.1:7100".parse().unwrap()), "clients: this pod only");

    // The image: built in one stage, run as a non-root user in another.
    let dockerfile = std::fs::read_to_string(repo().join("deploy/container/Dockerfile")).unwrap();
    assert_eq!(dockerfile.lines().filter(|l| l.starts_with("FROM ")).count(), 2, "multi-stage");
    assert!(dockerfile.lines().any(|l| l == "USER 10001:10001"), "non-root");
}
