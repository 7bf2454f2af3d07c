"""The package's layers (docs/architecture.md): no import runs from a lower
layer to a higher one, and only the cache manager stores the pages and the
manager states. Read from the source with `ast`; nothing is imported."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Bottom first, as docs/architecture.md lists them. A module may import its
# own layer and the layers below; models and engine share a rank but may not
# import each other.
LAYERS = {
  "kernels": (0, ["pallas_kernels"]),
  "foundations": (
    1,
    [
      "paged_jax.config",
      "paged_jax.structured",
      "paged_jax.compile_guard",
      "paged_jax.compilation_cache",
      "paged_jax.params",
      "paged_jax.sampling",
      "paged_jax.token_ids",
    ],
  ),
  "block manager": (2, ["paged_jax.block_manager"]),
  "KV cache and attention": (
    3,
    [
      "paged_jax.kernel_choice",
      "paged_jax.kv_memory",
      "paged_jax.kv_plans",
      "paged_jax.sharding",
      "paged_jax.attention",
      "paged_jax.kv_cache",
      "paged_jax.kv_swap",
      "paged_jax.hybrid_kv",
      "paged_jax.paged_cache",
    ],
  ),
  "models": (4, ["paged_jax.models"]),
  "engine": (4, ["paged_jax.engine"]),
  "entry points": (
    5,
    [
      "paged_jax.generate",
      "paged_jax.simulate",
      "paged_jax.aot",
      "paged_jax.aot_kv",
      "paged_jax.server",
      "paged_jax.command_line",
      "paged_jax.__main__",
      "paged_jax",
    ],
  ),
}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
  """The layer of `module`: that of the longest listed name it is or lies in."""
  best = None
  for layer, (_, names) in LAYERS.items():
    for name in names:
      if (module == name or module.startswith(name + ".")) and (
        best is None or len(name) > len(best[1])
      ):
        best = (layer, name)
  if best is None:
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")
  return best[0]


def is_module(name: str) -> bool:
  path = ROOT / name.replace(".", "/")
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(tree: ast.Module, package: str) -> set[str]:
  """The package's modules a module imports, anywhere in it (lazy imports
  too); `from a import b` counts `a.b` when that is a module."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
      for alias in node.names:
        full = f"{base}.{alias.name}"
        found.add(full if is_module(full) else base)
  return {m for m in found if m.split(".")[0] in ("paged_jax", "pallas_kernels")}


def source_files():
  return sorted(
    path for top in ("paged_jax", "pallas_kernels") for path in (ROOT / top).rglob("*.py")
  )


def wrong_way(importer: str, imported: str) -> bool:
  (rank, _), (their_rank, _) = LAYERS[importer], LAYERS[imported]
  return their_rank > rank or (their_rank == rank and importer != imported)


def test_no_import_runs_up_the_layers():
  bad = []
  for path in source_files():
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    mine = layer_of(module)
    for imported in sorted(imported_modules(ast.parse(path.read_text()), package)):
      theirs = layer_of(imported)
      if wrong_way(mine, theirs):
        bad.append(f"{module} ({mine}) imports {imported} ({theirs})")
  assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


@pytest.mark.parametrize(
  ("importer", "imported", "wrong"),
  [
    ("paged_jax.models.dense", "paged_jax.engine.llm_engine", True),
    ("paged_jax.kv_cache", "paged_jax.engine", True),
    ("paged_jax.engine.runner", "paged_jax.models", True),
    ("paged_jax.engine.runner", "paged_jax.kv_cache", False),
    ("paged_jax.server.app", "paged_jax.engine", False),
  ],
)
def test_the_rule_tells_wrong_arrows_from_right_ones(importer, imported, wrong):
  assert wrong_way(layer_of(importer), layer_of(imported)) == wrong


def test_only_the_cache_manager_stores_pages_and_manager_states():
  writers = []
  for path in source_files():
    if path.name == "cache_manager.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      targets = node.targets if isinstance(node, ast.Assign) else []
      for target in targets:
        for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
          if (
            isinstance(leaf, ast.Attribute)
            and leaf.attr in ("state", "kv")
            and isinstance(leaf.value, ast.Attribute | ast.Name)
            and getattr(leaf.value, "attr", getattr(leaf.value, "id", None)) == "cache"
          ):
            writers.append(f"{module_name(path)}:{node.lineno}")
  assert not writers, f"cache.state or cache.kv assigned outside the cache manager: {writers}"


# Inside the engine, bottom first; the parts of one rank import none of
# each other.
ENGINE_RANKS = [
  ["outputs", "protocol", "sequence", "memory", "arrivals"],
  ["scheduler_output", "admission", "beam", "speculative", "weights", "step_stream"],
  ["programs"],
  ["cache_manager"],
  ["packing", "row_table"],
  ["run_ahead"],
  ["scheduler", "runner", "input_processor", "output_processor"],
  ["engine_checks", "rounds", "lifecycle"],
  ["llm_engine", "rollout"],
  ["llm"],
  [""],  # the engine package's __init__
]


def engine_rank(module: str) -> int:
  part = module.removeprefix("paged_jax.engine").lstrip(".").split(".")[0]
  return next(i for i, names in enumerate(ENGINE_RANKS) if part in names)


def test_engine_parts_import_downwards():
  bad = []
  for path in sorted((ROOT / "paged_jax" / "engine").rglob("*.py")):
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    part = module.removeprefix("paged_jax.engine").lstrip(".").split(".")[0]
    for imported in imported_modules(ast.parse(path.read_text()), package):
      other = imported.removeprefix("paged_jax.engine").lstrip(".").split(".")[0]
      if not imported.startswith("paged_jax.engine") or other == part:
        continue
      if engine_rank(imported) >= engine_rank(module):
        bad.append(f"{module} imports {imported}")
  assert not bad, "engine parts importing their own rank or above:\n" + "\n".join(bad)
