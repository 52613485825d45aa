"""The rendered files under ``deploy/``: ``apps/NAME.yaml`` renders to ``serve/NAME.yaml``, and
a KubeRay manifest's block between ``# tandem-render: serveConfigV2 from apps/NAME.yaml`` and
``# tandem-render: end``; ``tandem config render [--check]`` writes or checks them."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cluster.config import TandemConfig
from cluster.render import serve_config_yaml

APPS = "apps"
SERVE = "serve"
MANIFESTS = "kuberay"
BEGIN = re.compile(
    r"^(?P<indent>[ \t]*)# tandem-render: serveConfigV2 from (?P<source>\S+)[^\n]*\n", re.M
)
END = "# tandem-render: end"


@dataclass(frozen=True)
class RenderedFile:
    path: Path
    text: str


def _header(deploy_dir: Path, source: Path) -> str:
    shown = Path(deploy_dir.name) / source.relative_to(deploy_dir)
    return (
        f"# Rendered by `tandem config render` from {shown.as_posix()}: edit that file and\n"
        "# re-render; CI fails when this file differs from what it renders to.\n"
    )


def _serve_file(deploy_dir: Path, app: Path) -> RenderedFile:
    cfg = TandemConfig.from_yaml(app)
    text = _header(deploy_dir, app) + serve_config_yaml(cfg)
    return RenderedFile(deploy_dir / SERVE / app.name, text)


def _manifest(deploy_dir: Path, manifest: Path) -> RenderedFile | None:
    text = manifest.read_text()
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        indent = m["indent"]
        end = re.compile(rf"^{re.escape(indent)}{re.escape(END)}[^\n]*$", re.M).search(
            text, m.end()
        )
        if end is None:
            raise ValueError(f"{manifest}: '{m.group(0).strip()}' has no '{END}' line after it")
        cfg = TandemConfig.from_yaml(deploy_dir / m["source"])
        body = "".join(f"{indent}  {line}" for line in serve_config_yaml(cfg).splitlines(True))
        out += [text[pos : m.end()], f"{indent}serveConfigV2: |\n", body]
        pos = end.start()
    if not out:
        return None
    return RenderedFile(manifest, "".join([*out, text[pos:]]))


def rendered_files(deploy_dir: Path) -> list[RenderedFile]:
    """Every rendered file under ``deploy_dir``, with the text it must hold now."""
    files = [_serve_file(deploy_dir, app) for app in sorted((deploy_dir / APPS).glob("*.yaml"))]
    for manifest in sorted((deploy_dir / MANIFESTS).glob("*.yaml")):
        rendered = _manifest(deploy_dir, manifest)
        if rendered is not None:
            files.append(rendered)
    return files


def orphans(deploy_dir: Path) -> list[Path]:
    """Serve config files whose app config is gone (they would deploy something stale)."""
    apps = {p.name for p in (deploy_dir / APPS).glob("*.yaml")}
    return [p for p in sorted((deploy_dir / SERVE).glob("*.yaml")) if p.name not in apps]


def stale(files: list[RenderedFile]) -> list[RenderedFile]:
    """The files whose text on disk differs from (or lacks) what they must hold."""
    return [f for f in files if not f.path.is_file() or f.path.read_text() != f.text]


def diff(f: RenderedFile) -> str:
    now = f.path.read_text().splitlines(True) if f.path.is_file() else []
    lines = difflib.unified_diff(now, f.text.splitlines(True), str(f.path), "rendered")
    return "".join(lines)


def render_command(deploy_dir: Path, check: bool, out: TextIO) -> int:
    """``tandem config render [--check]``: rewrite the stale files, or (check) report them."""
    files = stale(rendered_files(deploy_dir))
    gone = orphans(deploy_dir)
    if not check:
        for f in files:
            f.path.parent.mkdir(parents=True, exist_ok=True)
            f.path.write_text(f.text)
            print(f"rendered {f.path}", file=out)
        for p in gone:
            print(f"{p} has no app config in {deploy_dir / APPS}: delete it", file=out)
        return 1 if gone else 0
    for f in files:
        print(diff(f), file=out)
    for p in gone:
        print(f"{p} has no app config in {deploy_dir / APPS}", file=out)
    if files or gone:
        print(
            f"{len(files) + len(gone)} rendered file(s) out of date: run `tandem config render`",
            file=out,
        )
        return 1
    return 0
