#!/usr/bin/env bash
# Packaging check (CI): build the wheel, install it non-editable into a clean folder, and from
# outside the source tree, with only that folder providing elastor_ds, check that
#   1. every module of the source tree is in the wheel (a package folder without __init__.py is not),
#   2. every subpackage imports, and the imported code is the wheel's (not the editable checkout),
#   3. the console script works: `elastor --help`, `elastor plan ...`, and a checkpoint round trip
#      (save with the wheel's engine, `elastor verify`, `elastor convert --to consolidated`).
# Dependencies come from .venv (torch==2.13.0 from the local wheel, see ENV.md); the wheel is
# installed with --no-deps so nothing is downloaded. About 20 s.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
PY=${PYTHON:-$SRC/.venv/bin/python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/elastor_wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# build from a copy, so that setuptools' build/ and *.egg-info never land in the checkout
mkdir "$WORK/src"
tar -C "$SRC" --exclude=./.venv --exclude=./.git --exclude=./build --exclude=./runs --exclude='*.egg-info' \
  --exclude='__pycache__' -cf - . | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >/dev/null
WHL=$(ls "$WORK"/dist/elastor_ds-*.whl)
"$PY" -m pip install -q --no-deps --no-index --target "$WORK/site" "$WHL" >/dev/null
cd "$WORK"  # outside the source tree: nothing in the checkout can be imported by accident
export PYTHONPATH="$WORK/site" PYTHONNOUSERSITE=1 DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
"$PY" - "$SRC" "$WORK/site" "$WHL" <<'PYEOF'
import importlib, os, pkgutil, sys, zipfile
src, site, whl = sys.argv[1:]
want = {os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(os.path.join(src, "elastor_ds"))
        for f in fs if f.endswith(".py") and "__pycache__" not in d}
have = {n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".py")}
missing = sorted(want - have)
if missing:
    sys.exit(f"wheel check: {len(missing)} source modules are not in the wheel (a folder without __init__.py?): "
             f"{missing[:10]}")
import elastor_ds
if not os.path.realpath(elastor_ds.__file__).startswith(os.path.realpath(site)):
    sys.exit(f"wheel check: elastor_ds imported from {elastor_ds.__file__}, not from the installed wheel")
pkgs = ["elastor_ds"] + [m.name for m in pkgutil.walk_packages(elastor_ds.__path__, "elastor_ds.") if m.ispkg]
for name in pkgs:
    mod = importlib.import_module(name)
    if not os.path.realpath(mod.__file__).startswith(os.path.realpath(site)):
        sys.exit(f"wheel check: {name} imported from {mod.__file__}")
from elastor_ds.checkpoint import CheckpointEngine, LoadResult, Manifest, SaveStats, TensorShard  # public API
import torch
from elastor_ds.layout.region import Region
t = torch.arange(12.0).view(3, 4)
CheckpointEngine("ck", async_save=False).save(1, [TensorShard("w", (3, 4), Region.full((3, 4)), t)])
meta = next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".dist-info/METADATA"))
requires = [l for l in zipfile.ZipFile(whl).read(meta).decode().splitlines() if l.startswith("Requires-Dist: ")
            and "extra ==" not in l]
if not any(l.split()[1].startswith("zlib-ng") for l in requires):
    sys.exit(f"wheel check: a plain install must pull the fast CRC (zlib-ng); the wheel requires {requires}")
from elastor_ds.checkpoint import crc
if crc.IMPLEMENTATION != "zlib-ng":
    sys.exit(f"wheel check: the checksum runs on {crc.IMPLEMENTATION}, not zlib-ng")
if not any(l.split()[1].startswith("cryptography") for l in requires):
    sys.exit(f"wheel check: a plain install must pull GMAC for peer copies (cryptography); the wheel requires {requires}")
from elastor_ds.checkpoint import auth
if not auth.GMAC_AVAILABLE:
    sys.exit("wheel check: peer-copy digests run on HMAC-SHA256: the cryptography package is missing")
print(f"wheel check: {len(have)} modules in the wheel, {len(pkgs)} packages import from it; CRC32 by zlib-ng, "
      f"peer-copy MACs by GMAC")
PYEOF
ELASTOR="$WORK/site/bin/elastor"
"$ELASTOR" --help >/dev/null
"$ELASTOR" plan --num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --vocab-size 1000 \
  --micro-batch-size 1 --global-batch-size 8 --gpus-per-node 2,2 --json >/dev/null
"$ELASTOR" verify ck >/dev/null
"$ELASTOR" convert ck cons --to consolidated --no-progress >/dev/null
test -f cons/model.safetensors
set +e
"$ELASTOR" plan --num-layers 0 2>err.txt; rc=$?
set -e
if [ "$rc" != 2 ] || grep -q Traceback err.txt; then echo "wheel check: a usage error gave exit $rc" >&2; cat err.txt >&2; exit 1; fi
echo "wheel check: OK ($(basename "$WHL")): elastor --help, plan, verify, convert from the installed wheel"
