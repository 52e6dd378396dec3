"""Mutation check of the core (issue 18): run mutmut once per module against the tests that cover it, and write the
score and every surviving mutant to docs/results/mutation.md.

    python scripts/mutation.py                      # every module in MODULES
    python scripts/mutation.py training/ema.py data/ul2.py
    python scripts/mutation.py --list               # the module -> tests map

Each module runs in its own scratch copy of the working tree (tracked and untracked, not ignored, files) under
--workdir, with `[tool.mutmut]` of pyproject.toml plus `only_mutate` and the module's test selection, so runs never
touch the checkout and a module's survivors are judged by the tests meant to catch them. mutmut skips decorated
functions; in the scratch copy `@torch.no_grad()` and `@contextmanager` are rewritten as an assignment after the
function (`f = torch.no_grad()(f)`), which behaves the same and lets the samplers' loops and `EMA.update` be mutated.

Survivors are explained in EXPLAINED below (mutant name -> one line: why it is equivalent, or which test kills it
now); the doc lists any survivor without an entry as unexplained, with NOT_EQUIVALENT's note where it has one (a
dropped device argument: tests/test_device_check.py's fake accelerator sees it on the inference paths, issue 43).
Not part of .ci/run: a full run takes ~30 min on 2 cores. Set OMP_NUM_THREADS=1 and DLM_TEST_THREADS=1 on a shared
machine.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import fnmatch
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("DLM_MUTATION_ROOT", Path(__file__).resolve().parents[1]))  # another checkout: "before"

# module (under src/dlm) -> the tests that cover it (pytest node ids or files); slow-marked tests are deselected
MODULES: dict[str, list[str]] = {
    "training/ema.py": ["tests/test_ema.py", "tests/test_training.py::test_ema_and_final_model"],
    "data/ul2.py": ["tests/test_ul2.py", "tests/test_paper_constants.py"],
    "data/canvas.py": ["tests/test_canvas.py", "tests/test_data.py", "tests/test_masking.py"],
    "modeling/carry.py": ["tests/test_carry.py", "tests/test_build.py", "tests/test_progressive.py",
                          "tests/test_block_decoding.py"],
    # test_flex_attention's CPU tests (the BlockMask against the dense mask, backend selection); its flex logits test
    # compiles flex_attention (~1 min cold) and stays out
    "modeling/blocks.py": ["tests/test_blocks.py", "tests/test_blocks_spec.py", "tests/test_block_training.py",
                           "tests/test_block_decoding.py",
                           "tests/test_flex_attention.py::test_attends_nothing_matches_the_grid",
                           "tests/test_flex_attention.py::test_block_mask_equals_dense_mask_exactly",
                           "tests/test_flex_attention.py::test_backend_selection", "tests/test_device_check.py"],
    "diffusion/masking.py": ["tests/test_masking.py", "tests/test_paper_constants.py"],
    "diffusion/policies.py": ["tests/test_policies.py", "tests/test_device_check.py"],
    "diffusion/simplex.py": ["tests/test_simplex.py", "tests/test_paper_constants.py", "tests/test_device_check.py"],
    "diffusion/progressive.py": ["tests/test_progressive.py", "tests/test_pu_rules.py",
                                 "tests/test_paper_constants.py", "tests/test_progressive_spec.py",
                                 "tests/test_trajectory_pool_spec.py"],
    "training/trajectories.py": ["tests/test_progressive.py", "tests/test_block_training.py",
                                 "tests/test_trajectory_pool_spec.py"],
    "sampling/autoregressive.py": ["tests/test_ar_sampler.py", "tests/test_device_check.py"],
    # the masked samplers: each survivor reruns every mapped test, so the maps keep the tests that reach the module's
    # code paths (test_block_decoding's full-canvas-only and block-cache-only tests add minutes, not kills)
    "sampling/masked.py": ["tests/test_masked_sampler.py", *(f"tests/test_block_decoding.py::test_{t}" for t in (
        "uncached_and_cached_match_the_reference", "nfe_counts_and_block_size_from_the_model",
        "rejects_bad_cache_options", "fast_dllm_matches_its_reference")), "tests/test_device_check.py"],
    "sampling/block_cache.py": ["tests/test_block_decoding.py", "tests/test_device_check.py"],
    "sampling/steps.py": ["tests/test_masked_sampler.py", *(f"tests/test_block_decoding.py::test_{t}" for t in (
        "uncached_and_cached_match_the_reference", "only_the_current_block_is_eligible",
        "fast_dllm_matches_its_reference")), "tests/test_device_check.py"],
    "sampling/simplex.py": ["tests/test_simplex.py", "tests/test_guidance.py",
                            "tests/test_simplex_sampler_reference.py", "tests/test_simplex_sampler_spec.py",
                            "tests/test_device_check.py"],
    "sampling/guidance.py": ["tests/test_guidance.py", "tests/test_guidance_reference.py",
                             "tests/test_device_check.py"],
    # the ELBO: test_lm_eval's likelihood tests (not its lm-eval runs) and the fake-accelerator check
    "evaluation/elbo.py": [*(f"tests/test_lm_eval.py::test_{t}" for t in (
        "masked_elbo_is_unbiased_against_exact_enumeration", "masked_elbo_is_deterministic_and_independent_of_batching",
        "ar_loglikelihood_is_exact_and_greedy_flags_the_argmax_continuation", "likelihood_refusals",
        "mask_counts_are_stratified_and_weighted_by_one_over_t")), "tests/test_device_check.py", "tests/test_elbo.py"],
    # issue 47 item 7: the code added since the core's run. The serve tests start servers (~20 s a file): each module
    # maps to the tests that reach it, and each mutant reruns only those that called the mutated function
    "serve/limits.py": ["tests/test_cli_defaults.py::test_serve_limit_flags_show_the_library_defaults",
                        "tests/test_serve.py::test_cli_help_and_bad_limits",
                        "tests/test_serve_limits.py::test_cli_limits_and_access_flags",
                        "tests/test_serve_limits.py::test_every_limit_must_be_above_zero_and_names_its_flag"],
    "serve/access.py": [*(f"tests/test_serve_limits.py::test_{t}" for t in (
        "a_loopback_server_answers_only_to_loopback_host_names",
        "an_api_key_guards_v1_and_leaves_the_page_and_health_open", "cli_limits_and_access_flags")),
        "tests/test_serve_access.py"],
    "serve/protocol.py": ["tests/test_serve_limits.py", "tests/test_serve_protocol.py",
                          "tests/test_serve.py::test_malformed_requests_get_one_error_each_and_the_server_keeps_serving",
                          "tests/test_serve.py::test_seed_n_and_options_from_the_body",
                          "tests/test_serve.py::test_completions_continue_raw_text"],
    "serve/stream.py": ["tests/test_serve_limits.py", "tests/test_serve.py", "tests/test_serve_stream.py"],
    # test_serve.py's `servers` fixture starts five servers per pytest session (each mutant): engine, batching and
    # app map to the tests that build their own
    "serve/engine.py": ["tests/test_serve_engine.py", "tests/test_serve_options.py",
                        "tests/test_serve.py::test_recipe_eval_section_gives_the_defaults",
                        "tests/test_serve.py::test_server_flags_over_the_recipe_follow_the_same_rule"],
    "serve/batching.py": ["tests/test_serve_batching.py", "tests/test_serve_continuous.py",
                          "tests/test_serve_options.py"],
    "serve/app.py": ["tests/test_serve_app.py", "tests/test_serve_limits.py", *(f"tests/test_serve.py::test_{t}"
                                                                              for t in (
        "body_size_concurrency_and_disconnect", "timeouts_are_504_or_an_error_event",
        "recipe_eval_section_gives_the_defaults", "cli_help_and_bad_limits"))],
    "modeling/resolve.py": ["tests/test_resolve.py"],
    "modeling/formats.py": ["tests/test_convert.py", "tests/test_export_formats.py", "tests/test_resolve.py"],
    "modeling/convert.py": ["tests/test_convert.py", "tests/test_resolve.py"],
    "modeling/export.py": ["tests/test_export_formats.py", "tests/test_lora.py",
                           "tests/test_convert.py::test_lora_over_a_release_then_merged_export_matches"],
    "modeling/lora.py": ["tests/test_lora.py",
                         "tests/test_convert.py::test_lora_over_a_release_then_merged_export_matches"],
    # the adapter: its unit tests and test_lm_eval's lm-eval runs, less the three that index lm-eval's ~15k tasks or
    # run its CLI (20-25 s each, per surviving mutant of DlmLM.__init__; what they check is in the unit tests too)
    "evaluation/lm_eval.py": ["tests/test_lm_eval_adapter.py", *(f"tests/test_lm_eval.py::test_{t}" for t in (
        "generate_until_is_batch_invariant_and_matches_dlm_eval", "generate_until_with_a_simplex_model_is_reproducible",
        "tinymath_task_grades_programs_in_the_sandbox", "likelihood_tasks_from_local_jsonl_are_batch_invariant",
        "simple_evaluate_finds_the_registered_model",
        "dlm_eval_samples_file_for_tinymath_leaves_the_summary_unchanged"))],
    # the training loop's normalisation and skipping (issue 47 item 7): only the update's three methods are mutated
    # (FUNCTIONS); the rest of the loop (logging, evaluation, checkpoint cadence) has its own tests and stays out
    "training/loop.py": ["tests/test_loss_normaliser.py", "tests/test_training_robustness.py",
                         *(f"tests/test_training.py::test_{t}" for t in (
                             "gradient_accumulation_matches_full_batch", "ema_and_final_model", "lr_schedule",
                             "resume_after_crash_during_checkpoint_equals_uninterrupted")),
                         "tests/test_parallel.py"],
    # the strategies: the description, its refusals, the one-process/DDP strategy and FSDP2 over a one-process group
    # (tests/test_parallel.py); DeepSpeed runs only under two-process launches (tests/test_deepspeed*.py, slow-marked),
    # which mutmut cannot reach: scripts/planted_mutants.py checks it (and FSDP2's two-process behaviour)
    # (the training tests that drive them through the Trainer add ~20 s a mutant and no kills the unit tests miss)
    "training/parallel.py": ["tests/test_parallel.py"],
}

# module -> the functions mutated (mutmut name globs) where only part of a module is checked
FUNCTIONS: dict[str, list[str]] = {
    "training/loop.py": [f"dlm.training.loop.x\u01c1Trainer\u01c1{f}__mutmut_*"
                         for f in ("train_step", "_plan_update", "_accumulate")],
}

# mutmut's mutant name -> why it survives (equivalent), or the test that kills it after this changes
_INT_DTYPE = "dtype=torch.long dropped where torch infers int64 from Python ints anyway: the same tensor"
_DIM = "dim +1 (or no dim) instead of -1 on a 2-D tensor: the same axis"
_DEVICE = ("a device argument dropped on an inference path: tests/test_device_check.py runs it on a fake accelerator, "
           "where the CPU tensor fails as on a GPU (issue 43; expected killed on a rerun)")
_DEVICE_TRAINING = ("a device argument dropped in CPU-side training code (UL2 spans, masks, block ids: drawn on "
                    "the CPU and moved) or flex (CUDA-only) code: tests/test_device_check_training.py runs the "
                    "objectives on the fake accelerator, but these tensors are moved explicitly or never reach it")
_INF = "float('INF') / float('-INF') parse to the same infinities"
EXPLAINED: dict[str, str] = {
    # ---- modeling/lora.py ----
    "modeling.lora.x_embedding_modules__mutmut_4": "the output head listed even when get_output_embeddings() is None: "
                                                   "every *ForCausalLM backbone dlm builds or loads has one",
    # ---- training/parallel.py ----
    "training.parallel.x_from_accelerate_config__mutmut_11": "the default distributed_type 'no' instead of 'NO': it "
                                                               "is upper-cased next",
    **{f"training.parallel.x_from_accelerate_config__mutmut_{i}": "a missing shard size defaults to None instead of "
       "the process count: `or processes` gives the process count either way" for i in (62, 64)},
    **{f"training.parallel.x.FSDP2._load__mutmut_{i}": "torch.load with weights_only None/True/default instead of "
       "False: a shard file holds only tensors, dicts, lists and numbers, which the weights-only loader accepts (the "
       "round trip in tests/test_parallel.py passes either way)" for i in (3, 5, 7)},
    **{f"training.parallel.x.Replicated.load_state__mutmut_{i}": "state.get(key, None) or state.get(key) instead of "
       "state.get(key, False): bool() of a missing flag is False either way" for i in (13, 15)},
    "training.parallel.x.DeepSpeed.backward__mutmut_12": "float('NAN') instead of float('nan'): the same NaN",
    "training.parallel.x.DeepSpeed.backward__mutmut_17": "loss / poisoned instead of loss * poisoned: poisoned is 1.0 "
                                                         "or NaN, and x / 1 = x * 1, x / NaN = x * NaN = NaN",
    "training.parallel.x.Replicated.evaluation_model__mutmut_3": "the full weights computed where the weights are not "
                                                                 "partitioned too: a state dict built and never read "
                                                                 "(that branch evaluates the live model)",
    # training/loop.py (issue 47 item 7): accelerate's reduce divides only for "mean" (and takes the max for "max");
    # any other reduction, its default included, sums: the same all-reduce
    **{f"training.loop.x.Trainer.train_step__mutmut_{i}": "reduction=None / 'XXsumXX' / 'SUM' / the default instead "
       "of 'sum': accelerate's reduce sums for every reduction except 'mean' and 'max'" for i in (17, 19, 21, 22)},
    **{f"training.loop.x.Trainer._plan_update__mutmut_{i}": "reduction=None / 'XXsumXX' / 'SUM' / the default "
       "instead of 'sum': accelerate's reduce sums for every reduction except 'mean' and 'max'"
       for i in (25, 27, 28, 29)},
    "training.loop.x.Trainer.train_step__mutmut_62": "get_last_lr()[1]: the second param group (no weight decay) "
                                                     "follows the same schedule, so the same LR",
    "training.loop.x.Trainer.train_step__mutmut_36": "zero_grad(set_to_none=None): accelerate's AcceleratedOptimizer "
                                                     "turns None into True before calling the optimizer's zero_grad",
    "training.ema.x__trainable__mutmut_1": "named_parameters(remove_duplicate=None): None is falsy, as False",
    "data.ul2.x_ul2_mask__mutmut_20": "valid.sum(+1) on the 2-D [B, L] mask sums over dim 1, the same as dim -1",
    **{f"data.canvas.x_collate__mutmut_{i}": _INT_DTYPE for i in (27, 30, 54, 56, 60, 62)},
    **{f"data.canvas.x_left_pad__mutmut_{i}": _INT_DTYPE for i in (6, 9, 21, 23)},
    **{f"data.canvas.x_pack_documents__mutmut_{i}": _INT_DTYPE for i in (14, 16)},
    **{f"data.canvas.x__collate_blocks__mutmut_{i}": _INT_DTYPE for i in (23, 26, 54, 56, 60, 62)},
    "data.canvas.x__collate_blocks__mutmut_18": "max(..., pad_to or 1): every row spans at least one block, so the "
                                                "floor of 1 never binds",
    **{f"modeling.carry.x_carry_input__mutmut_{i}": "positions default 'all' misspelt: only 'masked' is tested "
       "for, so any other default behaves as 'all'" for i in (1, 2)},
    **{f"modeling.carry.x_carry_input__mutmut_{i}": "an int/bool mask not cast before multiplying a float tensor: "
       "type promotion gives the same float result" for i in (9, 26, 39)},
    "modeling.carry.x_carry_input__mutmut_35": "the error message wrapped in XX still contains the whole message",
    **{f"diffusion.policies.x_confidence_rank__mutmut_{i}": _DIM for i in (17, 19, 28, 38, 45, 51, 57, 59, 67, 89, 98)},
    **{f"diffusion.policies.x_threshold__mutmut_{i}": _DIM for i in (10, 18)},
    **{f"diffusion.masking.x_mdm_loss__mutmut_{i}": _DIM for i in (11, 20, 22)},
    **{f"diffusion.masking.x_sample_mask__mutmut_{i}": _DIM for i in (26, 48, 50)},
    **{f"diffusion.policies.x_confidence_rank__mutmut_{i}": "stable=False/None for the sort by group: torch's CPU "
       "sort keeps ties in order anyway, so the confidence order inside a group survives; an unstable CUDA sort "
       "could break it (not testable on this machine)" for i in (49, 52, 61)},
    "diffusion.policies.x_confidence_rank__mutmut_11": _INF,
    "diffusion.policies.x_confidences__mutmut_10": _INF,
    "diffusion.masking.x_sample_mask__mutmut_47": _INF,
    **{f"diffusion.policies.x_threshold__mutmut_{i}": "the fallback needs the row to have a masked position; "
       "`|`, or `any` over every dim or over the batch, changes nothing because the fallback is AND-ed with the "
       "row's own top-1 masked position, which is above tau whenever any is" for i in (5, 6, 8, 11)},
    **{f"diffusion.simplex.x_cosine_alpha_bar__mutmut_{i}": "a clamp of f/f0 to [0, 1] dropped or widened: cos² "
       "is >= 0 and decreasing on [0, 1), so f/f0 is already in [0, 1]" for i in (32, 33, 34, 35, 38)},
    **{f"diffusion.simplex.x_cosine_alpha_bar__mutmut_{i}": "float32 instead of float64 for u = t/T: the output "
       "is float32 and agrees to its precision" for i in (8, 10)},
    "diffusion.simplex.x_noise_simplex__mutmut_5": "alpha_bar not cast to s0's dtype: type promotion gives the "
                                                    "same values",
    **{f"diffusion.simplex.x_to_simplex__mutmut_{i}": "dtype=torch.float32 dropped: a float fill gives float32 "
       "anyway" for i in (4, 8)},
    **{f"diffusion.simplex.x_top_p_sample__mutmut_{i}": "the weights handed to multinomial are rescaled per row "
       "(or by a global constant): multinomial normalises them, same distribution" for i in (42, 43, 47)},
    "diffusion.simplex.x_top_p_sample__mutmut_21": "`<=` vs `<` at the nucleus edge: differs only when the "
                                                   "cumulative probability equals top_p exactly in float",
    **{f"sampling.autoregressive.x_pick_tokens__mutmut_{i}": _DIM for i in (12, 22)},
    "sampling.autoregressive.x_pick_tokens__mutmut_4": _DIM,
    **{f"sampling.autoregressive.x_generate__mutmut_{i}": _INT_DTYPE for i in (39, 43)},
    **{f"sampling.autoregressive.x_generate__mutmut_{i}": "position ids shifted by a constant per row (or left to "
       "the backbone, which counts from the left padding): invisible to rotary embeddings, the position encoding "
       "of every supported architecture (llama, mistral, qwen2)" for i in (47, 57, 59, 62, 64, 76, 79, 81, 83, 84,
                                                                            85, 86)},
    "sampling.autoregressive.x_generate__mutmut_49": _DIM,
    **{f"sampling.autoregressive.x_generate__mutmut_{i}": "the appended attention-mask column is float, so "
       "torch.cat promotes the mask to float 0/1: the backbone reads the same mask" for i in (123, 127)},
    **{f"diffusion.simplex.x_cosine_alpha_bar__mutmut_{i}": "f0 = cos^2(s/(1+s)·π/2) with s = 1e-4 is 1 − 2.5e-8; "
       "these variants move it by less than float32 resolves in the output" for i in (26, 27, 28, 29, 30, 31)},
    "diffusion.simplex.x_top_p_sample__mutmut_11": _DIM,
    "data.canvas.x_collate__mutmut_22": "max(max(lengths), pad_to or 1): every length is >= 1 (the EOS), so the "
                                        "floor of 1 never binds",
    # ---- modeling/blocks.py (add entries below this line) ----
    **{f"modeling.blocks.x_response_blocks__mutmut_{i}": _DIM for i in (3, 11)},
    "modeling.blocks.x_attends_nothing__mutmut_33": _DIM,
    **{f"modeling.blocks.x_block_attention_mask__mutmut_{i}": "auto not told the block ids' device, so it reads it "
       "as the CPU: the same on this CPU-only machine (on CUDA auto would pick dense instead of flex; not testable "
       "without a GPU)" for i in (5, 7)},
    "modeling.blocks.x_attends_nothing__mutmut_19": "the sentinel block id for 'no valid clean key' one larger (and "
                                                    "the noised-block table one column wider): it only has to exceed "
                                                    "every real block id",
    "modeling.blocks.x_attends_nothing__mutmut_47": "the noised-block table one column wider: the extra column is "
                                                    "never set and never gathered",
    "modeling.blocks.x_block_causal_block_mask__mutmut_83": "BLOCK_SIZE=_TILE dropped: 128 is create_block_mask's "
                                                            "default",
    **{f"modeling.blocks.x_block_causal_block_mask__mutmut_{i}": "create_block_mask never compiled: on this CPU "
       "machine it is not compiled anyway, and on CUDA compiling only builds the same BlockMask tile by tile in less "
       "memory (not testable without a GPU)" for i in (76, 84, 86, 87)},
    "modeling.blocks.x_block_forward__mutmut_32": "the layout's additive mask left float32 under a model of another "
                                                  "dtype: the backbone's attention gives identical outputs (checked: "
                                                  "float16, bfloat16 and float64 tiny models, max difference 0)",
    "modeling.blocks.x_block_forward__mutmut_47": "align=None: falsy, as False",
    "modeling.blocks.x.VectorisedLayout.raw_carry__mutmut_21": "the bool noised & valid mask not cast before "
                                                               "multiplying the float carry: type promotion gives the "
                                                               "same float result",

    # ---- end modeling/blocks.py ----
    #
    # ---- diffusion/progressive.py, training/trajectories.py (add entries below this line) ----
    "diffusion.progressive.x_random_subset__mutmut_13": _INF,
    **{f"diffusion.progressive.x_random_subset__mutmut_{i}": _DIM for i in (17, 19, 25)},
    **{f"diffusion.progressive.x_student_forcing_ratio__mutmut_{i}": "the overflow guard moved from x < 700 to "
       "x <= 700 / x < 701: there k/(k + e^x) < k·1e-304, so with a floor > 0 the max is the floor either way; "
       "with floor 0 the ratio is < 1e-300 instead of 0, which the torch.rand draws it is compared with (multiples "
       "of 2^-24) tell apart only by drawing exactly 0" for i in (16, 17)},
    **{f"diffusion.progressive.x.StageConstruction.stage_of__mutmut_{i}": _DIM for i in (4, 8)},
    "diffusion.progressive.x.StageConstruction.stage_of__mutmut_12": "the lower clamp at 0 dropped: the revealed "
                                                                     "fraction is >= 0, so floor(K·frac) is too",
    **{f"diffusion.progressive.x.StageConstruction.start__mutmut_{i}": "the fresh stage tensor built as float "
       "zeros: it is only read as stage.float() for r, and the returned stage is stage_of's (long)" for i in (11, 13)},
    **{f"diffusion.progressive.x.StageConstruction.step__mutmut_{i}": _DIM for i in (3, 27, 53)},
    "diffusion.progressive.x.ThresholdConstruction.start__mutmut_1": "the default of `spread` flipped: the threshold "
                                                                     "construction's start ignores it",
    "diffusion.progressive.x.ThresholdConstruction.step__mutmut_36": _DIM,
    "training.trajectories.x__widen__mutmut_1": "_widen's default fill 0 -> 1 pads the confidences (and predicted "
                                                "tokens) beyond `width`; advance never selects those positions "
                                                "(masked is AND-ed with inside), so the padding is never read",
    **{f"training.trajectories.x__widen__mutmut_{i}": "x.shape[:+1] / x.shape[+1] on the 2-D [n, w] inputs: "
       "the same as [:-1] / [-1]" for i in (2, 12, 15)},
    **{f"training.trajectories.x.TrajectoryPool.__init____mutmut_{i}": "dtype=torch.float32 dropped from the "
       "carry's zeros: torch's default float dtype is float32 (dlm never changes it), the same tensor"
       for i in (66, 70)},
    **{f"training.trajectories.x.TrajectoryPool.advance__mutmut_{i}": "the fill of keep_truth beyond `width` "
       "(True -> False): those positions are outside `masked`, never revealed, so their value is never "
       "committed" for i in (52, 53)},
    **{f"training.trajectories.x.TrajectoryPool.refill__mutmut_{i}": _DIM for i in (40, 42)},

    # ---- end progressive/trajectories ----
    #
    # ---- sampling/masked.py, sampling/block_cache.py, sampling/steps.py (add entries below this line) ----
    "sampling.steps.x.Progress.working__mutmut_6": _DIM,
    **{f"sampling.block_cache.x__padding_mask__mutmut_{i}": "the additive mask built in float32 instead of the "
       "model's dtype: its 0 and finfo(dtype).min are exact in float32 and the attention adds it to scores in the "
       "query's dtype (checked on a bf16 model: same tokens and NFE)" for i in (6, 12)},
    **{f"sampling.block_cache.x_decode_block_causal__mutmut_{i}": "block_causal_mask's dtype left at float32: as "
       "for _padding_mask (checked on a bf16 model: the same confidences, bit for bit)" for i in (87, 211)},
    **{f"sampling.block_cache.x_decode_fast_dllm__mutmut_{i}": "use_cache False/None/default with a cache object "
       "passed: the backbone fills a given cache either way (transformers 5.24)" for i in (41, 47, 55, 171, 177, 179)},
    **{f"sampling.block_cache.x_decode_fast_dllm__mutmut_{i}": "align=None instead of False: falsy, the same raw "
       "outputs" for i in (42, 172)},
    "sampling.masked.x_decode__mutmut_15": "max(gen_length, 2) as the one block's size: differs only for gen_length "
                                           "<= 1, where arange(G) // 1 and // 2 are the same",
    "sampling.masked.x_decode__mutmut_45": "getattr default None instead of False: bool() of either is False",
    "sampling.masked.x_decode__mutmut_86": "the unfinished rows always indexed by their ids, also when all are "
                                           "unfinished: a copy of the same rows, the same values",
    "sampling.masked.x_decode__mutmut_94": "the clamp of the first masked index raised past gen_length - 1: an "
                                           "unfinished row always has a mask, so it never binds",
    **{f"sampling.masked.x_decode__mutmut_{i}": "position ids left to the backbone, which counts from the left "
       "padding: a constant shift per row, invisible to rotary embeddings (llama, mistral, qwen2)"
       for i in (98, 100, 102)},
    "sampling.masked.x_decode__mutmut_118": "the block-change flag not cast before multiplying the float carry: "
                                            "type promotion gives the same float result",
    "sampling.masked.x_decode__mutmut_113": "block_causal_mask's dtype left at float32: as in block_cache (checked "
                                            "on a bf16 model: the same confidences, bit for bit)",
    **{f"sampling.block_cache.x__forward__mutmut_{i}": "align=None instead of False: falsy, the same raw outputs"
       for i in (3, 9)},
    "sampling.block_cache.x._StepLayer.__init____mutmut_2": "is_initialized=False on a step layer: its own update "
                                                            "never lazily initialises, and the backbone's only other "
                                                            "reader (get_seq_length, for cache positions) is unused "
                                                            "with explicit position ids and a 4-D mask: the same "
                                                            "outputs (transformers 5.24)",
    **{f"sampling.block_cache.x_decode_block_causal__mutmut_{i}": "use_cache False/None/left out/misspelt (an "
       "extra keyword the backbone passes on unread) with a cache object passed: the backbone fills a given cache "
       "either way (transformers 5.24)" for i in (104, 109, 114, 116, 231, 235, 239, 240)},
    "sampling.block_cache.x_decode_block_causal__mutmut_217": "`<=`: the step's rows, mask, positions, carry and "
                                                              "cache are also narrowed when every row goes on, to "
                                                              "themselves (a copy, the same values)",
    "sampling.block_cache.x_decode_block_causal__mutmut_121": "a zero carry built for a model without a carry: "
                                                              "_forward never passes it on (no in_block)",
    **{f"sampling.block_cache.x_decode_block_causal__mutmut_{i}": "a block's first-step zero carry built in "
       "float32 or without its row dimension: zeros are exact in any dtype, carry_input casts them to the carry "
       "norm's dtype and broadcasts them over the rows: the same input to the model" for i in (126, 127, 131)},
    "sampling.block_cache.x_decode_block_causal__mutmut_145": "a model without a carry run through the carry path "
                                                              "with no carry: the same logits, plus hidden states "
                                                              "nobody reads",
    "sampling.block_cache.x_decode_block_causal__mutmut_17": "the block ids computed P positions too long: every "
                                                             "use slices them to [:e] with e <= L, the same ids",
    "sampling.block_cache.x_decode_block_causal__mutmut_90": "the LM head also run at the position before the block "
                                                             "without label shift: one more logit, sliced off; the "
                                                             "block's logits are the same",
    "sampling.block_cache.x_decode_fast_dllm__mutmut_159": "`<=`: the step's rows, mask and cache are also "
                                                           "narrowed when every row goes on, to themselves (a copy, "
                                                           "the same values)",

    # masked.generate, mutants past the partial run (the whole module ran at the end of the session)
    **{f"sampling.masked.x_generate__mutmut_{i}": _INT_DTYPE for i in (101, 105)},
    **{f"sampling.masked.x_generate__mutmut_{i}": "the appended attention-mask columns are float, so torch.cat "
       "promotes the mask (and the positions from its cumsum) to float 0/1 and whole numbers: the backbone reads "
       "the same values" for i in (115, 119)},
    "sampling.masked.x_generate__mutmut_124": "positions cumsum + 1 instead of - 1: every real token's position "
                                              "moves by the same +2 (pads are masked), invisible to rotary "
                                              "embeddings (llama, mistral, qwen2)",
    "sampling.masked.x_generate__mutmut_126": _DIM,
    **{f"sampling.steps.x_first_index__mutmut_{i}": "device dropped in the empty-region branch (G = 0, max_new_tokens "
       "0): those zeros only meet first_index's other results, never a model tensor, so no device meets another on a "
       "GPU either (checked on the fake accelerator: masked, block-causal and Fast-dLLM decoding with 0 new tokens "
       "run through)" for i in (8, 11)},
    **{f"sampling.masked.x_generate__mutmut_{i}": "getattr(spec, 'carry', default): ModelSpec always has a `carry` "
       "field (default False), so the default is never read" for i in (39, 45)},
    **{f"sampling.steps.x_first_index__mutmut_{i}": "+1 instead of -1 for the axis (or shape[:+1] for [:-1]): "
       "first_index is only called on [B, G] regions, where both name the same axis" for i in (2, 12, 21, 24)},
    # ---- end sampling masked/block_cache/steps ----
    #
    # ---- sampling/simplex.py, sampling/guidance.py (add entries below this line) ----
    **{f"sampling.guidance.x_first_eos_or_last__mutmut_{i}": _DIM for i in (12, 15)},
    **{f"sampling.guidance.x_{f}__mutmut_{i}": "the reward model's position ids left to the backbone (0..L-1 for "
       "every row) instead of counted from each row's left padding: a constant shift per row over its real tokens "
       "(pads are masked), invisible to rotary embeddings, the position encoding of every supported architecture "
       "(llama, mistral, qwen2)" for f, i in (("reward_guidance", 15), ("reward_guidance", 22),
                                              ("reward_of_logits", 32), ("reward_of_logits", 37))},
    **{f"sampling.simplex.x_generate__mutmut_{i}": _INT_DTYPE for i in (55, 59, 127, 131)},
    **{f"sampling.simplex.x_generate__mutmut_{i}": "the appended attention-mask column is float, so torch.cat "
       "promotes the mask (and the position ids counted from it) to float 0/1 and whole numbers: the backbone reads "
       "the same mask and positions" for i in (69, 73)},
    **{f"sampling.simplex.x_generate__mutmut_{i}": _DIM for i in (80, 278)},
    "sampling.simplex.x_generate__mutmut_256": "the step before the last re-noises with ᾱ = 1 instead of "
                                               "ᾱ at the last timestep, which is always 0 (inference_timesteps), "
                                               "where ᾱ_0 = 1 exactly in float32: the same step",
    "sampling.simplex.x_generate__mutmut_258": "ᾱ after the last step is only used for an S that is never read: "
                                               "the output is that step's projection",
    **{f"sampling.simplex.x_generate__mutmut_{i}": "the early-stop counter kept as float: whole numbers far below "
       "2^24, compared with >=, never seen by a caller" for i in (135, 138)},
    "sampling.simplex.x_generate__mutmut_169": "rows indexed by the tensor of every row index instead of the slice "
                                               "when none has stopped: the same rows and values (the slice only "
                                               "avoids copies)",
    "sampling.simplex.x_generate__mutmut_218": "the reward model's position ids left to the backbone (0..L-1) "
                                               "instead of counted from each row's left padding: a constant shift "
                                               "per row over its real tokens, invisible to rotary embeddings "
                                               "(llama, mistral, qwen2)",
    **{f"sampling.simplex.x_show_steps__mutmut_{i}": "Console highlighting applies to printed str, never to the "
       "rich Text lines show_steps prints" for i in (3, 4)},
    **{f"sampling.simplex.x_show_steps__mutmut_{i}": "rich parses style words case-insensitively: the same style"
       for i in (39, 66)},
    "sampling.simplex.x_show_steps__mutmut_40": "cut = None instead of False: both falsy, and `or` turns it into "
                                                "the EOS test's bool at the first token",

    # ---- end sampling simplex/guidance ----

    # ---- serve/ (issue 47 item 7) ----
    **{f"serve.access.x.Access.__call____mutmut_{i}": "a response header's name in another case: starlette "
       "lowercases header names, so the bytes sent are the same (and HTTP names are case-insensitive)"
       for i in (11, 12, 19, 20)},
    "serve.access.x.Access.__call____mutmut_25": "the refusal's JSONResponse given no receive: starlette's Response "
                                                 "never reads it (it only sends the start and the body)",
    "serve.access.x.Access._refusal__mutmut_17": "'LATIN-1' names the same codec as 'latin-1'",
    "serve.access.x.Access._refusal__mutmut_71": "a missing Authorization header read as b'XXXX' instead of b'': "
                                                 "neither has a 'Bearer' scheme, both are missing_api_key",
    **{f"serve.protocol.x__check_unicode__mutmut_{i}": "'UTF-8' names the same codec as 'utf-8'" for i in (9, 27)},
    **{f"serve.protocol.x__as_api_error__mutmut_{i}": "get_close_matches' n (default 3, or 2) instead of 1: only "
       "the best match, close[0], is shown" for i in (31, 32)},
    **{f"serve.protocol.x__as_api_error__mutmut_{i}": "the union-member tags in a field's error location ('str', "
       "'list[str]'; 'int' never appears: the optional ints are nullable, untagged) are only ever in the location of "
       "a field of SHAPES (prompt, stop, content), whose param is cut back to that field and whose message is its "
       "shape; pydantic reports the first member's error (str) first, so the cut location ends at the field whatever "
       "the filter keeps" for i in (8, 9, 12, 13, 14, 15, 94, 95, 96, 104)},
    **{f"serve.stream.x.ChoiceText._stop_prefix__mutmut_{i}": "when to restart the scan at the text's last "
       "len(stop) - 1 characters instead of going on from the last match state: both give the same match state "
       "(a partial match at the end is never longer than len(stop) - 1); the condition only bounds the work"
       for i in (14, 15)},
    "serve.stream.x.ChoiceText.update__mutmut_16": "`<` instead of `<=`: an unchanged text (same length, same start) "
                                                  "then gives the delta '' and sets the same sent text",
    **{f"serve.stream.x.{f}__mutmut_{i}": "final=None instead of False: falsy, read only by `if not (final or ...)`"
       for f, i in (("Job._commit", 15), ("Job.finish", 23), ("Job.row_step", 12))},
    "serve.stream.x.Job.finish__mutmut_14": "the AR replay starting at k=0: the empty prefix decodes to '', which "
                                            "is never longer than the text sent, so it sends nothing",
    "serve.engine.x.Engine.__init____mutmut_26": "getattr without its default: every architecture dlm builds or "
                                                 "loads (llama, mistral, qwen2) has max_position_embeddings",
    "serve.engine.x.Engine.__init____mutmut_40": "strict=None: falsy, as False",
    "serve.engine.x.Engine.__init____mutmut_54": "ignored(...) also called without flags: with no options given it "
                                                 "returns [], as the else branch",
    "serve.engine.x.Engine._chat_ids__mutmut_8": "tokenize=None: falsy; apply_chat_template returns the text, as with "
                                                "False",
    "serve.engine.x.Engine._options__mutmut_114": "next() without its default: only an empty `given` would raise "
                                                  "StopIteration, and the override of no options cannot fail (the "
                                                  "defaults were checked when the engine was built)",
    "serve.engine.x.Engine.prepare__mutmut_52": "the longest of no stop strings counted as 1 instead of 0: "
                                                "max_stop_chars is > 0 (Limits), so neither is over it",
    "serve.batching.x.Batcher.stop__mutmut_16": "shutdown(cancel_futures=True) without wait=True: True is its "
                                                "default, the same call",
    # ---- end serve/ ----
    # ---- modeling/ (issue 47 item 7) ----
    **{f"modeling.resolve.x_resolve_model__mutmut_{i}": "the default of a missing model_type (None or 'XXXX' instead "
       "of ''): FORMATS has none of them as a key, so there is no release format either way" for i in (13, 15, 18)},
    # ---- end modeling/ ----
    # ---- evaluation/elbo.py (tests/test_elbo.py kills the rest) ----
    **{f"evaluation.elbo.x__right_pad__mutmut_{i}": _INT_DTYPE for i in (6, 9, 20, 22)},
    **{f"evaluation.elbo.x__score_chunk__mutmut_{i}": _DIM for i in (101, 111)},
    "evaluation.elbo.x__groups__mutmut_3": "`or True`: block is then spec.block_size for every model, which ModelSpec "
                                           "makes None unless the attention is block_causal: the same groups",
    **{f"evaluation.elbo.x__masked_logits__mutmut_{i}": "the block layout's canvas (23) or targets (41) padded past "
       "the row's width: VectorisedLayout gathers only positions below `widths` (its src), so the extra mask columns "
       "are never read" for i in (23, 41)},
    **{f"evaluation.elbo.x__masked_logits__mutmut_{i}": "prompt_lens / widths made on the CPU instead of the model's "
       "device: block_forward's VectorisedLayout only reads them (.tolist(), max()) and builds its own tensors on "
       "canvas.device; the block-carry ELBO passes on the fake accelerator" for i in (69, 71, 73, 75)},
    "evaluation.elbo.x__masked_logits__mutmut_85": "the zero carry made [d] instead of [B, W, d]: LayerNorm of zeros "
                                                   "is its bias either way, and carry_input multiplies it by the 2-D "
                                                   "attention mask ([B, W, 1]), which broadcasts it to [B, W, d]",
    "evaluation.elbo.x_sample_masks__mutmut_36": "the all-true maskable argument [L] instead of [mc, L]: "
                                                 "confidence_rank's torch.where broadcasts it over the mc rows, the "
                                                 "same key",
    # ---- end evaluation/elbo.py ----
    # ---- evaluation/lm_eval.py (tests/test_lm_eval_adapter.py kills the rest) ----
    **{f"evaluation.lm_eval.x.DlmLM.{f}__mutmut_1": "the default of disable_tqdm (True instead of False): the "
       "method never reads it (dlm's likelihood scoring draws no progress bar)"
       for f in ("loglikelihood", "loglikelihood_rolling")},
    "evaluation.lm_eval.x.DlmLM.chat_template__mutmut_1": "the default of the chat_template argument (True instead "
                                                          "of False): the method ignores it and returns the "
                                                          "tokenizer's template",
    "evaluation.lm_eval.x.DlmLM.apply_chat_template__mutmut_3": "tokenize=None instead of False: transformers' "
                                                                "apply_chat_template only tests its truth (`if not "
                                                                "tokenize`, `if tokenize`), so None renders the "
                                                                "same string",
    # ---- end evaluation/lm_eval.py ----
    # ---- serve/app.py (tests/test_serve_app.py kills the rest) ----
    **{f"serve.app.x_create_app__mutmut_{i}": "the FastAPI title changed or left at its default: only the OpenAPI "
       "schema and the docs pages show it, and the app serves neither (openapi_url=None)" for i in (33, 35, 40, 41)},
    **{f"serve.app.x_create_app__mutmut_{i}": "docs_url (37) or redoc_url (38) left at its default: FastAPI adds "
       "those pages only when openapi_url is set, and it is None (GET /docs and /redoc stay 404)" for i in (37, 38)},
    **{f"serve.app.x_create_app__mutmut_{i}": "the /static mount's name changed or None: a name serves only "
       "url_for('static', ...), which nothing calls (the page links /static/... by path)" for i in (48, 51, 55, 56)},
    **{f"serve.app.x__request_handler__mutmut_{i}": "the message of an assert that cannot fail (protocol.parse "
       "validates with `kind` and returns an instance of it)" for i in (15, 16)},
    "serve.app.x__events__mutmut_21": "the role chunk's text None instead of '': it is a chat chunk, and "
                                      "protocol.choice adds content to a delta only when the text is truthy",
    "serve.app.x__sse__mutmut_2": "ensure_ascii=None instead of False: json.dumps only tests its truth",
    # ---- end serve/app.py ----
}

# mutant -> why a survivor of the run above is *not* equivalent (listed as surviving, with this note). Device mutants
# were counted equivalent until issue 43 ("everything is on the CPU here"); they are real bugs on a GPU, and
# tests/test_device_check.py now runs the inference paths on a fake accelerator where they fail as on a GPU.
NOT_EQUIVALENT: dict[str, str] = {
    **{f"training.loop.x.Trainer._accumulate__mutmut_{i}": "killed by tests/test_loss_normaliser.py::"
       "test_the_trainers_update_is_the_gradient_of_the_mean_over_loss_positions when the diff is applied by hand "
       "(the token count of both micro-batches); the mutmut recheck was cut before it ran" for i in (41, 42)},
    "training.loop.x.Trainer._accumulate__mutmut_27": "backward given no model: the one-process and DDP strategy "
                                                      "ignore it (accelerate's backward), DeepSpeed's calls the "
                                                      "engine's backward, which only a DeepSpeed launch runs "
                                                      "(tests/test_deepspeed.py)",
    **{f"training.loop.x.Trainer.{f}__mutmut_{i}": "a device argument dropped in the update (the loss accumulator, "
       "the batch or the loss counts left on the CPU): a GPU run would fail or mix devices; the CPU tests cannot "
       "see it (benchmarks/gpu_check.sh trains on the GPU)" for f, i in (("_accumulate", 4), ("_accumulate", 6),
                                                                         ("_plan_update", 5), ("_plan_update", 18),
                                                                         ("_plan_update", 20))},
    **{f"training.loop.x.Trainer._accumulate__mutmut_{i}": "the micro-batch's gradient-sync context given no model "
       "or another flag: one process has no sync to skip; a launch would sync at the wrong micro-batch (the flag "
       "inverted is planted mutant loop-sync-on-the-first-micro-batch, caught by tests/test_sharded.py's DDP "
       "accumulation job)" for i in (13, 14, 17, 18, 19)},
    "training.parallel.x.Replicated.evaluation_model__mutmut_11": "the gathered evaluation copy left on the CPU "
                                                                  "(.to(None)): a GPU run would evaluate on the CPU; "
                                                                  "the CPU tests cannot see it",
    **{f"training.parallel.x.FSDP2.wrap__mutmut_{i}": "the accelerator's device dropped where FSDP2 shards (the mesh's "
       "device type left at cpu, or the model left where it was built): a CUDA launch would build a gloo mesh over "
       "CPU tensors; a CPU process group cannot show it" for i in (12, 13)},
    **{f"diffusion.policies.x_confidence_rank__mutmut_{i}": _DEVICE for i in (25, 27)},
    **{f"diffusion.simplex.x_to_simplex__mutmut_{i}": _DEVICE for i in (5, 9)},
    **{f"sampling.autoregressive.x_generate__mutmut_{i}": _DEVICE
       for i in (12, 15, 25, 28, 32, 35, 40, 44, 124, 128)},
    "modeling.blocks.x_block_forward__mutmut_25": _DEVICE,
    **{f"modeling.blocks.x_block_causal_mask__mutmut_{i}": _DEVICE for i in (27, 30)},
    **{f"modeling.blocks.x_canvas_blocks__mutmut_{i}": _DEVICE for i in (9, 11, 17, 20)},
    **{f"modeling.blocks.x.VectorisedLayout.__init____mutmut_{i}": _DEVICE for i in (77, 80)},
    **{f"sampling.steps.x_record_step__mutmut_{i}": _DEVICE for i in (5, 8, 11, 13)},
    **{f"sampling.steps.x.Progress.__init____mutmut_{i}": _DEVICE for i in (12, 15)},
    **{f"sampling.block_cache.x__padding_mask__mutmut_{i}": _DEVICE for i in (7, 13)},
    **{f"sampling.block_cache.x_decode_block_causal__mutmut_{i}": _DEVICE for i in (11, 16, 69, 71, 125, 130)},
    **{f"sampling.masked.x_decode__mutmut_{i}": _DEVICE for i in (7, 9, 23, 28, 65, 69, 73, 76)},
    **{f"sampling.masked.x_generate__mutmut_{i}": _DEVICE for i in (85, 88, 102, 106, 116, 120)},
    **{f"sampling.simplex.x_generate__mutmut_{i}": _DEVICE for i in (36, 39, 56, 60, 70, 74, 88, 92, 100, 104, 110,
                                                                     118, 122, 128, 132, 136, 139, 143, 146, 150,
                                                                     153, 175, 178, 270, 295, 298)},
    **{f"sampling.simplex.x__noise__mutmut_{i}": _DEVICE for i in (1, 2, 5, 8, 11)},  # 1, 2: randn off the generator's
    # device: the fake accelerator's generator refuses a CPU draw, as a CUDA generator does
    "data.ul2.x_ul2_mask__mutmut_62": _DEVICE_TRAINING,
    **{f"diffusion.masking.x_sample_mask__mutmut_{i}": _DEVICE_TRAINING for i in (2, 3, 7, 10, 13, 15, 19, 23)},
    **{f"modeling.blocks.x_attends_nothing__mutmut_{i}": _DEVICE_TRAINING for i in (40, 44)},  # the flex BlockMask
    **{f"modeling.blocks.x_block_causal_block_mask__mutmut_{i}": _DEVICE_TRAINING for i in (74, 82)},
    **{f"modeling.blocks.x_response_blocks__mutmut_{i}": _DEVICE_TRAINING for i in (8, 10)},
    # noised_at is read only with return_hidden (training); the ELBO's block_forward reads pred_at (mutant 80)
    "modeling.blocks.x.VectorisedLayout.__init____mutmut_79": _DEVICE_TRAINING,
}

DECORATORS = {"torch.no_grad()", "contextmanager"}
KILLERS = False

NOTES = """The three bugs issue 18 names, each planted by hand and now failing (they passed every test before):

