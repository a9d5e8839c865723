#!/usr/bin/env bash
# Prepare Transformer Engine for a GPU machine without a package index (run here, once):
# copies a one-carry TE bundle (TE wheels with the core library pruned to sm_90, a prebuilt
# torch extension, TE's pure-Python dependencies) into te_carry/ (git-ignored).
#   bash scripts/prepare_te.sh [BUNDLE_DIR=../shared/te-2.20.2]
# Then carry te_carry to the GPU machine and run the suite with TE=1:
#   TE=1 STAGES="unit functional" bash scripts/run_gpu_suite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-../shared/te-2.20.2}
[ -f "$SRC/install_te.sh" ] || { echo "no TE bundle at $SRC (install_te.sh missing)" >&2; exit 1; }
rm -rf te_carry && mkdir te_carry && cp "$SRC"/* te_carry/ && chmod -R u+w te_carry
(cd te_carry && sha256sum -c --quiet SHA256SUMS)
# The core wheel re-packed with LZMA (the same members, byte for byte): smaller, so that te_carry,
# .whl and the tracked tree stay within one call's 64 MiB carry. pip reads LZMA members (install_te.sh
# installs with pip; other installers may not). Its checksum line is rewritten to the re-packed file.
CORE=$(cd te_carry && ls transformer_engine_cu13-*.whl)
[ "$(echo "$CORE" | wc -l)" = 1 ] || { echo "expected one transformer_engine_cu13 wheel in $SRC" >&2; exit 1; }
python3 - "te_carry/$CORE" <<'PY'
import copy, os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".lzma", "w", zipfile.ZIP_LZMA) as dst:
    for info in src.infolist():
        data = src.read(info.filename)
        out = copy.copy(info)
        out.compress_type = zipfile.ZIP_LZMA
        dst.writestr(out, data)
os.replace(path + ".lzma", path)
PY
(cd te_carry && grep -v "  $CORE\$" SHA256SUMS > SHA256SUMS.new && sha256sum "$CORE" >> SHA256SUMS.new \
  && mv SHA256SUMS.new SHA256SUMS && sha256sum -c --quiet SHA256SUMS)
grep -qx '/te_carry/' .git/info/exclude 2>/dev/null || echo '/te_carry/' >> .git/info/exclude
echo "te_carry/ ready ($(du -sh te_carry | cut -f1)); carry it with the GPU call"
