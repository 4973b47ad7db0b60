#!/usr/bin/env bash
# `make test`'s pytest run: two processes side by side on the machine's cores.
#   cluster lane  the tests that share the local cluster and its real node (tests/e2e, tests/cluster), in order,
#                 printed as they run: most of their time is spent waiting on pods, scrapes and autoscaler windows;
#   local lane    every other test: the CPU-bound ones (server, operator units, bench), then the operator's
#                 integration tests (tests/integration) and the e2e modules that need no real node
#                 (tests/conftest.py SIDE_E2E_FILES) on a control plane of its own without a real node
#                 (.run/pytest-side: some of them stop their API server or etcd, which the cluster lane's tests
#                 must not see); logged to .run/test-lanes/local.log and printed after the cluster lane.
# The lane is chosen by folder (tests/conftest.py marks `cluster_lane`), so every collected test runs in exactly
# one. The exit status fails when either lane fails. Arguments go to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
logs=.run/test-lanes
mkdir -p "$logs"
local_log="$logs/local.log"

# The cluster components the tests need late (monitoring, gateway, Flux, promtool, actionlint; everything of
# `localcluster.build tests` not in `tests-start`, which `make test` built first) build beside the lanes, at the
# lowest CPU priority, filling the lanes' waits (a cold run on 2 cores 63 min against 70 with every build first,
# docs/cluster.md); a test that needs one waits for it (localcluster/components.py, provided). Warm, it finds all
# built at once. The build itself must not wait for its own end: its variable is emptied. It first writes the
# folders it will make (build.plan): a build into another cache (a test's own) does not wait for it; it builds
# them in the order the lanes reach them (localcluster/components.py TESTS_LATE).
build_log="$logs/build.log"
build_status="$logs/build.status"
rm -f "$build_status" "$logs/build.plan"
(EMBEDOPS_BACKGROUND_BUILD= nice -n 19 "$PY" -m localcluster.build --beside-tests "$logs/build.plan" tests >"$build_log" 2>&1
 echo $? >"$build_status") &
build_pid=$!
export EMBEDOPS_BACKGROUND_BUILD="$PWD/$build_status"

start=$(date +%s)
EMBEDOPS_TEST_CLUSTER=pytest-side EMBEDOPS_REAL_NODE=0 \
  "$PY" -m pytest -m "not cluster_lane" "$@" >"$local_log" 2>&1 &
local_pid=$!
# a Ctrl-C or a CI timeout stops both lanes
trap 'kill "$local_pid" 2>/dev/null; pkill -P "$build_pid" 2>/dev/null; kill "$build_pid" 2>/dev/null' EXIT

"$PY" -m pytest -m cluster_lane "$@"
cluster_rc=$?
cluster_end=$(date +%s)
wait "$local_pid"
local_rc=$?
wait "$build_pid"
build_rc=$(cat "$build_status" 2>/dev/null || echo 1)
trap - EXIT

echo
echo "================ local lane (no real node; ran beside the cluster lane) ================"
cat "$local_log"
echo
echo "lanes: cluster exit $cluster_rc in $((cluster_end - start)) s, local exit $local_rc" \
     "(log $local_log), $(( $(date +%s) - start )) s in all"
if [ "$build_rc" -ne 0 ]; then
  echo "the components built beside the tests: exit $build_rc (log $build_log):"
  tail -n 20 "$build_log"
  exit "$build_rc"
fi
grep -E '^cluster-binaries: .*[0-9]+s' "$build_log" | sed 's/^/beside the tests: /'
# 5: no test selected in a lane (arguments that name one lane's tests only)
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
if ok "$cluster_rc" && ok "$local_rc" && ! { [ "$cluster_rc" -eq 5 ] && [ "$local_rc" -eq 5 ]; }; then
  exit 0
fi
[ "$cluster_rc" -ne 0 ] && [ "$cluster_rc" -ne 5 ] && exit "$cluster_rc"
[ "$local_rc" -ne 0 ] && [ "$local_rc" -ne 5 ] && exit "$local_rc"
exit 5
