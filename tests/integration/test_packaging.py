"""How kvledger installs and what its parts import: one namespace in site-packages, a router without torch."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]
#: The design card's folders (and the replay bench's), each installed as ``kvledger.<folder>``.
FOLDERS = ("worker", "coordinator", "router", "launch", "replay")


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd,
                          check=False)


def package_folders() -> list[str]:
    """Every folder holding an ``__init__.py`` under the installed folders, as a dotted ``kvledger.*`` name."""
    out = []
    for top in FOLDERS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            out.append("kvledger." + ".".join(rel.parts))
    return out


def test_every_package_folder_is_installed_under_the_kvledger_namespace():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["packages"]) == sorted(package_folders()), "pyproject.toml lists every package folder"
    assert config["package-dir"] == {f"kvledger.{f}": f for f in FOLDERS}
    for name in package_folders():
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).is_relative_to(ROOT), name


def test_nothing_generic_lands_at_the_top_of_site_packages(tmp_path):
    site = Path(sysconfig.get_paths()["purelib"])
    assert not [f for f in FOLDERS if (site / f).exists()], f"a top-level folder in {site}"
    proc = python("import importlib.util\n"
                  f"print([m for m in {FOLDERS!r} if importlib.util.find_spec(m) is not None])", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_the_router_and_the_wire_import_without_torch(tmp_path):
    """Every router module (the HTTP API, the service, the index, the policies, the rank clients' protocol)."""
    modules = [*_modules("router"), *_modules("worker/wire"),
               "kvledger.worker.engine.tokenizer", "kvledger.launch.router_client"]
    proc = python("import importlib, sys\n"
                  f"for m in {modules!r}:\n"
                  "    importlib.import_module(m)\n"
                  "    assert 'torch' not in sys.modules, f'{m} imported torch'\n", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def _modules(folder: str) -> list[str]:
    return ["kvledger." + ".".join(p.with_suffix("").relative_to(ROOT).parts).removesuffix(".__init__")
            for p in sorted((ROOT / folder).rglob("*.py"))]
