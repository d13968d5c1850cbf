"""The house stays as docs/design.md draws it: its layout table names every module that exists
(and none that does not), and the sync's stages stay small enough to read and type alone."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _body_lines(node) -> int:
  """Lines of a function, its docstring aside."""
  body = node.body
  first = body[0]
  if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
      first.value.value, str):
    if len(body) == 1:
      return 0
    first = body[1]
  return node.end_lineno - first.lineno + 1


def _functions(tree, inside=False):
  """``(function, is_closure)`` for every function in ``tree``, nested ones included."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node, inside
      yield from _functions(node, True)
    else:
      yield from _functions(node, inside)


def test_no_function_of_the_sync_is_a_module_in_disguise():
  too_long = []
  paths = sorted([*(ROOT / "spardl_jax" / "_src" / "sync").glob("*.py"),
                  *(ROOT / "spardl_jax" / "_src" / "recipes").glob("*.py")])
  assert len(paths) > 10
  for path in paths:
    for node, closure in _functions(ast.parse(path.read_text())):
      limit = 40 if closure else 80
      if _body_lines(node) > limit:
        too_long.append(f"{path.name}:{node.lineno} {node.name} ({_body_lines(node)} > {limit})")
  assert not too_long


def test_sync_gradients_is_a_small_factory():
  tree = ast.parse((ROOT / "spardl_jax" / "_src" / "sync" / "transform.py").read_text())
  factory = next(node for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name == "sync_gradients")
  closures = [node.name for node, _ in _functions(factory)]
  assert _body_lines(factory) <= 60 and closures == ["init_fn", "update_fn"]


def test_the_layout_table_names_every_module():
  """docs/design.md's layout table lists each module of the library as a `path` in its first
  column; a module added, moved or removed must show there."""
  text = (ROOT / "docs" / "design.md").read_text()
  table = text[text.index("## Layout"):]
  table = table[:table.index("\n## ", 1)] if "\n## " in table[1:] else table
  named = set(re.findall(r"^\| `([^`]+\.py)`", table, flags=re.M))
  existing = {str(p.relative_to(ROOT)) for p in (ROOT / "spardl_jax").rglob("*.py")
              if p.name != "__init__.py"}
  assert named == existing, (sorted(existing - named), sorted(named - existing))


def test_every_relative_link_of_the_docs_resolves():
  """Pages moved between docs/ and benchmarks/results/ keep their links working."""
  pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").rglob("*.md")]
  broken = []
  for page in pages:
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if link.startswith(("http://", "https://", "#", "mailto:")):
        continue
      if not (page.parent / link.split("#")[0]).exists():
        broken.append(f"{page.relative_to(ROOT)} -> {link}")
  assert not broken


# What the pages and docstrings name: a path with a folder in backticks, found from the
# repository root, the library's root or its _src (the paper table's paths are under _src),
# and a dotted name of the public face, sj.<name>... or spardl_jax.<module>...<name>.
_NAMING_PAGES = ("README.md", "docs/*.md", "benchmarks/README.md", "spardl_jax/**/*.py",
                 "train/**/*.py", "benchmarks/*.py")


def _named(pattern):
  for glob in _NAMING_PAGES:
    for page in sorted(ROOT.glob(glob)):
      for match in re.finditer(pattern, page.read_text()):
        yield page.relative_to(ROOT), match.group(1)


def test_every_path_the_pages_name_exists():
  """A module moved or renamed takes its mentions with it (`sync/methods.py` stayed in
  design.md's paper table for a turn after its move)."""
  roots = (ROOT, ROOT / "spardl_jax" / "_src", ROOT / "spardl_jax")
  missing = [f"{page}: {path}" for page, path in _named(r"`([\w./-]+/[\w-]+\.py)\b")
             if not any((root / path).exists() for root in roots)]
  assert not missing


def test_every_public_name_the_pages_name_exists():
  """``sj.lookahead`` stayed in two pages after its rename to ``sj.weight_prediction``; a
  name of the face that does not exist fails here, whichever page holds it."""
  import importlib

  import spardl_jax as sj

  def found(path):
    obj, module = sj, "spardl_jax"
    for part in path.split("."):
      if hasattr(obj, part):
        obj = getattr(obj, part)
      else:
        try:
          obj = importlib.import_module(f"{module}.{part}")
        except ImportError:
          return False
      module = f"{module}.{part}"
    return True

  missing = [f"{page}: {prefix}.{path}"
             for prefix, pattern in (("sj", r"\bsj\.((?:\w+\.)*\w+)"),
                                     ("spardl_jax", r"\bspardl_jax\.((?:\w+\.)*\w+)"))
             for page, path in _named(pattern)
             if not found(path) and path not in ("X", "ns.X")]
  assert not missing
