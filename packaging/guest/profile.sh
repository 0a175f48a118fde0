# /etc/profile.d/ivcloud-guest.sh (ivcloud-guest): what a login shell
# needs for an MPI that speaks libfabric (Open MPI 5, MPICH, Intel MPI)
# to use the ivshm provider between co-resident guests, the way the
# Open MPI 4.1 BTL gets its defaults from openmpi-mca-params.conf
# (docs/mpi.md, "Guests"). Only where ivshm-bind bound a device.
#
# Everywhere: Debian's libfabric links libpsm_infinipath, whose library
# installs signal handlers that turn a rank's crash (SIGSEGV, abort) into
# an ordinary exit, so that its launcher would take it for a finished
# rank. A user's own choice stands.
: "${IPATH_NO_BACKTRACE:=1}"
export IPATH_NO_BACKTRACE
if [ -r /run/ivshm/ivshm.env ]; then
    while IFS='=' read -r ivcloud_k ivcloud_v; do
        case "$ivcloud_k" in
            IVSHM_BAR2) FI_IVSHM_REGION=$ivcloud_v; export FI_IVSHM_REGION;;
            IVSHM_UIO) [ -z "$ivcloud_v" ] || { FI_IVSHM_UIO_DEV=$ivcloud_v; export FI_IVSHM_UIO_DEV; };;
            IVSHM_BAR0) FI_IVSHM_BAR0=$ivcloud_v; export FI_IVSHM_BAR0;;
            IVSHM_POSITION) [ -z "$ivcloud_v" ] || { FI_IVSHM_POSITION=$ivcloud_v; export FI_IVSHM_POSITION; };;
        esac
    done < /run/ivshm/ivshm.env
    unset ivcloud_k ivcloud_v
    # the provider for every libfabric MPI (it hands peers outside the
    # region to tcp itself); a user's own choice stands
    : "${FI_PROVIDER:=ivshm}"
    # where Debian's libfabric finds it by itself; the PyPI MPIs' own
    # libfabric looks under its build prefix instead
    : "${FI_PROVIDER_PATH:=/usr/lib/x86_64-linux-gnu/libfabric}"
    # MPICH's wheel starts on UCX unless told otherwise
    : "${MPIR_CVAR_CH4_NETMOD:=ofi}"
    export FI_PROVIDER FI_PROVIDER_PATH MPIR_CVAR_CH4_NETMOD
fi
