"""Python 3.10-3.13 support: the sources use nothing newer than 3.10, pyproject.toml
admits exactly that range, scripts/setup.sh picks an interpreter in it, and the Triton
wheel has a python backend stub for each of those versions."""
import ast
import filecmp
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from backend.triton_server import REPO_ROOT, TritonServer, prepare_server_dir

SUPPORTED = ["3.10", "3.11", "3.12", "3.13"]
OLDEST = (3, 10)
# Every folder of the project that holds Python code (model_repository: the models' model.py).
SOURCE_DIRS = ["engine", "kernels", "backend", "scripts", "bench", "client_examples", "tests",
               "testing", "tuning", "model_repository", "openai_frontend"]


def _python_files() -> list[Path]:
    files = []
    for folder in SOURCE_DIRS:
        files += [p for p in sorted((REPO_ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts]
    return files


def _vermin_config(vermin):
    config = vermin.Config()
    # Annotations count: modules without `from __future__ import annotations` evaluate
    # them at definition time. (Under the future import vermin knows they are strings.)
    config.set_eval_annotations(True)
    # `tensor.long()` reads as Python 2's `long` builtin, which no code here uses.
    config.add_exclusion("long")
    config.set_verbose(3)  # the reason and line of each requirement in output_text()
    config.set_processes(1)
    return config


def _needs_newer_than_3_10(vermin, config, source: str, name: str) -> str | None:
    """Why `source` cannot run on Python 3.10, or None if nothing says so."""
    visitor = vermin.visit(source, config, name)
    if not isinstance(visitor, vermin.SourceVisitor):
        try:
            compile(source, name, "exec")
            error = "vermin cannot parse it"
        except SyntaxError as exc:
            error = f"line {exc.lineno}: {exc.msg}"
        return f"Python {sys.version.split()[0]} cannot parse it ({error})"
    try:
        py3 = visitor.minimum_versions()[1]
    except vermin.InvalidVersionException as exc:
        return str(exc)
    if py3 is not None and py3 <= OLDEST:
        return _syntax_vermin_misses(source)
    details = [line.strip() for line in visitor.output_text().splitlines()
               if re.search(r"requires .*3\.(1[1-9]|[2-9]\d)\b|!3", line)]
    needs = "no Python 3" if py3 is None else "Python %d.%d" % py3
    return f"needs {needs}: " + "; ".join(details)


_RE_FUNCTIONS = {"compile", "search", "match", "fullmatch", "findall", "finditer", "sub", "subn", "split"}


def _regex_needs_3_11(pattern: str) -> bool:
    """Atomic groups and possessive quantifiers, (?>...) and a*+ (3.11)."""
    try:
        parser = importlib.import_module("re._parser")  # 3.11+
    except ImportError:
        try:
            re.compile(pattern)
        except re.error:
            return True  # 3.10 rejects the new syntax (or the pattern is broken anyway)
        return False
    try:
        parsed = parser.parse(pattern)
    except re.error:
        return False
    todo = [parsed]
    while todo:
        item = todo.pop()
        if isinstance(item, parser.SubPattern):
            todo += item.data
        elif isinstance(item, (list, tuple)):
            if item and str(item[0]) in ("ATOMIC_GROUP", "POSSESSIVE_REPEAT"):
                return True
            todo += item
    return False


def _syntax_vermin_misses(source: str) -> str | None:
    """3.11 features that vermin 1.9 does not flag: `a[*b]` and the new regex syntax
    in literal patterns given to the `re` module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript):
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(isinstance(p, ast.Starred) for p in parts):
                return f"line {node.lineno}: starred expression in a subscript requires 3.11"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                and node.func.attr in _RE_FUNCTIONS and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and _regex_needs_3_11(node.args[0].value)):
            return f"line {node.lineno}: atomic group or possessive quantifier requires 3.11"
    return None


def test_sources_need_no_python_newer_than_3_10():
    vermin = pytest.importorskip("vermin", reason="vermin is not installed (pip install -e '.[test]')")
    config = _vermin_config(vermin)
    files = _python_files()
    assert len(files) > 50, "the source folders were not found"
    too_new = []
    for path in files:
        rel = str(path.relative_to(REPO_ROOT))
        reason = _needs_newer_than_3_10(vermin, config, path.read_text(encoding="utf-8"), rel)
        if reason is not None:
            too_new.append(f"{rel}: {reason}")
    assert not too_new, "code that Python 3.10 cannot run:\n" + "\n".join(too_new)


@pytest.mark.parametrize("source", [
    "import tomllib\n",
    "from typing import Self\n",
    "import asyncio\nasync def f():\n    async with asyncio.TaskGroup() as g:\n        pass\n",
    "import enum\nclass Kind(enum.StrEnum):\n    A = 'a'\n",
    "try:\n    pass\nexcept* ValueError:\n    pass\n",
    "import hashlib\nhashlib.file_digest(open('f', 'rb'), 'sha256')\n",
    "import re\nre.compile('(?>a+)b')\n",
    "import re\nre.search(r'a*+b', 'ab')\n",
    "def f(a, b):\n    return a[*b]\n",
])
def test_the_check_catches_what_3_10_lacks(source):
    vermin = pytest.importorskip("vermin", reason="vermin is not installed (pip install -e '.[test]')")
    assert _needs_newer_than_3_10(vermin, _vermin_config(vermin), source, "<example>") is not None


def _requires_python() -> SpecifierSet:
    text = (REPO_ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+
    match = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.MULTILINE)
    assert match, "pyproject.toml has no requires-python"
    return SpecifierSet(match.group(1))


def test_requires_python_is_3_10_to_3_13():
    spec = _requires_python()
    for version in SUPPORTED:
        assert spec.contains(f"{version}.0") and spec.contains(f"{version}.99"), version
    # 3.14: nvidia-pytriton 0.7.0 has no python backend stub for it.
    for version in ["3.9.18", "3.14.0"]:
        assert not spec.contains(version), version


def test_running_python_is_supported():
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in SUPPORTED


def _stubs_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-pytriton is not installed (pip install -e '.[serve]')")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver" / "python_backend_stubs"


def test_triton_wheel_has_a_stub_for_each_supported_python():
    stubs = _stubs_dir()
    missing = [v for v in SUPPORTED if not (stubs / v / "triton_python_backend_stub").is_file()]
    assert not missing, f"{stubs} has no python backend stub for Python {', '.join(missing)}"


def test_server_dir_gets_the_stub_of_the_running_python(tmp_path):
    stubs = _stubs_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = prepare_server_dir(tmp_path / "server")
    installed = target / "backends" / "python" / "triton_python_backend_stub"
    assert filecmp.cmp(installed, stubs / version / "triton_python_backend_stub", shallow=False)
    for other in SUPPORTED:
        if other != version:
            assert not filecmp.cmp(installed, stubs / other / "triton_python_backend_stub", shallow=False)


def test_stub_finds_libpython_with_the_server_environment():
    """The stub links libpython3.X.so.1.0 (3.13: a copy inside the wheel); the server's
    LD_LIBRARY_PATH must let it load, also for pyenv/python.org builds that keep it in
    their own LIBDIR."""
    stubs = _stubs_dir()
    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    server_env = TritonServer(model_repository=Path(".")).environment()
    env = dict(os.environ, LD_LIBRARY_PATH=server_env["LD_LIBRARY_PATH"])
    out = subprocess.run(["ldd", str(stubs / version / "triton_python_backend_stub")], env=env,
                         capture_output=True, text=True, check=True).stdout
    libpython = [line.strip() for line in out.splitlines() if "libpython" in line]
    assert libpython and not any("not found" in line for line in libpython), out


# scripts/setup.sh's choice of interpreter, with fake interpreters on a bare PATH: each
# prints its version for `-c ...` and fails `-m venv`, so setup stops at the venv step
# and says which interpreter it used; nothing is installed.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then echo {version}; exit 0; fi
exit 3
"""
BROKEN_SHIM = """#!/bin/sh
echo "pyenv: python3.12: command not found" >&2
exit 127
"""


def _run_setup(tmp_path: Path, interpreters: dict[str, str | None], env_python: str | None = None,
               venv_version: str | None = None) -> subprocess.CompletedProcess:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # Only the tools setup.sh runs before creating the venv, and the fake interpreters.
    os.symlink(shutil.which("dirname"), fake_bin / "dirname")
    for name, version in interpreters.items():
        script = fake_bin / name
        script.write_text(BROKEN_SHIM if version is None else FAKE_PYTHON.format(version=version))
        script.chmod(0o755)
    if venv_version is not None:
        (repo / ".venv" / "bin").mkdir(parents=True)
        venv_python = repo / ".venv" / "bin" / "python"
        venv_python.write_text(FAKE_PYTHON.format(version=venv_version))
        venv_python.chmod(0o755)
    env = {"PATH": str(fake_bin), "HOME": str(tmp_path)}
    if env_python is not None:
        env["PYTHON"] = env_python
    return subprocess.run([bash, str(repo / "scripts" / "setup.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("interpreters, chosen", [
    ({"python3.10": "3.10", "python3.12": "3.12", "python3": "3.11"}, "python3.12"),
    ({"python3.12": None, "python3.11": "3.11", "python3": "3.11"}, "python3.11"),
    # 3.13 last: Triton cannot serve from it (its stub needs numpy<2, no 3.13 wheels).
    ({"python3.13": "3.13", "python3.10": "3.10"}, "python3.10"),
    ({"python3.13": "3.13", "python3": "3.9"}, "python3.13"),
    ({"python3": "3.13"}, "python3"),
    ({"python3.9": "3.9", "python3": "3.10"}, "python3"),
])
def test_setup_picks_the_newest_servable_python(tmp_path, interpreters, chosen):
    result = _run_setup(tmp_path, interpreters)
    assert result.returncode == 1
    assert f"'{chosen} -m venv' failed" in result.stderr, result.stderr


@pytest.mark.parametrize("interpreters", [{}, {"python3": "3.9"}, {"python3": "3.14", "python3.9": "3.9"}])
def test_setup_without_a_supported_python_says_which_are(tmp_path, interpreters):
    result = _run_setup(tmp_path, interpreters)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "setup: no Python 3.10, 3.11, 3.12 or 3.13 found on PATH (python3.10 ... python3.13, python3); "
        "install one or set PYTHON=/path/to/python"]


def test_setup_honours_PYTHON(tmp_path):
    result = _run_setup(tmp_path, {"python3.13": "3.13", "mypython": "3.10"}, env_python="mypython")
    assert "'mypython -m venv' failed" in result.stderr, result.stderr


def test_setup_rejects_an_unsupported_PYTHON(tmp_path):
    result = _run_setup(tmp_path, {"python3.12": "3.12", "py39": "3.9"}, env_python="py39")
    assert result.returncode == 1
    assert "PYTHON=py39 is Python 3.9; this project supports Python 3.10, 3.11, 3.12 or 3.13" in result.stderr


def test_setup_names_a_venv_of_an_unsupported_python(tmp_path):
    result = _run_setup(tmp_path, {"python3.12": "3.12"}, venv_version="3.9")
    assert result.returncode == 1
    assert ".venv was made with Python 3.9, which this project does not support" in result.stderr
    assert "rm -rf .venv" in result.stderr
