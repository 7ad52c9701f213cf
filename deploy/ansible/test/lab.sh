# shellcheck shell=bash
# deploy/ansible/test/lab.sh: functions that build a lab of real systemd machines on one
# Linux host, to run the playbooks against (sourced by deploy/ansible/test/run; the
# rehearsal may source it too).
#
# Every machine is a systemd-nspawn container booted from one read-only Debian base
# (--volatile=overlay: a tmpfs over it, so several boot at once and the base is never
# written), in a network namespace of its own, joined to the others by a bridge in a
# namespace of its own. Nothing is addressed from the root namespace: the root namespace
# routes private ranges to the real network. Commands that talk to the lab run inside a
# namespace of it (lab_exec CONTROLLER ...).
#
# Each machine's systemd-nspawn starts in a cgroup of its own (the machine's name, under
# this shell's cgroup in every hierarchy systemd uses), as the rehearsal's machines do
# (deploy/rehearsal/machines.py): started from one shared cgroup, the machines' systemds
# share one system.slice on the host, and the same unit starting on one machine while it
# stops on another fails to attach to the cgroup the other just removed
# (status=219/CGROUP, seen at boot).
#
# Everything made is recorded in $LAB_DIR (namespaces, machine PIDs, cgroups), and lab_down
# removes exactly that: machines by SIGTERM to their systemd-nspawn PID, then their
# cgroups, then the namespaces.
#
# Settings (environment):
#   LAB_PREFIX  prefix of every namespace and machine name (ans); keep it apart from other labs
#   LAB_NET     the /24 the machines get their addresses in, as A.B.C (10.78.0)
#   LAB_BASE    the Debian root with systemd, sshd and python3 (/var/lib/rpcmesh-lab/base)
#   LAB_DIR     where keys, logs and the record of what was made go (a new temporary folder)

LAB_PREFIX=${LAB_PREFIX:-ans}
LAB_NET=${LAB_NET:-10.78.0}
LAB_BASE=${LAB_BASE:-/var/lib/rpcmesh-lab/base}
LAB_DIR=${LAB_DIR:-$(mktemp -d "/tmp/${LAB_PREFIX}-lab.XXXXXX")}
# How long a machine may take to reach "running" (about 10 s when the host is idle).
LAB_BOOT_TRIES=${LAB_BOOT_TRIES:-120}

lab_log() { printf '%s lab: %s\n' "$(date +%T)" "$*" >&2; }

# lab_init: the state folder and the SSH key every machine accepts for root.
lab_init() {
  mkdir -p "$LAB_DIR"
  : >>"$LAB_DIR/netns"
  : >>"$LAB_DIR/machines"
  : >>"$LAB_DIR/cgroups"
  if [ ! -f "$LAB_DIR/id_ed25519" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "${LAB_PREFIX}-lab" -f "$LAB_DIR/id_ed25519"
  fi
  install -m 0600 "$LAB_DIR/id_ed25519.pub" "$LAB_DIR/authorized_keys"
}

# lab_switch: the namespace holding the bridge every host is plugged into.
lab_switch() {
  local ns="${LAB_PREFIX}-sw"
  ip netns add "$ns"
  echo "$ns" >>"$LAB_DIR/netns"
  ip -n "$ns" link add br0 type bridge
  ip -n "$ns" link set br0 up
}

# lab_host NAME OCTET: a namespace NAME (prefixed) with eth0 at $LAB_NET.OCTET/24 on the
# bridge. The veth pair is made inside the switch namespace, never in the root one.
lab_host() {
  local name="$1" octet="$2" ns="${LAB_PREFIX}-$1" sw="${LAB_PREFIX}-sw"
  ip netns add "$ns"
  echo "$ns" >>"$LAB_DIR/netns"
  ip -n "$sw" link add "v-$name" type veth peer name eth0 netns "$ns"
  ip -n "$sw" link set "v-$name" master br0
  ip -n "$sw" link set "v-$name" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$LAB_NET.$octet/24" dev eth0
  ip -n "$ns" link set eth0 up
}

# lab_exec NAME CMD...: run CMD in host NAME's namespace (the controller's, for example).
lab_exec() {
  local ns="${LAB_PREFIX}-$1"
  shift
  ip netns exec "$ns" "$@"
}

# lab_cgroup_parents: the folders, one per line and one per hierarchy systemd uses here,
# under which a machine's own cgroup is made: this shell's cgroup in the unified hierarchy
# (cgroup v2) or, on a hybrid host, in name=systemd and in the unified one beside it.
lab_cgroup_parents() {
  local fs=/sys/fs/cgroup controllers path unified="" named=""
  while IFS=: read -r _ controllers path; do
    case "$controllers" in
      "") unified="${path#/}" ;;
      name=systemd) named="${path#/}" ;;
    esac
  done </proc/self/cgroup
  if [ -f "$fs/cgroup.controllers" ]; then
    echo "$fs/$unified"
    return
  fi
  if [ -d "$fs/systemd" ]; then echo "$fs/systemd/$named"; fi
  if [ -f "$fs/unified/cgroup.controllers" ]; then echo "$fs/unified/$unified"; fi
}

