#!/usr/bin/env bash
# Make NVIDIA Dynamo's own virtualenv (outside the project's .venv) for the Dynamo proof cluster.
#   clusters/dynamo/setup.sh [VENV]        (default: .venv-dynamo at the repository root)
# Idempotent: does nothing when VENV already imports dynamo.frontend and dynamo.mocker of 1.6.1.
# `pip install ai-dynamo==1.6.1` fails here: its dependency `aisimulate` is a placeholder that
# downloads from an index these machines cannot reach (only the planner and the mocker's
# --ais-perf-model use it). So: download both wheels without dependencies, install the runtime wheel
# with its dependencies (aiohttp, msgspec, prometheus-client, pyzmq, transformers, ...), then
# ai-dynamo itself with --no-deps and the dependencies it needs that are not aisimulate.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-dynamo}"
VERSION="1.6.1"
say() { echo "[dynamo-setup] $*"; }

good() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1 || return 1
import importlib.metadata as m, importlib.util as u
assert m.version("ai-dynamo") == "1.6.1" and m.version("ai-dynamo-runtime") == "1.6.1"
for mod in ("dynamo.frontend", "dynamo.mocker", "dynamo._core", "transformers", "tokenizers"):
    assert u.find_spec(mod) is not None, mod
PY
}

if good; then
  say "$VENV already has ai-dynamo $VERSION: nothing to do"
  exit 0
fi
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  say "python3 -m venv $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
retry() {  # retry N CMD...: a download cut short ("Response ended prematurely") is not a failed install
  local n=$1 k=1; shift
  until "$@"; do
    ((k < n)) || return 1
    say "attempt $k of $n failed: $*; again in $((k * 10)) s"; sleep $((k * 10)); k=$((k + 1))
  done
}
PIP=(retry 3 "$PY" -m pip --disable-pip-version-check -q)
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
say "pip download --no-deps ai-dynamo==$VERSION ai-dynamo-runtime==$VERSION"
"${PIP[@]}" download --no-deps -d "$wheels" "ai-dynamo==$VERSION" "ai-dynamo-runtime==$VERSION"
say "pip install the runtime wheel with its dependencies"
"${PIP[@]}" install "$wheels"/ai_dynamo_runtime-*.whl
# ai-dynamo's own requirements less aisimulate, read from the wheel's metadata (so a new release's list
# is followed, not copied here): aiohttp, msgspec, prometheus-client, pyzmq, transformers, zstandard, ...
"$PY" - "$wheels" <<'PY'
import glob, sys, zipfile
from email.parser import Parser
from pathlib import Path
wheel = glob.glob(sys.argv[1] + "/ai_dynamo-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
keep = [r for r in meta.get_all("Requires-Dist") or []
        if "extra ==" not in r and not r.lower().startswith(("aisimulate", "ai-dynamo-runtime"))]
Path(sys.argv[1], "requirements.txt").write_text("\n".join(keep) + "\n")
PY
say "pip install ai-dynamo's requirements except aisimulate: $(tr '\n' ' ' < "$wheels/requirements.txt")"
"${PIP[@]}" install -r "$wheels/requirements.txt"
say "pip install --no-deps ai-dynamo==$VERSION"
"${PIP[@]}" install --no-deps "$wheels"/ai_dynamo-*.whl
if ! good; then
  say "FAILED: $VENV does not import dynamo.frontend / dynamo.mocker of ai-dynamo $VERSION after install"
  exit 1
fi
say "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
