"""The documentation site, API reference included, builds with warnings as errors.

Needs `mkdocs` and `mkdocstrings[python]` (the API page is generated from the
docstrings with griffe, Google style). A docstring griffe cannot parse (a
malformed `Args:` section, say) makes `mkdocs build --strict` fail here.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    finished = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert finished.returncode == 0, (
        "mkdocs build --strict failed (pip install mkdocs 'mkdocstrings[python]' if "
        "it is missing):\n" + finished.stdout[-3000:] + finished.stderr[-5000:]
    )

    api = (site / "api" / "index.html").read_text()
    assert "ModelParallelStrategy" in api
    # Every object the API page names is rendered, under its own anchor.
    with open(os.path.join(ROOT, "docs", "api.md")) as page:
        names = re.findall(r"^::: (\S+)", page.read(), flags=re.MULTILINE)
    assert len(names) >= 20
    missing = [name for name in names if f'id="{name}"' not in api]
    assert not missing, missing
    # Google-style sections were parsed, not left as text.
    assert "Parameters:" in api and "Examples:" in api
    # Doctest lines outside an indented `Examples:` section render as nested quotes.
    assert "<blockquote>\n<blockquote>" not in api, (
        "a docstring has `>>>` lines outside an `Examples:` section: write them "
        "indented under `Examples:`"
    )
    for page in ("concepts", "guide", "tensor-parallel", "pipeline", "multi-host",
                 "callbacks", "troubleshooting"):
        assert (site / page / "index.html").exists(), page
