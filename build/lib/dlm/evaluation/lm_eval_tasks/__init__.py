"""dlm's packaged lm-eval tasks: the YAMLs in this folder (on lm-eval's --include_path) and their hooks."""
