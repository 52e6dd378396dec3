"""`dlm serve`: an OpenAI-compatible HTTP server for dlm models that streams the denoising (app.py), with dynamic
batching (batching.py), limits (engine.py) and a page at / that shows each denoising step (static/)."""

from __future__ import annotations

import os

from dlm.errors import DlmError


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, dtype="auto", device="auto",
          name: str | None = None, defaults=None, limits=None, log_level: str = "info", allowed_hosts=(),
          api_key: str | None = None) -> None:
    """Load `model` (a model, run or checkpoint directory) and serve it at http://host:port until interrupted.
    `defaults`: sampling settings over the run's recipe (SamplingSettings or a mapping); `limits`: `engine.Limits`;
    `allowed_hosts`: Host names answered besides the loopback ones; `api_key` (else $DLM_API_KEY): /v1 needs it."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as err:
        raise DlmError(f"dlm serve needs FastAPI and uvicorn ({err.name} is missing): "
                       "pip install -e '.[serve]'") from None
    from dlm.serve.access import rules
    from dlm.serve.app import create_app
    from dlm.serve.engine import Engine, Limits

    api_key = api_key if api_key is not None else os.environ.get("DLM_API_KEY")
    rules(host, allowed_hosts, api_key)  # a bad --allowed-hosts or an empty key fails before the model loads
    engine = Engine(model, dtype=dtype, device=device, name=name, defaults=defaults, limits=limits or Limits())
    for note in engine.ignored:
        print(f"dlm serve: {note} does not apply to this {engine.family} model; ignored")
    where = engine.placement
    print(f"dlm serve: {engine.name} ({engine.family}, {where['device']}, {where['dtype']}) at http://{host}:{port}/  "
          "(API: /v1, page: /)" + ("; /v1 needs the API key (page: /#key=KEY)" if api_key else ""))
    app = create_app(engine, host=host, allowed_hosts=allowed_hosts, api_key=api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
