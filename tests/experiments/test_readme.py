"""The README's and the docs' code examples run as written: a renamed function or argument fails here.

* The README's two self-contained examples (under "## Layer and models" and "### A training loop
  of your own"; the training loop shortened from 600 steps to 20 and pointed at a temporary folder).
* Every block of ``docs/*.md`` fenced as ```` ```python ````, as written, each in a fresh namespace
  with a temporary working directory (one test per block, ``page.md:N`` = the N-th such block of the
  page). Such a block must run on a CPU in seconds and check its own result with an ``assert``.
  A block that cannot run as written (it needs a checkpoint, a GPU, a long run or names defined
  elsewhere) is fenced ```` ```py ```` and not run; shell commands ```` ```bash ````, output and
  formulas ```` ```text ````. docs/testing.md states the same rule.
"""
import ast
import os
import pathlib
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = pathlib.Path(REPO) / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _block_after(heading: str) -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    i = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[i:], re.S).group(1)


def _docs_blocks():
    for page in sorted(DOCS.glob("*.md")):
        for n, m in enumerate(FENCE.finditer(page.read_text()), 1):
            yield pytest.param(m.group(1), id=f"{page.name}:{n}")


def test_readme_layer_and_model_example():
    ns = {}
    exec(_block_after("## Layer and models"), ns)
    assert ns["logits"].shape == (2, 16, 256)


def test_readme_training_loop_example(tmp_path, capsys):
    code = _block_after("### A training loop of your own")
    assert "range(600)" in code and '"ckpt"' in code
    code = code.replace("range(600)", "range(20)").replace('"ckpt"', repr(str(tmp_path / "ckpt")))
    ns = {}
    exec(code, ns)
    out = capsys.readouterr().out
    assert "'accuracy'" in out and ns["meta"]["note"] == "600 steps" and int(ns["state"].step) == 20
    assert ns["model"].cfg.mixer == "gdn"


def test_docs_have_python_blocks_and_no_misspelt_fences():
    """The docs pages exist, some blocks run, and no fence is a near miss of ``python`` / ``py`` (a
    typo such as ```pyhton or ```Python would otherwise leave a block silently untested)."""
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) >= 6 and len(list(_docs_blocks())) >= 3
    for page in pages:
        for lang in re.findall(r"^```(\S+)", page.read_text(), re.M):
            near = lang.lower().startswith("py") or "pyth" in lang.lower() or "ptyh" in lang.lower()
            assert lang in ("python", "py") or not near, (page.name, lang)


@pytest.mark.parametrize("code", list(_docs_blocks()))
def test_docs_python_block(code, tmp_path, monkeypatch):
    ast.parse(code)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<docs block>", "exec"), {"__name__": "__docs__"})
