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
#
# Where the tracked tree and .whl/ together exceed one call's 64 MiB, `bash scripts/device_wheels.sh --split`
# also halves the bundle: .whl_p1/ (the ray wheel's first part) and .whl_p2/ (its second part and the other
# wheels), both git-ignored, for two calls on the same warm machine (warm about 30 s after a call):
#   call 1, carry [".whl_p1"]:  mkdir -p /tmp/wparts && cp .whl_p1/* /tmp/wparts/
#   call 2, carry [".whl_p2"]:  mkdir -p .whl && cp .whl_p2/*.whl .whl/ && cat /tmp/wparts/ray.part00 \
#       .whl_p2/ray.part01 > .whl/$(cat .whl_p2/ray.name) && <the install above>
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
mkdir -p .git/info
bash ../shared/device/make-wheels.sh
python3 - <<'PY'
import base64, glob, hashlib, os, subprocess, tempfile, zipfile

STRIPPED = b"vpd: lzma, stripped"


def _stripped(data: bytes) -> bytes:
    """An ELF binary without its symbol tables (gcs_server, raylet, _raylet.so: ~25 % smaller)."""
    if not data.startswith(b"\x7fELF"):
        return data
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        subprocess.run(["strip", "--strip-unneeded", f.name], check=True)
        return open(f.name, "rb").read()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


UNUSED = ("ray/data/", "ray/tune/", "ray/train/", "ray/llm/", "ray/rllib/", "ray/serve/llm/")
for src in glob.glob(".whl/ray-*.whl"):
    with zipfile.ZipFile(src) as zin:
        if zin.comment == STRIPPED:
            continue  # already repacked
        tmp = src + ".tmp"
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as zout:
            zout.comment = STRIPPED
            record, hashes = None, {}
            for info in zin.infolist():
                if info.filename.endswith(".dist-info/RECORD"):
                    record = info
                elif not info.filename.startswith(UNUSED):
                    data = _stripped(zin.read(info))
                    hashes[info.filename] = _record_line(info.filename, data)
                    zout.writestr(info, data, compress_type=zipfile.ZIP_LZMA)
            # RECORD names each file's hash and size: rewritten for the files kept, as they are now.
            zout.writestr(record, "".join(hashes[n] for n in hashes) + f"{record.filename},,\n",
                          compress_type=zipfile.ZIP_LZMA)
    os.replace(tmp, src)
PY
du -sh .whl
if [ "${1:-}" = "--split" ]; then
    rm -rf .whl_p1 .whl_p2 && mkdir -p .whl_p1 .whl_p2
    ray_wheel=$(basename .whl/ray-*.whl)
    find .whl -type f -name '*.whl' ! -name 'ray-*' -exec cp {} .whl_p2/ \;
    # The ray wheel's first part as large as the rest together: each call carries half the bundle.
    half=$(( ($(du -cb .whl/*.whl | tail -1 | cut -f1) + 1) / 2 ))
    split -b "$half" -d ".whl/$ray_wheel" .whl_p1/ray.part
    mv .whl_p1/ray.part01 .whl_p2/
    echo "$ray_wheel" > .whl_p2/ray.name
    du -sh .whl_p1 .whl_p2
fi
