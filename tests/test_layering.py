"""Layering and configuration: lpoptim/kernels/ sits below lpoptim/nn/ (kernels never import the layers that use
them), and lpoptim has no environment variables of its own."""
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


def test_no_environment_switches():
    """lpoptim is configured by arguments, not environment variables: those it reads are Triton's own
    TRITON_INTERPRET (kernels/grid.py: whether kernels run under the interpreter) and Inductor's own switch for
    launching user Triton kernels statically (nn/weight_scale.py: whether Inductor's compile workers will, which
    informs prepare's automatic previous_weight_scale; the argument overrides it), and no module reads one at
    import."""
    reads = []
    for path in sorted(KERNELS.parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "putenv"):
                reads.append(path.relative_to(KERNELS.parent).as_posix())
        for stmt in tree.body:  # module level: reads that would happen at import
            for node in ast.walk(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    break
                assert not (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")), \
                    f"{path.name} reads the environment at import"
    assert reads == ["kernels/grid.py", "nn/weight_scale.py"], reads
