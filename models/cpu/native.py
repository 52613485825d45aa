"""C kernels compiled on first use with ``$CC`` (else ``cc``) and ``-march=native``, cached by
source, flags, compiler and CPU flags (``$TANDEM_KERNEL_CACHE``, else ~/.cache/tandem/kernels)."""

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
    """Raises when no compiler is found or the compile fails."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), version.stdout.encode()):
        key.update(part)
    for header in sorted(source.parent.glob("*.h")):
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
