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

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_notebook(name, tmp_path):
    """Executes examples/<name>; returns its text outputs, joined, and its images."""
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
    texts, images = [], []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", output
            if output["output_type"] == "stream":
                texts.append(output["text"])
            data = output.get("data", {})
            texts.append(data.get("text/plain", ""))
            if "image/png" in data:
                images.append(data["image/png"])
    return "\n".join(texts), images


@pytest.mark.parametrize("name", ["quickstart.ipynb", "is_my_model_balanced.ipynb"])
def test_notebook_is_stored_without_outputs(name):
    notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.source[:80]


def test_quickstart_notebook(tmp_path):
    text, _ = run_notebook("quickstart.ipynb", tmp_path)
    assert "DeviceMesh(batch=2, model=4; 8 x CPU)" in text
    assert "token_embedding/embeddings" in text and "('model', None)" in text
    assert "per device: parameters + optimizer variables" in text
    assert "13,280 + 26,572 = 39,852 bytes" in text  # docs/concepts.md's figure
    assert "test accuracy 1.000" in text
    assert "weights equal on the 1x8 mesh: True" in text
    assert "same loss as on the mesh: True" in text
    assert (tmp_path / "lm.keras").exists()


def test_is_my_model_balanced_notebook(tmp_path):
    text, images = run_notebook("is_my_model_balanced.ipynb", tmp_path)
    assert "per device: parameters + optimizer variables" in text
    assert "x the even share" in text
    # The unbalanced pipeline makes DeviceMemoryMonitor warn; summary lists stages.
    assert "the mesh mean" in text
    assert "per pipeline stage" in text
    assert "stage 0: ['wide']" in text
    assert len(images) == 3  # plot_memory's PNGs, displayed
    ratio = float(text.split("largest / smallest device: ")[1].split()[0])
    assert ratio < 1.5
