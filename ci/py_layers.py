"""The Python package's layers (run by ci/lint_rules; stdlib only).

Each part of portable_zip stands on a floor; a module imports only parts on
lower floors (or its own part), only through a part's face (its
__init__.py: `from ..comm import X`, never `from ..comm.group import X`),
and no name of another part that starts with an underscore. _C (the
compiled binding) and _version are the ground floor, open to all.

    python3 ci/py_layers.py [package dir]   exits 1 and names each violation
    python3 ci/py_layers.py --floors portable_zip/comm   each module's floor in its part
"""
from __future__ import annotations

import ast
import pathlib
import sys

FLOORS = {
    "_C": 0, "_version": 0,
    "codec": 1,
    "comm": 2, "netns": 2,
    "c10d": 3, "weights": 3, "kv": 3, "ops": 3,
    "ddp": 4, "fsdp": 4,  # the hooks: their Works are the backend's
    "__init__": 5, "demo": 6, "__main__": 7,  # the package's face; its demo (using the face), the CLI
}
GROUND = ("_C", "_version")
PKG = "portable_zip"


def part_of(mod: str) -> str:
    """portable_zip.comm.p2p -> comm; portable_zip -> __init__."""
    bits = mod.split(".")
    return bits[1] if len(bits) > 1 else "__init__"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    bits = list(rel.parts)
    if bits[-1] == "__init__":
        bits = bits[:-1]
    return ".".join(bits)


def resolve(node: ast.ImportFrom, here: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base if is_pkg else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def check_file(path: pathlib.Path, root: pathlib.Path) -> list:
    here = module_name(path, root)
    me = part_of(here) if path.name != "__init__.py" or here != PKG else "__init__"
    if me not in FLOORS:
        return [f"{path}: part {me!r} has no floor in ci/py_layers.py"]
    tree = ast.parse(path.read_text(), str(path))
    out, bound = [], {}  # bound: local name -> the other part it names (for attribute checks)

    def target(mod: str, names, line: int) -> None:
        if not (mod == PKG or mod.startswith(PKG + ".")):
            return
        if mod == PKG:  # from portable_zip import x: x is a part (or a name of the face)
            if not names:  # import portable_zip: the face itself
                edge("__init__", PKG, [], line)
            for alias in names:
                sub = alias.name
                if sub in FLOORS and sub != "__init__":
                    edge(sub, f"{PKG}.{sub}", [], line)
                    bound[alias.asname or sub] = sub
                else:
                    edge("__init__", PKG, [alias], line)
            return
        edge(part_of(mod), mod, names, line)
        if not names and part_of(mod) != me:
            bound[mod.split(".")[-1]] = part_of(mod)

    def edge(part: str, mod: str, names, line: int) -> None:
        if part == me or part in GROUND:
            return
        where = f"{path}:{line}"
        if part not in FLOORS:
            out.append(f"{where}: imports {mod}, a part with no floor")
            return
        if FLOORS[part] >= FLOORS[me]:
            out.append(f"{where}: {me} (floor {FLOORS[me]}) imports {part} (floor {FLOORS[part]}): an import up or sideways")
        if mod.count(".") > 1:
            out.append(f"{where}: imports {mod}: use {PKG}.{part}'s face, not its inside")
        for alias in names:
            if alias.name.startswith("_"):
                out.append(f"{where}: imports {part}'s private name {alias.name}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target(resolve(node, here, path.name == "__init__.py"), node.names, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target(alias.name, [], node.lineno)
                if alias.asname and alias.name.startswith(PKG + "."):
                    bound[alias.asname] = part_of(alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in GROUND:
            out.append(f"{path}:{node.lineno}: reaches {bound[node.value.id]}'s private name {node.attr}")
    return out


def floors(folder: pathlib.Path) -> dict:
    """Each module of one part (a folder) -> its floor within it: 1 + the
    highest floor of the part's modules it imports (docs/COMM.md's table)."""
    deps = {}
    for f in folder.rglob("*.py"):
        name = ".".join(f.relative_to(folder).with_suffix("").parts)
        if name.endswith("__init__"):
            continue
        here = name.split(".")[:-1]
        got = set()
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom) and 0 < n.level <= len(here) + 1:
                base = here[:len(here) - n.level + 1]
                mods = [n.module] if n.module else [a.name for a in n.names]
                got |= {".".join(base + m.split(".")) for m in mods}
        deps[name] = got

    def floor(m, seen=()):
        below = [d for d in deps[m] if d in deps and d != m and d not in seen]
        return 1 + max((floor(d, seen + (m,)) for d in below), default=0)
    return {m: floor(m) for m in deps}


def main(argv) -> int:
    if len(argv) > 2 and argv[1] == "--floors":  # python3 ci/py_layers.py --floors portable_zip/comm
        for m, f in sorted(floors(pathlib.Path(argv[2])).items(), key=lambda x: (-x[1], x[0])):
            print(f, m.replace(".", "/") + ".py")
        return 0
    root = pathlib.Path(argv[1] if len(argv) > 1 else PKG).resolve()
    bad = [v for f in sorted(root.rglob("*.py")) for v in check_file(f, root)]
    for v in bad:
        print(f"lint: {v}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
