#!/usr/bin/env bash
# Idempotent single-node Slurm (munged + slurmctld + slurmd) for CI: Debian 12, root, no systemd.
# Used by tests/cluster/test_slurm.py (its session fixture runs it and stops the daemons it started).
# State/spool/logs/pids live under $SLURM_CI_DIR. Exits non-zero on any failure.
set -euo pipefail
D=${SLURM_CI_DIR:-/tmp/slurm-ci}
H=$(hostname -s)
die() { echo "setup_slurm: ERROR: $*" >&2; tail -n 20 "$D"/log/*.log /var/log/munge/munged.log 2>/dev/null >&2 || true; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
retry() { local n=$1; shift; for _ in $(seq "$n"); do "$@" && return 0; sleep 0.2; done; return 1; }  # n*0.2s+
ctld_up() { alive "$D"/slurmctld.pid && timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_ok() { timeout 5 sinfo -h -n "$H" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
t0=$(date +%s)

# 1. packages (Debian 12: slurm 22.05.8, munge 0.5.15)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null || die "apt-get install failed"
fi

# 2. munge (postinst normally creates the key; policy-rc.d blocks service start, so start munged by hand)
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge; chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --force || die "munged failed to start"
  retry 50 bash -c 'munge -n | unmunge >/dev/null 2>&1' || die "munge credential round-trip failed"
fi

# 3. slurm.conf (no cgroups, no accounting, fast scheduling/requeue for tests)
mkdir -p "$D"/state "$D"/spool "$D"/log /etc/slurm
MEM=$(awk '/MemTotal/ {printf "%d", $2/1024*0.9}' /proc/meminfo)
NEW=$(cat <<EOF
ClusterName=ci
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,batch_sched_delay=0,sched_interval=1
ReturnToService=2
KillWait=10
RequeueExit=85
MinJobAge=300
MaxArraySize=10001
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
NodeName=$H NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
RESTART=0
if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$NEW" ]; then echo "$NEW" > /etc/slurm/slurm.conf; RESTART=1; fi
if [ $RESTART = 1 ]; then for p in "$D"/slurmd.pid "$D"/slurmctld.pid; do
  alive "$p" && { pid=$(cat "$p"); kill "$pid"; for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done; }; done; fi

# 4. daemons (they fork into the background and write pidfiles)
alive "$D"/slurmctld.pid || slurmctld || die "slurmctld failed to start"
retry 100 ctld_up || die "slurmctld not responding (port 6817 taken? see log)"
alive "$D"/slurmd.pid || slurmd || die "slurmd failed to start"
retry 100 node_ok || die "node $H not usable: $(timeout 5 sinfo -h -N -o '%N %T %E')"

# 5. smoke test
timeout 60 srun -N1 -n1 -t1 true || die "srun smoke test failed"
echo "setup_slurm: OK node=$H cpus=$(nproc) mem=${MEM}M in $(( $(date +%s) - t0 ))s; ctld=$(cat "$D"/slurmctld.pid) slurmd=$(cat "$D"/slurmd.pid)"
