#!/usr/bin/env bash
# mypy's verdict must not depend on which optional packages are installed: run it (strict, the
# project's configuration) against a Python that lacks lightning, pytorch_lightning, transformers,
# triton and matplotlib. That Python is a virtual environment without system packages whose one
# site directory links every package of this Python's but those (no download, no copy of torch).
# Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir "$WORK/site"
for path in "$SITE"/*; do
    case "$(basename "$path")" in
        lightning*|pytorch_lightning*|transformers*|triton*|matplotlib*|mpl_toolkits*|*.pth) continue ;;
    esac
    ln -s "$path" "$WORK/site/"
done
"$PY" -m venv --without-pip "$WORK/venv"
VENV_PY="$WORK/venv/bin/python"
echo "$WORK/site" > "$("$VENV_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/site.pth"
"$VENV_PY" -c "
import importlib.util
hidden = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'triton', 'matplotlib')
          if importlib.util.find_spec(m) is not None]
assert not hidden, f'still importable: {hidden}'
assert importlib.util.find_spec('torch') is not None
"
echo "mypy: without lightning, pytorch_lightning, transformers, triton, matplotlib"
"$PY" -m mypy --python-executable "$VENV_PY" --cache-dir "$WORK/mypy_cache" "$@"
