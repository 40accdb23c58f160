#!/usr/bin/env bash
# certkv as a package (docs/packaging.md), end to end:
#  1. installs the already-built tree (its own options: -march=native, warnings, CUDA when built)
#     into a temporary prefix, then moves the prefix (the package must be relocatable);
#  2. libcertkv.so: SONAME libcertkv.so.MAJOR.MINOR, and its dynamic symbols are exactly the C API
#     functions declared in certkv/certkv.h; the installed CLI and server start from bin/ (RPATH
#     $ORIGIN/../lib);
#  3. find_package: examples/c_consumer and examples/cpp_consumer configured, built and run
#     against the prefix (cpp_consumer through certkv::cuda when the package has it); a version
#     request of another minor version and an unknown component are refused;
#  4. pkg-config: the C consumer compiled and run with `pkg-config --cflags --libs certkv`;
#  5. examples/subproject: certkv built inside another project by FetchContent (CUDA off, unoptimized
#     to be quick, -march=native on to show it stays private) and run;
# and in every consumer compile line, no -march=native, -Wall or -Wextra of certkv's.
# Every step must pass; the first failure ends the check with its output.
# usage: package_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
jobs=$(nproc)

step() { echo "== package_check: $*"; }
fail() {
  echo "package_check: FAILED: $*" >&2
  exit 1
}
# run LOG CMD...: runs CMD with its output in LOG, shown only when it fails.
run() {
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    fail "$*"
  fi
}
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
# no_private_flags COMPILE_COMMANDS.json SOURCE: SOURCE's compile line carries none of certkv's
# private flags.
no_private_flags() {
  python3 - "$1" "$2" <<'PY' || fail "certkv's private flags in the compile line of $2 ($1)"
import json, sys
lines = [e["command"] for e in json.load(open(sys.argv[1])) if e["file"].endswith(sys.argv[2])]
assert len(lines) == 1, f"{len(lines)} compile lines of {sys.argv[2]}"
leaked = [f for f in ("-march=native", "-Wall", "-Wextra") if f in lines[0].split()]
print(lines[0])
assert not leaked, f"leaked: {leaked}"
PY
}

[ "$(cache_value CERTKV_INSTALL)" = ON ] || fail "$build was configured with CERTKV_INSTALL=OFF"
compilers=(-DCMAKE_C_COMPILER="$(cache_value CMAKE_C_COMPILER)" -DCMAKE_CXX_COMPILER="$(cache_value CMAKE_CXX_COMPILER)")

step "install $build, then move the prefix"
run "$work/install.log" cmake --install "$build" --prefix "$work/staged"
mv "$work/staged" "$work/prefix"
prefix=$work/prefix
libdir=$(dirname "$(find "$prefix" -name 'libcertkv.so' -print -quit)")
[ -f "$libdir/libcertkv.so" ] || fail "no libcertkv.so under $prefix"
[ -f "$prefix/include/certkv/certkv.h" ] && [ -f "$prefix/include/certkv/certkv_export.h" ] ||
  fail "public headers missing under $prefix/include/certkv"

