"""The example notebooks run top to bottom without error, and show what they promise.

Each notebook runs in a fresh Jupyter kernel (a separate process, so it calls
`tfmp.simulate_devices(8)` itself), with a temporary directory as its working
directory. Needs `nbclient`, `nbformat` and `ipykernel`.
"""

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import table_row

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_notebook(name, tmp_path):
    """Executes examples/<name>; returns each code cell's text output, and its images."""
    notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on error
    print(f"{name}: {time.perf_counter() - started:.1f} s")
    cells, images = [], []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        texts = []
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", output
            if output["output_type"] == "stream":
                texts.append(output["text"])
            data = output.get("data", {})
            texts.append(data.get("text/plain", ""))
            if "image/png" in data:
                images.append(data["image/png"])
        cells.append("\n".join(texts))
    return cells, images


@pytest.mark.parametrize("name", ["quickstart.ipynb", "is_my_model_balanced.ipynb"])
def test_notebook_is_stored_without_outputs(name):
    notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.source[:80]


def test_quickstart_notebook(tmp_path):
    cells, _ = run_notebook("quickstart.ipynb", tmp_path)
    text = "\n".join(cells)
    assert "DeviceMesh(batch=2, model=4; 8 x CPU)" in text
    assert "token_embedding/embeddings" in text and "('model', None)" in text
    # docs/concepts.md's figures: 13,280 + 26,572 = 39,852 bytes per device.
    assert table_row(text, "CPU:0-7 ") == ["CPU:0-7", "13.0 KiB", "25.9 KiB", "38.9 KiB", "6%"]
    assert "test accuracy 1.000" in text
    assert "weights equal on the 1x8 mesh: True" in text
    assert "same loss as on the mesh: True" in text
    assert (tmp_path / "lm.keras").exists()


def kib(text: str) -> float:
    return float(text.removesuffix(" KiB"))


def test_is_my_model_balanced_notebook(tmp_path):
    """What the notebook's text says of its tables and plots holds for the numbers."""
    cells, images = run_notebook("is_my_model_balanced.ipynb", tmp_path)
    text = "\n".join(cells)
    _, _, replicated, quarters, plot_replicated, fixed, naive, plot_naive, split, balanced = cells
    assert len(images) == 3  # plot_memory's PNGs, displayed

    # 1. Replicated: every device holds the same, several quarters of the model;
    # the summary names the large layers as replicated.
    sizes = {line.split(":")[0]: line.split(": ")[1] for line in quarters.splitlines() if line}
    assert len(sizes) == 8 and len(set(sizes.values())) == 1
    assert float(next(iter(sizes.values())).split(", ")[1].split("x")[0]) > 3
    assert "the bars are level" in plot_replicated
    prose = " ".join(replicated.split())
    assert "(largest: mlp/wide/kernel 128.0 KiB; mlp/proj/kernel 128.0 KiB;" in prose
    # The fix: "close to a quarter of the model".
    after = [float(line.split(", ")[1].split("x a quarter")[0]) for line in fixed.splitlines()
             if "x a quarter" in line]
    assert len(after) == 8 and all(1 <= share < 1.1 for share in after)

    # 2. Pipeline: the summary has a line per stage's devices; the monitor warns.
    assert "the mesh mean" in naive
    stage_rows = {k: table_row(naive, devices) for k, devices in enumerate(("CPU:0-3 ", "CPU:4-7 "))}
    assert "per pipeline stage" in naive
    assert "stage 0: ['wide']" in split
    assert "the bars are not level" in plot_naive
    # The balanced split: no warning, closer than the naive one, and the line
    # under the plot gives the summary's figures.
    assert "warning:" not in balanced
    ratio, naive_ratio = (
        float(part.split()[0]) for part in
        balanced.split("largest / smallest device: ")[1].split(", against ")
    )
    assert 1 < ratio < 1.5 < naive_ratio and stage_rows[0] != stage_rows[1]
    totals = [kib(table_row(balanced, devices)[3]) for devices in ("CPU:0-3 ", "CPU:4-7 ")]
    level = ratio <= 1.05
    assert ("the bars are level" in balanced) == level
    assert f"the fullest device holds {max(totals):.1f} KiB" in balanced
    assert f"the emptiest ({min(totals):.1f} KiB)" in balanced
    assert max(totals) / min(totals) == pytest.approx(ratio, abs=0.01)
