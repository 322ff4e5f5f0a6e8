#!/usr/bin/env bash
# Builds .whl/ (git-ignored): the Ray Serve wheels the GPU machine lacks, small enough to travel
# with this working tree (the device call carries at most 64 MiB; the tracked tree is ~21 MB).
#
# ../shared/device/make-wheels.sh downloads and strips the wheels (~45 MB); here the ray wheel is
# then repacked with LZMA and without the libraries Serve never imports (data, tune, train, llm,
# rllib), which brings the bundle to ~33 MB. pip installs LZMA-compressed wheels as usual.
#
#   bash scripts/device_wheels.sh
# and on the GPU machine, before anything imports ray:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
mkdir -p .git/info
bash ../shared/device/make-wheels.sh
python3 - <<'PY'
import glob, os, zipfile

UNUSED = ("ray/data/", "ray/tune/", "ray/train/", "ray/llm/", "ray/rllib/", "ray/serve/llm/")
for src in glob.glob(".whl/ray-*.whl"):
    with zipfile.ZipFile(src) as zin:
        if zin.infolist()[0].compress_type == zipfile.ZIP_LZMA:
            continue  # already repacked
        tmp = src + ".tmp"
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as zout:
            for info in zin.infolist():
                if not info.filename.startswith(UNUSED):
                    zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_LZMA)
    os.replace(tmp, src)
PY
du -sh .whl
