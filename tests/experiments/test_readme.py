"""The README's self-contained Python examples run as written (the training-loop example shortened
from 600 steps to 20 and pointed at a temporary folder): a renamed function or argument fails here."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _block_after(heading: str) -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    i = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[i:], re.S).group(1)


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
