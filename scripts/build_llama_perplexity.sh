#!/usr/bin/env bash
# Build llama.cpp's llama-perplexity tool from the vendored llama.cpp of the llama-cpp-python sdist that kveval
# pins (pyproject.toml's parity extra), once per llama.cpp commit and CPU, into kveval's cache:
#
#   $KVEVAL_CACHE/llama.cpp/<commit12>-<arch>-<cpu flags digest>/bin/llama-perplexity
#
# (KVEVAL_CACHE defaults to $XDG_CACHE_HOME/kveval, else ~/.cache/kveval, as kveval.paths.cache_root). A second
# call, or a fresh clone on a machine whose cache holds the build, finds it and builds nothing. The CPU flags are in
# the key because ggml is built for the building machine's CPU (GGML_NATIVE, llama.cpp's default, as the
# llama-cpp-python wheel is): a binary cached on another CPU could stop on an illegal instruction.
#
# The sdist: $LLAMA_CPP_SDIST (a .tar.gz) when set, else `pip download` from the package index (pip's cache); its
# sha256 must be PyPI's, and its vendored llama.cpp the commit below (read from the submodule's git directory).
# Needs cmake >= 3.14, a C/C++17 compiler; no network beyond the package index. Prints the binary's path last.
set -euo pipefail

VERSION="0.3.36"                                       # llama-cpp-python, as pinned in pyproject.toml
COMMIT="0c1e57098bba43ac29e6e3b677cdceebdd22334f"      # the llama.cpp it vendors
SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # of PyPI's sdist of that version
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

root="${KVEVAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kveval}"
flags="$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | LC_ALL=C sort | tr -d '\n' || true)"
cpu="$(printf '%s' "$flags" | sha256sum | cut -c1-8)"
dest="$root/llama.cpp/${COMMIT:0:12}-$(uname -m)-$cpu"
tool="$dest/bin/llama-perplexity"

# whether the binary $1 reports the pinned commit. Its output is read whole first: `tool | grep -q` under pipefail
# fails whenever grep exits before the tool has written everything (SIGPIPE), which rebuilt a good cached binary
# (4-15 min) about one set-up in three
reports_commit() {
  local said
  said="$("$1" --version 2>&1 || true)"
  [[ "$said" == *"commit ${COMMIT:0:7}"* ]]
}

if [ -x "$tool" ] && reports_commit "$tool"; then
  echo "llama-perplexity: up to date ($tool)"
  echo "$tool"
  exit 0
fi
for cmd in cmake c++ tar; do
  command -v "$cmd" >/dev/null || { echo "llama-perplexity: '$cmd' is not installed; cannot build" >&2; exit 1; }
done

mkdir -p "$root/llama.cpp"
work="$(mktemp -d "$root/llama.cpp/.build-XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

sdist="${LLAMA_CPP_SDIST:-}"
if [ -z "$sdist" ]; then
  "$PYTHON" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$work/sdist"
  sdist="$(ls "$work"/sdist/llama_cpp_python-*.tar.gz)"
fi
if [ "$(sha256sum "$sdist" | cut -d' ' -f1)" != "$SHA256" ]; then
  echo "llama-perplexity: $sdist is not PyPI's llama-cpp-python $VERSION sdist (sha256 differs)" >&2
  exit 1
fi
top="llama_cpp_python-$VERSION"
tar xzf "$sdist" -C "$work" "$top/vendor/llama.cpp" "$top/.git/modules/vendor/llama.cpp"
src="$work/$top/vendor/llama.cpp"
found="$(cat "$work/$top/.git/modules/vendor/llama.cpp/HEAD")"
if [ "$found" != "$COMMIT" ]; then
  echo "llama-perplexity: $sdist vendors llama.cpp $found, not $COMMIT; update VERSION/COMMIT in $0" >&2
  exit 1
fi

# only what the tool needs: ggml, llama, common; no server, tests, examples, HTTPS; one static binary
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_OPENSSL=OFF > "$work/configure.log" 2>&1 \
  || { tail -20 "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-perplexity -j "$JOBS" > "$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log" >&2; exit 1; }

mkdir -p "$work/out/bin"
cp "$work/build/bin/llama-perplexity" "$work/out/bin/"
reports_commit "$work/out/bin/llama-perplexity" \
  || { echo "llama-perplexity: the built tool does not report commit ${COMMIT:0:7}" >&2; exit 1; }
secs=$(( $(date +%s) - start ))
printf 'llama-cpp-python %s\nllama.cpp %s\ncpu %s %s\nbuilt %s in %s s with %s jobs\n' \
  "$VERSION" "$COMMIT" "$(uname -m)" "$cpu" "$(date -u +%FT%TZ)" "$secs" "$JOBS" > "$work/out/BUILD-INFO"
rm -rf "$dest"
mv "$work/out" "$dest"
echo "llama-perplexity: built in $secs s ($tool)"
echo "$tool"
