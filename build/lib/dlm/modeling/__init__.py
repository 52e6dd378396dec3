"""Models: an HF decoder backbone plus its ModelSpec and the extras the spec names; `build` and `load_model` are the
one way to get one."""
