"""The base CPU profile ships inside the package (a non-editable install finds it too)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import resources

import pytest

from torchrec_sparselift.calibration.store import BASE_CPU_PROFILE, base_profile, base_profile_text
from torchrec_sparselift.cost.hardware import HardwareProfile

REPO = os.path.join(os.path.dirname(__file__), os.pardir)


def test_the_base_cpu_profile_is_package_data_read_through_importlib_resources():
    data = resources.files("torchrec_sparselift.calibration").joinpath("data", BASE_CPU_PROFILE)
    assert data.is_file()
    text = data.read_text(encoding="utf-8")
    assert text == base_profile_text()
    prof = base_profile("cpu")
    assert prof.name == json.loads(text)["name"] and prof.compute_device == "cpu"
    # the repository's profiles/ path is the same profile (benchmarks and scripts name it)
    assert HardwareProfile.load(os.path.join(REPO, "profiles", BASE_CPU_PROFILE)) == prof
    assert base_profile("cuda").compute_device == "cuda"


def test_a_built_wheel_holds_the_base_profile(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "torchrec_sparselift"), src / "torchrec_sparselift",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        inside = z.read(f"torchrec_sparselift/calibration/data/{BASE_CPU_PROFILE}").decode("utf-8")
    assert inside == base_profile_text()


def test_the_planner_with_auto_hardware_and_no_stored_profile_prices_with_the_base_and_says_how_to_calibrate(
        tmp_path, monkeypatch):
    pytest.importorskip("torchrec")
    from torchrec.distributed.planner import Topology

    from torchrec_sparselift import SparseLiftPlanner

    monkeypatch.setenv("TORCHREC_SPARSELIFT_PROFILE_DIR", str(tmp_path / "empty"))
    with pytest.warns(UserWarning, match="torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps"):
        planner = SparseLiftPlanner(topology=Topology(world_size=2, local_world_size=2, compute_device="cpu"),
                                    batch_size=64, hardware="auto")
    assert planner.hardware == base_profile("cpu")
