"""`python -m dlm.cli ...` (and `accelerate launch -m dlm.cli ...`): the `dlm` command."""

from dlm.cli import main

main()
