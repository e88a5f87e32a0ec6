"""The package's layers import one way: no import cycle, no package import hidden in a function;
and no name is used undefined (pyflakes)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles_and_no_imports_in_functions():
    graph = _tool()
    top, in_functions = graph.imports()
    assert "cuflash.plan.dispatch" in top and len(top) > 40  # it read the package
    assert graph.cycles(top) == []
    assert in_functions == []


def test_the_checker_finds_a_cycle_and_a_hidden_import(tmp_path):
    graph = _tool()
    pkg = tmp_path / "cuflash"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from . import b\n")
    (pkg / "core" / "b.py").write_text("from .a import x\n\ndef f():\n    from ..core import a\n")
    top, in_functions = graph.imports(pkg)
    assert graph.cycles(top) == [["cuflash.core.a", "cuflash.core.b"]]
    assert in_functions == [("cuflash.core.b", 4, "cuflash.core.a")]


def test_lower_layers_do_not_import_upper_ones():
    order = ["core", "plan", "kernels", "backends", "api"]
    top, _ = _tool().imports()
    for mod, targets in top.items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] not in order:
            continue
        for t in targets:
            t_parts = t.split(".")
            if len(t_parts) >= 2 and t_parts[1] in order:
                assert order.index(t_parts[1]) <= order.index(parts[1]), f"{mod} imports {t}"


def test_accounting_models_and_nothing_that_runs_attention_imports_it():
    """accounting reads what plan.dispatch launches (and the e4m3 launcher's vt geometry); it runs
    nothing (no backend, no api), and the backends and the api do not import it."""
    top, _ = _tool().imports()
    layer = {m: m.split(".")[1] for m in top if m.count(".") >= 1}
    assert any(layer.get(m) == "accounting" for m in top)  # it read the package
    for mod, targets in top.items():
        for t in targets:
            pair = (layer.get(mod), layer.get(t))
            assert pair not in {("accounting", "backends"), ("accounting", "api"), ("backends", "accounting"),
                                ("api", "accounting")}, f"{mod} imports {t}"


def _undefined_names(paths):
    """pyflakes' undefined-name findings under paths, as 'file:line: message' strings."""
    # The test extra brings pyflakes (.ci/run fails without it); a GPU image may lack it.
    pyflakes_api = pytest.importorskip("pyflakes.api")
    messages = pytest.importorskip("pyflakes.messages")
    reporter = pytest.importorskip("pyflakes.reporter")
    found = []

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                found.append(f"{message.filename}:{message.lineno}: {message.message % message.message_args}")

        def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 - pyflakes' interface
            found.append(f"{filename}:{lineno}: syntax error: {msg}")

        def unexpectedError(self, filename, msg):  # noqa: N802
            found.append(f"{filename}: {msg}")

    pyflakes_api.checkRecursive([str(p) for p in paths], Collect())
    return found


def test_no_undefined_names_in_the_package_or_the_tests():
    """Code that runs only on a GPU (launchers, GPU tests) is never executed here: a name it uses
    without defining or importing it would first fail on the device. pyflakes finds those."""
    assert _undefined_names([ROOT / "cuflash", ROOT / "tests"]) == []


def test_the_undefined_name_check_finds_one(tmp_path):
    (tmp_path / "m.py").write_text("import os\n\ndef f(a):\n    return np.asarray(a, dtype=os.sep)\n")
    assert [line.split(": ", 1)[1] for line in _undefined_names([tmp_path])] == ["undefined name 'np'"]
