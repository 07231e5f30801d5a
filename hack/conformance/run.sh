#!/usr/bin/env bash
# `make conformance`: Jumpstarter's own e2e suite (v0.9.0, unmodified, from
# ../shared/conformance/jumpstarter-e2e-v0.9.0) against ucm's exporter feature and `ucm router`.
#
#   hack/conformance/run.sh [LANE...]     # default: every lane
#   lanes: core hooks auth-logging direct-listener dut-network old-client old-controller
#
# What upstream's setup-e2e.sh builds with kind, Helm and its operator is built here from local
# processes, in new network, mount and PID namespaces (unshare) so nothing leaks to the host:
#   - the project's local control plane (e2e/bin/kharness serve --with-kcm), also on
#     127.0.0.1:443 so dex reaches the ServiceAccount issuer https://kubernetes.default.svc.cluster.local;
#   - dex (e2e/bin/dex, built from the shared source) with dex.values.yaml's `config:` as written
#     except `storage: memory` and `web.https: 127.0.0.1:5556`, on openssl certificates;
#   - `ucm manager` (exporter feature only) in namespace jumpstarter-lab, gRPC on :8082 and login
#     on :8086, with the `jumpstarter-controller` ConfigMap upstream's values.kind.yaml describes,
#     and `ucm router` on :8083, one certificate from the same CA for both;
#   - the ConfigMap jumpstarter-service-ca-cert the operator would publish (the CA);
#   - jmp 0.9.0 (and 0.7.4 for old-client) from PyPI (hack/conformance/venv.sh);
#   - a private /etc (hosts entries for dex/grpc/router/login, /etc/jumpstarter/exporters,
#     /etc/dex/tls), /run, /tmp and $HOME, so the suite's pkill sees only its own processes.
# Each lane runs the suite's test binary (go test -c of its test/ package) with
# -ginkgo.label-filter=<lane>; the counts come from Ginkgo's JSON report.
#
# Logs and reports stay in .run/conformance/ (controller.log, router.log, dex.log, <lane>.log,
# <lane>.json, the exporters' logs); everything else is removed, nothing is left running.
# Environment: UCM (the ucm binary; default $CARGO_TARGET_DIR/debug/ucm),
# UCM_CONFORMANCE_SRC (default ../shared/conformance), UCM_CONFORMANCE_KEEP=1 keeps the work dir,
# UCM_CONFORMANCE_SKIP=<regexp> passes -ginkgo.skip (specs so skipped count as skipped),
# COMPAT_CLIENT_VERSION (upstream's name; default 0.7.4) the old-client lane's jmp from PyPI.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/hack/conformance
all_lanes=(core hooks auth-logging direct-listener dut-network old-client old-controller)

# Lanes that need an old controller release: upstream installs v0.8.1 with its operator from the
# GitHub release assets into kind. Neither a container runtime nor that download exists here.
skip_reason() {
  case $1 in
  old-controller) echo "needs an old Jumpstarter controller release (v0.8.1, installed by upstream from its GitHub operator-installer.yaml into a kind cluster): no container runtime and no download besides the package registries here" ;;
  *) return 1 ;;
  esac
}

