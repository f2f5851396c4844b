//! Compiles the C shim against the vendored libfabric headers (see csrc/shim.c for why a shim).
//! It is linked statically into this crate; libfabric itself is never linked.

fn main() {
    println!("cargo:rerun-if-changed=csrc/shim.c");
    println!("cargo:rerun-if-changed=include");
    cc::Build::new()
        .file("csrc/shim.c")
        .include("include")
        .warnings(true)
        .extra_warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-sign-compare")
        .compile("memkv_fabric_shim");
}
