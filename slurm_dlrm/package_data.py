"""Where the package's data folders are: `templates/`, `site-config/`, `examples/`.

In the repository they sit at its top (the layout the project guide asks for). A wheel
carries copies inside the package, under `slurm_dlrm/_data/` (setup.py's build_py hook
copies them at build time), so `pip install slurm-dlrm` is a complete install; they are
found through importlib.resources. An editable install (`pip install -e .`, what
`make setup` does) has no copy and reads the checkout's folders.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DATA_DIRS = ("templates", "site-config", "examples")
PACKAGED_DIR = "_data"  # inside the package, in a wheel (keep in step with setup.py)
_CHECKOUT = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """The folder `name` (one of DATA_DIRS): the installed copy, else the checkout's."""
    if name not in DATA_DIRS:
        raise ValueError(f"not a data folder of slurm_dlrm: {name!r} (one of {', '.join(DATA_DIRS)})")
    packaged = resources.files("slurm_dlrm").joinpath(PACKAGED_DIR, name)
    if packaged.is_dir():
        # pip unpacks wheels, so this is a real folder; jinja2's FileSystemLoader and the
        # site loader need paths. A zip import would not be one: say so, not a bad path.
        if not isinstance(packaged, Path):
            raise RuntimeError(f"slurm_dlrm's {name}/ is inside an archive ({packaged}); install the wheel with pip")
        return packaged
    return _CHECKOUT / name


def installed_from_wheel() -> bool:
    """True when the data folders come from the package (a wheel install), not a checkout."""
    return resources.files("slurm_dlrm").joinpath(PACKAGED_DIR).is_dir()
