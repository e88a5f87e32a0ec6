"""The package's layers import one way: no import cycle, no package import hidden in a function."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "import_graph.py"


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
