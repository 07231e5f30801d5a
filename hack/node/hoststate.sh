# What the local node may leave on the host, and a comparison of two snapshots of it: shared by
# `make node-check` (hack/node/check.sh) and `make run`'s teardown check (hack/demo/check.sh).
# Sourced, not run; the caller sets root, name (the node's name) and state (its directory).

# Values that move on their own (counters, entropy, the last PID) are not state we could leave.
host_volatile='^(fs\.(dentry-state|file-nr|inode-nr|inode-state|aio-nr|quota\.)|kernel\.(random\.|ns_last_pid|pty\.nr|sched_domain)|net\.netfilter\.nf_conntrack_count|vm\.(stat|nr_)|kernel\.(keys\.(gc_delay)|tainted))'

# host_snapshot DIR: sysctls, mounts, network namespaces, links, cgroups, PIDs and the files
# where containerd, CNI and kubelet keep things by default (the node is configured not to).
host_snapshot() {
  mkdir -p "$1"
  sysctl -a 2>/dev/null | grep -Ev "$host_volatile" | sort >"$1/sysctl"
  awk '{print $5}' /proc/self/mountinfo | sort >"$1/mounts"
  ip netns list 2>/dev/null | awk '{print $1}' | sort >"$1/netns"
  ip -o link | awk -F': ' '{print $2}' | sort >"$1/links"
  find /sys/fs/cgroup -maxdepth 2 -type d | sort >"$1/cgroups"
  ls /proc | grep -E '^[0-9]+$' | sort >"$1/pids"
  { find /run/containerd /run/netns /var/lib/cni /var/lib/kubelet /var/lib/containerd /etc/cni \
    /run/lvm /var/lib/drbd /run/ucm-snapshot-agent /var/log/pods /var/log/containers /var/lib/ucm-node-volumes /var/lib/miroir \
    -maxdepth 3 2>/dev/null || true; } | sort >"$1/files"
}

# host_compare BEFORE AFTER PREFIX: prints to stderr what the node left behind between the two
# snapshots (PREFIX starts each line); fails when anything was.
host_compare() {
  local before=$1 after=$2 prefix=$3 status=0 changed pid exe leaked
  report() { # WHAT FILE FILTER
    local new
    new=$(comm -13 "$before/$2" "$after/$2" | grep -E "$3" || true)
    if [ -n "$new" ]; then
      echo "$prefix: FAIL: $1 left behind:" >&2
      echo "$new" | sed 's/^/  /' >&2
      status=1
    fi
  }
  changed=$(diff "$before/sysctl" "$after/sysctl" || true)
  if [ -n "$changed" ]; then
    echo "$prefix: FAIL: sysctls changed:" >&2
    echo "$changed" >&2
    status=1
  fi
  # Other developers share this machine: only what the node could have made counts.
  report "mounts" mounts "^$state/|^/run/netns/|^/run/containerd|/kubelet"
  report "network namespaces" netns "."
  report "links" links "^$name-h|^cni0|^veth"
  report "cgroups" cgroups "/$name\$|kubepods"
  # Processes: any new PID still alive whose cgroup or executable belongs to the node.
  for pid in $(comm -13 "$before/pids" "$after/pids"); do
    [ -d "/proc/$pid" ] || continue
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null || true)
    # Only this worktree's binaries, the runtime's, or anything in the node's cgroup: other
    # developers' control planes (their own e2e/bin/kharness) are not ours.
    case "$exe" in
    "$root"/e2e/bin/* | /usr/bin/containerd* | */runc | "$state"/*) leaked=1 ;;
    *) if grep -qE ":/$name(/|\$)" "/proc/$pid/cgroup" 2>/dev/null; then leaked=1; else leaked=0; fi ;;
    esac
    if [ "$leaked" = 1 ]; then
      echo "$prefix: FAIL: process left behind: $pid $exe" >&2
      status=1
    fi
  done
  if [ -e "$state" ]; then
    echo "$prefix: FAIL: $state still exists" >&2
    status=1
  fi
  report "files" files "."
  return $status
}
