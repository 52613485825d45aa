"""Pack NIXL for a GPU machine that has PyTorch but no NIXL and no network (the device machine
``bench.gpu_check`` runs on): the ``nixl`` and ``nixl-cu13`` wheels for CPython 3.12, cut down
to the Python API, the UCX plugin, UCX's own transport modules (no InfiniBand ones) and the
shared libraries those load, as one ``.tar.xz`` to unpack onto ``PYTHONPATH`` there.

The whole ``nixl-cu13`` wheel is about 59 MB (238 MB unpacked, mostly an expert-parallel
library and storage plugins the KV transfer does not load); the bundle is about 8 MB, under
what one device call may carry.

    python -m bench.nixl_bundle --out .gpu/nixl-slim.tar.xz
    # on the GPU machine:
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/nixl-slim.tar.xz
    PYTHONPATH=/tmp/site:. python3 -m bench.gpu_check --out gpu_check.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def _needed(lib: Path) -> list[str]:
    """The sonames an ELF file links against (``readelf -d``)."""
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True)
    lines = [ln for ln in out.stdout.splitlines() if "(NEEDED)" in ln]
    return [ln.split("[", 1)[1].split("]", 1)[0] for ln in lines]


def bundle(version: str, cuda: str, out: Path) -> int:
    """Download, cut down and pack; returns the bundle's size in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site, slim = Path(tmp, "whl"), Path(tmp, "site"), Path(tmp, "slim")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(wheels)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        cmd += [f"nixl=={version}", f"nixl-{cuda}=={version}"]
        subprocess.run(cmd, check=True)
        for w in wheels.glob("*.whl"):
            zipfile.ZipFile(w).extractall(site)
        by_name: dict[str, Path] = {}
        for f in site.rglob("*.so*"):
            by_name.setdefault(f.name, f)
        pkg = f"nixl_{cuda}"
        roots = [*site.glob(f"{pkg}/*.so"), *site.rglob("libplugin_UCX.so")]
        roots += [
            f
            for f in site.glob(f"{pkg}.libs/ucx/*.so*")
            if "perftest" not in f.name and "_ib" not in f.name  # no InfiniBand, no tests
        ]
        keep: set[Path] = set()
        todo = list(roots)
        while todo:
            f = todo.pop()
            if f not in keep:
                keep.add(f)
                todo += [by_name[n] for n in _needed(f) if n in by_name]
        keep |= set(site.rglob("*.py"))
        keep |= set(site.glob(f"{pkg}/py.typed")) | set(site.glob(f"{pkg}.libs/ucx/*.la"))
        keep |= {f for f in site.glob("*.dist-info/*") if f.is_file()}
        keep = {f for f in keep if not f.relative_to(site).parts[0].startswith("nixl_ep")}
        for f in keep:
            dest = slim / f.relative_to(site)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as tar:
            for f in sorted(slim.rglob("*")):
                tar.add(f, arcname=str(f.relative_to(slim)), recursive=False)
    return out.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", default="1.5.1")
    ap.add_argument("--cuda", default="cu13", help="the wheel variant: cu13 (torch +cu130)")
    ap.add_argument("--out", type=Path, default=Path(".gpu/nixl-slim.tar.xz"))
    args = ap.parse_args()
    size = bundle(args.version, args.cuda, args.out)
    print(f"{args.out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
