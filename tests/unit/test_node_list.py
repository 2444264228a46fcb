"""node_list.json: the node ids ComfyUI-Manager maps to this pack ("install missing custom nodes").
A V3-only pack has no NODE_CLASS_MAPPINGS for Manager's scanner to find, so the file lists them;
it must name exactly the nodes that nodes/schemas.py defines, each with its description's first
sentence."""
import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def schema_nodes(source: str) -> dict:
    """{node_id: description} of every ``io.Schema(...)`` call in a schemas module."""
    found = {}
    for call in ast.walk(ast.parse(source)):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "Schema":
            kw = {k.arg: k.value for k in call.keywords}
            node_id, description = kw.get("node_id"), kw.get("description")
            assert isinstance(node_id, ast.Constant), "node_id must be a literal"
            found[node_id.value] = description.value if isinstance(description, ast.Constant) else ""
    return found


def first_sentence(text: str) -> str:
    m = re.match(r"(.+?\.)(\s|$)", text.strip())
    return m.group(1) if m else text.strip()


def check(node_list: dict, schemas: dict) -> list:
    problems = []
    if set(node_list) != set(schemas):
        problems.append(f"node_list.json lists {sorted(node_list)}, the schemas define {sorted(schemas)}")
    for node_id, desc in node_list.items():
        if not isinstance(desc, str) or not desc.strip() or "\n" in desc:
            problems.append(f"{node_id}: the description must be one non-empty line")
        elif node_id in schemas and desc != first_sentence(schemas[node_id]):
            problems.append(f"{node_id}: {desc!r} is not the schema description's first sentence "
                            f"{first_sentence(schemas[node_id])!r}")
    return problems


def test_node_list_matches_the_schemas():
    node_list = json.loads((ROOT / "node_list.json").read_text(encoding="utf-8"))
    schemas = schema_nodes((ROOT / "nodes" / "schemas.py").read_text(encoding="utf-8"))
    assert schemas, "no io.Schema found in nodes/schemas.py"
    assert check(node_list, schemas) == []


def test_the_check_catches_drift():
    schemas = {"A": "Does a. Then b.", "B": "Does b."}
    assert check({"A": "Does a.", "B": "Does b."}, schemas) == []
    assert "the schemas define" in check({"A": "Does a."}, schemas)[0]
    assert "first sentence" in check({"A": "Does x.", "B": "Does b."}, schemas)[0]
    assert "one non-empty line" in check({"A": "", "B": "Does b."}, schemas)[0]
    src = 'io.Schema(node_id="N", description=("One. " "Two."))\nio.Schema(node_id="M", description="Three.")'
    assert schema_nodes(src) == {"N": "One. Two.", "M": "Three."}
