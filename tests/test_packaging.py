"""What a built distribution carries: Hydra's configs inside the ``tuner`` package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tuner.__main__ import CONF_DIR

ROOT = Path(__file__).resolve().parent.parent


def test_the_config_directory_is_inside_the_package() -> None:
    conf = Path(CONF_DIR)
    assert conf == ROOT / "tuner" / "conf"
    assert (conf / "config.yaml").is_file()
    assert not (ROOT / "conf").exists()  # one config directory, the one that ships


@pytest.mark.slow
def test_the_wheel_ships_every_config_file(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    offline = ("No matching distribution", "Could not find a version")
    if built.returncode != 0 and any(words in built.stderr for words in offline):
        pytest.skip("pip cannot fetch the build backend (setuptools) here")
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"tuner/conf/{path.relative_to(CONF_DIR).as_posix()}"
        for path in Path(CONF_DIR).rglob("*.yaml")
    }
    assert expected and expected <= names
    assert {"kernels/tiled.cu", "db/alembic.ini"} <= names
    # the cost model's fitted constants (tuner.costmodel.calibrated() reads them)
    assert "tuner/costmodel_calibration.json" in names


def test_build_outputs_are_ignored_by_git(tmp_path: Path) -> None:
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", "build/lib/x.py", "dist/x.whl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if checked.returncode == 128:
        pytest.skip(f"not a git checkout: {checked.stderr.strip()}")
    assert checked.stdout.split() == ["build/lib/x.py", "dist/x.whl"]
