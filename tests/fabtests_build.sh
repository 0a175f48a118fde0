#!/bin/bash
# Builds libfabric 2.1.0 and its conformance suite, fabtests, from Debian
# 13's source package of libfabric (the orig tarball, checked against the
# sha256 trixie's Sources lists), for tests/test_fabtests.py.
#
# usage: fabtests_build.sh LINK
#
# The build goes to a cache outside the clone, keyed by what goes into it
# (the tarball's sha256 and the configure flags):
# ${IVCLOUD_FABTESTS_CACHE:-/var/cache/ivcloud}/fabtests-KEY, reused as
# long as the key holds; LINK (build/fabtests) points at it. libfabric is
# built with its core alone, plus tcp and ofi_rxm, the core provider our
# provider opens for peers beyond the region (docs/provider.md); our
# provider is loaded at run time as a DL provider (FI_PROVIDER_PATH=+FILE).
# The orig tarball is a git export without configure: autoreconf makes it.
set -euo pipefail

link=$(realpath -m "${1:?usage: fabtests_build.sh LINK}")
URL=http://deb.debian.org/debian/pool/main/libf/libfabric/libfabric_2.1.0.orig.tar.xz
SHA256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df
SRC=libfabric-2.1.0
LF_FLAGS="--enable-only --enable-tcp --enable-rxm --disable-static --with-uring=no"
FT_FLAGS="--disable-efa --disable-lpp"

key=$(echo "$SHA256 $LF_FLAGS | $FT_FLAGS" | sha256sum | cut -c1-16)
cache=${IVCLOUD_FABTESTS_CACHE:-/var/cache/ivcloud}
dir=$cache/fabtests-$key

done_already() { [ -f "$dir/.done" ] && ln -sfn "$dir" "$link"; }
done_already && exit 0

mkdir -p "$cache" "$(dirname "$link")"
exec 9>"$dir.lock"
flock 9
done_already && exit 0          # another make built it meanwhile

work=$(mktemp -d "$cache/fabtests-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log=$work/build.log
echo "fabtests: building libfabric 2.1.0 and fabtests from Debian's source package into $dir"
curl -sfL --retry 3 -o "$work/src.tar.xz" "$URL" || {
  echo "fabtests: cannot download $URL (curl's exit status $?)" >&2; exit 1; }
if ! echo "$SHA256  $work/src.tar.xz" | sha256sum -c --quiet - >/dev/null 2>&1; then
  echo "fabtests: $URL has sha256 $(sha256sum < "$work/src.tar.xz" | cut -c1-64), not $SHA256" >&2
  exit 1
fi

fail() { tail -n 40 "$log" >&2; echo "fabtests: $1 failed (log above; whole log in $dir.failed.log)" >&2
         cp "$log" "$dir.failed.log"; exit 1; }
rm -rf "$dir"
tar -C "$work" -xJf "$work/src.tar.xz"
cd "$work/$SRC"
{ ./autogen.sh && ./configure --prefix="$dir" $LF_FLAGS; } >> "$log" 2>&1 || fail "libfabric's configure"
{ make -j2 && make install; } >> "$log" 2>&1 || fail "libfabric's build"
cd fabtests
# The tests find this libfabric, not Debian's (the same soname), by their rpath.
{ ./autogen.sh && ./configure --prefix="$dir" --with-libfabric="$dir" \
    LDFLAGS="-Wl,-rpath,$dir/lib -Wl,--disable-new-dtags" $FT_FLAGS; } >> "$log" 2>&1 \
  || fail "fabtests' configure"
{ make -j2 && make install; } >> "$log" 2>&1 || fail "fabtests' build"
cp "$log" "$dir/build.log"
touch "$dir/.done"
rm -f "$dir.failed.log"
ln -sfn "$dir" "$link"
echo "fabtests: built in $dir"
