#!/bin/sh
# mkdeb.sh NATIVE_BUILD OUT_DIR VERSION
#
# Builds ivcloud-guest_VERSION_amd64.deb, ivcloud-host_VERSION_amd64.deb and
# python3-micromag_VERSION_all.deb with dpkg-deb from a release build of
# native/ (cmake) and the Python packages (ivcloud, micromag) of this tree. No debian/ source tree, no debhelper: the
# packages are staged here file by file, so what they hold is exactly
# what this script lists (see docs/vm.md, "Packages").
set -eu

[ $# -eq 3 ] || { echo "usage: mkdeb.sh NATIVE_BUILD OUT_DIR VERSION" >&2; exit 2; }
BUILD=$(cd "$1" && pwd)
OUT=$2
VERSION=$3
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/.." && pwd)
ARCH=amd64
MA=x86_64-linux-gnu
OMPI_COMPONENTS=usr/lib/$MA/openmpi/lib/openmpi3
MAINT="ivcloud maintainers <ivcloud@example.org>"

case "$VERSION" in
    [0-9]*) ;;
    *) echo "mkdeb.sh: bad version '$VERSION'" >&2; exit 2;;
esac
for f in libivshm.so.1.0.0 ivshmem-server guest/ivshm-guest guest/ivshm-guest-shared btl/mca_btl_ivshmem.so provider/libivshm-fi.so; do
    [ -f "$BUILD/$f" ] || { echo "mkdeb.sh: $BUILD/$f missing (run make build)" >&2; exit 2; }
done
for t in dpkg-deb strip readelf chrpath; do
    command -v $t >/dev/null || { echo "mkdeb.sh: $t not found (apt-get install dpkg-dev binutils chrpath)" >&2; exit 2; }
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/ivcloud-deb.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
# reproducible timestamps in the archives
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$SRC" log -1 --format=%ct 2>/dev/null || date +%s)}
export SOURCE_DATE_EPOCH

bin() { # src dest mode: a stripped ELF
    install -D -m "$3" "$1" "$2"
    strip --strip-unneeded --remove-section=.comment --remove-section=.note "$2"
    # build-tree or Open MPI RUNPATHs: every library we need is on the
    # default search path, and the BTL is loaded into a process that
    # already has libopen-pal
    if readelf -d "$2" | grep -q 'R.*PATH'; then chrpath -d "$2" >/dev/null; fi
}

docs() { # root package summary
    d=$1/usr/share/doc/$2
    mkdir -p "$d"
    cat > "$d/copyright" <<COPY
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: ivcloud
Comment: $3

Files: *
Copyright: the ivcloud authors
License: see-upstream
 The ivcloud source tree states no licence of its own; this package is
 built from it for use inside the project's own clusters and images.
COPY
    printf '%s (%s) unstable; urgency=medium\n\n  * Built from the ivcloud tree by packaging/mkdeb.sh.\n\n -- %s  %s\n' \
        "$2" "$VERSION" "$MAINT" "$(date -u -R -d "@$SOURCE_DATE_EPOCH")" \
        | gzip -9n > "$d/changelog.gz"  # a native package: no Debian revision
}

control() { # root package depends recommends description...
    root=$1 pkg=$2 deps=$3 recs=$4; shift 4
    size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
    (cd "$root" && find . -type f ! -path './DEBIAN/*' ! -path './etc/*' -printf '%P\0' \
        | sort -z | xargs -0 -r md5sum) > "$root/DEBIAN/md5sums"
    {
        echo "Package: $pkg"
        echo "Version: $VERSION"
        echo "Architecture: $ARCH"
        echo "Maintainer: $MAINT"
        echo "Installed-Size: $size"
        echo "Depends: $deps"
        [ -z "$recs" ] || echo "Recommends: $recs"
        echo "Section: ${SECTION:-net}"
        echo "Priority: optional"
        echo "Homepage: https://localhost/ivcloud"
        for line in "$@"; do echo "$line"; done
    } > "$root/DEBIAN/control"
}

build() { # root package
    find "$1" -type d -exec chmod 0755 {} +
    find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
    dpkg-deb --root-owner-group -Zxz --build "$1" "$OUT/${2}_${VERSION}_$ARCH.deb" >/dev/null
    echo "$OUT/${2}_${VERSION}_$ARCH.deb"
}