- AR sampler, cached position ids `positions[:, -1:] + 2` (mutmut's `x_generate__mutmut_135`): fails
  `test_ar_sampler.py::test_kv_cache_equals_recompute_logits` and `::test_cached_logits_match_unpadded_reference`,
  which compare next-token logits (cached vs recomputed, batched vs alone) on a `perturb`-ed model.
- EMA lerp by `decay` instead of `1 - decay`: fails `test_ema.py::test_update_matches_closed_form[0.9]` and
  `[0.75]` (the closed form over four updates, tied weights averaged once).
- Aggressive-T5 rate 0.50 -> 0.30: fails `test_paper_constants.py::test_ul2_rates_and_span_sets` and
  `::test_ul2_masks_the_papers_share[aggressive_t5-0.5-spans1]` (the paper's 50 %, TESS 2 App. A.1).

Notes on reading the table:

- "before" ran the commit before issue 18's tests (`DLM_MUTATION_ROOT` at `git archive 64e8332`) with the same
  module -> tests map; a test file added since (test_ema, test_canvas, test_carry, test_paper_constants) is simply
  absent there, so the difference is what the new and strengthened tests catch. The "before" of training/ema.py
  already includes `test_training.py::test_ema_and_final_model`, the only EMA test before.
- "equivalent" counts survivors explained as behaviour-preserving in `EXPLAINED` (scripts/mutation.py), each with
  its reason below; "after, non-equivalent" = (killed + timeout) / (mutants - equivalent). Mutants that drop a
  device argument are not equivalent: until issue 43 they were counted so ("everything is on the CPU on this
  machine"); now they are listed as survivors with a note (`NOT_EQUIVALENT`). On the inference paths (the samplers,
  the helpers they call in modeling/blocks.py, diffusion/policies.py and diffusion/simplex.py, and the ELBO)
  `tests/test_device_check.py` runs the models on a fake accelerator, where a tensor made without `device=` (or a
  generator of the wrong device) fails as on a GPU, and it is in those modules' test map: a rerun is expected to
  kill them. sampling/steps.py was rerun with it (2026-12-06, 9 min, the same machine): its six device mutants,
  counted equivalent before, are killed; its 19 unexplained survivors are in the proposal trace added since the
  first run (`record_step`'s proposed fields, passed on by `Progress.record`), which tests/test_trace.py reads but
  the module's map does not run. mutmut was not rerun over the other modules: their rows are the earlier runs
  re-rendered with the new rule (`--report-only`), so their "equivalent" column lost the device mutants and "after,
  non-equivalent" fell with it; evaluation/elbo.py is mapped and not run yet. Device mutants in training code
  (diffusion/masking.py's sample_mask, the UL2 mask, modeling/blocks.py's training-only and flex helpers) stay
  survivors: no CPU test runs them on a device yet.
- Where each "after" comes from: the modules of the first session from that session's run; blocks, progressive,
  trajectories, simplex and guidance from the last run on the branch that worked on them (the merged tree has the
  same module source and the same mapped tests; other branches only added tests elsewhere); masked, block_cache and
  steps from runs on the merged tree at the end of the second session.
- The sampling modules (masked, block_cache, steps, simplex, guidance) were first run in the next session: their
  "before" is the first run on 8c8a722 (that session's start, the same module -> tests map), before the tests
  written against their survivors (block_cache: on 2ad31b8, the same tests). Where a module's source changed since
  (dead code removed), its mutant count differs between before and after. masked.py has no "before": its run on
  the older tree timed out at 3,600 s under load, and a second one did not fit in the session.
- modeling/blocks.py: its "before" (64e8332) ran without tests/test_flex_attention.py, whose clean run failed under
  mutmut: a test set a torch._dynamo option with pytest's monkeypatch, whose undo deletes the option for the rest of
  the process, and mutmut runs pytest twice in one process. With that fixed, the CPU flex tests are in the map
  (the compiled flex-vs-dense logits test stays out: ~1 min cold per run); the flex-only functions no longer show
  as "no tests".
- Issue 47 item 7 (2026-12-06, the same 2-core machine): the code added since the core's run (serve/, the release
  formats, conversion, export, LoRA, model resolution, the lm-eval adapter) and the training loop's normalisation
  and skipping and the parallel strategies are mapped and run. Where its "before" is given, it is the first run
  with the tests that existed (`mutation-before.json`), and "after" the rerun with the tests written against its
  survivors. serve/protocol.py, stream.py, engine.py, batching.py, app.py and evaluation/lm_eval.py have no
  "before": their tests reach them mostly through running servers or lm-eval runs (20-60 s a surviving mutant), so
  unit tests (test_serve_protocol.py, test_serve_stream.py, test_serve_engine.py, test_serve_batching.py,
  test_serve_app.py, test_lm_eval_adapter.py) were written from the code first and mutmut ran with them. A
  "minutes" of "a + b": the whole run, then `--recheck` (the unexplained survivors rerun after the tests written
  against them, and for a module checked in part the mutants a cut run did not reach); the survivors it killed are
  listed "killed after".
- Runs cut short. Item 7's runs shared the 2 cores (up to five mutmut runs and a test session at once in its second
  session), so several stopped at their `--timeout` with mutants "not checked" (the "other" of the mutants column);
  the score counts only the checked ones, and mutmut orders the mutants with the fastest tests first, so the
  unchecked ones are those behind the slowest tests. Timeouts are mutants whose tests ran past mutmut's CPU-time
  limit, counted as caught as mutmut does; under that load many are slow tests rather than loops (formats,
  convert and LoRA have the most). Cut: modeling/formats.py, modeling/convert.py, serve/batching.py, serve/app.py,
  evaluation/lm_eval.py (its checked survivors all killed or explained), modeling/lora.py and modeling/export.py
  (their tests train and merge models: tens of seconds a mutant here). No checked mutant of formats or convert
  survived.
- training/loop.py is checked in part (`FUNCTIONS`): the update's three methods (`train_step`, `_plan_update`,
  `_accumulate`), the normalisation and skipping the issue names; the rest of the loop's mutants count as "not
  checked". Its two reductions over processes cannot differ in one process (accelerate's reduce is then the
  identity): they are checked by planted mutants against the two-process tests, as are FSDP2's and DeepSpeed's
  methods, which run only inside `accelerate launch` processes that import dlm from src/, out of mutmut's reach
  (`scripts/planted_mutants.py`, [mutation-planted.md](mutation-planted.md)). training/parallel.py's row is its
  unit tests (tests/test_parallel.py: the description, the refusals, each launch's strategy, the one-process and
  DDP strategy against a recording accelerator, FSDP2 over a one-process gloo group, DeepSpeed against a recording
  fake engine); the two planted mutants that survived the launches (bf16 gathers, the DeepSpeed loss check) are
  killed there.
