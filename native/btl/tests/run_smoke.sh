#!/bin/bash
# ctest btl_smoke: run tests/btl_smoke.c over a fresh region with only
# self,ivshmem (nothing else may carry the traffic), then check that
# every rank's counters show traffic through our BTL; finally the tcp
# fallback without a region.
#   run_smoke.sh COMPONENT_DIR MKREGION SMOKE_BINARY
set -u
comp_dir=$1 mkregion=$2 smoke=$3
command -v mpirun >/dev/null || { echo "btl_smoke: no mpirun, skipped"; exit 77; }
stock=$(dirname "$(find /usr/lib* -name mca_btl_vader.so -print -quit 2>/dev/null)")
[ -n "$stock" ] || { echo "btl_smoke: Open MPI components not found, skipped"; exit 77; }

region=/dev/shm/btl-smoke-$$
trap 'rm -f "$region"' EXIT
"$mkregion" "$region" || exit 1

root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
mpirun_ivshmem() { # NP ITERS MIB [MPIRUN OPTIONS...]: print the output
    local np=$1 iters=$2 mib=$3; shift 3
    timeout 180 mpirun "${root[@]}" --oversubscribe -np "$np" "$@" \
        --mca mca_base_component_path "$stock:$comp_dir" \
        --mca btl self,ivshmem --mca btl_ivshmem_region "$region" \
        --mca btl_ivshmem_verbose 1 --mca osc pt2pt "$smoke" "$iters" "$mib" 2>&1
}

fail=0
check_run() { # NP ITERS MIB [MPIRUN OPTIONS...]
    local np=$1 out
    out=$(mpirun_ivshmem "$@")
    local rc=$?
    echo "$out" | grep -E "^btl_(smoke|ivshmem):"
    if [ $rc -ne 0 ] || ! grep -q "btl_smoke: OK ($np ranks)" <<<"$out"; then
        echo "btl_smoke: FAILED with $np ranks (rc $rc)"; echo "$out" | tail -20
        fail=1; return
    fi
    local busy
    busy=$(grep -cE "^btl_ivshmem: rank [0-9]+ sent [1-9][0-9]* msgs .* received [1-9][0-9]* msgs" <<<"$out")
    if [ "$busy" -ne "$np" ]; then
        echo "btl_smoke: only $busy of $np ranks show ivshmem traffic"; fail=1
    fi
}

check_run 2 2000 64          # latency, sizes up to 64 MiB
check_run 4 200 8            # oversubscribed: ranks block between messages

# two "nodes" (different hostnames, like co-resident VMs): vader cannot
# be used between them, ivshmem still can
if [ "$(id -u)" = 0 ] && unshare --uts true 2>/dev/null; then
    check_run 2 1000 4 --host vmA:1,vmB:1 --bind-to none \
        --mca plm_rsh_agent "$(dirname "$0")/fake_rsh.sh"
else
    echo "btl_smoke: two-hostname run skipped (needs root for unshare --uts)"
fi

# no region: ivshmem disqualifies itself quietly and tcp carries it all
out=$(timeout 180 mpirun "${root[@]}" --oversubscribe -np 2 \
        --mca mca_base_component_path "$stock:$comp_dir" \
        --mca btl self,ivshmem,tcp --mca osc pt2pt "$smoke" 100 1 2>&1)
if ! grep -q "btl_smoke: OK (2 ranks)" <<<"$out" || grep -q "^btl_ivshmem" <<<"$out"; then
    echo "btl_smoke: tcp fallback without a region FAILED"; echo "$out" | tail -20; fail=1
else
    echo "btl_smoke: tcp fallback without a region OK"
fi

[ $fail = 0 ] && echo "btl_smoke: all passed"
exit $fail
