"""The agent runs on the Python that node images have: 3.9 through 3.13.

A node runs the agent (and the training library its ranks import) on the image's own
``python3``: 3.10 on SkyPilot's default images, 3.9 on older ones. This machine has
only 3.11, so these claims are static: every module a node imports parses as 3.9, uses
no 3.10+ runtime construct that vermin cannot see (``X | Y`` in ``isinstance``, a union
type alias), and imports nothing outside the standard library and the node's own files.
``scripts/test`` runs vermin over the same files (the list there is the one read here).
"""

from __future__ import annotations

import ast
import enum
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract import CommandType, StrEnum39

ROOT = Path(__file__).resolve().parents[2]


def _vermin_paths() -> list[str]:
    """The paths ``scripts/test`` hands vermin: the node's files, in one place."""
    line = next(ln for ln in (ROOT / "scripts/test").read_text().splitlines() if "vermin" in ln)
    return [w for w in line.split() if not w.startswith("-") and "vermin" not in w]


def _node_files() -> list[Path]:
    out: list[Path] = []
    for p in _vermin_paths():
        path = ROOT / p
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


NODE_FILES = _node_files()
IDS = [str(p.relative_to(ROOT)) for p in NODE_FILES]


def test_scripts_test_checks_the_agent_the_contract_and_the_training_library():
    names = set(IDS)
    assert {"orchestrator/agent/main.py", "orchestrator/contract.py"} <= names
    assert "orchestrator/package.py" in names and "training/checkpoint.py" in names


def test_everything_the_agent_imports_is_a_node_file_or_the_standard_library():
    """Import the agent and every module it imports lazily (metadata, storage), then
    look: a module outside the checked files would be unchecked 3.11 code on a node."""
    probe = (
        "import json, sys\n"
        "import orchestrator.agent.main, orchestrator.agent.allreduce_check\n"
        "import orchestrator.cloud.metadata, orchestrator.cloud.storage\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    files = {str(p.relative_to(ROOT).with_suffix("")).replace("/", ".") for p in NODE_FILES}
    files = {f.removesuffix(".__init__") for f in files}
    ours = {m for m in loaded if m.split(".")[0] in ("orchestrator", "training")}
    assert ours <= files, f"imported on a node but not checked: {sorted(ours - files)}"
    stdlib = set(sys.stdlib_module_names) | {"orchestrator", "training", "__main__"}
    foreign = {m.split(".")[0] for m in loaded} - stdlib - {m for m in loaded if m[:1] == "_"}
    assert not foreign, f"the agent imports packages a node image may not have: {foreign}"


def _runtime_union(node: ast.AST) -> bool:
    """``a | b`` where a side is a type: None, a builtin type name, a subscripted
    generic (``list[int]``) or another such union (a 3.10+ ``types.UnionType``)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)):
        return False

    def typeish(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return n.value is None
        if isinstance(n, ast.Name):
            return n.id in {"int", "float", "str", "bytes", "bool", "list", "tuple", "dict",
                            "set", "frozenset", "type", "object"} or n.id[:1].isupper()  # fmt: skip
        return isinstance(n, ast.Subscript) or _runtime_union(n)

    return typeish(node.left) or typeish(node.right)


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside an annotation (unevaluated: ``from __future__``)."""
    inside: set[int] = set()
    for n in ast.walk(tree):
        anns: list[ast.AST | None] = []
        if isinstance(n, ast.AnnAssign | ast.arg):
            anns.append(n.annotation)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            anns.append(n.returns)
        for a in anns:
            if a is not None:
                inside |= {id(x) for x in ast.walk(a)}
    return inside


@pytest.mark.parametrize("path", NODE_FILES, ids=IDS)
def test_a_node_module_is_python_3_9(path: Path):
    src = path.read_text()
    tree = ast.parse(src, filename=str(path), feature_version=(3, 9))  # match, except*...
    future = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    annotations = _annotation_nodes(tree)
    bad = []
    for n in ast.walk(tree):
        if _runtime_union(n):
            if id(n) not in annotations:
                bad.append(f"line {n.lineno}: a type union evaluated at run time (3.10+)")
            elif not future:
                bad.append(f"line {n.lineno}: X | Y annotation without __future__ annotations")
        if (
            isinstance(n, ast.With)
            and len(n.items) > 1
            and re.match(r"\s*(async\s+)?with\s*\(", ast.get_source_segment(src, n) or "")
        ):
            bad.append(f"line {n.lineno}: parenthesized context managers (3.10+)")
        if isinstance(n, ast.keyword) and n.arg == "strict":
            bad.append(f"line {n.lineno}: strict= (zip's is 3.10+)")
    assert not bad, "\n".join(bad)


def test_a_union_in_isinstance_is_found():
    """The check above can fail: the constructs it looks for are found."""
    tree = ast.parse("isinstance(x, int | None)\nY = list[int] | None\nZ = a | b\n")
    found = [n for n in ast.walk(tree) if _runtime_union(n)]
    assert len(found) == 2  # ``a | b`` of two values is an or, not a union


class Real(enum.StrEnum):
    A = "a"
    B = enum.auto()


class Compat(StrEnum39):
    A = "a"
    B = enum.auto()


@pytest.mark.parametrize(
    "probe",
    [str, repr, lambda m: f"{m}", lambda m: f"{m:>3}", lambda m: "%s" % m, json.dumps,  # noqa: UP031
     lambda m: m == m.value, lambda m: type(m)(m.value).name, lambda m: isinstance(m, str)],
    ids=["str", "repr", "fstring", "format-spec", "percent", "json", "eq", "by-value", "is-str"],
)  # fmt: skip
def test_the_3_9_str_enum_behaves_as_3_11s(probe):
    for real, compat in zip(Real, Compat, strict=True):
        want = probe(real)
        assert probe(compat) == (want.replace("Real", "Compat") if isinstance(want, str) else want)


def test_the_shared_vocabulary_is_the_str_enum_of_this_python():
    assert isinstance(CommandType.STOP, enum.StrEnum) and f"{CommandType.STOP}" == "stop"