step "libcertkv.so: SONAME and exported symbols"
version=$(sed -n 's/^project(certkv VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")
soname=libcertkv.so.${version%.*}
readelf -d "$libdir/libcertkv.so" | grep -q "Library soname: \[$soname\]" ||
  fail "SONAME of libcertkv.so is not $soname: $(readelf -d "$libdir/libcertkv.so" | grep -i soname)"
[ "$(readlink "$libdir/libcertkv.so")" = "$soname" ] || fail "libcertkv.so does not link to $soname"
nm -D --defined-only "$libdir/libcertkv.so" | awk '{print $3}' | sort >"$work/exported"
grep -v -E '^(certkv_[a-z0-9_]+|_init|_fini|_edata|_end|__bss_start)$' "$work/exported" >"$work/unexpected" || true
if [ -s "$work/unexpected" ]; then
  head -20 "$work/unexpected" >&2
  fail "libcertkv.so exports $(wc -l <"$work/unexpected") symbols outside the C API"
fi
grep -o '^CERTKV_API [^(]*(' "$prefix/include/certkv/certkv.h" | grep -o 'certkv_[a-z0-9_]*($' | tr -d '(' |
  sort >"$work/declared"
grep '^certkv_' "$work/exported" | diff "$work/declared" - >&2 ||
  fail "the exported certkv_* functions differ from the CERTKV_API declarations of certkv.h (< declared, > exported)"
echo "$(wc -l <"$work/declared") C API functions exported, nothing else; SONAME $soname"
if grep -q -E 'INTERFACE_COMPILE_OPTIONS|INTERFACE_LINK_OPTIONS' "$libdir"/cmake/certkv/certkvTargets.cmake; then
  fail "certkvTargets.cmake hands compile or link options to consumers"
fi

step "the installed CLI and server start from bin/"
[ "$("$prefix/bin/certkv" --version)" = "certkv $version" ] || fail "bin/certkv --version"
run "$work/serve.log" "$prefix/bin/certkv-serve" --help

step "find_package: examples/c_consumer"
consumer_flags=(-DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "${compilers[@]}")
run "$work/c.log" cmake -S "$src/examples/c_consumer" -B "$work/c" "${consumer_flags[@]}"
run "$work/c.log" cmake --build "$work/c"
"$work/c/certkv_c_consumer" || fail "examples/c_consumer (find_package) exited $?"
no_private_flags "$work/c/compile_commands.json" c_consumer/main.c

step "find_package: examples/cpp_consumer"
run "$work/cpp.log" cmake -S "$src/examples/cpp_consumer" -B "$work/cpp" "${consumer_flags[@]}"
run "$work/cpp.log" cmake --build "$work/cpp"
"$work/cpp/certkv_cpp_consumer" || fail "examples/cpp_consumer (find_package) exited $?"
no_private_flags "$work/cpp/compile_commands.json" cpp_consumer/main.cc
if [ "$(cache_value CERTKV_CUDA)" = ON ]; then
  grep -q -- -DCERTKV_HAS_CUDA=1 "$work/cpp/compile_commands.json" ||
    fail "certkv was built with CUDA but cpp_consumer did not get certkv::cuda"
  echo "certkv::cuda linked"
fi

step "find_package: version and component requests"
mkdir -p "$work/request"
# request CALL: configures a project that does nothing but CALL (a find_package line).
request() {
  printf 'cmake_minimum_required(VERSION 3.25)\nproject(request LANGUAGES NONE)\n%s\n' "$1" >"$work/request/CMakeLists.txt"
  rm -rf "$work/request/build"
  cmake -S "$work/request" -B "$work/request/build" -DCMAKE_PREFIX_PATH="$prefix" >"$work/request.log" 2>&1
}
request "find_package(certkv $version CONFIG REQUIRED)" || { cat "$work/request.log" >&2; fail "find_package(certkv $version)"; }
major=${version%%.*} minor=${version#*.}
minor=${minor%%.*}
request "find_package(certkv $major.$((minor + 1)) CONFIG REQUIRED)" &&
  fail "find_package(certkv $major.$((minor + 1))) accepted version $version (a minor version may break the ABI)"
request "find_package(certkv CONFIG REQUIRED COMPONENTS no_such_component)" &&
  fail "find_package(certkv COMPONENTS no_such_component) succeeded"
echo "$version found; $major.$((minor + 1)) and an unknown component refused"

step "pkg-config: examples/c_consumer/main.c"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
cflags=$(pkg-config --cflags certkv) libs=$(pkg-config --libs certkv)
pc_libdir=$(pkg-config --variable=libdir certkv) pc_version=$(pkg-config --modversion certkv)
echo "cflags: $cflags; libs: $libs"
[ "$(cd "$pc_libdir" && pwd -P)" = "$(cd "$libdir" && pwd -P)" ] || fail "certkv.pc's libdir $pc_libdir is not $libdir"
[ "$pc_version" = "$version" ] || fail "certkv.pc's version $pc_version is not $version"
for flag in -march=native -Wall -Wextra; do
  case " $cflags $libs " in *" $flag "*) fail "certkv.pc hands $flag to consumers" ;; esac
done
# shellcheck disable=SC2086  # pkg-config's output is a list of flags
run "$work/pc.log" "$(cache_value CMAKE_C_COMPILER)" -std=c99 $cflags "-DCERTKV_EXPECTED_VERSION=\"$pc_version\"" \
  "$src/examples/c_consumer/main.c" -o "$work/c_pkgconfig" $libs "-Wl,-rpath,$pc_libdir"
"$work/c_pkgconfig" || fail "examples/c_consumer (pkg-config) exited $?"

step "examples/subproject: certkv by FetchContent, CUDA off"
run "$work/sub.log" cmake -S "$src/examples/subproject" -B "$work/sub" -DCERTKV_CHECKOUT="$src" \
  -DCERTKV_CUDA=OFF -DCERTKV_NATIVE=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "${compilers[@]}"
for option in CERTKV_BUILD_TESTS CERTKV_BUILD_BENCH CERTKV_BUILD_TOOLS CERTKV_INSTALL; do
  grep -q "^$option:BOOL=OFF$" "$work/sub/CMakeCache.txt" || fail "$option is not OFF in a subproject"
done
run "$work/sub.log" cmake --build "$work/sub" -j"$jobs"
"$work/sub/certkv_subproject_demo" || fail "examples/subproject exited $?"
no_private_flags "$work/sub/compile_commands.json" subproject/main.cc
# The check above means something only if certkv's own lines carry those flags.
grep -q -- '-march=native .*src/api/certkv_c.cc' "$work/sub/compile_commands.json" ||
  fail "certkv's own compile lines lack -march=native in the subproject (CERTKV_NATIVE=ON)"

echo "package_check: every step passed"
