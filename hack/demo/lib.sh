# Shared by `make run`'s scripts (hack/demo/make-run.sh, run.sh, run-node.sh); sourced, not run.
# The caller has cd'ed to the repository root.

# stage NAME EXPECTED CMD...: one line per stage with its expected duration; CMD's output goes to
# .run/logs/<n>-<slug>.log, and only when it fails is its tail printed (then the script exits).
stage_n=${stage_n:-0}
stage() {
  local what=$1 expect=$2 slug log t0=$SECONDS rc=0
  shift 2
  stage_n=$((stage_n + 1))
  slug=$(printf '%s' "$what" | tr -cs 'A-Za-z0-9' '-' | tr 'A-Z' 'a-z' | sed 's/^-//; s/-$//' | cut -c1-40)
  mkdir -p .run/logs
  log=.run/logs/$(printf '%02d' "$stage_n")-$slug.log
  printf '==> %s (%s) ... ' "$what" "$expect"
  # A subshell outside any `||`, so that `set -e` holds inside shell functions too.
  set +e
  (
    set -e
    "$@"
  ) >"$log" 2>&1 </dev/null
  rc=$?
  set -e
  if [ $rc -ne 0 ]; then
    echo "FAILED after $((SECONDS - t0))s (exit $rc); the last lines of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
    exit $rc
  fi
  echo "done in $((SECONDS - t0))s"
  export stage_n
}

# stage_start NAME EXPECTED CMD...: a stage run in the background, its line printed now and its
# result by stage_wait; one at a time (make run overlaps the Go programs with Cargo's build,
# docs/operations.md, "make run").
stage_start() {
  local what=$1 expect=$2 slug
  shift 2
  stage_n=$((stage_n + 1))
  slug=$(printf '%s' "$what" | tr -cs 'A-Za-z0-9' '-' | tr 'A-Z' 'a-z' | sed 's/^-//; s/-$//' | cut -c1-40)
  mkdir -p .run/logs
  bg_log=.run/logs/$(printf '%02d' "$stage_n")-$slug.log
  bg_what=$what
  bg_t0=$SECONDS
  echo "==> $what ($expect): started, alongside the next stage"
  (
    set -e
    "$@"
  ) >"$bg_log" 2>&1 </dev/null &
  bg_pid=$!
}
# stage_wait: waits for stage_start's stage; its line, or its log's tail and exit on failure.
stage_wait() {
  local rc=0
  printf '==> %s ... ' "$bg_what"
  wait "$bg_pid" || rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAILED after $((SECONDS - bg_t0))s (exit $rc); the last lines of $bg_log:"
    tail -n 40 "$bg_log" | sed 's/^/    /'
    exit $rc
  fi
  echo "done in $((SECONDS - bg_t0))s"
}

# jmp_configs DIR ENDPOINT CA_PEM CLIENT_TOKEN EXPORTER_TOKEN: the demo Client's and Exporter's
# jmp configs (tokens: readable by the owner only). The CA verifies the controller at ENDPOINT
# and the router the controller hands out (both serve certificates it issued or is).
jmp_configs() {
  local dir=$1 endpoint=$2 ca
  ca=$(printf '%s' "$3" | base64 -w0)
  mkdir -p "$dir"
  (
    umask 077
    cat >"$dir/client-dev.yaml" <<YAML
apiVersion: jumpstarter.dev/v1alpha1
kind: ClientConfig
metadata: {namespace: default, name: dev}
endpoint: $endpoint
token: $4
tls: {ca: $ca}
drivers: {allow: [], unsafe: true}
YAML
    cat >"$dir/exporter-demo.yaml" <<YAML
apiVersion: jumpstarter.dev/v1alpha1
kind: ExporterConfig
metadata: {namespace: default, name: demo}
endpoint: $endpoint
token: $5
tls: {ca: $ca}
export:
  power: {type: jumpstarter_driver_power.driver.MockPower}
YAML
  )
}

# jmp_commands DIR: the commands the banner prints, which `hack/demo/check.sh` runs unchanged.
jmp_commands() {
  cat <<TXT
cd $PWD
source "\$(hack/jumpstarter/venv.sh)/bin/activate"   # jumpstarter 0.9.0 from PyPI (first time ~3 min)
jmp run --exporter-config $1/exporter-demo.yaml &   # the demo exporter (MockPower) on this host
jmp get exporters --client-config $1/client-dev.yaml --with online,status
jmp shell --client-config $1/client-dev.yaml -l board=demo -- j power read -n 1
TXT
}

# jmp_check DIR: runs jmp_commands DIR as printed, in bash from this host, and checks that
# `j power read` printed MockPower's two readings; then stops the exporter it started.
jmp_check() {
  local out rc=0
  out=$(timeout 300 bash -euo pipefail -c "$(jmp_commands "$1")
kill -INT \$! && wait \$! || true" 2>&1) || rc=$?
  if [ $rc -ne 0 ] || ! grep -q 'voltage=5.0 V  current=2.0 A' <<<"$out"; then
    echo "the printed jmp commands failed (exit $rc):"
    echo "$out" | tail -n 60
    return 1
  fi
  echo "$out"
}

# readable_log: the manager's JSON log lines (tracing's flattened events, optionally behind
# kubectl's `[pod/NAME/CONTAINER] ` prefix) as "POD HH:MM:SS LEVEL target: message key=value",
# with the controller of the reconcile span it ran in; other lines pass through.
readable_log() {
  jq -R -r --unbuffered '
    (capture("^(\\[pod/(?<pod>[^/]*)/[^]]*\\] )?(?<json>\\{.*)$") // null) as $m
    | if $m == null then . else
        ($m.json | fromjson? // null) as $e
        | if $e == null then . else
            "\(($m.pod // "") | if . == "" then "" else .[-5:] + " " end)\($e.timestamp[11:19] // "") \($e.level // "") \($e.target // ""): \($e.message // "")"
            + (if ($e.span | type) == "object" and $e.span.controller then " controller=\($e.span.controller)" else "" end)
            + ([$e | to_entries[]
                | select(.key | IN("timestamp", "level", "target", "message", "span", "spans") | not)
                | " \(.key)=\(.value | if type == "string" then . else tojson end)"] | join(""))
          end
      end'
}
