"""The library's imports point one way, down the layers of docs/ARCHITECTURE.md (a module
imports only its own layer or those below), and no jaxagent import hides inside a function."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxagent"
# Bottom to top, in the direction data flows.
LAYERS = ("sharding", "kernels", "models", "checkpoint", "envs", "data", "rollout", "learners",
          "runs", "train", "eval", "study", "planning", "bench")


def _layer(module: str) -> int:
  parts = module.split(".")
  if parts == ["jaxagent"]:
    return len(LAYERS)           # the package itself: above everything
  return LAYERS.index(parts[1])


def _modules():
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    name = ".".join(p for p in rel.parts if p != "__init__")
    yield name, ast.parse(path.read_text(), str(path))


def _imports(tree):
  """(imported jaxagent module, line, inside a function) of every import statement."""
  out = []

  def visit(node, in_fn):
    for child in ast.iter_child_nodes(node):
      fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        out.extend((a.name, child.lineno, fn) for a in child.names
                   if a.name.startswith("jaxagent"))
      elif isinstance(child, ast.ImportFrom) and child.module == "jaxagent":
        out.extend((f"jaxagent.{a.name}", child.lineno, fn) for a in child.names)
      elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("jaxagent"):
        out.append((child.module, child.lineno, fn))
      visit(child, fn)

  visit(tree, False)
  return out


def test_every_module_is_in_a_layer():
  for name, _ in _modules():
    if name != "jaxagent":
      assert name.split(".")[1] in LAYERS, f"{name}: add its package to LAYERS (and the docs)"


@pytest.mark.parametrize("name, tree", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_point_down_and_sit_at_the_top(name, tree):
  for module, line, in_fn in _imports(tree):
    assert not in_fn, f"{name}:{line} imports {module} inside a function; import it at the top"
    assert _layer(module) <= _layer(name), (
        f"{name}:{line} imports {module}, a layer above it ({LAYERS[_layer(module)]} > "
        f"{LAYERS[_layer(name)] if _layer(name) < len(LAYERS) else 'jaxagent'})")
