"""Build hook: the wheel carries `templates/`, `site-config/` and `examples/` inside the
package (as `slurm_dlrm/_data/<name>/`), while the repository keeps them at its top.

setuptools' package-data only takes files under a package's own folder, so build_py
copies the three folders into the build tree; slurm_dlrm/package_data.py finds them
there through importlib.resources (and falls back to the checkout in editable installs,
where build_py does not copy). Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
DATA_DIRS = ("templates", "site-config", "examples")  # slurm_dlrm/package_data.py DATA_DIRS
PACKAGED_DIR = "_data"  # slurm_dlrm/package_data.py PACKAGED_DIR


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's folders
        target = Path(self.build_lib) / "slurm_dlrm" / PACKAGED_DIR
        for name in DATA_DIRS:
            dest = target / name
            if dest.exists():
                shutil.rmtree(dest)  # a stale copy from an earlier build
            shutil.copytree(HERE / name, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithData})
