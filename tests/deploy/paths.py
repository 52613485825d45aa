"""Where the deployment files live, and loading them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def load_yaml(path: Path) -> Any:
    """One YAML document."""
    return yaml.safe_load(path.read_text())


def serve_files() -> list[Path]:
    """The committed Serve config files."""
    return sorted((DEPLOY / "serve").glob("*.yaml"))
