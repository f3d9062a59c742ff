"""The GPU validation script: clear refusal without a GPU, and its prediction half on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "validate_cuda.py"


def _script():
    spec = importlib.util.spec_from_file_location("validate_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert _script().main(["--out", str(tmp_path / "x.md")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()


def test_predict_only_writes_predictions_for_every_precision(tmp_path: Path) -> None:
    out = tmp_path / "validation.md"
    assert _script().main(["--predict-only", "--gpu", "H200", "--models", "mlp", "--out", str(out)]) == 0
    text = out.read_text()
    for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        assert f"mlp b64 {precision} |" in text
        assert f"mlp b64 {precision} ckpt" in text
    assert "prediction failed" not in text
