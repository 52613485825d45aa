"""API keys: where they come from, what is kept of them, how a header is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.api_config import AuthConfig
from cluster.auth import KeyRing, digest, load_keys

KEY = "sk-tandem-unit-test-0123456789"


def test_keys_from_file_and_env_are_kept_only_as_digests(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# comment\n\n  {KEY}  \n")
    env = {"MY_KEYS": " sk-second-key-abcdefghij , ,"}
    ring = load_keys(AuthConfig(api_keys_file=str(f), api_keys_env="MY_KEYS"), env)
    assert ring.enabled and len(ring.digests) == 2
    assert KEY not in repr(ring) and digest(KEY) in ring.digests
    assert ring.identify(f"Bearer {KEY}") == digest(KEY)[:8]
    assert ring.identify("Bearer sk-second-key-abcdefghij") is not None


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", "Bearer ", f"Basic {KEY}", f"Bearer {KEY}x", KEY]
)
def test_anything_but_a_valid_bearer_key_is_refused(header: str | None) -> None:
    assert KeyRing(frozenset({digest(KEY)})).identify(header) is None


def test_no_keys_means_open_and_bad_sources_fail_loudly(tmp_path: Path) -> None:
    assert not load_keys(AuthConfig(api_keys_env="TANDEM_NO_SUCH_VARIABLE"), {}).enabled
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_keys(AuthConfig(api_keys_env="K"), {"K": "short"})
    with pytest.raises(ValueError, match="does not exist"):
        load_keys(AuthConfig(api_keys_file=str(tmp_path / "missing")), {})


def test_closed_by_default_an_app_without_keys_refuses_to_start() -> None:
    """Before, no key meant an open API (on KubeRay, a build task on a node without the
    variable served open); now the app refuses to start unless a config says otherwise."""
    from cluster.auth import required_keys
    from cluster.builder import build_app
    from cluster.config import TandemConfig

    cfg = TandemConfig.model_validate({"auth": {"api_keys_env": "TANDEM_TEST_NO_SUCH_VAR"}})
    assert cfg.auth.required
    with pytest.raises(ValueError, match=r"auth\.required is true but no API key"):
        build_app(cfg)
    ring = required_keys(cfg.auth, {"TANDEM_TEST_NO_SUCH_VAR": "sk-a-key-long-enough-01"})
    assert ring.enabled
    opened = AuthConfig(api_keys_env="TANDEM_TEST_NO_SUCH_VAR", required=False)
    assert not required_keys(opened, {}).enabled  # deploy/local.yaml's loopback choice
    local = TandemConfig.from_yaml(Path(__file__).parents[2] / "deploy" / "local.yaml")
    assert not local.auth.required and local.http.host == "127.0.0.1"
