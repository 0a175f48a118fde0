#!/bin/sh
# fi_info finds the provider (FI_PROVIDER_PATH set by ctest), lists it with
# an RDM endpoint and lists its FI_IVSHM_* variables.
set -eu
FI_INFO=$1
out=$("$FI_INFO" -p ivshm 2>&1) || { echo "$out"; echo "fi_info -p ivshm failed"; exit 1; }
echo "$out" | grep -aq "provider: ivshm" || { echo "$out"; echo "ivshm not listed"; exit 1; }
echo "$out" | grep -aq "FI_EP_RDM" || { echo "$out"; echo "no RDM endpoint"; exit 1; }
vars=$("$FI_INFO" -e 2>&1)
for v in FI_IVSHM_REGION FI_IVSHM_SOCKET FI_IVSHM_CORE FI_IVSHM_REPORT \
         FI_IVSHM_PEER_ANSWER_BYTES FI_IVSHM_PEER_QUEUE \
         FI_IVSHM_PEER_UNEXPECTED_BYTES; do
    echo "$vars" | grep -aq "$v" || { echo "$v not listed by fi_info -e"; exit 1; }
done
echo "fi_info: ivshm listed, variables defined"
