"""The wheel is a complete install (issue 24, packaging).

`pip wheel . --no-deps` into a fresh venv, then `slurm-dlrm admin render` and
`slurm-dlrm demo --smoke` from a folder outside the checkout. The fresh venv takes its
dependencies (click, jinja2, ...) from this venv's site-packages through a .pth line, so
nothing is downloaded and torch is not reinstalled; the .pth files of this venv (its
editable install of the checkout) are not read there, and a test checks that
`slurm_dlrm` is imported from the fresh venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_dlrm import package_data
from slurm_dlrm.admin.render import render_site
from slurm_dlrm.site import REPO_SITE_FILE, load_site

REPO = Path(__file__).resolve().parent.parent
DATA_DIRS = ("templates", "site-config", "examples")
_SKIP_COPY = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                                    ".hypothesis", "out")


# ---------------------------------------------------------------- the locator

def test_data_dirs_come_from_the_checkout_in_an_editable_install():
    assert not package_data.installed_from_wheel()
    for name in DATA_DIRS:
        assert package_data.data_dir(name) == REPO / name
    assert REPO_SITE_FILE == REPO / "site-config" / "site.toml"


def test_a_packaged_copy_wins_over_the_checkout(tmp_path, monkeypatch):
    pkg = tmp_path / "slurm_dlrm"
    (pkg / package_data.PACKAGED_DIR / "templates").mkdir(parents=True)
    monkeypatch.setattr(package_data.resources, "files", lambda name: pkg)
    assert package_data.data_dir("templates") == pkg / "_data" / "templates"
    assert package_data.data_dir("examples") == REPO / "examples"  # not packaged there: the checkout's


def test_an_unknown_data_folder_is_refused():
    with pytest.raises(ValueError, match="not a data folder"):
        package_data.data_dir("scripts")


# ---------------------------------------------------------------- a real wheel in a fresh venv

@dataclass(frozen=True)
class WheelInstall:
    wheel: Path
    venv: Path
    cwd: Path  # outside the checkout

    @property
    def exe(self) -> Path:
        return self.venv / "bin" / "slurm-dlrm"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLURM_DLRM_SITE", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return {**env, **extra}

    def run(self, *args: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.exe), *args], cwd=self.cwd, env=self.env(**env), text=True,  # noqa: S603
                              capture_output=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory) -> WheelInstall:
    root = tmp_path_factory.mktemp("wheel")
    # Build from a copy: an in-tree build would leave build/ in the checkout.
    src = root / "src"
    shutil.copytree(REPO, src, ignore=_SKIP_COPY, symlinks=True)
    dist = root / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(dist)],  # noqa: S603
                   check=True, timeout=300, cwd=root)
    wheel = next(dist.glob("slurm_dlrm-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)  # noqa: S603
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",  # noqa: S603
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # This venv's packages as plain path entries, after the fresh venv's own ones.
    Path(purelib, "zz-slurm-dlrm-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", str(wheel)],  # noqa: S603
                   check=True, timeout=300, cwd=root)
    cwd = root / "elsewhere"
    cwd.mkdir()
    return WheelInstall(wheel, venv, cwd)


def test_the_wheel_carries_the_data_folders(wheel_install):
    names = set(zipfile.ZipFile(wheel_install.wheel).namelist())
    for name in DATA_DIRS:
        files = [p.relative_to(REPO).as_posix() for p in (REPO / name).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts]
        assert files, name
        missing = [f for f in files if f"slurm_dlrm/_data/{f}" not in names]
        assert not missing, f"not in the wheel: {missing}"


def test_the_installed_package_is_the_wheel_not_the_checkout(wheel_install):
    out = subprocess.run([str(wheel_install.python), "-c",  # noqa: S603
                          "import slurm_dlrm.package_data as p, slurm_dlrm.site as s; "
                          "print(p.__file__); print(p.installed_from_wheel()); print(s.REPO_SITE_FILE)"],
                         cwd=wheel_install.cwd, env=wheel_install.env(), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0].startswith(str(wheel_install.venv)), out
    assert out[1] == "True"
    assert out[2].startswith(str(wheel_install.venv)) and out[2].endswith("_data/site-config/site.toml")


def test_admin_render_from_the_wheel(wheel_install):
    out = wheel_install.cwd / "rendered"
    result = wheel_install.run("admin", "render", "--out", str(out))
    assert result.returncode == 0, result.stderr
    expected = render_site(load_site(REPO_SITE_FILE))  # the checkout's templates and site file
    assert {f.name for f in expected} == {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for f in expected:
        assert (out / f.name).read_text() == f.text, f.name


def test_spec_example_and_estimate_from_the_wheel(wheel_install):
    """The example specs ship too: `estimate` on the demo's sweep spec works from the wheel."""
    spec = package_dir(wheel_install) / "_data" / "examples" / "sweep" / "tiny-a.yaml"
    result = wheel_install.run("estimate", str(spec), "--json")
    assert result.returncode == 0, result.stderr


def package_dir(install: WheelInstall) -> Path:
    out = subprocess.run([str(install.python), "-c", "import slurm_dlrm; print(slurm_dlrm.__file__)"],  # noqa: S603
                         cwd=install.cwd, env=install.env(), capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).parent


@pytest.mark.slurm
def test_demo_smoke_from_the_wheel(wheel_install, tmp_path_factory):
    """Its own local cluster, rendered from the wheel's templates (not the suite's cluster)."""
    from slurm_dlrm.localcluster import which_missing

    missing = which_missing()
    if os.geteuid() != 0 or missing:
        reason = "must run as root (slurmd, mknod)" if os.geteuid() != 0 else f"not installed: {', '.join(missing)}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"local Slurm cluster unavailable in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("wc")  # short: munge and MariaDB sockets live in it
    env = {"SLURM_DLRM_CLUSTER_DIR": str(state)}
    try:
        result = wheel_install.run("demo", "--smoke", timeout_s=300, **env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "still running" in result.stdout
        conf = (state / "etc" / "slurm.conf").read_text()
        assert str(state) in conf  # the cluster the wheel rendered, not the suite's
    finally:
        down = wheel_install.run("cluster", "down", timeout_s=120, **env)
        assert down.returncode == 0, down.stderr
