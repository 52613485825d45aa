"""C kernels built on first use with the system's C compiler, for this CPU, and cached.

Two kernels are compiled this way (``models.cpu_paged``, ``models.cpu_linear``): each is small,
written for a guarantee no maintained library gives on a CPU for this torch (paged attention
read in place, row-invariant matmuls), and tuned by ``-march=native`` to the instructions the
host has, which a prebuilt wheel could not assume.

The compiled library goes into a cache keyed by the source, the flags, the compiler's version
and the CPU's feature flags (``$TANDEM_KERNEL_CACHE``, else ``~/.cache/tandem/kernels``), so a
replica restarting on the same machine loads it without compiling, and a different CPU gets
its own build. The compiler is ``$CC``, else ``cc``. Libraries link the OpenMP runtime torch has
loaded, so their threads are torch's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


def cpu_flags() -> str:
    """The CPU's feature flags, which ``-march=native`` compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    base = os.environ.get("TANDEM_KERNEL_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "tandem" / "kernels"


def build_library(source: Path, flags: tuple[str, ...]) -> Path:
    """``source`` compiled into a shared library with ``flags``: from the cache, else compiled
    into it (about a second). Raises when no compiler is found or the compile fails."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), version.stdout.encode()):
        key.update(part)
    for header in sorted(source.parent.glob("*.h")):  # what the sources may include
        key.update(header.read_bytes())
    key.update(cpu_flags().encode())
    out_dir = cache_dir()
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:400]}")
        os.replace(tmp, target)  # atomic: another process may be building the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s: %s", source.name, target)
    return target
