#!/usr/bin/env bash
# Run a command as a new machine would: in a fresh clone of this repository's HEAD with every cache empty
# (EMBEDOPS_CACHE, Go build and module caches, pip and npm caches, podman storage, the demo's model folder),
# timed, then remove all of it. How docs/cluster.md's cold figures are measured.
#   scripts/cold-run.sh make demo        # the demo is stopped afterwards (make demo-down)
#   scripts/cold-run.sh bash .ci/run
# The log and the time stay in $COLD_LOGS (default /tmp/cold-run-<UTC time>); KEEP=1 keeps the clone and caches.
# Not emptied: Debian packages already installed (scripts/host-packages.sh takes ~1 min more on a new machine)
# and PIP_FIND_LINKS, a wheel folder some machines provide.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
stamp=$(date -u +%Y%m%dT%H%M%SZ)
logs=${COLD_LOGS:-/tmp/cold-run-$stamp}
# Under /var/lib, not /tmp: the model folder must be readable by the server's uid 10001 through its parents.
work=$(mktemp -d /var/lib/embedops-cold.XXXXXX)
chmod 755 "$work"
mkdir -p "$logs" "$work/cache" "$work/containers"
git clone -q "$repo" "$work/repo"
cat > "$work/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$work/containers/storage"
runroot = "$work/containers/run"
CONF
export EMBEDOPS_CACHE="$work/cache/embedops" XDG_CACHE_HOME="$work/cache" GOCACHE="$work/cache/go-build" \
  GOMODCACHE="$work/cache/gomod" GOPATH="$work/go" PIP_CACHE_DIR="$work/cache/pip" \
  npm_config_cache="$work/cache/npm" CONTAINERS_STORAGE_CONF="$work/storage.conf" \
  EMBEDOPS_MODELS_HOSTPATH="$work/models"

finish() {
  rc=$?
  if [ "$*" = "make demo" ]; then
    (cd "$work/repo" && make demo-down) >>"$logs/run.log" 2>&1 || true
  fi
  du -sh "$work/repo/.venv" "$work/cache"/* "$work/containers" 2>/dev/null | sed 's/^/cold-run: size /' | tee -a "$logs/run.log"
  if [ "${KEEP:-0}" != 1 ]; then
    podman system reset --force >/dev/null 2>&1 || true   # its overlay mounts, before the files go
    rm -rf "$work"
  fi
  echo "cold-run: exit $rc; log $logs/run.log" >&2
}
trap 'finish "$@"' EXIT

echo "cold-run: $* in $work/repo at $(git -C "$repo" rev-parse --short HEAD), start $(date -u +%FT%TZ)" | tee "$logs/run.log"
start=$(date +%s)
(cd "$work/repo" && /usr/bin/time -v "$@") >>"$logs/run.log" 2>&1
echo "cold-run: $* took $(( $(date +%s) - start )) s, end $(date -u +%FT%TZ)" | tee -a "$logs/run.log"
