#!/usr/bin/env bash
# Starts one local control plane, runs the e2e tests (the #[ignore]d ones) against it, stops it.
# The suite is one test binary (`e2e`, e2e/tests/main.rs) with a module per feature area.
# `--test <area>` (repeatable) runs only those areas' tests (default: every e2e test); a name
# filter narrows them, options (e.g. --nocapture, --skip <name>) go to the test binary:
#   hack/e2e.sh --test jumpstarter [filter]      hack/e2e.sh oidc
set -euo pipefail
areas=()
filters=()
options=()
while (($#)); do
  case $1 in
    --test)
      (($# >= 2)) || { echo "--test needs an area" >&2; exit 2; }
      areas+=("$2")
      shift 2
      ;;
    --skip)
      options+=("$1" "${2:?--skip needs a name}")
      shift 2
      ;;
    -*)
      options+=("$1")
      shift
      ;;
    *)
      filters+=("$1")
      shift
      ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ((${#areas[@]})); then
  # One binary, so an area is a module path: pick its tests by name (`<area>::…`, containing one
  # of the filters if any) and run exactly those.
  mapfile -t all < <(cargo test --locked --test e2e -- --ignored --list 2>/dev/null | sed -n 's/: test$//p')
  ((${#all[@]})) || { cargo test --locked --test e2e --no-run; echo "listing the e2e tests failed" >&2; exit 1; }
  names=()
  for area in "${areas[@]}"; do
    mine=()
    for t in "${all[@]}"; do
      [[ $t == "$area::"* ]] && mine+=("$t")
    done
    if ! ((${#mine[@]})); then
      echo "no e2e area '$area'; areas: $(printf '%s\n' "${all[@]}" | sed 's/::.*//' | sort -u | tr '\n' ' ')" >&2
      exit 2
    fi
    for t in "${mine[@]}"; do
      if ! ((${#filters[@]})); then
        names+=("$t")
        continue
      fi
      for f in "${filters[@]}"; do
        if [[ $t == *"$f"* ]]; then
          names+=("$t")
          break
        fi
      done
    done
  done
  if ! ((${#names[@]})); then
    echo "no test of ${areas[*]} matches ${filters[*]}" >&2
    exit 2
  fi
  cmd=(cargo test --locked --no-fail-fast --test e2e -- --ignored --exact "${names[@]}")
else
  # The node area runs on the local node, under hack/node-check.sh.
  cmd=(cargo test --locked --no-fail-fast --tests -- --ignored --skip node:: ${filters[@]+"${filters[@]}"})
fi
work=$(mktemp -d /tmp/ucm-e2e-XXXXXX)
"$root/e2e/bin/kharness" serve --dir "$work/cluster" --with-kcm --rm-dir >"$work/ready" 2>"$work/harness.log" &
pid=$!
cleanup() {
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
start=$(date +%s)
until grep -q '^READY ' "$work/ready"; do
  if ! kill -0 "$pid" 2>/dev/null || (( $(date +%s) - start > 180 )); then
    echo "the local control plane did not start; last harness log lines:" >&2
    tail -n 60 "$work/harness.log" >&2
    exit 1
  fi
  sleep 0.2
done
echo "control plane ready in $(( $(date +%s) - start ))s"
export UCM_E2E_KUBECONFIG=$(sed -n 's/^READY //p' "$work/ready")
"${cmd[@]}" --test-threads="${E2E_THREADS:-4}" ${options[@]+"${options[@]}"}
