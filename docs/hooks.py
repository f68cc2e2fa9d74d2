"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* The notebooks in ``notebooks/`` and ``benchmarks/README.md`` join the site as they lie in the
  repository (no copy under ``docs/``): the notebooks are rendered by mkdocs-jupyter from their
  committed outputs, the benchmark record becomes ``benchmark-record.md``.
* The notebooks' mathematics (``$...$``, ``$$...$$`` in markdown cells) becomes MathML, which
  browsers render natively: no MathJax to fetch when a page is viewed.
* ``reference/cli.md``'s placeholder becomes the ``--help`` of every ``jaxacct`` subcommand,
  read from the command line's own parser (a new subcommand appears by itself).
* After the build, every public name must be documented: each name in ``jaxacct.__all__`` and,
  recursively, in the ``__all__`` of every public module that has one (``jaxacct.pld``,
  ``jaxacct.training``, ...) must have a docstring and appear in the API reference (its own
  heading, or that of another public name for the same object), and every module-level object
  the reference renders must have a docstring. Docstrings are read statically by griffe, as
  mkdocstrings reads them: the check imports no JAX. A failure aborts the build, strict or not,
  naming each name and what it lacks.
"""

from __future__ import annotations

import html
import logging
import pathlib
import re
import sys

import griffe
from latex2mathml.converter import convert as latex_to_mathml
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "jaxacct"
NOTEBOOKS = ROOT / "notebooks"
# Pages whose source lies outside docs/: {site path: file}.
OUTSIDE = {"benchmark-record.md": ROOT / "benchmarks" / "README.md"}
CLI_PAGE = "reference/cli.md"
CLI_PLACEHOLDER = "<!-- jaxacct subcommands' --help -->"
# mkdocstrings' heading of a documented object: <hN id="jaxacct.x.y" class="doc doc-heading">.
_HEADING = re.compile(r'<h[1-6] id="(' + PACKAGE + r'(?:\.\w+)*)" class="doc doc-heading')

# A notebook's markdown cell as mkdocs-jupyter (nbconvert) renders it, its code, and its math.
_MARKDOWN_CELL = re.compile(r'(<div class="[^"]*\bjp-RenderedMarkdown\b[^"]*"[^>]*>)(.*?)(</div>)',
                            re.S)
_CODE = re.compile(r"(<code\b.*?</code>|<pre\b.*?</pre>)", re.S)
_MATH = re.compile(r"\$\$(.+?)\$\$|\$([^$\n]+?)\$", re.S)
_TOC_ENTRY = re.compile(r'(<span class="md-ellipsis">)(.*?)(</span>)', re.S)
_log = logging.getLogger("mkdocs.hooks.jaxacct")

_rendered: dict[str, str] = {}  # heading id -> page, filled as pages render


def on_pre_build(config):  # noqa: ARG001 - mkdocs' hook
  _rendered.clear()


@event_priority(50)  # before mkdocs-jupyter's on_files, which wraps the notebooks
def on_files(files, config):
  """Adds the notebooks and the pages that live outside docs/ to the site's files."""
  for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
    # A plain file (not File.generated): mkdocs-jupyter's wrapper reads it from src_dir.
    files.append(File(notebook.relative_to(ROOT).as_posix(), str(ROOT), config.site_dir,
                      config.use_directory_urls))
  for uri, path in OUTSIDE.items():
    files.append(File.generated(config, uri, abs_src_path=str(path)))
  return files


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 - mkdocs' hook
  if page.file.src_uri == CLI_PAGE:
    if CLI_PLACEHOLDER not in markdown:
      raise PluginError(f"{CLI_PAGE} lost its placeholder {CLI_PLACEHOLDER!r}")
    markdown = markdown.replace(CLI_PLACEHOLDER, cli_help())
  return markdown


def on_page_content(content, page, config, files):  # noqa: ARG001 - mkdocs' hook
  for identifier in _HEADING.findall(content):
    _rendered.setdefault(identifier, page.file.src_uri)
  if page.file.src_uri.endswith(".ipynb"):
    content = _MARKDOWN_CELL.sub(lambda m: m[1] + _math(m[2], page.file.src_uri) + m[3], content)
  return content


def on_post_page(output, page, config):  # noqa: ARG001 - mkdocs' hook
  if page.file.src_uri.endswith(".ipynb"):  # a heading's $T$ in the table of contents: T
    output = _TOC_ENTRY.sub(lambda m: m[1] + _MATH.sub(lambda t: t[1] or t[2], m[2]) + m[3],
                            output)
  return output


def on_post_build(config):  # noqa: ARG001 - mkdocs' hook
  problems = undocumented(_rendered)
  if problems:
    raise PluginError("the API reference leaves public names undocumented:\n  "
                      + "\n  ".join(problems))


