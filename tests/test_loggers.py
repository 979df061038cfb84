"""wandb, swanlab and mlflow through MetricsLogger: each runs offline or on a local store, and the
logged values are read back with the package's own reader. A logger whose package is missing is
refused with the pip command; the pins agree with setup.py and the names with the config."""
import ast
import glob
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import typing

import pytest
import torch

from engine.metrics import (BUILTIN_LOGGERS, LOGGERS, OPTIONAL_LOGGERS, MetricsLogger, check_loggers,
                            mlflow_metric_name)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"trainer": {"project_name": "proj", "experiment_name": "exp1"}, "actor": {"lr": 1e-6}}


def _needs(name):
    entry = OPTIONAL_LOGGERS[name]
    missing = [m for m in entry.modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{name} not installed: pip install {entry.pip}")


def _metrics(step):
    return {"critic/score/mean": 0.1 * step, "actor/pg_loss": torch.tensor(-0.5 + step),
            "response_length/mean": 7.0 + step, "val/score/mean@4": 0.25 * step, "note": "not a scalar",
            **({"actor/ppo_kl": float("nan")} if step == 3 else {})}


def _expected(step):
    return {"critic/score/mean": 0.1 * step, "actor/pg_loss": -0.5 + step,
            "response_length/mean": 7.0 + step, "val/score/mean@4": 0.25 * step}


def _log_three_steps(run_dir, name, experiment="exp1"):
    console = io.StringIO()
    logger = MetricsLogger(str(run_dir), ["console", name], project="proj", experiment=experiment,
                           total_steps=3, stream=console, config=CONFIG)
    for step in (1, 2, 3):
        logger.log(_metrics(step), step)
    logger.close()
    return console.getvalue()


def _assert_steps(by_step, name=lambda n: n):
    assert sorted(by_step) == [1, 2, 3]
    for step in (1, 2, 3):
        for metric, value in _expected(step).items():
            assert by_step[step][name(metric)] == pytest.approx(value), (step, metric)
        assert name("note") not in by_step[step]
    assert math.isnan(float(by_step[3][name("actor/ppo_kl")]))


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No tracker settings or saved logins from this machine: a fresh HOME, no WANDB_ / SWANLAB_ /
    MLFLOW_ variables."""
    for var in list(os.environ):
        if var.startswith(("WANDB_", "SWANLAB_", "MLFLOW_")) or var == "NETRC":
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()


def _wandb_records(path):
    """wandb's own reader of its transaction log (`wandb leet inspect --json`): one record a line."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@_needs("wandb")
@pytest.mark.parametrize("user_offline", [False, True], ids=["no-key", "WANDB_MODE=offline"])
def test_wandb_offline_run_reads_back(tmp_path, monkeypatch, no_credentials, user_offline):
    run_dir, wandb_dir = tmp_path / "logs", tmp_path / "logs"
    if user_offline:  # the user's choice: WANDB_MODE and WANDB_DIR are respected
        wandb_dir = tmp_path / "wandb_dir"
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    printed = _log_three_steps(run_dir, "wandb")
    assert ("wandb: no API key" in printed) == (not user_offline)  # no key: offline by itself
    files = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    records = _wandb_records(files[0])
    run = next(r["run"] for r in records if r["type"] == "run")
    assert (run["project"], run["display_name"]) == ("proj", "exp1")
    assert run["config"]["update"]["actor"] == {"lr": 1e-6}
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    _assert_steps(history)


@_needs("swanlab")
def test_swanlab_offline_run_reads_back(tmp_path, no_credentials):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader
    printed = _log_three_steps(tmp_path / "logs", "swanlab")
    assert "swanlab: no API key" in printed
    files = glob.glob(str(tmp_path / "logs" / "swanlog" / "run-*" / "run-*.swanlab"))
    assert len(files) == 1, files
    reader = DataStoreReader()
    reader.open(files[0])
    by_step, start = {}, None
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "start":
            start = record.start
        elif kind == "scalar":
            by_step.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
    reader.close()
    assert (start.project, start.name) == ("proj", "exp1")
    _assert_steps(by_step)


def _mlflow_steps(client, run_id, names):
    by_step = {}
    for name in names:
        for m in client.get_metric_history(run_id, name):
            by_step.setdefault(m.step, {})[name] = m.value
    return by_step


@_needs("mlflow")
def test_mlflow_local_store_reads_back(tmp_path, monkeypatch, no_credentials):
    from mlflow.tracking import MlflowClient
    names = [mlflow_metric_name(n) for n in list(_expected(1)) + ["actor/ppo_kl"]]
    assert "val/score/mean_at_4" in names and "critic/score/mean" in names  # slashes kept

    _log_three_steps(tmp_path / "logs", "mlflow")  # no MLFLOW_TRACKING_URI: SQLite under the log dir
    client = MlflowClient(f"sqlite:///{tmp_path}/logs/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert (run.info.run_name, run.info.status) == ("exp1", "FINISHED")
    assert run.data.params["actor.lr"] == "1e-06" and run.data.params["trainer.project_name"] == "proj"
    _assert_steps(_mlflow_steps(client, run.info.run_id, names), mlflow_metric_name)

    store = f"sqlite:///{tmp_path}/store.db"  # the user's tracking server / store wins
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    _log_three_steps(tmp_path / "logs2", "mlflow", experiment="exp1")
    _log_three_steps(tmp_path / "logs3", "mlflow", experiment="exp2")  # same project: same experiment
    assert not (tmp_path / "logs2" / "mlflow.db").exists()
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["exp1", "exp2"]
    for r in runs:
        _assert_steps(_mlflow_steps(client, r.info.run_id, names), mlflow_metric_name)


@pytest.mark.parametrize("name", sorted(OPTIONAL_LOGGERS))
def test_missing_package_is_refused_with_the_pip_command(name, tmp_path, monkeypatch):
    entry = OPTIONAL_LOGGERS[name]
    monkeypatch.setitem(sys.modules, entry.modules[0], None)  # as if not installed
    message = (f"trainer.logger: {name!r} needs the {entry.modules[0]} package: pip install {entry.pip} "
               f"(or pip install -e .[loggers])")
    with pytest.raises(ValueError) as err:
        check_loggers(["console", name])
    assert str(err.value) == message
    with pytest.raises(ValueError, match="needs the"):  # on every rank, not only the one that logs
        MetricsLogger(str(tmp_path / "run"), ["console", name], rank=1)
    check_loggers(list(BUILTIN_LOGGERS))
    if name == "wandb":
        assert message == ("trainer.logger: 'wandb' needs the wandb package: pip install wandb==0.31.0 "
                           "(or pip install -e .[loggers])")


def test_registry_agrees_with_setup_and_config():
    from engine.config import Logger
    assert set(typing.get_args(Logger)) == set(LOGGERS)
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    pins = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", None) == "LOGGER_PINS")
    assert sorted(pins) == sorted(p for e in OPTIONAL_LOGGERS.values() for p in e.pip.split())
