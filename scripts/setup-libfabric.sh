#!/usr/bin/env bash
# libfabric for the RDMA transport's tests and for operators' `fi_info`: installs the
# distribution's libfabric1 and libfabric-bin with apt when libfabric.so.1 or fi_info is missing.
#
# memkv itself never links libfabric: it loads libfabric.so.1 at first use (dlopen), and builds
# against headers vendored in native/crates/memkv-fabric, so no -dev package is needed. The
# tests run the real one-sided path over libfabric's tcp provider on loopback, which is why CI
# needs the library.
#
# Exit status: 0 when libfabric is present or was installed; 1 when it is missing and could not
# be installed (not root and no password-less sudo, or no apt-get), with what to run instead.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # ldconfig, for users whose PATH lacks the sbin directories
PKGS=(libfabric1 libfabric-bin)

present() {
  ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1 ' && command -v fi_info >/dev/null
}
version() { fi_info --version 2>/dev/null | sed -n 's/^libfabric: *//p'; }

if present; then
  echo "libfabric $(version) present ($(command -v fi_info))"
  exit 0
fi

sudo=()
if ((EUID != 0)); then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    sudo=(unavailable)
  fi
fi
if ! command -v apt-get >/dev/null || [[ "${sudo[*]}" == unavailable ]]; then
  echo "libfabric is missing and this script cannot install it (it needs apt-get and root or" \
       "password-less sudo). Install ${PKGS[*]} (Debian/Ubuntu; elsewhere the distribution's" \
       "libfabric and its fi_info): the RDMA transport's tests need it, and without it" \
       "MEMKV_TRANSPORT=rdma fails with 'cannot load libfabric.so.1'." >&2
  exit 1
fi

echo "libfabric missing: installing ${PKGS[*]} with apt-get (about 1 minute)"
"${sudo[@]}" apt-get update
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y --no-install-recommends "${PKGS[@]}"
if ! present; then
  echo "apt-get installed ${PKGS[*]} but libfabric.so.1 or fi_info is still not found" >&2
  exit 1
fi
echo "libfabric $(version) installed; providers: $(fi_info -l 2>/dev/null | sed -n 's/:$//p' | tr '\n' ' ')"
