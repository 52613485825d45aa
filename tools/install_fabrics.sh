#!/usr/bin/env bash
# The userspace of the fabrics kv.fabric uses (docs/deploy.md, "Fabrics per cloud"), into a Ray image or
# container: rdma-core's verbs providers (InfiniBand, RoCE; the UCX inside NIXL's wheel loads
# them), and with --efa AWS's EFA installer, whose libfabric (EFA provider) NIXL's LIBFABRIC
# backend needs: the nixl wheel ships the plugin but not libfabric itself. The kernel module
# stays the host's. Idempotent; EFA_INSTALLER_VERSION pins the installer (default: latest).
set -euo pipefail
efa=0
[ "${1:-}" = "--efa" ] && efa=1
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends \
  ibverbs-providers libibverbs1 librdmacm1 libhwloc15 curl ca-certificates
if [ "$efa" = 1 ] && [ ! -e /opt/amazon/efa/lib/libfabric.so.1 ]; then
  tmp=$(mktemp -d)
  curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION:-latest}.tar.gz" \
    | tar xz -C "$tmp"
  (cd "$tmp/aws-efa-installer" && $sudo ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify)
  rm -rf "$tmp"
  echo /opt/amazon/efa/lib | $sudo tee /etc/ld.so.conf.d/tandem-efa.conf >/dev/null
  $sudo ldconfig
fi
