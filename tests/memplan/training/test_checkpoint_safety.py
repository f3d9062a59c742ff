"""A checkpoint is data: resuming never runs code that a checkpoint folder carries.

``checkpoint.pt`` loads with ``weights_only=True``; its ``dcp`` entry names the folder of an
FSDP2 run's sharded tensors (``torch.distributed.checkpoint``), whose ``.metadata`` is a
pickle and whose ``.distcp`` files hold pickled non-tensor values. A resume reads only the
run's own folder (``checkpoint-dcp/step-<step>-<id>`` inside the output folder), its metadata
through an allow-list of DCP's own classes, its non-tensor values with ``weights_only=True``;
anything else is a one-line error (exit code 2), and the crafted code never runs.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from estimators import load_task
from memplan.cli import main
from memplan.training._checkpoint_io import (
    SHARDED_DIR,
    DamagedCheckpointError,
    load_checkpoint,
    read_sharded_metadata,
    save_sharded,
)

GOOD = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
"""

NAME = "step-00000002-0123abcd"  # the form the trainer writes: step-<step:08d>-<4 random bytes in hex>
COMMON = ["--vram", "1GB", "--global-batch", "8", "--probe-top", "0", "--no-progress"]


class RunsCode:
    """Unpickled, it writes ``marker``: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('the checkpoint ran code')",))


def crafted_folder(folder: Path, marker: Path) -> Path:
    """A sharded-checkpoint folder whose ``.metadata`` is a DCP ``Metadata`` carrying the code."""
    folder.mkdir(parents=True)
    metadata = Metadata(state_dict_metadata={}, storage_data={}, storage_meta=StorageMeta(save_id=RunsCode(marker)))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model file and a fit run of 2 steps with a single-file checkpoint (copied by each test)."""
    root = tmp_path_factory.mktemp("template")
    path = root / "model_file.py"
    path.write_text(GOOD)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMPLAN_CACHE_DIR", str(root / "cache"))
        assert main(["fit", str(path), "--max-steps", "2", "--out", str(root / "run"), *COMMON]) == 0
    return path, root / "run"


