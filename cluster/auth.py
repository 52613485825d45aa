"""API keys: loaded once where the app is built, kept and compared only as SHA-256 digests (the
plain keys never reach a Serve config, an actor or a log); a key is named by 8 hex digits."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.api_config import AuthConfig


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRing:
    """The accepted keys' digests; empty means the API is open."""

    digests: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def identify(self, authorization: str | None) -> str | None:
        """The key id of a valid ``Authorization: Bearer <key>`` header, else None."""
        if authorization is None:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        d = digest(token.strip())
        # every digest compared, so the time taken does not depend on which one matched
        match = [hmac.compare_digest(d, known) for known in sorted(self.digests)]
        return d[:8] if any(match) else None


def load_keys(cfg: AuthConfig, environ: dict[str, str] | None = None) -> KeyRing:
    """Read the keys from ``cfg.api_keys_file`` and ``$cfg.api_keys_env``."""
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if cfg.api_keys_file:
        path = Path(cfg.api_keys_file).expanduser()
        if not path.is_file():
            raise ValueError(f"auth.api_keys_file: {path} does not exist")
        lines = (raw.strip() for raw in path.read_text().splitlines())
        keys += [line for line in lines if line and not line.startswith("#")]
    keys += [k.strip() for k in env.get(cfg.api_keys_env, "").split(",") if k.strip()]
    short = [k for k in keys if len(k) < 16]
    if short:
        raise ValueError(f"API keys must be at least 16 characters; {len(short)} are shorter")
    return KeyRing(frozenset(digest(k) for k in keys))


def required_keys(cfg: AuthConfig, environ: dict[str, str] | None = None) -> KeyRing:
    """The keys, or ValueError when ``auth.required`` and there are none (closed by default)."""
    ring = load_keys(cfg, environ)
    if cfg.required and not ring.enabled:
        raise ValueError(
            "auth.required is true but no API key is configured: put keys in "
            f"auth.api_keys_file or ${cfg.api_keys_env} (on KubeRay, from the Secret the "
            "manifests mount), or set auth.required: false for a server on loopback only"
        )
    return ring
