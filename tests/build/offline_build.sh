#!/usr/bin/env bash
# Shows that `scripts/setup --offline PACK` builds from the pack alone: in a private mount
# namespace, every file under / of the packed development packages (headers, pkg-config and
# CMake files, the .so links, pkgconf) is covered by an empty one, so a build that reached for
# the system's copy would fail; then it sets up and builds in VRAMD_BUILD_DIR (default
# build-offline) with ccache off, checks with ldd that the executables load the pack's libraries,
# and runs the test suite (extra arguments go to ctest). The runtime libraries themselves stay
# visible (CMake links libuv1); the executables' RUNPATH must still pick the pack's.
#
#   VRAMD_PYTHON=/path/to/python tests/build/offline_build.sh PACK [ctest arguments]
# Needs root (unshare -m) and Debian's dpkg, to list the packages' files. docs/development.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[ $# -ge 1 ] || { echo "usage: VRAMD_PYTHON=PY tests/build/offline_build.sh PACK [ctest arguments]" >&2; exit 2; }
pack="$(cd "$1" && pwd)"
shift
hidden="libluajit2-5.1-dev libuv1-dev liburing-dev libhttp-parser-dev libtomlplusplus-dev libsimdjson-dev
        nlohmann-json3-dev libcli11-dev catch2 libgloo-dev zlib1g-dev pkgconf pkgconf-bin"
export VRAMD_BUILD_DIR="${VRAMD_BUILD_DIR:-build-offline}" CCACHE_DISABLE=1
exec unshare -m bash -s "$root" "$pack" "$hidden" "$@" <<'EOF'
set -euo pipefail
root="$1" pack="$2" hidden="$3"
shift 3
mount --make-rprivate /
covered=0
for package in $hidden; do
  while read -r path; do
    # Files only: a symbolic link is followed by mount, and would hide its target (a runtime library).
    if [ -f "$path" ] && [ ! -L "$path" ]; then
      mount --bind /dev/null "$path"
      covered=$((covered + 1))
    fi
  done < <(dpkg -L "$package")
done
echo "offline_build: $covered files of $(echo $hidden | wc -w) system packages covered"
[ ! -s /usr/include/uv.h ] && [ ! -s /usr/include/nlohmann/json.hpp ] || { echo "offline_build: not covered" >&2; exit 1; }
cd "$root"
scripts/setup --offline "$pack"
for exe in "$VRAMD_BUILD_DIR"/bin/vramd "$VRAMD_BUILD_DIR"/bin/vramctl "$VRAMD_BUILD_DIR"/bin/vramctl-torch; do
  for lib in libluajit-5.1 libuv liburing libhttp_parser libsimdjson; do
    where="$(ldd "$exe" | awk -v lib="$lib" 'index($1, lib) == 1 {print $3}')"
    case "$where" in
      "") ;;  # not linked by this executable
      "$root/.offline/"*) ;;
      *) echo "offline_build: $exe loads $lib from $where, not from the pack" >&2; exit 1 ;;
    esac
  done
done
echo "offline_build: vramd and vramctl load every packed library from $root/.offline"
ctest --test-dir "$VRAMD_BUILD_DIR" --output-on-failure -j2 "$@"
EOF
