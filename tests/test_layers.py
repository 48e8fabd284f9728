"""The package layers: no module imports a package above its own (function-local imports included).

Data flows one way (docs/architecture.md): config -> runtime -> data + models -> parallel -> loop -> checkpoint /
observe, with the commands on top. A `command.py` module is a subcommand's entry point: it sits above every
component (it may import any package below the CLI), and nothing imports it but the CLI's table.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "phalanx"

# Lowest first. Packages on one level must not import each other.
LAYERS = [
    {"errors"},
    {"config"},
    {"runtime"},
    {"checkpoint"},
    {"data"},
    {"models"},
    {"parallel"},
    {"observe"},
    {"launch"},
    {"train", "engine", "generate"},
    {"plan"},
    {"cli"},
    {"__main__"},
]
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}
COMMANDS = LEVEL["cli"]  # the level a command.py module imports from


def phalanx_imports(path: Path) -> list[str]:
    """Every `phalanx.X...` module a file imports, wherever the import statement is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phalanx.") and node.level == 0:
            found.append(node.module[len("phalanx.") :])
        elif isinstance(node, ast.Import):
            found += [a.name[len("phalanx.") :] for a in node.names if a.name.startswith("phalanx.")]
    return found


def package_of(relative: Path) -> str:
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_every_package_has_a_layer():
    packages = {package_of(p.relative_to(SRC)) for p in SRC.rglob("*.py")} - {"__init__"}
    assert packages <= LEVEL.keys(), packages - LEVEL.keys()


def test_no_module_imports_a_higher_layer():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC)
        own = package_of(relative)
        if own == "__init__":
            continue
        level = COMMANDS if relative.name == "command.py" else LEVEL[own]
        for module in phalanx_imports(path):
            target = module.split(".")[0]
            if target == own:
                continue
            target_level = COMMANDS if module.endswith(".command") else LEVEL[target]
            if target_level >= level and not (module.endswith(".command") and own == "cli"):
                wrong.append(f"{relative} imports phalanx.{module}")
    assert not wrong, "\n".join(wrong)
