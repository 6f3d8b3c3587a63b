#!/usr/bin/env bash
# Runs a test program under mpirun: NP ranks (oversubscribed: more ranks
# than cores is fine) over one transport, Open MPI's shared memory (vader)
# or TCP, and fails it if the job runs longer than a minute.
# usage: mpirun.sh NP vader|tcp BUILD_DIR PROGRAM [ARGS...]
# Skipped (77) without mpirun or without the MPI plugin.
set -u
np=$1 btl=$2 build=$3
shift 3
command -v mpirun >/dev/null || { echo "mpirun not found: skipped"; exit 77; }
[ -e "$build/libmoonrl_mpi.so" ] || { echo "moonrl built without MPI (no $build/libmoonrl_mpi.so): skipped"; exit 77; }
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# ob1 so that the BTL chosen here is the one used (UCX would take over);
# copy-in/copy-out shared memory: CMA needs ptrace rights that containers lack
exec timeout -k 5 60 mpirun --oversubscribe -np "$np" --mca pml ob1 --mca btl "$btl,self" \
  --mca btl_vader_single_copy_mechanism none --mca btl_tcp_if_include lo "$@"
