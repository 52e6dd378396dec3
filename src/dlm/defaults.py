"""Defaults a CLI flag shares with the library function it feeds, where the parser can read them without importing
torch: each is defined here once and both sides use the name."""

DEMO_OUT = "runs/demo"  # `dlm demo --out`, dlm.demo.run_demo(out=)
DEMO_MINUTES = 15.0  # `dlm demo --minutes`: the training time the estimate is checked against (measured: 7-12 min)
