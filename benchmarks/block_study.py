"""Block PUMBA vs block MDM, long continuations (PUMBA §4.2, App. F.4), as a pre-registered plan (issue 17):

    OMP_NUM_THREADS=1 python benchmarks/block_study.py --plan benchmarks/plans/block-long.yaml --max-minutes 300

The same driver as benchmarks/pumba_study.py (see its docstring for the plan's settings): every arm of the plan is
continued for the updates the plan gives it, seed-major, and every diffusion model decodes with the Fast-dLLM
threshold policy left to right in blocks of settings.block_size (tau=X evaluations; block-causal models with the
exact KV cache, a full-canvas model recomputing its canvas), AR greedily with a KV cache. Results go to the study
table (default docs/results/block-long.json); benchmarks/study_report.py writes the doc's numbers from it.
"""

from __future__ import annotations

import pumba_study

if __name__ == "__main__":
    pumba_study.main(description=__doc__, default_plan="benchmarks/plans/block-long.yaml")
