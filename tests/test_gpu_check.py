"""benchmarks/gpu_check.sh, the GPU acceptance test: without a GPU it says so and exits 0; --smoke runs every part on
the CPU at toy size (the "device" placements are the CPU: fp32 comparisons hold trivially, bf16 ones are recorded),
so every command the GPU run drives, every comparison and every timing part runs here."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCEPTANCE = ("prepare", "convert", "generate", "eval", "humaneval", "lm_eval", "serve", "train", "export", "logits")
TIMING = ("mfu", "memory", "block_attention_dense", "sampling")


def _gpu_check(tmp_path, *flags, **env_extra):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", **env_extra)
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), *flags], env=env, capture_output=True,
                          text=True, timeout=900)
    return tmp_path / "out", proc, time.perf_counter() - start


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the full check would run")
    out, proc, _ = _gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout
    assert "no CUDA device" in json.loads((out / "summary.json").read_text())["skipped"]


def test_gpu_check_smoke_runs_every_part_on_cpu(tmp_path):
    out, proc, seconds = _gpu_check(tmp_path, "--smoke")  # ~90 s on 2 idle cores (no timing assertion)
    summary = json.loads((out / "summary.json").read_text())
    status = {k: v["status"] for k, v in summary["parts"].items()}
    assert proc.returncode == 0, f"{status}\n{proc.stdout[-3000:]}"
    assert status.pop("block_attention_flex") in ("ok", "skipped: flex attention trains on CUDA only")
    assert status.pop("sglang") in ("ok", "skipped: sglang not installed")  # optional: a skip passes
    assert status == {k: "ok" for k in ACCEPTANCE + TIMING}
    assert summary["passed"] and summary["tolerances"]["logits_fp32_rel"] > 0

    parts = {name: json.loads((out / f"{name}.json").read_text()) for name in ACCEPTANCE}
    for name, part in parts.items():  # every asserted check held, and a run of the part is more than its commands
        assert part["passed"] and part["checks"], name
        assert all(c["ok"] for c in part["checks"] if c["asserted"]), name
        assert all(c["exit"] == 0 for label, c in part["commands"].items() if label != "serve"), name
    names = {name: [c["check"] for c in part["checks"]] for name, part in parts.items()}
    for name, what in (("convert", "llada generate"), ("convert", "dream generate"), ("generate", "ar generate"),
                       ("generate", "mdm generate"), ("eval", "mdm eval"), ("eval", "ar eval"),
                       ("export", "merged (device) vs LoRA run (CPU)")):
        assert f"{what}: greedy dev fp32 = CPU fp32" in names[name]
    bf16 = [c for part in parts.values() for c in part["checks"] if "bf16" in c["check"] and "fp32" in c["check"]]
    assert bf16 and not any(c["asserted"] for c in bf16)  # --smoke: the CPU's bf16, recorded only
    assert any("ELBO" in c and "dev_bf16" in c for c in names["lm_eval"])
    assert any("20 sampled completions" in c for c in names["lm_eval"])
    assert any("streamed text" in c for c in names["serve"]) and any("stopped" in c for c in names["serve"])
    assert parts["serve"]["stream"]["steps"] > 0
    assert {c.split(":")[0] for c in names["logits"]} == {"llada", "dream", "ar", "mdm", "lora", "pu", "merged"}
    assert parts["logits"]["missing"] == []

    mfu = json.loads((out / "mfu.json").read_text())["runs"]
    for run in mfu.values():
        assert run["achieved_flops"] == pytest.approx(6 * run["matrix_params"] * run["tokens_per_s"])
    assert set(json.loads((out / "memory.json").read_text())["runs"]) == {"w1_no_ckpt", "w1_ckpt", "w2_no_ckpt",
                                                                           "w2_ckpt"}
    dense = json.loads((out / "block_attention_dense.json").read_text())
    assert len(dense["losses"]) == 3 and dense["mode"] == "dense"
    if (out / "block_attention.json").is_file():  # both modes ran (CUDA, or a CPU flex backward)
        block = json.loads((out / "block_attention.json").read_text())
        assert block["steps_compared"] == 3
        if not block["switch_in_this_checkout"]:  # both runs took the same path: identical losses
            assert block["max_loss_abs_diff"] == 0
    sampling = json.loads((out / "sampling.json").read_text())["runs"]
    assert sampling["block_top_u_4_batch2"]["mean_nfe"] == 16 / 4  # u = 4 of 16 positions per step
    assert sampling["ar_batch2"]["tokens"] == 2 * 16 and sampling["ar_batch1"]["mean_nfe"] == 16
    print(f"gpu_check --smoke: {seconds:.0f} s")


def test_a_failing_part_is_recorded_and_the_check_goes_on(tmp_path):
    """A part whose inputs are missing fails with its error in summary.json, the next part still runs, and the exit
    status says not everything passed."""
    out, proc, _ = _gpu_check(tmp_path, "--smoke", "--parts", "export,sampling")
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 1 and not summary["passed"]
    assert summary["parts"]["export"]["status"].startswith("failed (exit 1)")
    assert "run the prepare (and train) parts first" in summary["parts"]["export"]["status"]
    assert summary["parts"]["sampling"]["status"] == "ok"
    assert "error" in json.loads((out / "export.json").read_text())


FAKE_SGLANG = """import argparse, json
from http.server import BaseHTTPRequestHandler, HTTPServer
ap = argparse.ArgumentParser()
for flag in ("--model-path", "--port", "--host", "--dllm-algorithm"):
    ap.add_argument(flag)
a, _ = ap.parse_known_args()
config = json.load(open(a.model_path + "/config.json"))
assert a.dllm_algorithm == "LowConfidence" and config["architectures"] == ["LLaDAModelLM"]
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body = json.dumps({"text": " served " + request["text"]}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
HTTPServer((a.host, int(a.port)), Handler).serve_forever()
"""


@pytest.mark.parametrize("knows_llada", [True, False])
def test_the_sglang_part_serves_the_llada_export_where_sglang_is_installed(tmp_path, knows_llada):
    """A stand-in sglang (its launch_server a tiny HTTP server that checks the flags and the export's architecture):
    the part exports the LLaDA stand-in with `dlm export --format llada`, starts the server, sends one request and
    stops it; an sglang whose srt/dllm/config.py does not name LLaDAModelLM is a skip, which passes."""
    fake = tmp_path / "fake"
    (fake / "sglang" / "srt" / "dllm").mkdir(parents=True)
    for package in ("sglang", "sglang/srt", "sglang/srt/dllm"):
        (fake / package / "__init__.py").write_text("")
    (fake / "sglang" / "srt" / "dllm" / "config.py").write_text(
        'DLLM_PARAMS = {"LLaDAModelLM": 126336}\n' if knows_llada else 'DLLM_PARAMS = {"SDARForCausalLM": 151669}\n')
    (fake / "sglang" / "launch_server.py").write_text(FAKE_SGLANG)
    out, proc, _ = _gpu_check(tmp_path, "--smoke", "--parts", "sglang",
                              PYTHONPATH=f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    summary = json.loads((out / "summary.json").read_text())
    part = json.loads((out / "sglang.json").read_text())
    assert proc.returncode == 0 and summary["passed"], proc.stdout[-2000:]
    if knows_llada:
        assert summary["parts"]["sglang"]["status"] == "ok" and part["passed"]
        assert part["export"]["exit"] == 0 and "untested on the engines" in part["export"]["stdout"]
        assert part["request"] == {"status": 200, "body": '{"text": " served Hello"}'}
    else:
        assert summary["parts"]["sglang"]["status"].startswith("skipped: this sglang's srt/dllm/config.py")
