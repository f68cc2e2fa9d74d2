"""The README's quickstart and the getting-started guide's examples run as written
(documentation that cannot drift)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.slow
def test_readme_example_runs():
  text = (ROOT / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
  eps = namespace["eps"]
  assert float(eps.lower) <= float(eps.estimate) <= float(eps.upper)
  assert abs(float(eps.estimate) - 6.1877) < 1e-3  # dp-accounting's value for this setting
  # The guide's first example is the README's; then its tour (grad, vmap, calibration, every
  # accountant, compositions), in the same process (compiled programs shared).
  guide = (ROOT / "docs" / "getting-started.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
  assert "eps = jaxacct.dpsgd_epsilon(noise_multiplier=1.0" in blocks[0]
  for block in blocks:
    exec(compile(block, "docs/getting-started.md", "exec"), namespace)  # noqa: S102
  assert float(namespace["eps"].upper) == float(eps.upper)
