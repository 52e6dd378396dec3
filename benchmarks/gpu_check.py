"""The GPU acceptance test of dlm (`benchmarks/gpu_check.sh` runs it): at most 10 minutes on one H100/H200, no network.
Every command that runs a model is run on the GPU and asserted against the CPU, then what the dry run (`dlm train
--dry-run`) can only estimate is measured.

Parts, each in its own subprocess (its own process group, killed at its hard time cap), in this order; each writes
$OUT/<part>.json as it goes, so a timeout keeps what was done; $OUT/summary.json lists what ran, how long, and what
failed or timed out. A failed part records its error and the check goes on; the exit status is 0 only when every part
passed. Acceptance (benchmarks/gpu_acceptance.py, run through benchmarks/gpu_commands.py; tolerances in
TOLERANCES there and in docs/guides/multi-gpu.md):
  prepare          tiny LLaDA and Dream stand-ins (scripts/standins.py); an AR model trained on tinymath (`dlm
                   train`), then an MDM adapted from it: trained weights make greedy comparisons meaningful
  convert          `dlm convert` of both stand-ins, each decoded by `dlm generate` (CPU fp32 / GPU fp32 / GPU bf16)
  generate         `dlm generate` of the AR and MDM models, same three placements
  eval             `dlm eval --task tinymath` of both models (threshold decoding, tau 0.9), same three placements
  humaneval        `dlm eval --task humaneval` sampled (temperature 0.8, 4 samples per problem, pass@1,2) on the GPU
  lm_eval          `dlm lm-eval` on the GPU in bf16: dlm_humaneval_sampled (generate_until, sampled) and a tinymath
                   multiple-choice task (loglikelihood: the MDM's Monte-Carlo ELBO), the latter also through `dlm
                   eval --task lm-eval:` at CPU fp32 and GPU fp32; log-likelihoods compared request by request
  serve            `dlm serve` on the GPU (fp32): one streamed chat request with denoising steps, events checked, its
                   text against CPU `dlm generate`; stopped
  train            `dlm train`: a LoRA MDM (from the AR model) and PU W=2 with carry (from the MDM), 10 updates each,
                   bf16 on the GPU against fp32 on the CPU (per-update losses)
  export           `dlm export --merge` of the GPU LoRA run; the merged model decoded on the GPU against the LoRA run
                   on the CPU
  logits           a teacher-forced forward of every model above at the three placements: max |logits - CPU fp32|
Timing (random-initialised models built from configs):
  mfu              a ~1 B Llama-shaped model (hidden 2048, 16 layers, MLP 5632) trained in bf16 by dlm's Trainer on
                   tinymath: MDM and PU W=2 (carry); tokens/s, achieved FLOPs (6 x matrix params x tokens) and their
                   share of the device's peak bf16 (dlm.config.GPUS)
  memory           torch.cuda.max_memory_allocated of one update at PU W = 1, 2, 4, 8, each with and without
                   train.activation_checkpointing, on a ~0.2 B model (hidden 1024, 16 layers)
  block_attention  a block-MDM training step (the ~0.2 B model) with DLM_BLOCK_ATTENTION=dense, then =flex (two
                   subprocesses): time per step and the per-step losses of both (same seed, same data), and whether
                   this checkout reads the switch at all
  sampling         block decoding (blocks of 32, exact KV cache; Fast-dLLM threshold 0.9 and top-u 4) vs the AR
                   sampler with its KV cache on the ~1 B model in bf16, 64-token prompts, 128 new tokens, tokens/s at
                   batch 1 and 16. Random weights: a throughput check only (a random model rarely passes the
                   threshold: ~1 token per step)

Engines (benchmarks/gpu_sglang.py; optional: a skip passes):
  sglang           where `import sglang` works (the machines here have no network, so usually not: "skipped: sglang
                   not installed"), `dlm export --format llada` of the LLaDA stand-in served by sglang's dLLM path
                   and sent one /generate request; runs last, in what the budget leaves

Without CUDA it prints that and exits 0; --smoke runs every part at toy size on the CPU (the "GPU" placements are the
CPU there, so fp32 comparisons hold trivially and bf16 ones are recorded, not asserted), except flex attention, which
has no CPU backward in torch; the test suite runs it (tests/test_gpu_check.py, ~50-90 s on 2 cores). To fit that, on a
CPU-only machine --smoke forks each part and each dlm command from a process that has imported dlm (imports are most
of a toy command's cost); on a GPU every part is `python gpu_check.py --part NAME` and every command `python -m
dlm.cli ...` (`dlm serve` is one under --smoke too).

    bash benchmarks/gpu_check.sh                       # OUT=./gpu_check_out
    OUT=/tmp/gc bash benchmarks/gpu_check.sh --smoke
    bash benchmarks/gpu_check.sh --parts prepare,eval  # some parts (a part needs what `prepare` writes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import gpu_acceptance  # (the acceptance parts: dlm's commands on the GPU against the CPU)
import gpu_commands  # (how a part runs dlm commands)
import gpu_sglang  # (an engine serving dlm's export, where one is installed)

ROOT = Path(__file__).resolve().parents[1]
ACCEPTANCE = tuple(gpu_acceptance.CHILDREN)
TIMING = ("mfu", "memory", "block_attention", "sampling")
ENGINES = ("sglang",)  # optional: "skipped: ..." (not installed, no LLaDA path, out of budget) passes
PARTS = ACCEPTANCE + TIMING + ENGINES
CAPS_S = {  # hard caps on one H100/H200; 580 s together, 20 s of the 600 left for the parent and process starts
    "prepare": 70, "convert": 25, "generate": 25, "eval": 30, "humaneval": 25, "lm_eval": 45, "serve": 25,
    "train": 45, "export": 25, "logits": 25,  # 340 s of acceptance
    "mfu": 65, "memory": 45, "block_attention": 80, "sampling": 50,  # 240 s of timing
    "sglang": 120,  # last, in what the 600 s leave (a skip, without sglang, takes a second)
}
SMOKE_CAP_S, SMOKE_BUDGET_S = 120, 900  # --smoke on 2 loaded CPU cores: a stuck part still ends, the suite finishes
MODE_SHARES = {"dense": 0.375, "flex": 0.625}  # block_attention's cap: flex compiles its kernels first
BUDGET_S = 600.0
SIZES = {  # the "~1 B" model (mfu, sampling), a "~0.2 B" one (memory, block_attention), and a toy one for --smoke
    "gpu": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                intermediate_size=5632),
    "mid": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                intermediate_size=2816),
    "smoke": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64),
}


# ---- the parent: parts with caps ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="results folder (default: $OUT, "
                    "else ./gpu_check_out)")
    ap.add_argument("--smoke", action="store_true", help="every part at toy size, on the CPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    ap.add_argument("--budget", type=float, help=f"seconds for all parts together (default: {BUDGET_S:.0f}; "
                    f"--smoke: {SMOKE_BUDGET_S})")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        CHILDREN[args.part](args, out)
        return

    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "smoke": args.smoke,
               "device": device, "torch": torch.__version__, "tolerances": gpu_acceptance.TOLERANCES, "parts": {}}
    if not cuda and not args.smoke:
        summary["skipped"] = "no CUDA device: nothing measured (--smoke exercises the script on CPU)"
        _write_summary(out, summary)
        print(f"gpu_check: {summary['skipped']}; wrote {out / 'summary.json'}")
        return
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    fork = args.smoke and not cuda  # --smoke on a CPU machine: parts forked from here, dlm imported once (below)
    if fork:
        gpu_commands.preload(*gpu_commands.PRELOAD)
    start = time.monotonic()
    deadline = start + (args.budget or (SMOKE_BUDGET_S if args.smoke else BUDGET_S))
    for part in [p for p in PARTS if p in parts]:  # always in dependency order
        modes = ("dense", "flex") if part == "block_attention" else (None,)
        for mode in modes:
            name = part if mode is None else f"{part}_{mode}"
            if mode == "flex" and not cuda:  # smoke on CPU: torch's flex attention has no CPU backward
                summary["parts"][name] = {"status": "skipped: flex attention trains on CUDA only", "seconds": 0.0}
                continue
            cap = SMOKE_CAP_S if args.smoke else CAPS_S[part] * (MODE_SHARES[mode] if mode else 1.0)
            cap = min(cap, deadline - time.monotonic())
            if cap < 5:
                summary["parts"][name] = {"status": "skipped: out of budget", "seconds": 0.0}
                continue
            summary["parts"][name] = _run_part(part, mode, out, args.smoke, cap, fork)
            skipped = (_read(out / f"{name}.json") or {}).get("skipped")
            if skipped and summary["parts"][name]["status"] == "ok":  # a part that found nothing to check
                summary["parts"][name]["status"] = f"skipped: {skipped}"
            print(f"gpu_check: {name}: {summary['parts'][name]['status'][:400]} "
                  f"({summary['parts'][name]['seconds']:.0f} s)", flush=True)
            _write_summary(out, summary)
        if part == "block_attention":
            _compare_block_attention(out)
    summary["seconds"] = time.monotonic() - start
    failed = [k for k, p in summary["parts"].items() if not _passed(k, p["status"])]
    summary["passed"] = not failed
    _write_summary(out, summary)
    print(f"gpu_check: {'all parts passed' if summary['passed'] else 'NOT passed: ' + ', '.join(failed)} in "
          f"{summary['seconds']:.0f} s; results in {out}/")
    sys.exit(0 if summary["passed"] else 1)


def _passed(name: str, status: str) -> bool:
    """ok; the flex half of block_attention skipped on a CPU; an engine part skipped for any reason it gives."""
    return status == "ok" or status.startswith("skipped: flex") or (name in ENGINES and status.startswith("skipped: "))


def _write_summary(out: Path, summary: dict) -> None:
    _write(out, "summary", summary)


def _run_part(part: str, mode: str | None, out: Path, smoke: bool, cap: float, fork: bool = False) -> dict:
    """One part in its own process group (session), killed with everything it started (servers, dlm commands) at
    `cap`. On a GPU it is `python gpu_check.py --part NAME`; `fork` (--smoke without CUDA) forks it from this
    process, which has imported torch, transformers and dlm already: imports are most of a toy part's cost on 2 cores.
    """
    name = part if mode is None else f"{part}_{mode}"
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    env = {} if mode is None else {"DLM_BLOCK_ATTENTION": mode}
    start = time.monotonic()
    if fork:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _forked_part(part, mode, out, log, env)  # never returns
        poll = lambda: _exit_code(os.waitpid(pid, os.WNOHANG))  # noqa: E731
    else:
        cmd = [sys.executable, __file__, "--part", part, "--out", str(out)] + (["--smoke"] if smoke else [])
        cmd += ["--mode", mode] if mode else []
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        pid, poll = proc.pid, proc.poll
    code = poll()
    while code is None and time.monotonic() - start < cap:
        time.sleep(0.05)
        code = poll()
    if code is None:
        status = f"timed out after {cap:.0f} s (results so far kept): {_tail(log, 600)}"
    else:
        status = "ok" if code == 0 else f"failed (exit {code}): {_tail(log)}"
    try:
        os.killpg(pid, signal.SIGKILL)  # what the part started dies with it
    except ProcessLookupError:
        pass
    while code is None:
        time.sleep(0.05)
        code = poll()
    return {"status": status, "seconds": time.monotonic() - start, "log": str(log)}


def _exit_code(waited: tuple[int, int]) -> int | None:
    pid, status = waited
    return os.waitstatus_to_exitcode(status) if pid else None


def _forked_part(part: str, mode: str | None, out: Path, log: Path, env: dict) -> None:
    """A forked part: its own session, output into `log`, then exit with its status."""
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        CHILDREN[part](argparse.Namespace(smoke=True, mode=mode, out=str(out), part=part, fork=True), out)
        code = 0
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: B036 - a forked child must never return into the parent's loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _tail(log: Path, n: int = 1500) -> str:
    return log.read_text(errors="replace")[-n:]


def _compare_block_attention(out: Path) -> None:
    runs = {m: _read(out / f"block_attention_{m}.json") for m in ("dense", "flex")}
    if not all(r and r.get("losses") for r in runs.values()):
        return
    dense, flex = runs["dense"], runs["flex"]
    n = min(len(dense["losses"]), len(flex["losses"]))
    diff = max(abs(a - b) for a, b in zip(dense["losses"][:n], flex["losses"][:n]))
    result = {"dense_s_per_step": dense["median_s"], "flex_s_per_step": flex["median_s"],
              "flex_speedup": dense["median_s"] / flex["median_s"], "max_loss_abs_diff": diff, "steps_compared": n,
              "switch_in_this_checkout": dense["switch_in_this_checkout"],
              "note": "bf16 under autocast: equal paths give identical losses; dense and flex kernels may differ in "
                      "the last bits, which grow over updates"}
    _write(out, "block_attention", result)


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _write(out: Path, part: str, payload: dict) -> None:
    tmp = out / f".{part}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, out / f"{part}.json")


# ---- timing children ----------------------------------------------------------------------------------------------
def _setup(args, size: str = "gpu"):
    """torch and a device; registers the size preset the Trainer-based parts use."""
    import torch

    from dlm.modeling import backbone

    size = "smoke" if args.smoke else size
    backbone.PRESETS[f"gpucheck-{size}"] = SIZES[size]  # ModelConfig.preset is looked up when the model is built
    torch.manual_seed(0)
    return torch, "cuda" if torch.cuda.is_available() else "cpu", size


def _trainer(args, out: Path, name: str, size: str, overrides: list[str]):
    from dlm.config import load_recipe
    from dlm.training.loop import Trainer

    recipe = load_recipe(None, [
        f"out_dir={out}/work/{name}", f"data.dir={out}/work/timing-data", "data.level=medium",
        f"data.n_train={200 if args.smoke else 2000}", "data.n_validation=10", "data.n_test=10",
        f"model.preset=gpucheck-{size}", "model.vocab_size=1024", "model.max_length=144", "model.label_shift=true",
        f"train.batch_size={4 if args.smoke else 32}", "train.steps=1000", "train.seed=0",
        f"train.precision={'fp32' if args.smoke else 'bf16'}", *overrides])
    return Trainer(recipe, progress=False)


def _peak_flops(torch) -> float | None:
    from dlm.config import GPUS

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((g.peak_flops for k, g in GPUS.items() if k.split("-")[0] in name), None)


def _matrix_params(model) -> int:
    embed = model.backbone.get_input_embeddings().weight
    tied = model.backbone.config.tie_word_embeddings
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.ndim >= 2) - (
        0 if tied else embed.numel())


def _timed_updates(torch, trainer, warmup: int, updates: int) -> tuple[list[float], int]:
    for _ in range(warmup):
        trainer.train_step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    tokens0, times = trainer.tokens_seen, []
    for _ in range(updates):
        t0 = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, trainer.tokens_seen - tokens0


def child_mfu(args, out: Path) -> None:
    torch, device, size = _setup(args)
    configs = {"mdm": ["train.objective=mdm", "model.attention=bidirectional"],
               "pu_w2": ["train.objective=pu", "model.attention=bidirectional", "progressive.construction=threshold",
                         "progressive.reveal_count=4", "progressive.carry=true", "progressive.window=2"]}
    peak = _peak_flops(torch)
    result = {"model": SIZES[size], "device": device, "peak_bf16_flops": peak, "runs": {},
              "flops": "6 x matrix params x tokens (real, non-padding tokens the objective processed; PU: all W "
                       "passes)"}
    for name, overrides in configs.items():
        trainer = _trainer(args, out, f"mfu-{name}", size, overrides)
        n_mm = _matrix_params(trainer.unwrapped)
        times, tokens = _timed_updates(torch, trainer, warmup=1 if args.smoke else 2, updates=1 if args.smoke else 5)
        seconds = sum(times)
        achieved = 6 * n_mm * tokens / seconds
        result["runs"][name] = {"params": trainer.n_params, "matrix_params": n_mm, "vocab": len(trainer.tok),
                                "updates": len(times), "s_per_update": seconds / len(times),
                                "tokens_per_s": tokens / seconds, "achieved_flops": achieved,
                                "mfu": achieved / peak if peak else None}
        _write(out, "mfu", result)
        del trainer
        _free(torch)


def child_memory(args, out: Path) -> None:
    torch, device, size = _setup(args, "mid")
    cuda = torch.cuda.is_available()
    result = {"model": SIZES[size], "device": device, "metric": "torch.cuda.max_memory_allocated over one update "
              "(after one warm-up update), bytes; CPU (smoke): null", "runs": {},
              "note": "equal peaks with and without train.activation_checkpointing mean this checkout's loop does not "
                      "act on the flag"}
    windows = (1, 2) if args.smoke else (1, 2, 4, 8)
    for window in windows:
        for ckpt in (False, True):
            name = f"w{window}_{'ckpt' if ckpt else 'no_ckpt'}"
            trainer = _trainer(args, out, f"mem-{name}", size, [
                "train.objective=pu", "model.attention=bidirectional", "progressive.construction=threshold",
                "progressive.reveal_count=4", "progressive.carry=true", f"progressive.window={window}",
                f"train.activation_checkpointing={str(ckpt).lower()}", f"train.batch_size={2 if args.smoke else 16}"])
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
            result["runs"][name] = {"window": window, "train_activation_checkpointing": ckpt,
                                    "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                                    "s_per_update": time.perf_counter() - t0}
            _write(out, "memory", result)
            del trainer
            _free(torch)


def child_block_attention(args, out: Path) -> None:
    torch, device, size = _setup(args, "mid")
    from dlm.modeling import blocks

    mode = args.mode or os.environ.get("DLM_BLOCK_ATTENTION", "dense")
    trainer = _trainer(args, out, f"block-{mode}", size, ["train.objective=mdm", "model.attention=block_causal",
                                                          f"model.block_size={4 if args.smoke else 32}"])
    losses, times = [], []
    cuda = torch.cuda.is_available()
    result = {"mode": mode, "model": SIZES[size], "device": device, "losses": losses, "s_per_step": times,
              "switch_in_this_checkout": "DLM_BLOCK_ATTENTION" in Path(blocks.__file__).read_text()}
    for _ in range(3 if args.smoke else 6):  # the first step includes flex attention's compilation
        t0 = time.perf_counter()
        record = trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(record["loss"])
        steady = sorted(times[1:] or times)
        result["median_s"] = steady[len(steady) // 2]
        _write(out, f"block_attention_{mode}", result)


def child_sampling(args, out: Path) -> None:
    torch, device, size = _setup(args)
    from dlm.modeling.build import build
    from dlm.modeling.device import make_generator, place
    from dlm.modeling.spec import ModelSpec
    from dlm.sampling import generate
    from dlm.sampling.options import AutoregressiveOptions, MaskedOptions

    vocab, block = (300, 4) if args.smoke else (32000, 32)
    gen, prompt_len = (16, 8) if args.smoke else (128, 64)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = SIZES[size]
    models = {
        "ar": build(ModelSpec(family="autoregressive"), arch="llama", preset="nano", vocab_size=vocab,
                    max_positions=1024, **sizes),
        "block": build(ModelSpec(family="masked", attention="block_causal", block_size=block,
                                 mask_token_id=vocab - 1), arch="llama", preset="nano", vocab_size=vocab,
                       max_positions=1024, **sizes),
    }
    settings = {"ar": AutoregressiveOptions(),
                "block_threshold_0.9": MaskedOptions(policy="threshold", confidence_threshold=0.9),
                "block_top_u_4": MaskedOptions(policy="top_u", reveal_count=4)}
    result = {"model": sizes, "vocab": vocab, "device": device, "dtype": str(dtype), "gen_length": gen,
              "prompt_length": prompt_len, "block_size": block, "runs": {},
              "note": "random-initialised models: throughput only. EOS is an id outside the vocabulary, so every row "
                      "generates gen_length tokens"}
    for model in models.values():
        place(model, device, dtype).eval()
    g = make_generator(0)  # prompts drawn on the CPU: the same prompts on every device
    for batch in (1, 2) if args.smoke else (1, 16):
        prompts = torch.randint(0, vocab - 2, (batch, prompt_len), generator=g).tolist()
        for name, options in settings.items():
            model = models["ar" if name == "ar" else "block"]
            kwargs = dict(max_new_tokens=gen, eos_id=vocab, pad_id=0)
            generate(model, prompts, options, **kwargs)  # warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = generate(model, prompts, options, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = sum(len(t) for t in res.tokens)
            result["runs"][f"{name}_batch{batch}"] = {"batch": batch, "tokens": tokens, "seconds": seconds,
                                                      "tokens_per_s": tokens / seconds,
                                                      "mean_nfe": sum(res.nfe) / len(res.nfe)}
            _write(out, "sampling", result)


def _free(torch) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


CHILDREN = {**gpu_acceptance.CHILDREN, "mfu": child_mfu, "memory": child_memory,
            "block_attention": child_block_attention, "sampling": child_sampling, "sglang": gpu_sglang.child_sglang}

if __name__ == "__main__":
    main()