def _math(cell: str, where: str) -> str:
  """A rendered markdown cell with its ``$...$`` / ``$$...$$`` TeX (outside code) as MathML."""

  def mathml(match):
    display = match[1] is not None
    tex = html.unescape(match[1] if display else match[2])
    try:
      return latex_to_mathml(tex, display="block" if display else "inline")
    except Exception as error:  # noqa: BLE001 - any failure: said, and the TeX kept
      _log.warning("%s: cannot convert $%s$ to MathML (%s)", where, tex, error)
      return match[0]

  parts = _CODE.split(cell)
  return "".join(part if i % 2 else _MATH.sub(mathml, part) for i, part in enumerate(parts))


def cli_help() -> str:
  """Markdown: ``jaxacct --help`` and each subcommand's ``--help``, one section each (a
  subcommand added to the parser gets its section)."""
  sys.path.insert(0, str(ROOT))
  try:
    from jaxacct import cli  # noqa: PLC0415 - the command line's parser, imported at build time
  finally:
    sys.path.remove(str(ROOT))
  parser = cli._parser()  # noqa: SLF001 - the parser `jaxacct` itself runs
  commands = next(action.choices for action in parser._actions  # noqa: SLF001
                  if hasattr(action, "choices") and isinstance(action.choices, dict))
  sections = [f"## `jaxacct`\n\n```text\n{_help(parser)}```"]
  for name, command in commands.items():
    sections.append(f"## `jaxacct {name}`\n\n```text\n{_help(command)}```")
  return "\n\n".join(sections)


def _help(parser) -> str:
  """A parser's help at a fixed width (the same site on any terminal)."""
  formatter = parser.formatter_class(prog=parser.prog, width=96)
  parser_formatter = parser._get_formatter  # noqa: SLF001
  try:
    parser._get_formatter = lambda: formatter  # noqa: SLF001
    return parser.format_help()
  finally:
    parser._get_formatter = parser_formatter  # noqa: SLF001


def load_package(name: str = PACKAGE, root: pathlib.Path = ROOT) -> griffe.Module:
  """The package ``name`` under ``root`` as griffe reads it statically (with its lazily imported
  names)."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  try:
    from griffe_extensions import LazyExports  # noqa: PLC0415 - beside this file
  finally:
    sys.path.pop(0)
  return griffe.load(name, search_paths=[str(root)], allow_inspection=False,
                     extensions=griffe.load_extensions(LazyExports), resolve_aliases=True,
                     resolve_external=False)


def public_names(package: griffe.Module) -> tuple[dict[str, griffe.Object], list[str]]:
  """``({path: object}, problems)``: every name in the package's ``__all__`` and, recursively,
  in the ``__all__`` of each public module that has one; problems: names that do not
  resolve."""
  names, problems, queue, seen = {}, [], [package], set()
  while queue:
    module = queue.pop(0)
    if module.path in seen or module.exports is None:
      continue
    seen.add(module.path)
    for name in map(str, module.exports):
      path = f"{module.path}.{name}"
      try:
        target = module[name]
        target = target.final_target if target.is_alias else target
      except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError) as error:
        problems.append(f"{path}: in __all__ but cannot be resolved ({error})")
        continue
      names[path] = target
      if target.is_module:
        queue.append(target)
  return names, problems


def undocumented(rendered: dict[str, str], package: griffe.Module | None = None) -> list[str]:
  """What the check above finds wrong, one line each (empty: every public name documented).

  ``rendered``: the heading ids the reference rendered, each with its page; ``package``: the
  package read by ``load_package`` (default: jaxacct)."""
  package = load_package() if package is None else package
  names, problems = public_names(package)

  def resolve(identifier):
    try:
      obj = (package if identifier == package.path
             else package[identifier[len(package.path) + 1:]])
      return obj.final_target if obj.is_alias else obj
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
      return None

  public = {obj.path for obj in names.values()}  # (their docstrings are checked below)
  shown = {}
  for identifier in rendered:
    obj = resolve(identifier)
    if obj is not None:
      shown.setdefault(obj.path, identifier)
      if (obj.parent is not None and obj.parent.is_module and not obj.docstring
          and obj.path not in public):
        problems.append(f"{identifier}: rendered in {rendered[identifier]} without a docstring")
  for path, obj in sorted(names.items()):
    if not obj.docstring:
      problems.append(f"{path}: no docstring ({obj.kind.value} {obj.path})")
    if path not in rendered and obj.path not in shown:
      problems.append(f"{path}: not in the API reference (add it to a page of docs/reference/)")
  return problems