@pytest.fixture
def run(template: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    shutil.copytree(template[1], out)
    return template[0], out


def point_at(out: Path, entry: str) -> None:
    """Rewrite ``checkpoint.pt`` (plain data, as the trainer's) as an FSDP2 run's: the tensors
    in the sharded folder ``entry``."""
    for name in ("checkpoint.pt", "checkpoint.previous.pt"):
        if (out / name).exists():
            ckpt = load_checkpoint(out / name)
            ckpt.update(model=None, optimizer=None, dcp=entry)
            torch.save(ckpt, out / name)


def resume(capsys: pytest.CaptureFixture[str], path: Path, out: Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["fit", str(path), "--max-steps", "4", "--resume", "--out", str(out), *COMMON])
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def assert_refused(code: int, err: str, marker: Path, *words: str) -> None:
    assert not marker.exists(), "resuming ran the checkpoint's code"
    assert code == 2 and err.count("\n") == 1, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("where", ["absolute", "dot-dot", "other-name"])
def test_a_dcp_entry_outside_the_runs_own_folders_is_refused(where: str, run: tuple[Path, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path, out = run
    marker = tmp_path / "marker"
    if where == "absolute":
        entry = str(crafted_folder(tmp_path / "elsewhere" / NAME, marker))
    elif where == "dot-dot":
        crafted_folder(tmp_path / "elsewhere" / NAME, marker)
        (out / SHARDED_DIR).mkdir()  # so that the path resolves (the folder is the checkpoint's to make)
        entry = f"{SHARDED_DIR}/../../elsewhere/{NAME}"
    else:  # inside the output folder, but not a name the trainer writes
        crafted_folder(out / "mine", marker)
        entry = "mine"
    point_at(out, entry)
    code, _, err = resume(capsys, path, out)
    assert_refused(code, err, marker, "checkpoint.pt", repr(entry), f"{SHARDED_DIR}/step-", "--out")


def test_a_dcp_entry_naming_a_missing_or_linked_folder_is_refused(run: tuple[Path, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, out = run
    marker = tmp_path / "marker"
    point_at(out, f"{SHARDED_DIR}/{NAME}")
    code, _, err = resume(capsys, path, out)
    assert_refused(code, err, marker, "is missing")
    # The run's own name, but a link to a folder elsewhere.
    (out / SHARDED_DIR).mkdir()
    (out / SHARDED_DIR / NAME).symlink_to(crafted_folder(tmp_path / "elsewhere" / NAME, marker))
    code, _, err = resume(capsys, path, out)
    assert_refused(code, err, marker, "link")


def test_crafted_metadata_in_the_runs_own_folder_never_runs(run: tuple[Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path, out = run
    marker = tmp_path / "marker"
    crafted_folder(out / SHARDED_DIR / NAME, marker)
    point_at(out, f"{SHARDED_DIR}/{NAME}")
    code, _, err = resume(capsys, path, out)
    assert_refused(code, err, marker, ".metadata", "builtins.exec", "--out")


def sharded_copy(path: Path, out: Path, *, lr: Any = None) -> None:
    """Turn the run's single-file checkpoint into the sharded one an FSDP2 run writes: the same
    weights and optimizer state, saved by :func:`save_sharded` in this one process. ``lr``: what
    the first parameter group's learning rate is replaced by."""
    ckpt = load_checkpoint(out / "checkpoint.pt")
    task = load_task(path)
    model = task.build_model()
    model.load_state_dict(ckpt["model"])
    optimizer = task.make_optimizer(model)
    optimizer.load_state_dict(ckpt["optimizer"])
    if lr is not None:
        optimizer.param_groups[0]["lr"] = lr
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # no process group: on purpose
        save_sharded(model, optimizer, out / SHARDED_DIR / NAME)
    point_at(out, f"{SHARDED_DIR}/{NAME}")


def test_a_crafted_value_in_the_sharded_files_never_runs(run: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # DCP keeps non-tensor values (the optimizer's hyperparameters) as pickles in its .distcp
    # files, which it reads with torch.load(weights_only=False) unless told otherwise.
    path, out = run
    marker = tmp_path / "marker"
    sharded_copy(path, out, lr=RunsCode(marker))
    assert not marker.exists()
    code, _, err = resume(capsys, path, out)
    assert_refused(code, err, marker, str(out / SHARDED_DIR / NAME), "--out")


def test_a_legitimate_sharded_checkpoint_resumes_as_the_single_file_one(
        run: tuple[Path, Path], template: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = run
    sharded_copy(path, out)
    plain = tmp_path / "plain"
    shutil.copytree(template[1], plain)
    for folder in (out, plain):
        code, printed, err = resume(capsys, path, folder)
        assert code == 0, err
        assert "4 steps" in printed
    a, b = load_checkpoint(out / "model.pt"), load_checkpoint(plain / "model.pt")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key)


def test_the_metadata_check_accepts_what_dcp_writes(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {"w": torch.ones(3, 2), "bf16": torch.ones(3, dtype=torch.bfloat16), "half": torch.zeros(2, dtype=torch.float16),
             "ids": torch.arange(4), "flag": torch.tensor(True), "step": torch.tensor(3.0),
             "complex": torch.zeros(2, dtype=torch.complex64), "transposed": torch.zeros(4, 3).t(),
             "lr": 0.5, "betas": (0.9, 0.99), "name": "adamw", "params": ["a", "b"], "fused": None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save(state, checkpoint_id=tmp_path / NAME)
    metadata = read_sharded_metadata(tmp_path / NAME)
    assert isinstance(metadata, Metadata)
    want = FileSystemReader(tmp_path / NAME).read_metadata()
    assert metadata.state_dict_metadata == want.state_dict_metadata
    assert metadata.storage_data == want.storage_data


def test_the_metadata_check_refuses_any_other_global(tmp_path: Path) -> None:
    folder = tmp_path / NAME
    folder.mkdir()
    marker = tmp_path / "marker"
    for payload, named in ((RunsCode(marker), "builtins.exec"), (Path, "pathlib.Path"),
                           ({"a": __import__("collections").OrderedDict()}, "collections.OrderedDict")):
        (folder / ".metadata").write_bytes(pickle.dumps(payload))
        with pytest.raises(DamagedCheckpointError, match=named.replace(".", r"\.")) as info:
            read_sharded_metadata(folder)
        assert "\n" not in str(info.value)
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(DamagedCheckpointError, match="not a sharded checkpoint's metadata"):
        read_sharded_metadata(folder)
    assert not marker.exists()


def test_a_sharded_checkpoint_of_another_model_is_one_line(run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # DCP's own errors are BaseExceptions (CheckpointException), which would escape the CLI's handler.
    path, out = run
    other = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        save_sharded(other, torch.optim.AdamW(other.parameters()), out / SHARDED_DIR / NAME)
    point_at(out, f"{SHARDED_DIR}/{NAME}")
    code, _, err = resume(capsys, path, out)
    assert code == 2 and err.count("\n") == 1, err
    assert "could not be loaded" in err and "Missing key" in err and "--out" in err