# ---------------------------------------------------------------- guest
G=$STAGE/guest
mkdir -p "$G/DEBIAN"
bin "$BUILD/libivshm.so.1.0.0" "$G/usr/lib/$MA/libivshm.so.1.0.0" 0644
ln -s libivshm.so.1.0.0 "$G/usr/lib/$MA/libivshm.so.1"
bin "$BUILD/btl/mca_btl_ivshmem.so" "$G/$OMPI_COMPONENTS/mca_btl_ivshmem.so" 0644
# where Debian's libfabric (1.17 in Debian 12, 2.1 in 13) loads external
# providers from by itself
bin "$BUILD/provider/libivshm-fi.so" "$G/usr/lib/$MA/libfabric/libivshm-fi.so" 0644
install -D -m 0644 "$HERE/guest/profile.sh" "$G/etc/profile.d/ivcloud-guest.sh"
bin "$BUILD/guest/ivshm-guest-shared" "$G/usr/bin/ivshm-guest" 0755
install -D -m 0755 "$HERE/guest/ivshm-bind" "$G/usr/libexec/ivcloud-guest/ivshm-bind"
install -D -m 0644 "$HERE/guest/60-ivcloud-ivshmem.rules" "$G/lib/udev/rules.d/60-ivcloud-ivshmem.rules"
install -D -m 0644 "$HERE/guest/ivshm-bind@.service" "$G/lib/systemd/system/ivshm-bind@.service"
install -D -m 0644 "$HERE/guest/modprobe.conf" "$G/etc/modprobe.d/ivcloud-guest.conf"
docs "$G" ivcloud-guest "libivshm, the Open MPI ivshmem BTL and the device binding for guests"
install -m 0644 "$HERE/guest/README" "$G/usr/share/doc/ivcloud-guest/README"
for s in postinst prerm postrm triggers; do
    install -m "$( [ $s = triggers ] && echo 0644 || echo 0755 )" "$HERE/guest/$s" "$G/DEBIAN/$s"
done
printf '%s\n' /etc/modprobe.d/ivcloud-guest.conf /etc/profile.d/ivcloud-guest.sh > "$G/DEBIAN/conffiles"
echo "libivshm 1 ivcloud-guest (>= $VERSION)" > "$G/DEBIAN/shlibs"
# Debian 12 (Open MPI 4.1: the BTL) or Debian 13 (Open MPI 5: the
# provider through mtl ofi); the BTL is inert beside Open MPI 5
control "$G" ivcloud-guest \
    "libc6 (>= 2.34), libfabric1 (>= 1.17), libopenmpi3 (<< 4.2) | libopenmpi40 (>= 5.0), openmpi-bin, udev, kmod, adduser" "" \
    "Breaks: libopenmpi3 (<< 4.1)" \
    "Description: ivcloud guest: MPI over ivshmem shared memory between VMs" \
    " Installs, inside a QEMU guest with an ivshmem-doorbell device:" \
    "  - libivshm, the shared-memory message library;" \
    "  - the Open MPI 4.1 BTL component \"ivshmem\";" \
    "  - the libfabric provider \"ivshm\" (Open MPI 5, MPICH, Intel MPI);" \
    "  - ivshm-guest, a diagnostic and ping-pong tool;" \
    "  - a udev rule and unit that give every ivshmem device (1af4:1110) to" \
    "    vfio-pci (or uio_pci_generic) for group ivshm, and point Open MPI at" \
    "    it, so that a plain mpirun between guests uses the shared region;" \
    "  - a login profile that points the libfabric MPIs at the provider."
build "$G" ivcloud-guest

