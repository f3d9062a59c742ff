"""OUT/report.html: written by fit/train, self-contained, and rendered by a real headless
Chromium (Debian's ``chromium``, installed by the test when missing) with its charts drawn."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from memplan.reports._html_report import render_report, write_report
from memplan.cli import main

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"global_batch": 16}

def _data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, x[:, :3].argmax(dim=1))

def model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

def train_data():
    return _data(0)

def val_data():
    return _data(1)
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    model = root / "model.py"
    model.write_text(MODEL)
    out = root / "out"
    assert main(["doctor", str(model), "--steps", "30", "--out", str(out), "--checks", "init,data,outputs"]) == 0
    assert main(["fit", str(model), "--vram", "1GB", "--probe-top", "0", "--epochs", "3", "--out", str(out),
                 "--no-progress", "--storage", f"sqlite:///{root}/s.db"]) == 0
    # An OOM switch as the trainer logs one, to show in the report.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"type": "oom_recovery", "event": "oom_recovery", "step": 4, "phase": "backward",
                            "from": {"micro_batch_size": 16, "grad_accum_steps": 1, "precision": "fp32",
                                     "checkpoint_segments": 0},
                            "to": {"micro_batch_size": 8, "grad_accum_steps": 2, "precision": "fp32",
                                   "checkpoint_segments": 0}, "seconds": 0.5}) + "\n")
    write_report(out)
    return out


def test_fit_writes_a_self_contained_report(run_dir):
    html = (run_dir / "report.html").read_text()
    for section in ("Plan", "Memory", "Training curves", "Out-of-memory switches", "Doctor"):
        assert f"<h2>{section}</h2>" in html
    # Offline: nothing fetched, no script at all.
    assert "<script" not in html
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', html)
    assert html.count("<svg") >= 6 and "val accuracy" in html and "gradient norm per layer" in html
    assert "micro-batch 8 x2 accumulation" in html  # the OOM switch's target
    assert "healthy" in html  # the doctor's verdict


def test_a_folder_with_only_some_files_still_renders(tmp_path):
    html = render_report(tmp_path)
    assert "no plan.json" in html and "no data" in html


def _find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _chromium() -> str:
    """Debian's Chromium; installed here when missing and this is a root shell with apt-get (CI's
    machine and a fresh developer's), so that the README's one test command needs no other step.
    A lock keeps parallel test workers from running apt-get twice."""
    found = _find_chromium()
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        import fcntl

        with open(Path(tempfile.gettempdir()) / "memplan-tests-chromium.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _find_chromium() is None:
                env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
                for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
                    subprocess.run(cmd, env=env, capture_output=True, timeout=900)
        found = _find_chromium()
    if found is None:
        pytest.fail("the report's browser test needs Chromium, and it could not be installed here: "
                    "apt-get install -y chromium")
    return found


def _browse(page: Path, *args: str) -> tuple[str, str]:
    # The network flags keep Chromium from reaching out at start (a closed network refuses it).
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={tempfile.mkdtemp(prefix='memplan-chromium-')}",
                           "--enable-logging=stderr", "--v=0", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout, proc.stderr


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


# Measures every chart the browser laid out: its box, and the drawn length of its lines.
_PROBE = """<script>
const charts = [...document.querySelectorAll('svg.chart')].map(s => {
  const lines = [...s.querySelectorAll('polyline')].reduce((n, p) => n + p.getTotalLength(), 0);
  const r = s.getBoundingClientRect();
  return {w: r.width, h: r.height, lines: lines, marks: s.querySelectorAll('polyline,rect,circle').length};
});
document.title = 'PROBE' + JSON.stringify(charts);
</script>"""


@pytest.mark.browser
def test_chromium_renders_the_charts_without_console_errors(run_dir, tmp_path):
    report = run_dir / "report.html"
    _stdout, stderr = _browse(report, "--dump-dom")
    assert _console(stderr) == [], _console(stderr)
    # The harness does see console errors (it can fail):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('broken chart')</script></body></html>")
    assert any("broken chart" in line for line in _console(_browse(bad, "--dump-dom")[1]))

    probed = tmp_path / "probed.html"
    probed.write_text(report.read_text().replace("</body>", _PROBE + "</body>"))
    dom, _err = _browse(probed, "--dump-dom")
    charts = json.loads(re.search(r"<title>PROBE(.*?)</title>", dom).group(1).replace("&quot;", '"'))
    assert len(charts) >= 6
    assert all(c["w"] > 300 and c["h"] > 50 and c["marks"] > 0 for c in charts), charts
    assert sum(c["lines"] > 100 for c in charts) >= 4  # loss, accuracy, lr, throughput, grad norms drawn

    shot = tmp_path / "shot.png"
    _browse(report, f"--screenshot={shot}", "--window-size=1200,2200")
    import numpy as np
    from PIL import Image
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape == (2200, 1200, 3)
    ink = float((pixels != 255).any(axis=2).mean())
    assert ink > 0.03, ink  # not a blank page
    for colour in ((0x4e, 0x79, 0xa7), (0xf2, 0x8e, 0x2c)):  # the first two series colours
        assert (pixels == colour).all(axis=2).sum() > 200, colour  # the charts' lines and bars are on screen
