#!/usr/bin/env bash
# Install everything gradtrace, its tests and its CI need on a fresh Debian machine (run as root).
# Idempotent: whatever is already there is left alone, so a second run takes seconds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0  # a CPU build of exactly this release lies on the machines' disk

log() { printf 'setup: %s\n' "$*"; }

# --- system packages: `dot` renders DOT to SVG/PNG; Debian's chromium drives the browser tests.
missing=()
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if ((${#missing[@]})); then
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || { log "need root (or sudo) to install ${missing[*]}"; exit 1; }
        SUDO=(sudo)
    fi
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    log "graphviz and chromium already installed"
fi

# --- torch first, pinned: every later requirement range (torch>=2.4) is then satisfied by it,
# so pip never reaches for a multi-GB CUDA build from the index.
have_torch=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [[ ${have_torch%%+*} != "$TORCH_VERSION" ]]; then
    log "installing torch==$TORCH_VERSION"
    "$PY" -m pip install -q --root-user-action=ignore "torch==$TORCH_VERSION"
else
    log "torch $have_torch already installed"
fi

# --- the package itself, editable, with the test extra (pytest, transformers, playwright, ruff).
# No `playwright install`: it downloads browsers, which this network refuses; the browser tests
# launch /usr/bin/chromium instead.
log "installing gradtrace (editable) with its test extra"
"$PY" -m pip install -q --root-user-action=ignore -e ".[test]"

log "done: $("$PY" -c 'import torch, tracer; print(f"torch {torch.__version__}, gradtrace {tracer.__version__}")')"
