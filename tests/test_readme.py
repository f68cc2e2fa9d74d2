"""The README's Python example runs as written (documentation that cannot drift)."""

import pathlib
import re

import pytest


@pytest.mark.slow
def test_readme_example_runs():
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
  eps = namespace["eps"]
  assert float(eps.lower) <= float(eps.estimate) <= float(eps.upper)
  assert abs(float(eps.estimate) - 6.1877) < 1e-3  # dp-accounting's value for this setting
