"""The layout of ``benchmarks/``: one folder per question, each script named in its folder's README,
and at the top only the folders, the README, the modules that scripts of several folders share and
the lent GPU machine's two entry points."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FOLDERS = {"races", "speed", "memory", "numerics", "distributed", "device"}
#: Modules imported by the scripts of more than one folder (directly or through one another).
SHARED = {
    "common.py",
    "_records.py",
    "_stamp.py",
    "_environment.py",
    "_timing.py",
    "_meta_shampoo.py",
    "_peers_contenders.py",
    "family_models.py",
    "_step_time_cases.py",
    "_shampoo_loop.py",
    "_state_bytes.py",
}
#: The lent GPU machine's entry points: they run the scripts of several folders.
DEVICE_SCRIPTS = {"device_checks.sh", "prepare_device.sh"}
IMPORT = re.compile(r"^\s*(?:from|import) (\w+)", re.M)


def entries(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir() if path.name != "__pycache__"}


def scripts(folder: str) -> list[str]:
    """The folder's scripts: every Python or shell file that is not a helper (``_*``)."""
    return sorted(
        path.name
        for path in (BENCHMARKS / folder).iterdir()
        if path.suffix in {".py", ".sh"} and not path.name.startswith("_")
    )


def names_file(text: str, name: str) -> bool:
    """``text`` names the file ``name`` (``peers.py`` in ``races/peers.py``, not in ``_peers.py``)."""
    return re.search(rf"(?<!\w){re.escape(name)}", text) is not None


def imports(path: Path) -> set[str]:
    return set(IMPORT.findall(path.read_text()))


def test_the_top_level_holds_only_the_folders_the_readme_and_the_shared_modules():
    assert entries(BENCHMARKS) == FOLDERS | SHARED | DEVICE_SCRIPTS | {"README.md"}
    for folder in FOLDERS:
        assert (BENCHMARKS / folder).is_dir()


def test_the_readme_maps_every_folder_and_lists_every_shared_module():
    readme = (BENCHMARKS / "README.md").read_text()
    for name in sorted(FOLDERS):
        assert f"`{name}/`" in readme, name
    for name in sorted(SHARED):
        assert names_file(readme, name), name


@pytest.mark.parametrize("folder", sorted(FOLDERS - {"device"}))
def test_every_script_is_named_in_its_folders_readme(folder):
    readme = (BENCHMARKS / folder / "README.md").read_text()
    assert scripts(folder), f"benchmarks/{folder}/ has no script"
    missing = [name for name in scripts(folder) if not names_file(readme, name)]
    assert not missing, f"benchmarks/{folder}/README.md does not name {missing}"


def test_the_device_readme_names_the_entry_points_and_device_keeps_no_script():
    readme = (BENCHMARKS / "device" / "README.md").read_text()
    assert all(names_file(readme, f"benchmarks/{name}") for name in DEVICE_SCRIPTS)
    assert not scripts("device")


def test_shared_modules_serve_several_folders_and_helpers_one():
    """A shared module is imported by modules of two folders or more (directly or through other
    shared modules); a folder's helper (``_*.py``) by modules of its own folder only."""
    stems = {name.removesuffix(".py") for name in SHARED}
    users: dict[str, set[str]] = {stem: set() for stem in stems}
    for folder in FOLDERS:
        for path in (BENCHMARKS / folder).glob("*.py"):
            for name in imports(path) & stems:
                users[name].add(folder)
            for name in imports(path):
                for other in FOLDERS - {folder}:
                    foreign = name.startswith("_") and (BENCHMARKS / other / f"{name}.py").is_file()
                    assert not foreign, f"{folder}/{path.name} imports {other}/{name}.py, a helper of another folder"
    changed = True
    while changed:  # a shared module serves the folders of the shared modules that import it
        changed = False
        for stem in stems:
            for name in imports(BENCHMARKS / f"{stem}.py") & stems:
                if not users[stem] <= users[name]:
                    users[name] |= users[stem]
                    changed = True
    lonely = {stem: sorted(folders) for stem, folders in users.items() if len(folders) < 2}
    assert not lonely, f"shared modules used by one folder only (move them there): {lonely}"
