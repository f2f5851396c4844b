//! `memkv net selftest`: checks a host end to end and says plainly what it could not check.

use std::time::{Duration, Instant};

use clap::Args;
use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice};
use memkv_fabric::Fabric;
use memkv_server::rdma::RdmaConfig;
use memkv_server::{Server, ServerConfig};
use memkv_topo::{NicKind, Topology};

use super::TopoSource;

#[derive(Args)]
pub(super) struct SelftestArgs {
    #[command(flatten)]
    source: TopoSource,
}

enum Outcome {
    Ok(String),
    Failed(String),
    /// Could not be checked on this host, and why.
    Skipped(String),
}

/// The providers tried, hardware first: InfiniBand/RoCE, AWS EFA, then the software ones.
const PROVIDERS: [&str; 4] = ["verbs", "efa", "tcp", "sockets"];
const HARDWARE: [&str; 2] = ["verbs", "efa"];

/// A provider libfabric opened here: its name as libfabric reports it and the domain.
struct Offered {
    asked: &'static str,
    provider: String,
    domain: String,
    completion: memkv_fabric::WriteCompletion,
}

pub(super) fn run(a: SelftestArgs) -> Result<i32, String> {
    let mut checks: Vec<(&str, Outcome)> = Vec::new();
    let topo = a.source.read();
    checks.push((
        "topology",
        match &topo {
            Ok(t) => Outcome::Ok(describe(t)),
            Err(e) => Outcome::Failed(e.clone()),
        },
    ));
    let rdma_nics: Vec<String> = topo
        .as_ref()
        .map(|t| {
            t.nics
                .iter()
                .filter(|n| n.kind == NicKind::Rdma)
                .map(|n| n.name.clone())
                .collect()
        })
        .unwrap_or_default();
    checks.push(("tcp round trip", outcome(round_trip(None))));
    let offered = match memkv_fabric::probe() {
        Err(e) => {
            checks.push(("libfabric", Outcome::Failed(e)));
            Vec::new()
        }
        Ok(version) => {
            checks.push((
                "libfabric",
                Outcome::Ok(format!("version {version} loaded")),
            ));
            let offered = providers(&a.source);
            checks.push(("providers", judge_providers(&offered, &rdma_nics)));
            offered
        }
    };
    // The fastest provider libfabric offers: hardware where there is one, else tcp on loopback.
    let pick = offered
        .iter()
        .find(|o| HARDWARE.contains(&o.asked))
        .or_else(|| offered.iter().find(|o| o.asked == "tcp"));
    checks.push((
        "rdma round trip",
        match pick {
            None => Outcome::Skipped("no libfabric provider to run it over".into()),
            Some(o) => {
                let domains = if o.asked == "tcp" {
                    vec!["lo".to_string()]
                } else {
                    vec![o.domain.clone()]
                };
                outcome(
                    round_trip(Some(RdmaConfig {
                        provider: Some(o.asked.into()),
                        domains,
                        ..RdmaConfig::default()
                    }))
                    .map(|t| format!("{} ({}): {t}", o.asked, o.provider)),
                )
            }
        },
    ));

    let (mut ok, mut failed, mut skipped) = (0, 0, 0);
    for (name, outcome) in &checks {
        let (tag, text) = match outcome {
            Outcome::Ok(t) => {
                ok += 1;
                ("ok  ", t)
            }
            Outcome::Failed(t) => {
                failed += 1;
                ("FAIL", t)
            }
            Outcome::Skipped(t) => {
                skipped += 1;
                ("skip", t)
            }
        };
        println!("{tag}  {name}: {text}");
    }
    println!("{ok} passed, {failed} failed, {skipped} not checked");
    Ok(i32::from(failed > 0))
}

fn outcome(r: Result<String, String>) -> Outcome {
    match r {
        Ok(t) => Outcome::Ok(t),
        Err(e) => Outcome::Failed(e),
    }
}

fn describe(t: &Topology) -> String {
    let rdma: Vec<&str> = t
        .nics
        .iter()
        .filter(|n| n.kind == NicKind::Rdma)
        .map(|n| n.name.as_str())
        .collect();
    let down: Vec<&str> = t
        .nics
        .iter()
        .filter(|n| n.active == Some(false))
        .map(|n| n.name.as_str())
        .collect();
    let mut text = format!(
        "{} GPU(s), RDMA NICs: {}",
        t.gpus.len(),
        if rdma.is_empty() {
            "none (only the tcp provider can run here)".into()
        } else {
            rdma.join(", ")
        }
    );
    if !down.is_empty() {
        text += &format!("; no ACTIVE port on {}", down.join(", "));
    }
    text
}

