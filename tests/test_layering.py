"""lpoptim/kernels/ sits below lpoptim/nn/: kernels never import the layers that use them."""
import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "lpoptim" / "kernels"


def test_kernels_do_not_import_nn():
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = "." * node.level + (node.module or "")
                assert not (name.startswith("..nn") or name.startswith("lpoptim.nn")), f"{path.name}: {name}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("lpoptim.nn") for a in node.names), path.name
