"""The examples end to end with tiny settings: the main job's logs, table, JSON and plot,
checked against the CSV history, and fine-tuning an AdamW checkpoint under strategy="dash"."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from lightning_dash import DASH
from lightning_dash.showcase.lightning_gpt import GPTModule, StdlibBytes, warmup_cosine
from lightning_dash.showcase.stdlib_text import RandomWindows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch-size",
    "8",
    "--val-windows",
    "64",
    "--max-bytes",
    "300000",
    "--accelerator",
    "cpu",
    "--devices",
    "1",
    "--no-progress-bar",
]


#: What a Lightning launcher leaves in this process's environment (a one-device run sets
#: LOCAL_RANK and NODE_RANK); inherited by a script, it would make Fabric believe its
#: processes were already launched and wait for ranks that never come.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")


@pytest.fixture(autouse=True)
def one_thread_and_release_process_group(monkeypatch):
    """Tiny models run fastest on one thread (and do not stall when the cores are shared);
    OMP_NUM_THREADS keeps Lightning's launcher from raising it. A one-device
    strategy="dash" run leaves gloo initialised in this process: free it afterwards."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if dist.is_initialized():
        dist.destroy_process_group()
    for variable in LAUNCH_VARIABLES:
        os.environ.pop(variable, None)


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_train_char_gpt_logs_table_and_plot_agree(tmp_path):
    result = example("train_char_gpt").main(
        TINY + ["--steps", "40", "--val-every", "10", "--lr", "3e-3", "--out", str(tmp_path)]
    )

    (adamw_csv,) = (tmp_path / "adamw").glob("version_*/metrics.csv")
    (dash_csv,) = (tmp_path / "dash").glob("version_*/metrics.csv")
    adamw, dash = csv_rows(adamw_csv), csv_rows(dash_csv)
    # Validation after optimizer steps 10, 20, 30, 40 (Lightning's ``step`` column counts from 0).
    validation = {
        name: [(int(r["step"]) + 1, float(r["val_loss"])) for r in rows if r["val_loss"]]
        for name, rows in (("AdamW", adamw), ("DASH", dash))
    }
    assert [s for s, _ in validation["AdamW"]] == [s for s, _ in validation["DASH"]] == [10, 20, 30, 40]
    # The scheduler drove the converted optimizer exactly as it drove AdamW.
    lr_adamw = [float(r["lr-AdamW"]) for r in adamw if r.get("lr-AdamW")]
    lr_dash = [float(r["lr-DASH"]) for r in dash if r.get("lr-DASH")]
    assert len(lr_adamw) == 4 and lr_adamw == pytest.approx(lr_dash)
    assert lr_adamw[-1] < lr_adamw[0]
    assert isinstance(result["trainers"]["dash"].optimizers[0], DASH)
    assert isinstance(result["trainers"]["adamw"].optimizers[0], torch.optim.AdamW)

    table = json.loads((tmp_path / "train_char_gpt.json").read_text())["results"]
    target = validation["AdamW"][-1][1]
    for row in table:
        history = validation[row["optimizer"]]
        expected = next((step for step, loss in history if loss <= target), None)
        assert row["steps_to_target"] == expected
        assert row["final_val_loss"] == pytest.approx(history[-1][1])
        assert row["wall_time_s"] > 0
    assert table[0]["steps_to_target"] is not None  # AdamW reaches its own final loss
    assert validation["AdamW"][-1][1] < validation["AdamW"][0][1]  # it learned
    assert (tmp_path / "train_char_gpt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_finetune_existing_checkpoint_with_dash(tmp_path):
    result = example("finetune_existing").main(
        TINY + ["--pretrain-steps", "30", "--finetune-steps", "30", "--out", str(tmp_path)]
    )
    assert Path(result["checkpoint"]).is_file()
    assert result["optimizer"] == "DASH"
    assert isinstance(result["trainer"].optimizers[0], DASH)
    assert result["after"] < result["before"]


def test_batches_and_initial_weights_are_reproducible():
    data = torch.arange(1000, dtype=torch.uint8)
    first, again, other = (RandomWindows(data, 16, 8, seed) for seed in (0, 0, 1))
    assert torch.equal(first.starts, again.starts) and not torch.equal(first.starts, other.starts)
    tokens, targets = first[3]
    assert torch.equal(tokens[1:], targets[:-1]) and tokens.shape == (16,)
    a, b = GPTModule(context=16, width=16, depth=1, heads=2), GPTModule(context=16, width=16, depth=1, heads=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    factors = [warmup_cosine(2, 10)(step) for step in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_data_module_gives_the_same_batches_for_every_run():
    loaders = []
    for _ in range(2):
        module = StdlibBytes(context=16, batch_size=4, steps=5, val_windows=8, max_bytes=100_000)
        module.setup("fit")
        loaders.append(module)
    assert len(loaders[0].train_dataloader()) == 5
    for left, right in zip(loaders[0].train_dataloader(), loaders[1].train_dataloader()):
        assert all(torch.equal(a, b) for a, b in zip(left, right))
    assert all(
        torch.equal(a, b)
        for a, b in zip(next(iter(loaders[0].val_dataloader())), next(iter(loaders[1].val_dataloader())))
    )


FABRIC_TINY = ["--width", "32", "--depth", "2", "--heads", "2", "--context", "32", "--batch-size", "4"]


def run_script(name: str, *args: str) -> str:
    """Run an example as a script (Fabric's launcher re-runs it for each other rank); return its output."""
    command = [sys.executable, str(EXAMPLES / f"{name}.py"), *args]
    environment = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def logged_steps(output: str) -> list[int]:
    return [int(line.split()[1]) for line in output.splitlines() if line.startswith("step ")]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model",
    [
        "tiny",
        pytest.param(
            "litgpt",
            marks=pytest.mark.skipif(importlib.util.find_spec("litgpt") is None, reason="LitGPT is not installed"),
        ),
    ],
)
def test_fabric_gpt_trains_with_dash_fsdp_on_two_processes_and_resumes_on_one(tmp_path, model):
    checkpoint = tmp_path / "checkpoint"
    settings = ["--model", model, *FABRIC_TINY, "--max-bytes", "200000"]
    first = run_script("fabric_gpt", *settings, "--steps", "4", "--save", str(checkpoint))
    assert "DASH on 2 processes, DTensor parameters" in first
    assert logged_steps(first) == [1, 2, 3, 4] and "validation loss" in first
    assert (checkpoint / "meta.pt").is_file() and len(list(checkpoint.glob("*.distcp"))) == 2
    second = run_script("fabric_gpt", *settings, "--steps", "6", "--devices", "1", "--resume", str(checkpoint))
    assert "DASH on 1 process, DTensor parameters" in second
    assert logged_steps(second) == [5, 6]


def test_fabric_gpt_without_litgpt_says_so_and_stops(capsys, monkeypatch):
    module = example("fabric_gpt")
    monkeypatch.setattr(module, "find_spec", lambda name: None)
    assert module.main([]) is None
    assert "LitGPT is not installed (pip install litgpt)" in capsys.readouterr().out


#: Runs an example as ``__main__`` the way a user does, on a machine that Lightning's data connector
#: thinks has 8 cores (on 2 it does not warn about ``num_workers``), optionally without the filters,
#: with the contention verdict given (CONTENTION, or none) instead of measured, so that the machine's
#: load cannot change the output; then raises warnings from user code, some with the filtered
#: messages' text and category.
QUIET_WRAPPER = """
import runpy, sys, warnings
import lightning.fabric.utilities.data as fabric_data
from lightning.fabric.utilities.warnings import PossibleUserWarning
import lightning_dash.showcase.contention as contention
import lightning_dash.showcase.quiet as quiet

script, filters, verdict, *argv = sys.argv[1:]
fabric_data._num_cpus_available = lambda: 8
contention.contention_warning = lambda phases: verdict or None
if filters == "off":
    quiet.quiet_third_party_output = lambda: None
sys.argv = [script, *argv]
runpy.run_path(script, run_name="__main__")
warnings.warn("user warning from the wrapper", UserWarning)
warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated (user code)", FutureWarning)
warnings.warn("The 'train_dataloader' does not have many workers which may be a bottleneck (user code)",
              PossibleUserWarning)
"""

LEAFSPEC = "`isinstance(treespec, LeafSpec)` is deprecated"
FEW_WORKERS = "does not have many workers which may be a bottleneck"
TIP = "💡 Tip: For seamless cloud"
CONTENTION = "other processes took CPU time from this run (given by the test)"


def third_party(lines: list[str], text: str) -> list[str]:
    return [line for line in lines if text in line and "(user code)" not in line]


@pytest.mark.multiprocess
@pytest.mark.parametrize("filters", ["on", "off"])
def test_train_char_gpt_output_is_quiet_and_ends_with_the_table(tmp_path, filters):
    """Stdout and stderr are files (not a terminal): no progress bar, none of the filtered notices, the
    table last (after the contention warning, given rather than measured), and every warning from user
    code still shown. ``off`` shows that the notices do appear without the filters (so the test sees them)
    and runs without a contention warning, ``--quick`` that its files and settings are its own."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(QUIET_WRAPPER)
    settings = [a for a in TINY if a != "--no-progress-bar"]
    settings += ["--quick", "--steps", "20", "--val-every", "10", "--out", str(tmp_path / "out")]
    verdict = CONTENTION if filters == "on" else ""
    command = [sys.executable, str(wrapper), str(EXAMPLES / "train_char_gpt.py"), filters, verdict, *settings]
    environment = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    environment.pop("PYTHONWARNINGS", None)
    # This checkout's lightning_dash, whatever the interpreter has installed.
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES.parent), environment.get("PYTHONPATH")]))
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=environment, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out, err = result.stdout, result.stderr
    err_lines = err.splitlines()

    for stream in (out, err):
        assert "\r" not in stream and "it/s" not in stream and "Epoch 0" not in stream
    for text in ("user warning from the wrapper", f"{LEAFSPEC} (user code)", f"{FEW_WORKERS} (user code)"):
        assert text in err
    assert "GPU available: False, used: False" in err  # Lightning's device summary stays
    if filters == "on":
        assert not third_party(err_lines, LEAFSPEC)
        assert not third_party(err_lines, FEW_WORKERS)
        assert TIP not in err + out
    else:
        assert third_party(err_lines, FEW_WORKERS) and TIP in err
        if getattr(torch.utils._pytree.LeafSpec, "__deprecated__", None):  # deprecated in this torch
            assert third_party(err_lines, LEAFSPEC)

    lines = [line for line in out.splitlines() if line.strip()]
    header = next(i for i, line in enumerate(lines) if line.startswith("optimizer ") and "final val loss" in line)
    assert set(lines[header + 1]) == {"-"}
    assert [line.split()[0] for line in lines[header + 2 :]] == ["AdamW", "DASH"]  # nothing after the table
    assert any(line.startswith("table: ") for line in lines[:header])
    assert [line for line in lines if "WARNING" in line] == ([f"WARNING: {CONTENTION}"] if verdict else [])

    config = json.loads((tmp_path / "out" / "train_char_gpt_quick.json").read_text())["config"]
    assert config["contention"] == (verdict or None)
    example_module = example("train_char_gpt")
    assert config["steps"] == 20 and config["val_windows"] == 64 and config["max_bytes"] == 300_000  # flags win
    assert config["val_windows"] != example_module.QUICK["val_windows"]
    assert (config["lr_adamw"], config["lr_dash"]) == (
        example_module.QUICK_LR["adamw"],
        example_module.QUICK_LR["dash"],
    )
    assert config["environment"]["torch_num_threads"] == 1 and config["environment"]["torch"] == torch.__version__
    assert (tmp_path / "out" / "train_char_gpt_quick.png").is_file()
    assert list((tmp_path / "out" / "quick" / "dash").glob("version_*/metrics.csv"))
    assert not (tmp_path / "out" / "train_char_gpt.json").exists()


def test_quick_settings_are_defaults_that_flags_override():
    module = example("train_char_gpt")
    quick = module.parse_args(["--quick"])
    assert {key: getattr(quick, key) for key in module.QUICK} == module.QUICK
    assert quick.width == 128 and quick.context == 128  # the full run's model
    mixed = module.parse_args(["--quick", "--steps", "300", "--val-every", "50"])
    assert (mixed.steps, mixed.val_every, mixed.val_windows) == (300, 50, module.QUICK["val_windows"])
    assert module.parse_args([]).steps == 800
    assert module.parse_args([]).progress_bar is None and module.parse_args(["--no-progress-bar"]).progress_bar is False
