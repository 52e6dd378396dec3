"""Device and precision resolution (`dlm.modeling.device`): auto picks CUDA, then MPS, then the CPU; a device this
machine lacks is one line naming what it has, from every command; results record where they ran. A GPU is simulated
by patching torch.cuda's queries (resolution only: nothing runs there)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dlm.errors import DlmError
from dlm.modeling import device as dev
from tests.conftest import tiny_model


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda answers as on a machine with two bf16-capable GPUs (resolution only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_auto_is_the_cpu_in_float32_here():
    assert not torch.cuda.is_available()
    assert dev.resolve_device("auto") == dev.resolve_device(None) == torch.device("cpu")
    assert dev.resolve_dtype("auto", "cpu") is torch.float32
    assert dev.resolve_dtype("bfloat16", "cpu") is torch.bfloat16 and dev.resolve_dtype("float16") is torch.float16
    assert dev.available_devices()[-1] == "cpu"


def test_auto_prefers_a_gpu_in_bfloat16(fake_gpus, monkeypatch):
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve_dtype("auto", torch.device("cuda", 1)) is torch.bfloat16
    assert dev.resolve_dtype("auto", "cpu") is torch.float32  # asked for the CPU: float32 even beside a GPU
    with pytest.raises(DlmError, match=r"device 'cuda:2' is not available: this machine has cuda:0, cuda:1.*cpu"):
        dev.resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert dev.resolve_dtype("auto", "cuda") is torch.float32  # an older GPU: no bf16, so float32


@pytest.mark.parametrize("name, message", [
    ("cuda", "device 'cuda' is not available on this machine (it has: cpu); use --device auto or cpu"),
    ("cuda:0", "device 'cuda:0' is not available on this machine (it has: cpu)"),
    ("mps", "device 'mps' is not available on this machine (it has: cpu)"),
    ("tpu", "unknown device 'tpu'; use auto, cpu, cuda, cuda:N or mps"),
])
def test_a_missing_device_is_one_clear_error(name, message):
    if torch.backends.mps.is_available() and name == "mps":
        pytest.skip("this machine has MPS")
    with pytest.raises(DlmError) as err:
        dev.resolve_device(name)
    assert message in str(err.value)
    with pytest.raises(DlmError, match="unknown dtype 'fp8'"):
        dev.resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("command", [
    ["generate", "MODEL", "--prompt", "hi"], ["eval", "MODEL"], ["serve", "MODEL"], ["demo", "--out", "OUT"],
    ["export", "MODEL", "OUT", "--merge"], ["lm-eval", "--model", "dlm", "--model_args", "pretrained=MODEL",
                                             "--tasks", "dlm_tinymath"],
])
def test_every_command_refuses_a_missing_gpu_in_one_line(command, tmp_path):
    """Before any work (the model directory does not even exist): exit 2 and one line naming what this machine has."""
    argv = [a.replace("MODEL", str(tmp_path / "nothing")).replace("OUT", str(tmp_path / "out")) for a in command]
    argv += ["--device", "cuda"]
    out = subprocess.run([sys.executable, "-m", "dlm.cli", *argv], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"dlm {argv[0]}: device 'cuda' is not available on this machine (it has: cpu); use --device " \
        "auto or cpu", out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_the_cli_knows_the_same_dtypes_without_importing_torch():
    from dlm.cli.flags import DTYPES

    assert DTYPES == dev.DTYPES


def test_place_casts_and_moves_once_and_placement_says_where(tiny_tokenizer):
    model = tiny_model(len(tiny_tokenizer), attention="bidirectional", family="masked", label_shift=True,
                       mask_token_id=tiny_tokenizer.mask_token_id)
    placed = dev.place(model, "cpu", "bfloat16")
    assert placed is model and dev.model_dtype(model) is torch.bfloat16 and dev.model_device(model).type == "cpu"
    assert dev.placement(model) == {"device": "cpu", "dtype": "bfloat16", "device_name": "cpu",
                                    "threads": torch.get_num_threads()}


def test_generators_live_on_the_models_device_and_a_foreign_one_still_draws(tiny_tokenizer):
    model = tiny_model(len(tiny_tokenizer))
    g = dev.make_generator(7, model)
    assert g.device == dev.model_device(model) and g.initial_seed() == 7
    probs = torch.softmax(torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)), -1)
    same = dev.categorical(probs, dev.make_generator(3))
    assert same.shape == (3, 5) and same.dtype == torch.long
    # the same draws as torch.multinomial on the flattened rows: seeds keep their meaning
    want = torch.multinomial(probs.reshape(-1, 11), 1, generator=torch.Generator().manual_seed(3)).view(3, 5)
    assert torch.equal(same, want)


def test_set_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert dev.set_threads(1) == 1 and torch.get_num_threads() == 1
        assert dev.set_threads(None) == dev.machine_cores()
        with pytest.raises(DlmError, match="--threads must be >= 1"):
            dev.set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_eval_and_health_record_the_placement(tmp_path, tiny_tokenizer):
    """`dlm eval --out` and the server's /health and /v1/models say where the model ran and at what precision."""
    from dlm.cli import main
    from dlm.serve.engine import Engine

    tok = tiny_tokenizer
    model = tiny_model(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "ar")
    tok.save_pretrained(tmp_path / "ar")
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"prompt": "Ann has 2 cats.", "response": "return 2", "answer": 2}) + "\n")
    out = tmp_path / "eval.json"
    main(["eval", str(tmp_path / "ar"), "--data", str(data), "--max-new-tokens", "4", "--device", "cpu", "--dtype",
          "bfloat16", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert (result["device"], result["dtype"], result["device_name"]) == ("cpu", "bfloat16", "cpu")
    engine = Engine(tmp_path / "ar", device="auto", dtype="auto")
    assert (engine.placement["device"], engine.placement["dtype"]) == ("cpu", "float32")
    assert engine.describe()["dlm"]["device"] == "cpu"
