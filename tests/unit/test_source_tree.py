"""A process imports the engine, its kernels and its client from one tree. A second copy of the tree, run by this
Python (whose editable install may point at another checkout), imports its own three packages; an engine whose
kernels would come from another tree refuses to import and names both folders."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("diffulex_backend", "kernels", "client")
LINKS = ("diffulex_kernels", "diffulex_client")
PRINT_ORIGINS = ("import diffulex_backend, diffulex_kernels, diffulex_client\n"
                 "for module in (diffulex_backend, diffulex_kernels, diffulex_client): print(module.__file__)")


def copy_of_tree(root: Path, folders=FOLDERS, links=LINKS) -> Path:
    for folder in folders:
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for link in links:
        (root / link).symlink_to(os.readlink(REPO / link))  # relative, so it names the copy's folder
    return root


def run_python(code: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_second_copy_of_the_tree_imports_its_own_kernels_and_client(tmp_path):
    tree = copy_of_tree(tmp_path / "second")
    done = run_python(PRINT_ORIGINS, cwd=tree)
    assert done.returncode == 0, done.stderr[-3000:]
    origins = [Path(line) for line in done.stdout.split()]
    assert origins == [tree / "diffulex_backend" / "__init__.py", tree / "diffulex_kernels" / "__init__.py",
                       tree / "diffulex_client" / "__init__.py"]


def test_an_engine_whose_kernels_come_from_another_tree_refuses_to_import(tmp_path):
    # The engine's folder alone, first on the path; the kernels are found in this checkout, after it.
    engine_only = copy_of_tree(tmp_path / "engine_only", folders=("diffulex_backend",), links=())
    done = run_python("import diffulex_backend", cwd=engine_only, pythonpath=REPO)
    assert done.returncode != 0
    assert "ImportError: diffulex_kernels comes from" in done.stderr
    assert str(REPO / "kernels") in done.stderr
    assert str(engine_only / "diffulex_backend") in done.stderr
