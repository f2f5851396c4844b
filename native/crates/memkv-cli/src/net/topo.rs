//! `memkv net topo`: the topology as a table, or JSON with `--json`.

use clap::Args;
use memkv_topo::{gpu_scratch, NicKind, PciPlace, ScratchVerdict, Topology};
use serde_json::{json, Value};

use super::{device_memory, TopoSource};

#[derive(Args)]
pub(super) struct TopoArgs {
    #[command(flatten)]
    source: TopoSource,
    /// Print JSON instead of the tables.
    #[arg(long)]
    json: bool,
}

pub(super) fn run(a: TopoArgs) -> Result<i32, String> {
    let topo = a.source.read()?;
    let text = if a.json {
        serde_json::to_string_pretty(&to_json(&topo)).unwrap() + "\n"
    } else {
        render(&topo)
    };
    // A closed pipe (`memkv net topo | head`) is the reader's choice, not an error.
    use std::io::Write;
    let _ = std::io::stdout().write_all(text.as_bytes());
    Ok(0)
}

fn scratch(topo: &Topology, gpu: usize) -> ScratchVerdict {
    gpu_scratch(topo, topo.gpus[gpu].place.addr, device_memory)
}

fn place_json(p: &PciPlace) -> Value {
    json!({
        "pci": p.addr.to_string(),
        "numa_node": p.numa_node,
        "root_complex": p.root_complex,
        "switch": p.switch().map(|s| s.to_string()),
    })
}

fn with(mut base: Value, more: Value) -> Value {
    if let (Value::Object(b), Value::Object(m)) = (&mut base, more) {
        b.extend(m);
    }
    base
}

pub(super) fn to_json(topo: &Topology) -> Value {
    let gpus: Vec<Value> = topo
        .gpus
        .iter()
        .map(|g| {
            with(
                json!({"index": g.index, "vendor": g.vendor.name()}),
                place_json(&g.place),
            )
        })
        .collect();
    let nics: Vec<Value> = topo
        .nics
        .iter()
        .map(|n| {
            with(
                json!({
                    "name": n.name,
                    "kind": n.kind.name(),
                    "netdevs": n.netdevs,
                    "link_layers": n.link_layers,
                    "active": n.active,
                }),
                place_json(&n.place),
            )
        })
        .collect();
    let pairing: Vec<Value> = topo
        .pairing()
        .iter()
        .map(|p| {
            let s = scratch(topo, p.gpu);
            json!({
                "gpu": p.gpu,
                "pci": topo.gpus[p.gpu].place.addr.to_string(),
                "nic": p.nic.map(|i| topo.nics[i].name.clone()),
                "proximity": p.proximity.map(|x| x.key()),
                "gpu_scratch": s.gpu,
                "gpu_scratch_reason": s.reason,
            })
        })
        .collect();
    json!({"gpus": gpus, "nics": nics, "pairing": pairing})
}

/// Left-aligned columns two spaces apart.
fn columns(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("  {cell:<w$}"))
            .collect();
        out.push_str(cells.concat().trim_end());
        out.push('\n');
    }
    out
}

fn place_cells(p: &PciPlace) -> [String; 4] {
    [
        p.addr.to_string(),
        p.numa_node.map_or("-".into(), |n| n.to_string()),
        p.root_complex.clone(),
        p.switch().map_or("-".into(), |s| s.to_string()),
    ]
}

fn or_dash(v: &[String]) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        v.join(",")
    }
}

pub(super) fn render(topo: &Topology) -> String {
    let mut out = format!("GPUs: {}\n", topo.gpus.len());
    if !topo.gpus.is_empty() {
        let mut rows = vec![["#", "PCI", "NUMA", "ROOT COMPLEX", "SWITCH", "VENDOR"]
            .map(String::from)
            .to_vec()];
        for g in &topo.gpus {
            let mut r = vec![g.index.to_string()];
            r.extend(place_cells(&g.place));
            r.push(g.vendor.name().into());
            rows.push(r);
        }
        out += &columns(&rows);
    }
    let rdma = topo.nics.iter().filter(|n| n.kind == NicKind::Rdma).count();
    out += &format!(
        "NICs: {} RDMA, {} plain network\n",
        rdma,
        topo.nics.len() - rdma
    );
    if !topo.nics.is_empty() {
        let mut rows = vec![[
            "NAME",
            "PCI",
            "NUMA",
            "ROOT COMPLEX",
            "SWITCH",
            "KIND",
            "LINK",
            "STATE",
            "NETDEV",
        ]
        .map(String::from)
        .to_vec()];
        for n in &topo.nics {
            let mut r = vec![n.name.clone()];
            r.extend(place_cells(&n.place));
            r.push(n.kind.name().into());
            r.push(or_dash(&n.link_layers));
            r.push(match n.active {
                Some(true) => "ACTIVE".into(),
                Some(false) => "down".into(),
                None => "-".into(),
            });
            r.push(or_dash(&n.netdevs));
            rows.push(r);
        }
        out += &columns(&rows);
    }
    if rdma == 0 {
        out += "No RDMA NIC: only libfabric's software providers (tcp, sockets) can run here, \
                slower than plain TCP.\n";
    } else if topo
        .nics
        .iter()
        .all(|n| n.active == Some(false) || n.kind == NicKind::Net)
    {
        out += "No RDMA NIC has an ACTIVE port: check cabling and the subnet manager \
                (`ibstat`).\n";
    }
    if topo.gpus.is_empty() {
        return out;
    }
    out += "Pairing (each GPU's rank uses the nearest NIC):\n";
    let mut rows = vec![["GPU", "PCI", "NIC", "PROXIMITY", "GPU SCRATCH (auto)"]
        .map(String::from)
        .to_vec()];
    for p in topo.pairing() {
        let s = scratch(topo, p.gpu);
        rows.push(vec![
            p.gpu.to_string(),
            topo.gpus[p.gpu].place.addr.to_string(),
            p.nic.map_or("-".into(), |i| topo.nics[i].name.clone()),
            p.proximity.map_or("-".into(), |x| x.describe().into()),
            format!("{}: {}", if s.gpu { "yes" } else { "no" }, s.reason),
        ]);
    }
    out + &columns(&rows)
}