# lab_machine NAME [NSPAWN_ARG...]: boot a systemd machine in host NAME's namespace
# (lab_host first), in cgroups of its own, with the lab's key as root's authorized_keys,
# and any further systemd-nspawn arguments. Returns once systemd-nspawn is started; see
# lab_wait_running.
lab_machine() {
  local name="$1" machine="${LAB_PREFIX}-$1" parent cg
  local -a cgroups=()
  shift
  while read -r parent; do
    cg="${parent%/}/$machine"
    mkdir -p "$cg"
    echo "$cg" >>"$LAB_DIR/cgroups"
    cgroups+=("$cg")
  done < <(lab_cgroup_parents)
  (
    # This subshell enters the machine's cgroups ("0": the writer), then becomes nspawn.
    for cg in "${cgroups[@]}"; do echo 0 >"$cg/cgroup.procs"; done
    exec systemd-nspawn --quiet --register=no --keep-unit --boot \
      --directory="$LAB_BASE" --volatile=overlay --machine="$machine" \
      --network-namespace-path="/run/netns/$machine" \
      --bind-ro="$LAB_DIR/authorized_keys:/root/.ssh/authorized_keys" \
      --console=passive "$@"
  ) >"$LAB_DIR/$name.console" 2>&1 </dev/null &
  echo "$name $!" >>"$LAB_DIR/machines"
}

# lab_nspawn_pid NAME: the PID of NAME's systemd-nspawn.
lab_nspawn_pid() {
  awk -v n="$1" '$1 == n { print $2 }' "$LAB_DIR/machines" | tail -n 1
}

# lab_leader NAME: the PID of NAME's systemd (PID 1 inside), the child of systemd-nspawn.
lab_leader() {
  local pid
  pid=$(lab_nspawn_pid "$1")
  [ -n "$pid" ] || return 1
  cat "/proc/$pid/task/$pid/children" 2>/dev/null | awk '{ print $1 }'
}

# lab_in NAME CMD...: run CMD inside machine NAME (all its namespaces).
lab_in() {
  local name="$1" leader
  shift
  leader=$(lab_leader "$name")
  [ -n "$leader" ] || { lab_log "$name: no leader process"; return 1; }
  nsenter -t "$leader" -a "$@"
}

# lab_wait_running NAME: wait until NAME's systemd says running (or degraded: a unit
# failed, which the caller's checks then show) and its sshd is active.
lab_wait_running() {
  local name="$1" i state
  for ((i = 0; i < LAB_BOOT_TRIES; i++)); do
    state=$(lab_in "$name" systemctl is-system-running 2>/dev/null || true)
    case "$state" in
      running | degraded)
        if lab_in "$name" systemctl is-active --quiet ssh.service; then
          lab_log "$name: $state"
          return 0
        fi
        ;;
    esac
    sleep 0.5
  done
  lab_log "$name: not running after $LAB_BOOT_TRIES tries (last state: ${state:-none})"
  return 1
}

# lab_down: stop every machine made (SIGTERM to systemd-nspawn: the machine halts
# cleanly), then remove every namespace made, newest first.
lab_down() {
  local name pid i ns
  if [ -f "$LAB_DIR/machines" ]; then
    while read -r name pid; do
      [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && lab_log "$name: SIGTERM to $pid"
    done <"$LAB_DIR/machines"
    while read -r name pid; do
      for ((i = 0; i < 60; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
      done
      if kill -0 "$pid" 2>/dev/null; then
        lab_log "$name: still up after 30 s; SIGKILL to $pid"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    done <"$LAB_DIR/machines"
    : >"$LAB_DIR/machines"
  fi
  # The machines' cgroups, innermost first, once what is left in them is killed (they
  # hold only what their machine ran).
  if [ -f "$LAB_DIR/cgroups" ]; then
    while read -r cg; do
      [ -d "$cg" ] || continue
      find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
      for ((i = 0; i < 20; i++)); do
        find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [ -d "$cg" ] || break
        sleep 0.5
      done
      if [ -d "$cg" ]; then lab_log "cgroup $cg not removed"; else lab_log "cgroup $cg removed"; fi
    done <"$LAB_DIR/cgroups"
    : >"$LAB_DIR/cgroups"
  fi
  if [ -f "$LAB_DIR/netns" ]; then
    tac "$LAB_DIR/netns" | while read -r ns; do
      ip netns del "$ns" 2>/dev/null && lab_log "namespace $ns removed"
    done
    : >"$LAB_DIR/netns"
  fi
}