if [[ ${1:-} != --inside ]]; then
  # ---- on the host: prerequisites, then the same script inside new namespaces ----
  lanes=("$@")
  ((${#lanes[@]})) || lanes=("${all_lanes[@]}")
  for l in "${lanes[@]}"; do
    [[ " ${all_lanes[*]} " == *" $l "* ]] || { echo "unknown lane '$l'; lanes: ${all_lanes[*]}" >&2; exit 2; }
  done
  [ "$(id -u)" -eq 0 ] || { echo "make conformance needs root (namespaces, mounts, the dut-network lane)" >&2; exit 1; }
  "$root/hack/build/host-deps.sh" conformance
  src=${UCM_CONFORMANCE_SRC:-$(cd "$root/.." && pwd)/shared/conformance}
  ucm=${UCM:-${CARGO_TARGET_DIR:-$root/target}/debug/ucm}
  for f in "$root/e2e/bin/kharness" "$root/e2e/bin/kubectl" "$root/e2e/bin/dex" \
    "$root/e2e/bin/jumpstarter-e2e.test" "$ucm"; do
    [ -x "$f" ] || { echo "missing $f: run this through 'make conformance'" >&2; exit 1; }
  done
  [ -d "$src/jumpstarter-e2e-v0.9.0/exporters" ] || { echo "no suite at $src/jumpstarter-e2e-v0.9.0" >&2; exit 1; }
  venv=$("$here/venv.sh" 0.9.0)
  old_venv=""
  # The old client's version as upstream's compat/setup.sh names it (its default: 0.7.4).
  [[ " ${lanes[*]} " == *" old-client "* ]] && old_venv=$("$here/venv.sh" "${COMPAT_CLIENT_VERSION:-0.7.4}")
  logs=$root/.run/conformance
  rm -rf "$logs"
  mkdir -p "$logs"
  work=$(mktemp -d /var/tmp/ucm-conformance-XXXXXX)
  # A copy, so a build into the shared target directory during the run cannot swap it.
  cp "$ucm" "$work/ucm"
  ucm=$work/ucm
  cleanup() {
    if [ -n "${UCM_CONFORMANCE_KEEP:-}" ]; then echo "work directory kept: $work"; else rm -rf "$work"; fi
  }
  trap cleanup EXIT
  # PID 1 of the new PID namespace is the inner script: when it exits, the kernel kills every
  # process left in the namespace, and the mounts and the network namespace go with it.
  rc=0
  env UCM_CONF_ROOT="$root" UCM_CONF_SRC="$src" UCM_CONF_UCM="$ucm" UCM_CONF_VENV="$venv" \
    UCM_CONF_OLD_VENV="$old_venv" UCM_CONF_LOGS="$logs" UCM_CONF_WORK="$work" \
    unshare --net --mount --pid --fork --mount-proc --propagation private --kill-child \
    "$0" --inside "${lanes[@]}" || rc=$?
  exit "$rc"
fi

# ---- inside the namespaces (PID 1) ----
shift
lanes=("$@")
root=$UCM_CONF_ROOT
suite=$UCM_CONF_SRC/jumpstarter-e2e-v0.9.0
work=$UCM_CONF_WORK
logs=$UCM_CONF_LOGS
ns=jumpstarter-lab
base=jumpstarter.127.0.0.1.nip.io
grpc_ep=grpc.$base:8082
router_ep=router.$base:8083
login_ep=login.$base:8086
dex_host=dex.dex.svc.cluster.local
bin=$root/e2e/bin
py=$UCM_CONF_VENV/bin/python # has PyYAML (a jumpstarter dependency)
t0=$(date +%s)
say() { printf '[conformance %4ss] %s\n' "$(($(date +%s) - t0))" "$*"; }

pids=()
stop_all() {
  set +e
  trap - EXIT INT TERM
  # Newest first: router, manager, dex, the API forward, then the control plane.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null; done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    for _ in $(seq 100); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "${pids[i]}" 2>/dev/null
    wait "${pids[i]}" 2>/dev/null
  done
  # Whatever a lane left behind (exporters, dnsmasq) dies with this PID namespace.
  [ -d /tmp/e2e-logs ] && cp -r /tmp/e2e-logs "$logs/" 2>/dev/null
}
trap 'stop_all' EXIT
trap 'say "interrupted"; exit 130' INT TERM

fail() {
  echo "conformance setup failed: $*" >&2
  for f in harness dex controller router; do
    [ -s "$logs/$f.log" ] && { echo "---- last lines of $f.log ----" >&2; tail -n 30 "$logs/$f.log" >&2; }
  done
  exit 1
}

# wait_for <what> <seconds> <command...>: polls until the command succeeds.
wait_for() {
  local what=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    (($(date +%s) - start < limit)) || fail "$what not ready after ${limit}s"
    sleep 0.3
  done
}

# ---- private filesystem: /etc, /run (ip netns) and /tmp; loopback up ----
ip link set lo up
for d in etc run; do
  mkdir -p "$work/$d/upper" "$work/$d/work"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$work/$d/upper,workdir=$work/$d/work" "/$d"
done
mkdir -p "$work/tmp"
mount --bind "$work/tmp" /tmp
chmod 1777 /tmp
{
  grep -v -e "$dex_host" -e "$base" /etc/hosts || true
  echo "127.0.0.1 $dex_host grpc.$base router.$base login.$base kubernetes.default.svc.cluster.local"
} >"$work/hosts"
cat "$work/hosts" >/etc/hosts
rm -rf /etc/jumpstarter && mkdir -p /etc/jumpstarter/exporters

# ---- certificates (openssl; the names of upstream's cfssl ones: ca.pem, server.pem) ----
pki=$work/pki
mkdir -p "$pki"
(
  cd "$pki"
  key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
  key ca-key.pem
  openssl req -x509 -new -key ca-key.pem -days 7 -subj "/C=US/ST=CA/L=San Francisco/CN=example.net" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem 2>/dev/null
  # leaf <name> <CN> <SANs>
  leaf() {
    key "$1-key.pem"
    openssl req -new -key "$1-key.pem" -subj "/C=US/ST=CA/L=San Francisco/CN=$2" -out "$1.csr" 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' "$3" >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 7 \
      -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  }
  leaf server "$dex_host" "DNS:$dex_host"
  leaf jumpstarter "grpc.$base" "DNS:grpc.$base,DNS:router.$base,DNS:login.$base,DNS:localhost,IP:127.0.0.1"
) || fail "openssl"
mkdir -p /etc/dex/tls
cp "$pki/server.pem" /etc/dex/tls/tls.crt
cp "$pki/server-key.pem" /etc/dex/tls/tls.key

# ---- the local control plane ----
say "starting the local control plane"
# shellcheck source=hack/lib/controlplane.sh
source "$root/hack/lib/controlplane.sh"
controlplane_start "$work/cluster" "$work/ready" "$logs/harness.log"
pids+=("$controlplane_pid")
controlplane_wait || fail "the control plane is not ready"
export KUBECONFIG=$controlplane_kubeconfig
kc() { "$bin/kubectl" "$@"; }
api_port=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["apiserver"])' "$work/cluster/ports.json")
# dex's kubernetes connector discovers https://kubernetes.default.svc.cluster.local (port 443).
"$bin/kharness" forward --netns /proc/self/ns/net --listen 127.0.0.1:443 --to "127.0.0.1:$api_port" \
  2>"$logs/forward.log" &
pids+=($!)
# Its rootCAs path as written in dex.values.yaml (a Pod's ServiceAccount mount), in the private /run.
mkdir -p /run/secrets/kubernetes.io/serviceaccount
cp "$work/cluster/pki/ca.crt" /run/secrets/kubernetes.io/serviceaccount/ca.crt

kc apply --server-side --field-manager=ucm-conformance -f "$root/crds/" >/dev/null
kc wait --for condition=established --timeout=60s -f "$root/crds/" >/dev/null
kc create namespace "$ns" >/dev/null
# As setup-e2e.sh: anonymous OIDC discovery for dex, and the suite's ServiceAccounts.
kc create clusterrolebinding oidc-reviewer --clusterrole=system:service-account-issuer-discovery \
  --group=system:unauthenticated >/dev/null
kc -n "$ns" create sa test-client-sa >/dev/null
kc -n "$ns" create sa test-exporter-sa >/dev/null
# The operator publishes the CA of the controller's certificates; `jmp admin create --save` reads it.
kc -n "$ns" create configmap jumpstarter-service-ca-cert --from-file=ca.crt="$pki/ca.pem" >/dev/null
# values.kind.yaml's controller config, with the CA injected as setup-e2e.sh does, plus what the
# operator adds from its Jumpstarter CR (internal prefix, ServiceAccount tokens).
"$py" - "$pki/ca.pem" >"$work/controller-config.yaml" <<'PY'
import json, sys
ca = open(sys.argv[1]).read()
config = {
    "authentication": {
        "internal": {"prefix": "internal:"},
        "k8s": {"enabled": True},
        "jwt": [{
            "issuer": {"url": "https://dex.dex.svc.cluster.local:5556", "audiences": ["jumpstarter-cli"],
                       "audienceMatchPolicy": "MatchAny", "certificateAuthority": ca},
            "claimMappings": {"username": {"claim": "name", "prefix": "dex:"}},
        }],
    },
    "provisioning": {"enabled": True},
}
print(json.dumps(config, indent=2))  # JSON is YAML
PY
kc -n "$ns" create configmap jumpstarter-controller --from-file=config="$work/controller-config.yaml" >/dev/null

# ---- dex ----
say "starting dex"
"$py" - "$suite/dex.values.yaml" >"$work/dex.yaml" <<'PY'
import json, sys, yaml
config = yaml.safe_load(open(sys.argv[1]))["config"]
config["storage"] = {"type": "memory"}
config["web"]["https"] = "127.0.0.1:5556"
print(json.dumps(config, indent=2))
PY
"$bin/dex" serve "$work/dex.yaml" >"$logs/dex.log" 2>&1 &
pids+=($!)
wait_for "dex" 60 curl -sf --cacert "$pki/ca.pem" "https://$dex_host:5556/.well-known/openid-configuration"

# ---- ucm: the manager (exporter feature) and the router ----
say "starting ucm manager and ucm router"
cert=$(cat "$pki/jumpstarter.pem")
key=$(cat "$pki/jumpstarter-key.pem")
EXTERNAL_CERT_PEM=$cert EXTERNAL_KEY_PEM=$key CA_BUNDLE_PEM=$(cat "$pki/ca.pem") \
  "$UCM_CONF_UCM" manager --namespace "$ns" --leader-elect=false --log-format=json \
  --enable-snapshot=false --enable-vmexport=false \
  --metrics-bind-address=127.0.0.1:8080 --health-probe-bind-address=127.0.0.1:8081 \
  --exporter-grpc-bind-address=127.0.0.1:8082 --exporter-grpc-endpoint="$grpc_ep" \
  --exporter-router-endpoint="$router_ep" --exporter-login-bind-address=127.0.0.1:8086 \
  >"$logs/controller.log" 2>&1 &
pids+=($!)
EXTERNAL_CERT_PEM=$cert EXTERNAL_KEY_PEM=$key \
  "$UCM_CONF_UCM" router --namespace "$ns" --bind-address=127.0.0.1:8083 --endpoint="$router_ep" \
  --health-probe-bind-address=127.0.0.1:8087 \
  --log-format=json >"$logs/router.log" 2>&1 &
pids+=($!)
wait_for "ucm manager" 120 curl -sf http://127.0.0.1:8081/readyz
wait_for "the controller gRPC port" 60 nc -z 127.0.0.1 8082
wait_for "ucm router" 60 nc -z 127.0.0.1 8083
wait_for "the login service" 30 curl -sf "http://$login_ep/v1/auth/config"
say "ready"

# ---- the suite's environment (what run-e2e.sh and its .e2e-setup-complete export) ----
mkdir -p "$work/bin" "$work/repo"
ln -s "$suite" "$work/repo/e2e" # REPO_ROOT/e2e/exporters/*.yaml: read only
cp "$root/hack/conformance/kubectl" "$work/bin/kubectl"
export UCM_CONFORMANCE_KUBECTL=$bin/kubectl UCM_CONFORMANCE_LOGS=$logs
export E2E_TEST_NS=$ns ENDPOINT=$grpc_ep LOGIN_ENDPOINT=$login_ep REPO_ROOT=$work/repo
export SSL_CERT_FILE=$pki/ca.pem REQUESTS_CA_BUNDLE=$pki/ca.pem JUMPSTARTER_GRPC_INSECURE=1
export PYTHON_VENV=$UCM_CONF_VENV VIRTUAL_ENV=$UCM_CONF_VENV
export PATH=$work/bin:$UCM_CONF_VENV/bin:$PATH
unset JMP_CLIENT JMP_EXPORTER JMP_NAMESPACE JMP_NAME JMP_ENDPOINT JMP_TOKEN JMP_DRIVERS_ALLOW

total_p=0 total_f=0 total_s=0 summary=()
for lane in "${lanes[@]}"; do
  if reason=$(skip_reason "$lane"); then
    say "lane $lane: SKIPPED: $reason"
    summary+=("$(printf '%-16s skipped as a lane: %s' "$lane" "$reason")")
    continue
  fi
  # A fresh HOME per lane (clients' and exporters' user configs), as upstream's separate jobs.
  home=$work/home-$lane
  mkdir -p "$home"
  extra=()
  skip=()
  [ -n "${UCM_CONFORMANCE_SKIP:-}" ] && skip=(-ginkgo.skip="$UCM_CONFORMANCE_SKIP")
  [ "$lane" = old-client ] && extra=(PYTHON_OLD_VENV="$UCM_CONF_OLD_VENV")
  say "lane $lane: running"
  start=$(date +%s)
  (
    cd "$home"
    env HOME="$home" E2E_EXPORTER_LOG_DIR="$logs/exporters-$lane" ${extra[@]+"${extra[@]}"} \
      "$bin/jumpstarter-e2e.test" -test.v -test.timeout=0 \
      -ginkgo.label-filter="$lane" -ginkgo.v -ginkgo.show-node-events -ginkgo.trace \
      -ginkgo.timeout=30m -ginkgo.no-color -ginkgo.json-report="$logs/$lane.json" ${skip[@]+"${skip[@]}"}
  ) >"$logs/$lane.log" 2>&1 || true
  secs=$(($(date +%s) - start))
  mapfile -t counted < <("$py" "$root/hack/conformance/count.py" "$logs/$lane.json" "$lane")
  read -r p f s <<<"${counted[0]}"
  if ((p + f + s == 0)); then
    f=1 # no spec ran: the binary failed before Ginkgo did
    counted+=("FAILED  no spec of lane $lane ran; see $logs/$lane.log")
  fi
  total_p=$((total_p + p)) total_f=$((total_f + f)) total_s=$((total_s + s))
  say "lane $lane: $p passed, $f failed, $s skipped in $((secs / 60))m$((secs % 60))s (log: .run/conformance/$lane.log)"
  summary+=("$(printf '%-16s %3d passed, %3d failed, %3d skipped  %dm%02ds' "$lane" "$p" "$f" "$s" $((secs / 60)) $((secs % 60)))")
  for n in "${counted[@]:1}"; do summary+=("    $n"); done
done

echo
echo "==== conformance: Jumpstarter e2e v0.9.0 against ucm ($(($(date +%s) - t0))s in all) ===="
printf '%s\n' "${summary[@]}"
echo "logs: $logs"
echo "conformance: $total_p passed, $total_f failed, $total_s skipped"
((total_f == 0))
