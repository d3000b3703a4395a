#!/usr/bin/env bash
# Wheels for running the benchmarks (and `flwr run` simulation) on an offline GPU machine whose
# image already has Python 3.12, torch, timm, peft, numpy, pandas, pyarrow and scikit-learn, but no
# Flower, Ray or datasets, and no package registry.
#
#     bash scripts/gpu_wheels.sh [DEST]        # here, with a registry; DEST defaults to .whl
#     # there:  python3 -m pip install --no-index --no-deps DEST/*.whl
#
# Versions are the ones this project's lock-step environment is tested with. Ray's wheel is
# repacked with LZMA and without its Java jar, RLlib, Serve, Tune, Train and the dashboard's
# web client (74 MB -> about 25 MB), none of which Flower's simulation loads, so that
# everything fits a 64 MiB transfer.
set -euo pipefail
DEST="${1:-.whl}"
mkdir -p "$DEST"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PACKAGES=(
  flwr==1.42.0 ray==2.55.1 datasets==4.8.5 flwr-datasets==0.6.1
  cryptography==50.0.2 pycryptodome==3.24.1 iterators==0.0.2 tomli==2.5.0 tomli-w==1.2.0
  grpcio==1.85.1 grpcio-health-checking==1.81.1 protobuf==6.33.6
  typer==0.20.1 click==8.5.1 rich==14.3.4 packaging==25.0 shellingham==1.5.4
  prompt-toolkit==3.0.53 wcwidth==0.9.4 sqlalchemy==2.1.9 greenlet==3.5.6
  alembic==1.20.1 mako==1.4.3 uvicorn==0.49.0 fastapi==0.138.2 starlette==1.3.1
  annotated-doc==0.0.7 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 httptools==0.9.0 websockets==17.4 watchfiles==1.3.0
  python-dotenv==1.2.4 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.2.0
  cffi==2.1.1 pycparser==3.12
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "${PACKAGES[@]}"
python3 - "$DEST" <<'PY'
import pathlib, sys, zipfile

dest = pathlib.Path(sys.argv[1])
(wheel,) = dest.glob("ray-*.whl")
drop = tuple(f"ray/{d}/" for d in ("jars", "rllib", "serve", "llm", "tune", "train", "dashboard/client"))
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_LZMA) as out:
    for item in src.infolist():
        if item.filename.startswith(drop):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(x for x in lines if not x.startswith(drop)).encode()
        out.writestr(item, data, compress_type=zipfile.ZIP_LZMA)
slim.replace(wheel)
PY
du -sh "$DEST"