- Code removed after a run: `lora.is_adapter` (no caller anywhere) went after the LoRA run found its 2 mutants
  untested; `--recheck` dropped them (the row's `removed`)."""


def undecorate(source: str) -> str:
    """`@torch.no_grad()` / `@contextmanager` on a function become `name = deco(name)` after it (same behaviour),
    since mutmut leaves decorated functions unmutated."""
    tree = ast.parse(source)
    edits = []  # (decorator line numbers, end line, indent, name, decorators)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list:
            decos = [ast.unparse(d) for d in node.decorator_list]
            if all(d in DECORATORS for d in decos):
                indent = " " * node.col_offset
                edits.append(([d.lineno for d in node.decorator_list], node.end_lineno, indent, node.name, decos))
    lines = source.splitlines()
    for deco_lines, end, indent, name, decos in sorted(edits, key=lambda e: -e[1]):
        wrapped = name
        for d in reversed(decos):
            wrapped = f"{d}({wrapped})"
        lines.insert(end, f"{indent}{name} = {wrapped}")
        for ln in sorted(deco_lines, reverse=True):
            del lines[ln - 1]
    return "\n".join(lines) + "\n"


def copy_worktree(dest: Path) -> Path:
    """A fresh copy at `dest` of the working tree's tracked and untracked (not ignored) files, docs/ left out."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for f in files:
        if (ROOT / f).is_file() and not f.startswith("docs/"):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def scratch_copy(module: str, tests: list[str], workdir: Path) -> Path:
    dest = copy_worktree(workdir / module.replace("/", "_").removesuffix(".py"))
    target = dest / "src" / "dlm" / module
    target.write_text(undecorate(target.read_text()))
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    extra = (f'only_mutate = ["src/dlm/{module}"]\n'
             f"pytest_add_cli_args_test_selection = {json.dumps(tests + ['-m', 'not slow'])}\n")
    pyproject.write_text(text.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + extra, 1))
    return dest


def _exists(test: str) -> bool:
    """The test file exists under ROOT and, for a node id, defines that test function."""
    path, _, name = test.partition("::")
    if not (ROOT / path).exists():
        return False
    return not name or f"def {name.split('[')[0]}(" in (ROOT / path).read_text()


def run_module(module: str, tests: list[str], workdir: Path, timeout: int, watch: dict | None = None,
               recheck: dict | None = None) -> dict:
    """mutmut over one module; `watch` (mutant -> diff, the survivors of an earlier run) get the test that kills
    them now, if one does. `recheck` (an earlier result of the same source): only its unexplained survivors run
    again, the other mutants keep their status, and those now killed are listed under "rechecked"."""
    tests = [t for t in tests if _exists(t)]  # an older checkout may lack a newer test file or test
    dest = scratch_copy(module, tests, workdir)
    # the tests import the studies and benchmark helpers as pytest's `pythonpath` gives them (benchmarks/)
    env = dict(os.environ, PYTHONPATH=f"src{os.pathsep}{dest / 'benchmarks'}", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               DLM_TEST_THREADS=os.environ.get("DLM_TEST_THREADS", "1"))
    names = [n for n in (recheck or {}).get("survivors", {}) if short(n) not in EXPLAINED]
    if recheck is not None:  # and the mutants of the checked functions an earlier run cut short never reached
        names += [n for n, s in recheck["status"].items() if s == "not checked" and module in FUNCTIONS
                  and any(fnmatch.fnmatchcase(n, g) for g in FUNCTIONS[module])]
    if recheck is None:
        names = FUNCTIONS.get(module, [])
    elif not names:  # nothing to rerun (mutmut given no names would run every mutant)
        return recheck
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", *names], cwd=dest,
                              env=env, capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:  # what ran is kept; the rest counts as "not checked"
        proc, out = None, f"{err.stdout or ''}{err.stderr or ''}"
    seconds = time.time() - start
    meta = dest / "mutants" / "src" / "dlm" / (module + ".meta")
    if not meta.exists():
        tail = out[-3000:] if isinstance(out, str) else out.decode(errors="replace")[-3000:]
        code = proc.returncode if proc is not None else f"after the {timeout} s timeout"
        return {"module": module, "tests": tests, "error": f"mutmut exited {code}: {tail}", "seconds": seconds}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    from mutmut.stats import status_by_exit_code

    status = {name: status_by_exit_code[code] for name, code in codes.items()}
    if recheck is not None:
        if set(status) - set(recheck["status"]):
            print(f"  {module}: it has mutants the earlier run did not (the source changed): run it whole",
                  flush=True)
            return recheck
        gone = sorted(set(recheck["status"]) - set(status))  # code removed since (e.g. a dead function)
        if gone:
            print(f"  {module}: {len(gone)} mutants of removed code dropped", flush=True)
            recheck = {**recheck, "status": {n: v for n, v in recheck["status"].items() if n not in gone},
                       "survivors": {n: v for n, v in recheck["survivors"].items() if n not in gone},
                       "removed": recheck.get("removed", []) + gone}
        status = {n: status[n] if n in names else s for n, s in recheck["status"].items()}
        rechecked = {n: recheck["survivors"][n] for n in names
                     if n in recheck["survivors"] and status[n] in ("killed", "timeout")}
        rechecked.update(recheck.get("rechecked", {}))
    survivors = sorted(n for n, s in status.items() if s in ("survived", "no tests"))
    diffs = {n: _diff(dest, module, n) for n in survivors}
    counts = {k: sum(1 for s in status.values() if s == k) for k in sorted(set(status.values()))}
    killers = {n: _killer(dest, n, tests, env) for n in (watch or {}) if status.get(n) in ("killed", "timeout")} \
        if KILLERS else {}
    if recheck is not None:
        diffs = {n: recheck["survivors"].get(n, diffs[n]) for n in survivors}
        return {**recheck, "tests": tests, "counts": counts, "total": len(status), "survivors": diffs, "status": status,
                "rechecked": rechecked, "recheck_seconds": recheck.get("recheck_seconds", 0) + seconds}
    return {"module": module, "tests": tests, "counts": counts, "total": len(status), "survivors": diffs,
            "status": status, "killers": killers, "seconds": seconds}


def _killer(dest: Path, name: str, tests: list[str], env: dict) -> str:
    """The first test that fails with mutant `name` switched on (mutmut's trampolines read MUTANT_UNDER_TEST)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", "-m",
                              "not slow", *tests], cwd=dest / "mutants", env=dict(env, MUTANT_UNDER_TEST=name),
                             capture_output=True, text=True, timeout=600).stdout
    except subprocess.TimeoutExpired:
        return "a timeout (the mutant loops)"
    failed = [line.split()[1] for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return f"`{failed[0]}`" if failed else "a crash or timeout under mutmut"


@functools.cache
def _functions(path: Path) -> tuple[str, dict[str, ast.FunctionDef]]:
    source = path.read_text()
    return source, {n.name: n for n in ast.walk(ast.parse(source))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _diff(dest: Path, module: str, name: str) -> str:
    """The changed lines of mutant `name`: its function against the original in mutmut's mutated copy of the file
    (what `mutmut show` prints, without a subprocess per mutant)."""
    source, funcs = _functions(dest / "mutants" / "src" / "dlm" / module)
    fn = name.rsplit(".", 1)[-1]
    orig, mutant = funcs.get(fn.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"), funcs.get(fn)
    if orig is None or mutant is None:
        return "(source not found)"
    plain = orig.name.removesuffix("__mutmut_orig").split("\u01c1")[-1].removeprefix("x_")
    a = ast.get_source_segment(source, orig).replace(orig.name, plain, 1).splitlines()
    b = ast.get_source_segment(source, mutant).replace(mutant.name, plain, 1).splitlines()
    return "\n".join(line for line in difflib.unified_diff(a, b, lineterm="", n=0)
                     if line.startswith(("+", "-")) and not line.startswith(("+++", "---")))


def short(name: str) -> str:
    return name.replace("\u01c1", ".").replace("dlm.", "", 1)


def _score(r: dict) -> tuple[str, int, int, int, int]:
    """(score, killed, survived, timeout, other); the score is (killed + timeout) / (killed + survived + timeout)."""
    c = r["counts"]
    killed, survived, timeout = c.get("killed", 0), c.get("survived", 0) + c.get("no tests", 0), c.get("timeout", 0)
    other = r["total"] - killed - survived - timeout
    return f"{(killed + timeout) / max(1, killed + survived + timeout):.0%}", killed, survived, timeout, other


def write_report(results: list[dict], before: dict[str, dict], path: Path, command: str,
                 not_run: list[str]) -> None:
    lines = ["# Mutation check of the core", "",
             "[mutmut](https://github.com/boxed/mutmut) plants small bugs (mutants) in a module, one at a time, and "
             "runs the tests that cover that module; a mutant the tests still pass *survived*. Each survivor of the "
             "first run (before issue 18's tests) is listed below with the test that kills it now, or why it is "
             "equivalent (no behaviour a caller can see changes). Produced by `scripts/mutation.py`; not part of "
             "`.ci/run`.", "",
             f"- Command: `{command}` (before: the same script with `DLM_MUTATION_ROOT` at an export of the commit "
             "before this work, so the module -> tests map is the same but the older tests run)",
             f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with another session's tests, Python "
             f"{platform.python_version()}, mutmut {_mutmut_version()}, OMP_NUM_THREADS=1, one mutant at a time",
             "- Score = (killed + timeout) / (killed + survived + timeout); survived includes mutants no selected "
             "test reaches (mutmut's 'no tests'). Decorated functions (`@torch.no_grad()`, `@contextmanager`) are "
             "mutated too: the script rewrites the decorator as an assignment in its scratch copy.", "",
             "| module | tests | mutants | before: killed / survived / timeout | before | after: killed / survived "
             "/ timeout | after | equivalent | after, non-equivalent | minutes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tests = ", ".join(t.removeprefix("tests/") for t in r["tests"])
        if "error" in r:
            lines.append(f"| {r['module']} | {tests} | error | | | | | | | {r['seconds'] / 60:.1f} |")
            continue
        score, k, sv, to, _ = _score(r)
        b = before.get(r["module"])
        if b and "error" not in b:
            bscore, bk, bsv, bto, _ = _score(b)
            bcol = f"{bk} / {bsv} / {bto} | {bscore}"
        else:
            bcol = "not run | "
        equivalent = sum(1 for n in r["survivors"] if short(n) in EXPLAINED)
        live = k + to + sv - equivalent
        after_ne = f"{(k + to) / max(1, live):.0%}"
        checked = k + sv + to  # a run cut by its timeout leaves the rest "not checked"
        mutants = f"{r['total']}" if checked == r["total"] else f"{r['total']} ({checked} checked)"
        lines.append(f"| {r['module']} | {tests} | {mutants} | {bcol} | {k} / {sv} / {to} | {score} | "
                     f"{equivalent} | {after_ne} | {_minutes(r)} |")
    lines += ["", NOTES]
    if not_run:
        lines += ["", "Not run: " + ", ".join(not_run) + " (time; each is mapped in `MODULES` and runs with "
                  "`python scripts/mutation.py MODULE`)."]
    lines += ["", "## Survivors", "",
              "Every mutant that survived the first run (or survives now), with its fate.", ""]
    for r in results:
        if "error" in r:
            lines += [f"### {r['module']}", "", "```", r["error"], "```", ""]
            continue
        b = before.get(r["module"], {})
        rechecked = r.get("rechecked", {})
        names = sorted(set(b.get("survivors", {})) | set(r["survivors"]) | set(rechecked))
        if not names:
            continue
        lines += [f"### {r['module']}", ""]
        for name in names:
            diff = r["survivors"].get(name) or b.get("survivors", {}).get(name) or rechecked.get(name, "")
            if name in r["survivors"]:
                why = "equivalent: " + EXPLAINED[short(name)] if short(name) in EXPLAINED else "**survives**"
                if short(name) in NOT_EQUIVALENT:
                    why += ", not equivalent: " + NOT_EQUIVALENT[short(name)]
            else:
                why = "killed after" + (f" by {r['killers'][name]}" if name in r.get("killers", {}) else "")
            lines += [f"- `{short(name)}`: {why}", "  ```diff", *("  " + d for d in diff.splitlines()), "  ```"]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def _minutes(r: dict) -> str:
    """The run's minutes, plus the recheck's (its survivors rerun after the tests written against them)."""
    extra = f" + {r['recheck_seconds'] / 60:.1f}" if r.get("recheck_seconds") else ""
    return f"{r['seconds'] / 60:.1f}{extra}"


def _mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help="modules under src/dlm (default: all in MODULES)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dlm-mutation"))
    ap.add_argument("--json", type=Path, default=ROOT / "docs/results/mutation.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/mutation.md")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per module")
    ap.add_argument("--before", type=Path, help="JSON of an earlier run (e.g. on the commit before new tests): "
                    "its survivors get the test that kills them now, and its scores go in the table")
    ap.add_argument("--killers", action="store_true", help="name the test that kills each earlier survivor (one "
                    "pytest run per survivor: minutes per module)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from --json without running")
    ap.add_argument("--recheck", action="store_true", help="rerun only the unexplained survivors of each module's "
                    "result in --json (same source), after tests were added against them, and, for a module checked "
                    "in part (FUNCTIONS), the mutants of its functions a run cut by --timeout did not reach")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for m, t in MODULES.items():
            print(f"{m}: {' '.join(t)}")
        return
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    global KILLERS
    KILLERS = args.killers
    previous = {r["module"]: r for r in json.loads(args.json.read_text())} if args.json.exists() else {}
    before = {r["module"]: r for r in json.loads(args.before.read_text())} if args.before else {}
    for m in modules if not args.report_only else []:
        print(f"mutating {m} against {' '.join(MODULES[m])}", flush=True)
        if args.recheck and "status" not in previous.get(m, {}):
            raise SystemExit(f"--recheck {m}: no earlier result of it in {args.json}")
        previous[m] = run_module(m, MODULES[m], args.workdir, args.timeout, before.get(m, {}).get("survivors"),
                                 previous[m] if args.recheck else None)
        r = previous[m]
        print(f"  {r.get('counts', r.get('error'))} in {r['seconds']:.0f}s", flush=True)
        args.json.write_text(json.dumps([previous[k] for k in MODULES if k in previous], indent=1) + "\n")
    results = [previous[k] for k in MODULES if k in previous]
    command = "OMP_NUM_THREADS=1 DLM_TEST_THREADS=1 nice -n 10 python scripts/mutation.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only")
    write_report(results, before, args.out, command.strip(), [m for m in MODULES if m not in previous])


if __name__ == "__main__":
    main()
