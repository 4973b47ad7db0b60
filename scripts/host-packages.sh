#!/usr/bin/env bash
# Debian packages the real-pod tests and the demo's real node need: podman (builds the images), containerd +
# runc (the real kubelet's runtime), the CNI plugins (pod network), debootstrap (the images' base, since no
# registry can be reached here), iptables/conntrack (kube-proxy), ipset (kube-router's NetworkPolicy), CNI's dnsname
# plugin (podman's networks answer container names: kind's nodes join the control plane by name, make e2e-kind).
# Idempotent and quiet when all is there.
# Hosts that are not Debian, or where apt-get cannot install, get a one-line message and exit 0: the
# tests that need these packages then skip with their reason.
set -euo pipefail
pkgs=(podman containerd runc containernetworking-plugins debootstrap iptables conntrack ipset busybox-static
      golang-github-containernetworking-plugin-dnsname)
missing=()
for p in "${pkgs[@]}"; do
  # captured, not piped into `grep -q`: under pipefail a reader that exits first can fail the pipeline
  st="$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)"
  [[ "$st" == *"install ok installed"* ]] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
    echo "host-packages: missing ${missing[*]} (needs root and apt-get); real-pod tests will be skipped" >&2
    exit 0
  fi
  echo "host-packages: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# podman's default container ulimits (RLIMIT_NOFILE 1048576) exceed what this sandbox allows: every `podman
# run`/build step fails with "setrlimit ... operation not permitted" unless they are cleared.
conf=/etc/containers/containers.conf
if [ -w /etc ] && ! grep -q '^default_ulimits *= *\[\]' "$conf" 2>/dev/null; then
  mkdir -p /etc/containers
  if grep -q '^\[containers\]' "$conf" 2>/dev/null; then
    sed -i 's/^\[containers\]/[containers]\ndefault_ulimits = []/' "$conf"
  else
    printf '[containers]\ndefault_ulimits = []\n' >> "$conf"
  fi
fi
echo "host-packages: ready"
