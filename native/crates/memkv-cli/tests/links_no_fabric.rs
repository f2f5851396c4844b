//! The `memkv` binary must start on any Linux host: it may load libfabric at run time (dlopen)
//! but must not name it, or anything RDMA, among the libraries the dynamic loader resolves.

use std::process::Command;

/// Libraries of RDMA stacks: libfabric and what it or UCX would pull in.
const FABRIC: [&str; 7] = [
    "libfabric",
    "libibverbs",
    "librdmacm",
    "libefa",
    "libmlx5",
    "libucp",
    "libucs",
];

fn output(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_memkv_binary_links_no_fabric_library() {
    let bin = env!("CARGO_BIN_EXE_memkv");
    // NEEDED entries name what the binary links; ldd also shows what those pull in.
    let needed = output("readelf", &["-d", bin]);
    let resolved = output("ldd", &[bin]);
    assert!(
        needed.contains("(NEEDED)") && needed.contains("libc.so.6"),
        "{needed}"
    );
    for lib in FABRIC {
        assert!(!needed.contains(lib), "{bin} links {lib}:\n{needed}");
        assert!(!resolved.contains(lib), "{bin} loads {lib}:\n{resolved}");
    }
}
