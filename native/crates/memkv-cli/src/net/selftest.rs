//! `memkv net selftest`: checks a host end to end and says plainly what it could not check.

use std::time::{Duration, Instant};

use clap::Args;
use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice};
use memkv_server::{Server, ServerConfig};
use memkv_topo::NicKind;

use super::TopoSource;

#[derive(Args)]
pub(super) struct SelftestArgs {
    #[command(flatten)]
    source: TopoSource,
}

enum Outcome {
    Ok(String),
    Failed(String),
    /// Could not be checked on this host or with this build, and why.
    Skipped(String),
}

pub(super) fn run(a: SelftestArgs) -> Result<i32, String> {
    let checks: Vec<(&str, Outcome)> = vec![
        ("topology", topology(&a.source)),
        ("tcp round trip", round_trip(TransportChoice::Tcp)),
        (
            "libfabric",
            Outcome::Skipped(
                "this build of memkv has no RDMA transport and loads no libfabric".into(),
            ),
        ),
        (
            "rdma round trip",
            Outcome::Skipped("this build of memkv has no RDMA transport".into()),
        ),
    ];
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

fn topology(source: &TopoSource) -> Outcome {
    match source.read() {
        Err(e) => Outcome::Failed(e),
        Ok(t) => {
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
            Outcome::Ok(text)
        }
    }
}

/// Values of these sizes are put and read back: one byte, a page plus one, and a multi-frame
/// megabyte value, so short, unaligned and large transfers all run.
const SIZES: [usize; 3] = [1, 4097, 3 << 20];

/// Puts values through a temporary server on loopback with `transport` and reads them back.
fn round_trip(transport: TransportChoice) -> Outcome {
    match try_round_trip(transport) {
        Ok(t) => Outcome::Ok(t),
        Err(e) => Outcome::Failed(e),
    }
}

fn try_round_trip(transport: TransportChoice) -> Result<String, String> {
    let server = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 64 << 20,
        lanes: 1,
        ..ServerConfig::default()
    })
    .map_err(|e| format!("cannot start a server on loopback: {e}"))?;
    let result = (|| {
        let client = Client::new(ClientConfig {
            servers: vec![server.addr.to_string()],
            transport,
            op_timeout: Duration::from_secs(10),
            io_threads: 1,
            ..ClientConfig::default()
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
        let put = unsafe {
            client.put(
                &keys,
                &values.iter().map(|v| Buf::of(v)).collect::<Vec<_>>(),
            )
        };
        if put.iter().any(|s| *s != Status::Ok) {
            return Err(format!("put answered {put:?}"));
        }
        let mut back: Vec<Vec<u8>> = SIZES.iter().map(|&n| vec![0u8; n]).collect();
        let bufs: Vec<Buf> = back.iter_mut().map(|v| Buf::of_mut(v)).collect();
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
