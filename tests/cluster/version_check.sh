# Helpers shared by build.sh and its tests (tests/cluster/test_build_script.py), sourced.
#
# No pipeline here has a reader that may stop before its writer: under `set -o pipefail` a
# `cmd | head -1` fails at random when `head` exits first and `cmd` dies of SIGPIPE (status 141) while
# still writing. A command's whole output is captured first and cut with bash itself.

# check_version NAME WANT CMD...: CMD's first output line must contain WANT (a leading "v" optional).
check_version() {
  local name="$1" want="$2" out first
  shift 2
  if ! out="$("$@" 2>&1)"; then
    echo "cluster-binaries: $name: \`$*\` failed: ${out%%$'\n'*}" >&2
    return 1
  fi
  first="${out%%$'\n'*}"
  if [[ "$first" != *"${want#v}"* ]]; then
    echo "cluster-binaries: $name: \`$*\` says '$first', versions.env says $want" >&2
    return 1
  fi
}

# module_dir MODULE@VERSION: the folder `go mod download` unpacked the module into.
module_dir() {
  local json
  # outside any module (the caller's folder may hold a go.mod); on failure the JSON carries the reason
  if ! json="$(cd "${cache:-${TMPDIR:-/tmp}}" && GOFLAGS= go mod download -json "$1" 2>&1)"; then
    echo "cluster-binaries: go mod download $1: $(printf '%s' "$json" | tr -s '\n\t ' ' ')" >&2
    return 1
  fi
  printf '%s' "$json" | "${py:-python3}" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}
