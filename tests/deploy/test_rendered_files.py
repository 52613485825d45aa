"""One source of truth: the committed Serve configs and serveConfigV2 blocks are what the app
configs under deploy/apps/ render to now, and `tandem config render` finds and repairs drift."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.config import TandemConfig
from cluster.render import serve_config
from cluster.render_files import diff, orphans, rendered_files, stale
from tests.deploy.paths import DEPLOY, load_yaml


def test_committed_rendered_files_equal_what_the_app_configs_render_to() -> None:
    files = rendered_files(DEPLOY)
    names = {f.path.relative_to(DEPLOY).as_posix() for f in files}
    assert {"serve/local-colocated.yaml", "serve/gpu-disaggregated.yaml"} <= names
    assert "kuberay/rayservice.yaml" in names
    out_of_date = stale(files)
    assert not out_of_date, "run `tandem config render`:\n" + "\n".join(map(diff, out_of_date))
    assert orphans(DEPLOY) == []


def _copy_deploy(tmp_path: Path) -> Path:
    deploy = tmp_path / "deploy"
    for sub in ("apps", "serve", "kuberay"):
        shutil.copytree(DEPLOY / sub, deploy / sub)
    return deploy


def test_check_reports_drift_and_render_repairs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = _copy_deploy(tmp_path)
    app = deploy / "apps" / "gpu-disaggregated.yaml"
    app.write_text(app.read_text().replace("max_replicas: 32", "max_replicas: 24"))
    manifest = deploy / "kuberay" / "rayservice.yaml"
    hand_written = [ln for ln in manifest.read_text().splitlines() if ln.startswith("#")]

    assert main(["config", "render", "--check", "--deploy-dir", str(deploy)]) == 1
    report = capsys.readouterr().out
    added = [ln for ln in report.splitlines() if ln.startswith("+") and "max_replicas: 24" in ln]
    assert len(added) == 2  # the decode deployment, in the Serve file and in the manifest
    assert "gpu-disaggregated.yaml" in report and "rayservice.yaml" in report
    assert "2 rendered file(s) out of date" in report

    assert main(["config", "render", "--deploy-dir", str(deploy)]) == 0
    assert main(["config", "render", "--check", "--deploy-dir", str(deploy)]) == 0
    serve_doc = load_yaml(deploy / "serve" / "gpu-disaggregated.yaml")
    decode = next(d for d in serve_doc["applications"][0]["deployments"] if d["name"] == "decode")
    assert decode["autoscaling_config"]["max_replicas"] == 24
    block = load_yaml(manifest)["spec"]["serveConfigV2"]
    assert yaml.safe_load(block) == serve_doc  # the manifest embeds the very same document
    assert [ln for ln in manifest.read_text().splitlines() if ln.startswith("#")] == hand_written


def test_a_serve_file_without_its_app_config_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = _copy_deploy(tmp_path)
    (deploy / "apps" / "local-disaggregated.yaml").unlink()
    assert main(["config", "render", "--check", "--deploy-dir", str(deploy)]) == 1
    assert "local-disaggregated.yaml has no app config" in capsys.readouterr().out


def test_a_manifest_block_without_its_end_marker_is_refused(tmp_path: Path) -> None:
    deploy = _copy_deploy(tmp_path)
    manifest = deploy / "kuberay" / "rayservice.yaml"
    manifest.write_text(manifest.read_text().replace("# tandem-render: end", "# (removed)"))
    with pytest.raises(ValueError, match="has no '# tandem-render: end' line"):
        rendered_files(deploy)


def test_render_of_one_app_prints_its_serve_config(capsys: pytest.CaptureFixture[str]) -> None:
    app = DEPLOY / "apps" / "local-colocated.yaml"
    assert main(["config", "render", str(app)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == serve_config(TandemConfig.from_yaml(app))
    assert printed["applications"][0]["args"]["config"]["mode"] == "colocated"
