"""Where the config tree and the shipped data live, and how a relative data path is found.

Installed from a wheel, `conf/` and `data/` ship inside the package as `topp_rl/resources/conf` and
`topp_rl/resources/data` (pyproject's package-dir mapping); in a source checkout (a clone, `pip install -e .`)
they stay at the repository root, beside `topp_rl/`. `resource_root()` is whichever of the two holds them, so the
same relative name (`data/gsm8k_sample.jsonl`, as the shipped configs write it) works from any working directory.
"""

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
INSTALLED_ROOT = PACKAGE_DIR / "resources"  # a wheel's copy of conf/ and data/
CHECKOUT_ROOT = PACKAGE_DIR.parent  # a source checkout's root


def resource_root() -> Path:
    """The directory holding `conf/` and `data/`: the installed package's resources, else the source checkout."""
    for root in (INSTALLED_ROOT, CHECKOUT_ROOT):
        if (root / "conf" / "config.yaml").is_file():
            return root
    raise RuntimeError(
        f"topp_rl's config tree is missing: neither {INSTALLED_ROOT / 'conf'} (an installed package) nor "
        f"{CHECKOUT_ROOT / 'conf'} (a source checkout) holds config.yaml; reinstall topp_rl (pip install <clone>)"
    )


def config_dir() -> Path:
    """The shipped Hydra config tree (`config.yaml` and one folder per group)."""
    return resource_root() / "conf"


def resolve_data_path(path: str | os.PathLike, *, option: str = "task.path") -> Path:
    """An absolute path as given; a relative one from the working directory when it exists there, else from the
    shipped data (`resource_root() / path`); a ValueError naming both places when it is in neither."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    shipped = resource_root() / given
    if shipped.exists():
        return shipped
    raise ValueError(
        f"{option} ({str(path)!r}) does not exist: not in the working directory ({Path.cwd() / given}) nor among "
        f"topp_rl's shipped files ({shipped}); pass an existing data file or save_to_disk directory, absolute or "
        "relative to the working directory"
    )