/// The providers of `PROVIDERS` that open a domain with the one-sided endpoints memkv needs;
/// hardware providers only on the NICs `MEMKV_RDMA_DEVICES` names, when it names any.
fn providers(source: &TopoSource) -> Vec<Offered> {
    let named = memkv_topo::device_list(&source.rdma_devices);
    PROVIDERS
        .iter()
        .filter_map(|&asked| {
            let domains = if HARDWARE.contains(&asked) {
                named.clone()
            } else {
                Vec::new()
            };
            let fab = Fabric::open(Some(asked), &domains).ok()?;
            Some(Offered {
                asked,
                provider: fab.provider.clone(),
                domain: fab.domain_name.clone(),
                completion: fab.write_completion,
            })
        })
        .collect()
}

/// A host with RDMA NICs needs a hardware provider on them; one without needs tcp.
fn judge_providers(offered: &[Offered], rdma_nics: &[String]) -> Outcome {
    let list = offered
        .iter()
        .map(|o| {
            format!(
                "{} ({} on {}, {})",
                o.asked,
                o.provider,
                o.domain,
                o.completion.describe()
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let hardware = offered.iter().any(|o| HARDWARE.contains(&o.asked));
    if !rdma_nics.is_empty() && !hardware {
        Outcome::Failed(format!(
            "RDMA NICs {} but libfabric offers no verbs or efa endpoint for one-sided reads \
             and writes (offered: {}); check the NIC driver and rdma-core (`fi_info -p verbs`)",
            rdma_nics.join(", "),
            if list.is_empty() { "none" } else { &list }
        ))
    } else if offered.is_empty() {
        Outcome::Failed(format!(
            "libfabric offers none of {PROVIDERS:?} with one-sided reads and writes"
        ))
    } else {
        Outcome::Ok(list)
    }
}

/// Values of these sizes are put and read back: one byte, a page plus one, and a value larger
/// than a checksum chunk, so short, unaligned and large transfers all run.
const SIZES: [usize; 3] = [1, 4097, 3 << 20];

/// Puts values through a temporary in-process server on loopback, over TCP (`rdma` None) or
/// one-sided RDMA on `rdma`'s provider, and reads them back.
fn round_trip(rdma: Option<RdmaConfig>) -> Result<String, String> {
    let client_cfg = match &rdma {
        None => ClientConfig::default(),
        Some(r) => ClientConfig {
            transport: TransportChoice::Rdma,
            rdma_provider: r.provider.clone(),
            rdma_devices: r.domains.clone(),
            ..ClientConfig::default()
        },
    };
    let server = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 64 << 20,
        lanes: 1,
        rdma,
        ..ServerConfig::default()
    })
    .map_err(|e| format!("cannot start a server on loopback: {e}"))?;
    let result = (|| {
        let client = Client::new(ClientConfig {
            servers: vec![server.addr.to_string()],
            op_timeout: Duration::from_secs(10),
            io_threads: 1,
            ..client_cfg
        })?;
        let keys: Vec<Vec<u8>> = (0..SIZES.len())
            .map(|i| format!("memkv-selftest/{i}").into_bytes())
            .collect();
        let values: Vec<Vec<u8>> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7) as u8).collect())
            .collect();
        let t0 = Instant::now();
        let bufs: Vec<Buf> = values.iter().map(|v| Buf::of(v)).collect();
        // SAFETY: `values` outlives the call.
        let put = unsafe { client.put(&keys, &bufs) };
        if put.iter().any(|s| *s != Status::Ok) {
            return Err(format!("put answered {put:?}"));
        }
        let mut back: Vec<Vec<u8>> = SIZES.iter().map(|&n| vec![0u8; n]).collect();
        let bufs: Vec<Buf> = back.iter_mut().map(|v| Buf::of_mut(v)).collect();
        // SAFETY: `back` outlives the call and nothing else touches it meanwhile.
        let got = unsafe { client.get(&keys, &bufs) };
        if got.iter().any(|s| *s != Status::Ok) {
            return Err(format!("get answered {got:?}"));
        }
        if back != values {
            return Err("get returned other bytes than were put".into());
        }
        Ok(format!(
            "put and got back {} values of {:?} bytes, identical, in {:.1} ms",
            SIZES.len(),
            SIZES,
            t0.elapsed().as_secs_f64() * 1e3
        ))
    })();
    server.shutdown();
    server.wait();
    result
}
