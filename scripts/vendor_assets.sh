#!/usr/bin/env bash
# Re-fetch the JavaScript that the HTML report inlines, from the npm registry, at pinned versions.
#
#   scripts/vendor_assets.sh           # fetch, verify, copy into export/assets/vendor/
#   scripts/vendor_assets.sh --check   # fetch and compare with what is committed (exit 1 on drift)
#
# What is vendored and why:
#   @dagrejs/dagre 3.1.3     layered (Sugiyama) graph layout; its dist/dagre.min.js bundles
#   @dagrejs/graphlib 4.0.6  (dagre's only dependency), so one file is enough. MIT licences of both
#                            are kept beside it.
# Drawing, pan/zoom, folding, search and the table are our own code (export/assets/report.js and
# report.css), so the page depends on nothing else and opens from file:// with no network.
# `npm pack` checks each tarball against the registry's integrity hash; the sha256 of every
# vendored file is recorded in export/assets/vendor/SHA256SUMS.
set -euo pipefail

DAGRE_VERSION=3.1.3
GRAPHLIB_VERSION=4.0.6

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/export/assets/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$work"
npm pack --silent "@dagrejs/dagre@${DAGRE_VERSION}" "@dagrejs/graphlib@${GRAPHLIB_VERSION}" >/dev/null
mkdir dagre graphlib
tar -xzf "dagrejs-dagre-${DAGRE_VERSION}.tgz" -C dagre
tar -xzf "dagrejs-graphlib-${GRAPHLIB_VERSION}.tgz" -C graphlib

# The dagre bundle must carry the graphlib version we name (it is built in, not loaded).
grep -q "\"@dagrejs/graphlib\": \"${GRAPHLIB_VERSION}\"" dagre/package/package.json

out="$work/out"
mkdir "$out"
cp dagre/package/dist/dagre.min.js "$out/dagre.min.js"
cp dagre/package/LICENSE "$out/dagre.LICENSE"
cp graphlib/package/LICENSE "$out/graphlib.LICENSE"
cat > "$out/VERSIONS" <<TXT
@dagrejs/dagre ${DAGRE_VERSION} (npm, dist/dagre.min.js, MIT, bundles @dagrejs/graphlib)
@dagrejs/graphlib ${GRAPHLIB_VERSION} (npm, MIT; licence only: its code is inside dagre.min.js)
TXT
(cd "$out" && sha256sum dagre.min.js dagre.LICENSE graphlib.LICENSE VERSIONS > SHA256SUMS)

if [[ "${1:-}" == "--check" ]]; then
    diff -r "$out" "$dest" && echo "vendored assets match npm @dagrejs/dagre@${DAGRE_VERSION}"
    exit $?
fi
mkdir -p "$dest"
cp "$out"/* "$dest"/
echo "vendored into $dest:"
cat "$dest/SHA256SUMS"
