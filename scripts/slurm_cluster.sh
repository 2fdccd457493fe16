#!/usr/bin/env bash
# A one-machine Slurm cluster for the tests: munged, slurmctld and slurmd on this host, all
# state, sockets and logs in DIR, nothing in /etc touched (commands find it by SLURM_CONF).
#   bash scripts/slurm_cluster.sh start DIR   start it; prints `export SLURM_CONF=DIR/slurm.conf`
#   bash scripts/slurm_cluster.sh stop DIR    stop its daemons (and whatever job steps remain)
# Needs root (slurmd starts tasks as their user) and Debian's slurm-wlm and munge packages
# (scripts/setup_launchers.sh). ProctrackType=proctrack/linuxproc and TaskPlugin=task/none:
# no cgroups, which containers rarely delegate. The daemons' ports are chosen free at start;
# munge's key is fresh and private to DIR, so only this user's commands that read DIR's
# configuration can submit. slurmctld and slurmd listen on every interface (Slurm has no
# option to bind them to one); their RPCs need a credential signed with that key.
set -euo pipefail
cmd="${1:?usage: slurm_cluster.sh start|stop DIR}"
dir="$(mkdir -p "${2:?usage: slurm_cluster.sh start|stop DIR}" && cd "$2" && pwd)"

stop() {
  for name in slurmd slurmctld munge/munged; do
    pidfile="$dir/$name.pid"
    [ -f "$pidfile" ] || continue
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

start() {
  for tool in munged slurmctld slurmd srun sinfo; do
    command -v "$tool" >/dev/null || {
      echo "slurm_cluster: $tool not found; install slurm-wlm and munge" \
           "(bash scripts/setup_launchers.sh)" >&2
      exit 1
    }
  done
  stop
  rm -rf "$dir/state" "$dir/spool" "$dir/munge"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
  chmod 700 "$dir/munge"
  head -c 128 /dev/urandom > "$dir/munge/munge.key"
  chmod 600 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/log/munged.log" --pid-file="$dir/munge/munged.pid" \
    --seed-file="$dir/munge/munged.seed"
  host="$(hostname -s)"
  cat > "$dir/slurm.conf" <<EOF
ClusterName=keepalive
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 150); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  echo "slurm_cluster: the node did not become idle within 30 s; sinfo says:" >&2
  sinfo >&2 || true
  tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
  stop
  exit 1
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: slurm_cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
