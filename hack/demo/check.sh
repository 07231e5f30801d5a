#!/usr/bin/env bash
# `make test`'s check of `make run` on the local node, run and ended as a user does: the node part
# (hack/demo/run-node.sh) with its output piped into tee, as in `make run 2>&1 | tee run.log`;
# once the banner is up, the jmp commands it printed run unchanged from this host; then Ctrl-C,
# which the terminal sends to the whole foreground process group, tee included. The teardown
# must still run with its reader gone: the host ends as it began (hack/node/hoststate.sh), no
# process, mount, namespace, link, cgroup, file or sysctl of the node left. Needs root.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
name=${UCM_NODE_NAME:-ucm-node}
state=${UCM_NODE_DIR:-$root/.run/node}
. hack/node/hoststate.sh
. hack/demo/lib.sh
snap=$(mktemp -d)
log=$snap/run.log
pgid=""
cleanup() {
  [ -z "$pgid" ] || kill -KILL -- "-$pgid" 2>/dev/null || true
  rm -rf "$snap"
}
trap cleanup EXIT
fail() {
  echo "run-check: FAIL: $*" >&2
  echo "run-check: the run's output:" >&2
  sed 's/^/    /' "$log" >&2 || true
  hack/node/node.sh down >/dev/null 2>&1 || true
  exit 1
}

# The host as it was before make run: one node per machine, so one already up (another checkout's,
# or `make node`) would be part of "before" and taken down by the run; say so instead.
if ip link show "$name-h" >/dev/null 2>&1 || [ -e "/run/netns/$name" ]; then
  echo "run-check: FAIL: a node ($name) is already up on this machine: 'make node-down' in its checkout first" >&2
  exit 1
fi
host_snapshot "$snap/before"
t0=$SECONDS
# Job control puts the run in a process group of its own, as a terminal's foreground job is, and
# leaves SIGINT to it (without it, a background job starts with SIGINT ignored, which no trap can
# undo). tee's own output is not needed: the log is what the user would read. A terminal's job
# starts with SIGINT and SIGHUP at their defaults, but this check may itself have been started
# with them ignored (`cmd &` in a script without job control: a CI wrapper, nohup), which `set -m`
# does not undo, and a shell cannot trap a signal ignored on entry: the run would never see the
# Ctrl-C. Reset them, as a terminal would.
set -m
env --default-signal=INT,HUP,PIPE,TERM bash -c 'hack/demo/run-node.sh 2>&1 | tee "$1" >/dev/null' run-check "$log" </dev/null &
pid=$!
set +m
pgid=$pid
until grep -q '^ucm is running on node' "$log" 2>/dev/null; do
  kill -0 "$pid" 2>/dev/null || fail "make run's node part ended before its banner"
  ((SECONDS - t0 < 900)) || fail "no banner after 900 s"
  sleep 1
done
echo "run-check: banner after $((SECONDS - t0)) s"
out=$(jmp_check .run/jumpstarter) || fail "the printed jmp commands failed: $out"
grep -h 'voltage=' <<<"$out"
echo "run-check: the printed jmp commands worked from this host"

# Ctrl-C: SIGINT to the whole group. tee dies at once; the script's teardown writes to a pipe
# with no reader and must carry on regardless.
t1=$SECONDS
kill -INT -- "-$pgid"
while kill -0 "$pid" 2>/dev/null; do
  ((SECONDS - t1 < 180)) || fail "make run still running 180 s after Ctrl-C"
  sleep 0.5
done
rc=0
wait "$pid" || rc=$?
pgid=""
echo "run-check: Ctrl-C with the output piped into tee: the run ended (exit $rc) after $((SECONDS - t1)) s"
grep -q 'down after' .run/logs/node-down.log 2>/dev/null || fail "the node's teardown did not finish (.run/logs/node-down.log)"
host_snapshot "$snap/after"
host_compare "$snap/before" "$snap/after" run-check || fail "the teardown left the above behind"
echo "run-check: OK, make run's teardown ran with its reader gone; nothing left behind ($((SECONDS - t0)) s)"