# ---------------------------------------------------------------- host
H=$STAGE/host
mkdir -p "$H/DEBIAN"
bin "$BUILD/ivshmem-server" "$H/usr/sbin/ivshmem-server" 0755
install -D -m 0644 "$HERE/host/ivshmem-server@.service" "$H/lib/systemd/system/ivshmem-server@.service"
install -D -m 0755 "$HERE/host/ivcloud" "$H/usr/bin/ivcloud"
# the CLI's native directory (IVCLOUD_NATIVE_DIR): a private libivshm,
# so this package and ivcloud-guest can be installed together
N=$H/usr/lib/ivcloud
bin "$BUILD/libivshm.so.1.0.0" "$N/libivshm.so" 0644
ln -s ../../sbin/ivshmem-server "$N/ivshmem-server"
bin "$BUILD/btl/mca_btl_ivshmem.so" "$N/btl/mca_btl_ivshmem.so" 0644
bin "$BUILD/btl/btl_mkregion" "$N/btl/btl_mkregion" 0755
# static: it runs in the busybox initramfs of `ivcloud vm`
bin "$BUILD/guest/ivshm-guest" "$N/guest/ivshm-guest" 0755
install -D -m 0644 "$HERE/host/lintian-overrides" "$H/usr/share/lintian/overrides/ivcloud-host"
for b in ivshm-pingpong tcp-pingpong mpi-pingpong mpi-osu mpi-halo; do
    [ ! -f "$BUILD/$b" ] || bin "$BUILD/$b" "$N/$b" 0755
done
P=$H/usr/lib/python3/dist-packages
mkdir -p "$P"
(cd "$SRC" && find ivcloud micromag -name '*.py' -printf '%p\0' | sort -z \
    | xargs -0 -I{} install -D -m 0644 {} "$P/{}")
docs "$H" ivcloud-host "ivshmem-server, its systemd unit and the ivcloud command"
install -m 0644 "$HERE/host/README" "$H/usr/share/doc/ivcloud-host/README"
for s in postinst prerm postrm; do
    install -m 0755 "$HERE/host/$s" "$H/DEBIAN/$s"
done
# it carries the solver too (`ivcloud mag`): it takes python3-micromag's
# place rather than sharing its files
control "$H" ivcloud-host "python3 (>= 3.9), libc6 (>= 2.34)" \
    "qemu-system-x86, openmpi-bin, python3-numpy" \
    "Suggests: python3-matplotlib, python3-scipy, python3-petsc4py" \
    "Provides: python3-micromag (= $VERSION)" \
    "Conflicts: python3-micromag" "Replaces: python3-micromag" \
    "Description: ivcloud host: ivshmem-server, its systemd unit and the CLI" \
    " Installs on a VM host:" \
    "  - ivshmem-server, which hands QEMU guests (ivshmem-doorbell) and" \
    "    host processes one shared region with doorbells, and a hardened" \
    "    template unit ivshmem-server@NAME.service;" \
    "  - the ivcloud command (servers, VMs, MPI launcher, benchmarks)."
build "$H" ivcloud-host

# ---------------------------------------------------------------- solver
# The micromagnetic solver alone (`python3 -m micromag run`), for machines
# without ivcloud: the guests of a VM cluster run the application
# benchmark's bar with it. Pure Python: architecture all.
ARCH=all
M=$STAGE/micromag
mkdir -p "$M/DEBIAN"
P=$M/usr/lib/python3/dist-packages
mkdir -p "$P"
(cd "$SRC" && find micromag -name '*.py' -printf '%p\0' | sort -z \
    | xargs -0 -I{} install -D -m 0644 {} "$P/{}")
docs "$M" python3-micromag "the micromagnetic finite-element solver of ivcloud"
SECTION=python control "$M" python3-micromag \
    "python3 (>= 3.11), python3-numpy, python3-scipy, python3-petsc4py, python3-mpi4py, python3-mpi4py-fft" \
    "python3-meshio, python3-matplotlib" \
    "Suggests: python3-gmsh" \
    "Description: finite-element micromagnetics on PETSc (ivcloud's solver)" \
    " LLG dynamics and energy minimisation with exchange, demagnetization" \
    " (FEM/BEM), anisotropy and Zeeman fields on tetrahedral meshes, on any" \
    " number of MPI ranks. Run a TOML problem file with" \
    " \"mpirun -np N python3 -m micromag run PROBLEM.toml --out DIR\"." \
    " meshio writes the VTU snapshots and matplotlib the <m>(t) plot; gmsh" \
    " meshes shapes that are not structured boxes."
build "$M" python3-micromag
