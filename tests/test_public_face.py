"""What `import spardl_jax` gives: the library, not its tools (`spardl_jax.tools`, imported
where used), every namespace a door file over the private `spardl_jax._src`; and the
library's own users (the trainer, the models, the lab, the docs' programs) need nothing past
that face. (The suite's own unit tests reach into `_src`, as optax's tests do.)"""

import inspect
import pathlib
import subprocess
import sys

import spardl_jax as sj


def test_importing_the_library_loads_no_tool():
  code = ("import sys, spardl_jax as sj; "
          "assert not [m for m in sys.modules if m.startswith('spardl_jax.tools')]; "
          "assert not hasattr(sj, 'traffic') and sj.checkpoint.refold; "
          "from spardl_jax.tools import traffic; assert traffic.parse_hlo")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


ROOT = pathlib.Path(__file__).resolve().parent.parent
USERS = ("train", "models", "benchmarks")  # the library's own users, held to its public face


def _past_the_face(source: str) -> list[str]:
  """Where ``source`` reaches past ``spardl_jax``'s public face: an import of a module inside
  it (but the tools, ``spardl_jax.tools``, a door of their own), a name it does not export,
  or ``sj.X`` / ``sj.ns.X`` where ``X`` is not in the ``__all__`` of ``sj`` or of its
  namespace ``ns`` (``ns`` a module ``sj`` exports)."""
  import ast
  found, aliases = [], set()
  tree = ast.parse(source)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("spardl_jax.") and not _tool(a.name):
          found.append(f"line {node.lineno}: import {a.name}")
        elif a.name == "spardl_jax":
          aliases.add(a.asname or a.name)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      space = _namespace(node.module)
      if space is not None:  # from a namespace sj exports: the names it exports
        found += [f"line {node.lineno}: from {node.module} import {a.name}"
                  for a in node.names if a.name not in space.__all__]
      elif node.module.startswith("spardl_jax.") and not _tool(node.module):
        found.append(f"line {node.lineno}: from {node.module} import ...")
      elif node.module == "spardl_jax":
        found += [f"line {node.lineno}: from spardl_jax import {a.name}" for a in node.names
                  if a.name not in sj.__all__]
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases):
      if node.attr not in sj.__all__:
        found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
          and isinstance(node.value.value, ast.Name) and node.value.value.id in aliases):
      space = getattr(sj, node.value.attr, None)
      if inspect.ismodule(space) and node.attr not in getattr(space, "__all__", ()):
        found.append(f"line {node.lineno}: {node.value.value.id}.{node.value.attr}.{node.attr}")
  return found


def _namespace(module: str):
  """The namespace ``sj`` exports as ``module`` (``spardl_jax.<name>``), or None."""
  head, _, name = module.partition(".")
  space = getattr(sj, name, None) if head == "spardl_jax" and "." not in name else None
  return space if inspect.ismodule(space) and name in sj.__all__ else None


def _tool(module: str) -> bool:
  return module == "spardl_jax.tools" or module.startswith("spardl_jax.tools.")


def test_the_trainer_models_and_benchmarks_use_only_the_public_face():
  """train/, models/ and benchmarks/ import `spardl_jax` and nothing inside it, and use only
  the names it and its namespaces export: what they need, a user has."""
  past = {str(path.relative_to(ROOT)): found
          for folder in USERS for path in sorted((ROOT / folder).rglob("*.py"))
          if (found := _past_the_face(path.read_text()))}
  assert not past, past


def test_the_face_check_sees_each_way_past():
  source = ("import spardl_jax as sj\nimport spardl_jax._src.core.topk\n"
            "from spardl_jax._src.sync import registry as methods\nfrom spardl_jax import stages\n"
            "from spardl_jax.tools import traffic\nimport spardl_jax.tools.bench\n"
            "sj._src\nsj.methods.protocol\nsj.methods.make\nsj.spardl\n"
            "from spardl_jax.states import layout, protocol\n")
  assert sorted((f.split(":")[0] for f in _past_the_face(source)),
                key=lambda line: int(line.split()[1])) == [
      "line 2", "line 3", "line 4", "line 7", "line 8", "line 11"]


def _doc_blocks():
  from tests.test_readme import _blocks  # every Python block of a page, as it runs them
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    for i, block in enumerate(_blocks(str(path))):
      yield f"{path.name} block {i}", block


def test_every_doc_program_and_flax_user_program_uses_only_the_public_face():
  """What the README and the guides show, and the Flax user's programs, a user can write
  with the public names alone."""
  sources = dict(_doc_blocks())
  sources.update({str(path.relative_to(ROOT)): path.read_text()
                  for path in sorted((ROOT / "tests" / "flax_user").glob("*.py"))})
  assert len(sources) > 10
  past = {where: found for where, source in sources.items()
          if (found := _past_the_face(source))}
  assert not past, past


LIBRARY = ROOT / "spardl_jax"


def test_every_namespace_is_a_door_file_that_only_hands_names_on():
  """Each module ``sj`` exports is a file ``spardl_jax/NAME.py`` whose ``__all__`` names only
  what it imports from ``spardl_jax._src`` (no code of its own), and the files beside
  ``__init__.py`` are those doors and nothing else (the implementation is under ``_src``,
  the tools under ``tools``)."""
  import ast
  spaces = [name for name in sj.__all__ if inspect.ismodule(getattr(sj, name))]
  assert len(spaces) >= 10
  doors = sorted(p.stem for p in LIBRARY.glob("*.py") if p.name != "__init__.py")
  assert doors == sorted(spaces)
  assert sorted(p.name for p in LIBRARY.iterdir() if p.is_dir()
                and p.name != "__pycache__") == ["_src", "tools"]
  for name in spaces:
    module = getattr(sj, name)
    assert pathlib.Path(module.__file__) == LIBRARY / f"{name}.py", name
    tree = ast.parse((LIBRARY / f"{name}.py").read_text())
    defined = [node.name for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    assert defined == [], (name, defined)
    imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("spardl_jax._src.")
                for a in node.names}
    assert set(module.__all__) <= imported, (name, set(module.__all__) - imported)
    assert all(getattr(module, n, None) is not None for n in module.__all__), name


def _past_the_trainer_face(source: str) -> list[str]:
  """Where ``source`` reaches past the trainer's face: an import from a module inside
  ``train``, or of a name ``train.__all__`` does not hold."""
  import ast

  import train
  past = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
        node.module == "train" or node.module.startswith("train.")):
      past += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
               if node.module != "train" or a.name not in train.__all__]
    elif isinstance(node, ast.Import):
      past += [f"line {node.lineno}: import {a.name}" for a in node.names
               if a.name.startswith("train.")]
  return past


def test_the_lab_reaches_the_trainer_only_through_its_face():
  """benchmarks/ imports from ``train`` itself, names in ``train.__all__``: the trainer's
  step functions, its optimizer building and its command line are its own."""
  past = {path.name: found for path in sorted((ROOT / "benchmarks").rglob("*.py"))
          if (found := _past_the_trainer_face(path.read_text()))}
  assert past == {}


def test_the_trainer_face_check_sees_each_way_past():
  source = ("from train.train import _setup\nimport train.loop\n"
            "from train import make_mesh, _secret\nimport train\n")
  assert _past_the_trainer_face(source) == [
      "line 1: from train.train import _setup", "line 2: import train.loop",
      "line 3: from train import _secret"]
