#!/bin/sh
# Stand-in for ssh as Open MPI's launch agent (--mca plm_rsh_agent), to
# test ranks that Open MPI believes are on different nodes, as in
# co-resident VMs: "fake_rsh.sh [opts] HOST CMD..." runs CMD on this
# machine in a new UTS namespace whose hostname is HOST (needs root).
while [ $# -gt 0 ]; do
    case "$1" in -*) shift ;; *) break ;; esac
done
host=$1
shift
# the rest is shell code (mpirun by absolute path prefixes "PATH=...;")
exec unshare --uts sh -c "hostname '$host' && $*"
