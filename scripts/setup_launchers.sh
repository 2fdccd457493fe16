#!/usr/bin/env bash
# The launchers the tests serve under, from Debian's packages: Slurm (slurm-wlm, munge: the
# tests start a one-machine cluster, scripts/slurm_cluster.sh) and Open MPI (openmpi-bin);
# and systemd's `systemd-analyze`, which checks the example unit (examples/systemd/).
# Called by scripts/test.sh, not by scripts/setup.sh: serving (scripts/serve.sh) needs none of
# them. Idempotent (nothing happens once the commands exist).
# Installing needs root and apt-get. Without them it says what is missing and returns 0:
# the tests that need a missing tool then fail, naming it (tests/launchers.py).
set -euo pipefail
missing=()
for tool in srun slurmctld slurmd sinfo munged; do
  command -v "$tool" >/dev/null || { missing+=(slurm-wlm munge); break; }
done
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v systemd-analyze >/dev/null || missing+=(systemd)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup: not installing ${missing[*]} (needs root and apt-get); the tests that use" \
       "them (srun, mpirun, the example unit) will fail until they are installed" >&2
  exit 0
fi
echo "setup: installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; }
if ! install && ! { apt-get update -q >/dev/null 2>&1 && install; }; then
  echo "setup: apt-get could not install ${missing[*]}; the tests that use them (srun," \
       "mpirun, the example unit) will fail until they are installed" >&2
fi
