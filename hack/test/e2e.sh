#!/usr/bin/env bash
# Starts one local control plane, runs the e2e tests (the #[ignore]d ones) against it, stops it.
# The suite is one test binary (`e2e`, e2e/tests/main.rs) with a module per feature (exporter,
# snapshot, vmexport) and one for the platform under them; tests read `<area>::<module>::<test>`.
# `--test <area>` (repeatable; a module path: `exporter`, `exporter::jumpstarter`,
# `platform::faults`) runs only those tests (default: every e2e test); a name filter narrows
# them, options (e.g. --nocapture, --skip <name>) go to the test binary:
#   hack/test/e2e.sh --test exporter::jumpstarter [filter]      hack/test/e2e.sh oidc
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
root=$(cd "$(dirname "$0")/../.." && pwd)
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
      echo "no e2e area '$area'; areas: $(printf '%s\n' "${all[@]}" | sed 's/::[^:]*$//' | sort -u | tr '\n' ' ')" >&2
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
  # The platform::node tests run on the local node, under hack/node/check.sh.
  cmd=(cargo test --locked --no-fail-fast --tests -- --ignored --skip platform::node:: ${filters[@]+"${filters[@]}"})
fi
# shellcheck source=hack/lib/controlplane.sh
source "$root/hack/lib/controlplane.sh"
controlplane_up ucm-e2e
echo "control plane ready in $(( $(date +%s) - controlplane_started ))s"
"${cmd[@]}" --test-threads="${E2E_THREADS:-4}" ${options[@]+"${options[@]}"}
