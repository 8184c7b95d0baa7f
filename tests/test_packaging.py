"""What an install gets: one wheel, built once from a copy of the checkout, read as pip would install it."""

import email
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ beside the sources, and the checkout stays as it was
    source = tmp / "source"
    ignore = (".git", ".venv", ".tox", "build", "*.egg-info", "__pycache__", ".hypothesis", "fuzz-failures", "*.so")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*ignore))
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w"]
    proc = subprocess.run([*command, str(tmp)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = tmp.glob("radixspec-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


# what a build leaves beside the sources (the extensions built in place, the cffi module's generated C): the wheel
# carries its own builds of these
BUILD_OUTPUTS = ("*.so", "*.pyc", "*.o", "_radix_c.c")


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """pyproject.toml's mapping of import names to folders (``radixspec.fuzz`` -> fuzz/)."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def expected_wheel_files(root: Path = ROOT) -> set[str]:
    """Every file of the mapped folders (modules, stubs, markers, whatever a module reads beside it), at the path
    the wheel must hold it: a module of fuzz/cache/ is radixspec/fuzz/cache/..."""
    expected = set()
    for name, folder in package_dirs(root).items():
        for path in folder.rglob("*"):
            relative = path.relative_to(folder)
            if path.is_dir() or "__pycache__" in relative.parts or any(path.match(p) for p in BUILD_OUTPUTS):
                continue
            # radixspec/ itself maps to radixspec/, and a sub-mapping's folder is not walked twice
            if name == "radixspec" and relative.parts[0] in {n.split(".")[1] for n in package_dirs(root) if "." in n}:
                continue
            expected.add("/".join([*name.split("."), *relative.parts]))
    return expected


def missing_from_wheel(names: set[str], root: Path = ROOT) -> list[str]:
    """The files of the mapped folders that a wheel listing ``names`` lacks, sorted."""
    return sorted(expected_wheel_files(root) - names)


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [entry for entry in wheel.namelist() if entry.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_a_wheel_adds_one_top_level_import_name(wheel: zipfile.ZipFile) -> None:
    tops = {entry.split("/")[0] for entry in wheel.namelist() if not entry.split("/")[0].endswith(".dist-info")}
    assert tops == {"radixspec"}
    assert dist_info(wheel, "top_level.txt").split() == ["radixspec"]


def test_a_wheel_holds_the_four_layers_and_the_face_but_no_maintainer_tool(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in ("spec/prefix_cache.py", "reference/radix_cache.py", "optimized/radix_cache.py", "fuzz/campaign.py"):
        assert f"radixspec/{module}" in names
    assert {"radixspec/py.typed", "radixspec/__init__.py", "radixspec/__main__.py"} <= names
    assert any(name.startswith("radixspec/optimized/_radix_c") for name in names), "the C tree is not built in"
    assert any(name.startswith("radixspec/optimized/_hotpath.cpython") for name in names), "the hot path is not built"
    assert "radixspec/optimized/_hotpath.pyi" in names, "the hot path's types are not shipped"
    for tool in ("mutate_c", "mutation_sample", "mutation_report", "sanitize", "planted"):
        assert not any(name.endswith(f"/{tool}.py") for name in names), f"{tool} is a maintainer tool (tools/)"


def test_a_wheel_holds_every_module_and_data_file_of_the_mapped_folders(wheel: zipfile.ZipFile) -> None:
    missing = missing_from_wheel(set(wheel.namelist()))
    assert not missing, f"{len(missing)} files of the checkout are not in the wheel: {missing[:20]}"


def test_the_wheel_comparison_names_a_subpackage_left_out(wheel: zipfile.ZipFile) -> None:
    # the wheel as it was built when pyproject.toml listed the packages by hand (fuzz/cache/ was not listed)
    names = {name for name in wheel.namelist() if not name.startswith("radixspec/fuzz/cache/")}
    missing = missing_from_wheel(names)
    assert "radixspec/fuzz/cache/__init__.py" in missing
    assert all(name.startswith("radixspec/fuzz/cache/") for name in missing), missing


def test_every_folder_of_modules_is_a_package() -> None:
    # a folder of modules without __init__.py is not found by setup.py's discovery, so it would not be installed
    for folder in package_dirs().values():
        for path in folder.rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert (path.parent / "__init__.py").is_file(), f"{path.parent} has modules but no __init__.py"


def test_a_wheel_carries_the_cuda_sources(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert {f"radixspec/optimized/csrc/{name}" for name in ("store.cu", "store_cuda.h", "store_status.h")} <= names


def test_a_wheel_has_its_license_its_console_script_and_no_dev_pin(wheel: zipfile.ZipFile) -> None:
    metadata = email.message_from_string(dist_info(wheel, "METADATA"))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(entry.endswith(".dist-info/licenses/LICENSE") for entry in wheel.namelist())
    assert "radixspec = radixspec.fuzz.commands:main" in dist_info(wheel, "entry_points.txt")
    runtime = [req for req in metadata.get_all("Requires-Dist") or [] if "extra ==" not in req]
    for dev in ("pytest", "pytest-benchmark", "tox", "ruff", "mypy", "mutmut"):
        assert not any(req.split()[0].startswith(dev) for req in runtime), f"{dev} is a dev tool: {runtime}"
