# Sourced: the storage lab's pinned inputs (the cache is keyed by them).
SL_KVER=${SL_KVER:-6.1.0-57-cloud-amd64}
SL_DRBD=9.3.3
SL_CACHE=${SL_CACHE:-$HOME/.cache/ucm/storage-lab}
# DRBD's source: the read-only reference tree next to the clone (../shared), else the
# workplace's /work/shared; SL_DRBD_SRC overrides. Only read when the cached modules are missing.
if [[ -z ${SL_DRBD_SRC:-} ]]; then
  for d in "$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/shared" /work/shared; do
    SL_DRBD_SRC=$d/reference/drbd-$SL_DRBD
    [[ -d $SL_DRBD_SRC ]] && break
  done
fi
