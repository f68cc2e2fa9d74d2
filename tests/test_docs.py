"""The documentation site builds offline and strictly, and documents every public name.

The build (``mkdocs build --strict``, as the README says) runs in a subprocess into a temporary
folder: a broken link, anchor, reference or nav entry, a griffe warning about a docstring, or a
public name without a docstring or a place in the API reference fails it (``docs/hooks.py``).
It reads the docstrings statically and the notebooks from their committed outputs, so it takes
seconds and imports no JAX.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import hooks  # noqa: E402 - docs/hooks.py, the site's check of the public names


def test_docs_build_strict_offline(tmp_path):
  site = tmp_path / "site"
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # (Material's notice on stderr)
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
       str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

  # The API reference: the front door's signature and docstring under its public name.
  api = (site / "reference" / "accounting.html").read_text()
  assert 'id="jaxacct.dpsgd_epsilon"' in api
  assert re.search(r"dpsgd_epsilon\(.*noise_multiplier", api)
  assert "Certified epsilon of DP-SGD" in api
  # Module-level pages list their __all__; the command line's help is generated.
  assert 'id="jaxacct.pld.make_plan"' in (site / "reference" / "pld.html").read_text()
  assert 'id="jaxacct.training.private_trainer"' in (
      site / "reference" / "training.html").read_text()
  cli = (site / "reference" / "cli.html").read_text()
  for command in ("epsilon", "delta", "compare", "calibrate", "demo", "report"):
    assert f"usage: jaxacct {command}" in cli, command
  # Every notebook renders from its committed outputs, plots included, with its .ipynb beside.
  for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    html = (site / "notebooks" / f"{notebook.stem}.html").read_text()
    assert "data:image/png;base64," in html, notebook.name
    assert (site / "notebooks" / notebook.name).exists()
  assert "<math" in (site / "notebooks" / "calibration.html").read_text()  # TeX as MathML
  # Moved README material and the benchmark record are pages.
  assert (site / "benchmark-record.html").exists()
  assert "Replace adjacency" in (site / "group_privacy.html").read_text()
  # Nothing the pages load comes from the network (fonts, scripts, styles).
  for path in site.rglob("*.html"):
    remote = re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"',
                        path.read_text())
    assert not remote, (path, remote)


def test_check_names_undocumented_public_names(tmp_path):
  """docs/hooks.py's check on a small package: a lazily exported name, a submodule's __all__,
  a missing docstring and a name no page shows are each reported; documented ones are not."""
  package = tmp_path / "toypkg"
  package.mkdir()
  (package / "__init__.py").write_text(textwrap.dedent('''\
      """A package whose names are imported on first use."""
      _EXPORTS = {**dict.fromkeys(("shown", "bare"), "toypkg.impl"),
                  **{name: f"{__name__}.{name}" for name in ("sub",)}}
      __all__ = ["bare", "shown", "sub"]
      '''))
  (package / "impl.py").write_text(textwrap.dedent('''\
      """Where the names live."""
      def shown():
        """Documented and shown."""
      def bare():
        pass
      '''))
  (package / "sub.py").write_text(textwrap.dedent('''\
      """A public module with its own __all__."""
      __all__ = ["hidden"]
      def hidden():
        """Documented, on no page."""
      '''))
  toy = hooks.load_package("toypkg", tmp_path)
  rendered = {"toypkg.shown": "api.md", "toypkg.sub": "api.md"}
  problems = hooks.undocumented(rendered, toy)
  assert sorted(problems) == [
      "toypkg.bare: no docstring (function toypkg.impl.bare)",
      "toypkg.bare: not in the API reference (add it to a page of docs/reference/)",
      "toypkg.sub.hidden: not in the API reference (add it to a page of docs/reference/)",
  ]
  # Shown under another public name of the same object counts; so does a rendered module.
  rendered.update({"toypkg.impl.bare": "api.md", "toypkg.sub.hidden": "api.md"})
  assert hooks.undocumented(rendered, toy) == ["toypkg.bare: no docstring (function "
                                               "toypkg.impl.bare)"]
