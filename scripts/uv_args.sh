# Sourced by scripts/setup.sh and scripts/setup_vllm_version.sh: uv_args_from_pip PYTHON
# fills the array uv_args with pip's find-links (where this machine keeps torch's CPU
# build), constraint files and http(s) indexes, from its config files and PIP_* variables
# alike (`pip config list` reports both): uv does not read pip's configuration.
uv_args_from_pip() {
  uv_args=()
  local line key value v
  while IFS= read -r line; do
    key="${line%%=*}"; value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
    for v in $value; do
      case "$key" in
        *.find-links) uv_args+=(--find-links "$v") ;;
        *.constraint) [ -f "$v" ] && uv_args+=(-c "$v") ;;
        *.index-url) case "$v" in http*) uv_args+=(--index-url "$v") ;; esac ;;
        *.extra-index-url) case "$v" in http*) uv_args+=(--extra-index-url "$v") ;; esac ;;
      esac
    done
  done < <("$1" -m pip config list 2>/dev/null || true)  # not -q: it prints nothing
}
