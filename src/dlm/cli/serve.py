"""`dlm serve`: one model over an OpenAI-compatible HTTP API; the limits' defaults are dlm.serve.limits.Limits'."""

from __future__ import annotations

import argparse

from dlm.cli.flags import add_device_flags, add_sampling_flags, device_first, library_default, sampling_settings

SERVE_HELP = """endpoints (OpenAI-compatible; any OpenAI client works with base_url http://HOST:PORT/v1):
  POST /v1/completions        prompt: text (or token ids), continued as it is
  POST /v1/chat/completions   messages, rendered with the model's chat template (generation prompt added)
  GET  /v1/models             the served model, with dlm's facts (family, block size, context, sampling defaults)
  GET  /health                status, queue and batching counters
  GET  /                      a page that shows the denoising step by step

request fields: model, max_tokens (masked: the canvas length), temperature (default 0: greedy), seed, n, stop,
  stream; top_p is the simplex sampler's top-p projection (top_p 1 is accepted by every model, as are OpenAI's
  other fields at values that ask for nothing: presence_penalty 0, logit_bias {}, tools [], ...; any other value is
  a 400 naming the field). dlm's extensions, as extra body fields:
  sampling options of the model's family (policy, reveal_count/u, confidence_threshold/tau, block_size, kv_cache,
  cache; inference_steps/steps, top_p, early_stop_patience, guidance_scale/eta, ...): another family's option is a
  400 naming it; reward_model is a server flag only. Defaults: the run's recipe eval section, then the flags. An
  option given without a policy selects the policy that reads it (tau alone: threshold); one the request's policy
  does not read (tau with top_u) is a 400 naming it.
  "dlm_steps": true (with stream) adds one event per denoising step:
  {"object": "dlm.denoise.step", "index", "step", "nfe", "tokens", "pieces", "masked", "confidence", "new",
  "block_size", "eos"[, "timestep"]}. Responses and the last stream chunk carry usage, "nfe" per choice and the
  "sampling" options in effect.

limits and access: a body must be JSON (Content-Type: application/json, else 415) that arrives within
  --body-timeout (else 408); only then does the request take one of the --max-concurrent slots. stop takes at most 4
  strings of --max-stop-chars. A stream whose client reads nothing for --send-timeout is cancelled. A loopback --host
  answers only to Host localhost, 127.0.0.1 or [::1] with its port (else 403: a web page cannot reach the server by
  rebinding its own name; --allowed-hosts adds names). With --api-key (or DLM_API_KEY), /v1 needs
  Authorization: Bearer KEY (else 401); / and /health stay open.

streaming: text is sent once it can no longer change (masked: the revealed prefix; simplex: at the end; AR: token
  by token after decoding), never past a stop string. Concurrent greedy requests with the same options and
  max_tokens are decoded in one batch (identical to decoding each alone).

example:
  dlm serve runs/mdm --port 8000
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Mia has 3 apples..."}], "max_tokens": 64, "tau": 0.9}'
"""


def add_serve_parser(sub) -> None:
    """`dlm serve MODEL`: address, name, device, limits, access and the sampling defaults."""
    from dlm.serve import serve

    v = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API, streaming the denoising",
                       description="Serve one model (run, model or checkpoint directory) over HTTP: OpenAI-compatible\n"
                       "completions and chat completions, streamed denoising steps, dynamic batching, limits, and a\n"
                       "live page at /. Needs the serve extra (pip install -e '.[serve]').",
                       epilog=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("model", help="run directory, model directory or checkpoint directory")
    host, port = library_default(serve, "host"), library_default(serve, "port")
    v.add_argument("--host", default=host, help=f"address to listen on (default: {host}, this machine only)")
    v.add_argument("--port", type=int, default=port, help=f"port (default: {port})")
    v.add_argument("--name", help="the model id clients send as `model` (default: the directory's name)")
    add_device_flags(v)
    _add_limit_flags(v.add_argument_group("limits"))
    _add_access_flags(v.add_argument_group("access"))
    add_sampling_flags(v)
    v.set_defaults(func=serve_command)


def _add_limit_flags(lim) -> None:
    """One flag per field of dlm.serve.limits.Limits, its default read from there."""
    from dlm.serve.limits import FALLBACK_MAX_TOKENS, Limits

    lim.add_argument("--max-tokens", type=int, default=Limits.max_tokens, help="largest max_tokens a request may ask "
                     f"for (default: {Limits.max_tokens})")
    lim.add_argument("--default-max-tokens", type=int, help="max_tokens of a request that gives none (default: the "
                     f"run's eval.max_new_tokens, else {FALLBACK_MAX_TOKENS})")
    lim.add_argument("--max-prompt-tokens", type=int, help="longest prompt (default: the model's context minus the "
                     "request's generation length); longer: 400")
    lim.add_argument("--max-batch-size", type=int, default=Limits.max_batch_size, help="rows (prompts x n) in the "
                     "running batch; a request joins it at the next step boundary once its rows fit (default: "
                     f"{Limits.max_batch_size})")
    lim.add_argument("--batch-window-ms", type=float, default=Limits.batch_window_ms, help="how long the first "
                     "request after an idle spell waits for others to start with it (default: "
                     f"{Limits.batch_window_ms:g})")
    lim.add_argument("--max-nfe", type=int, help="forward passes a row may take; a row that reaches it ends with the "
                     "text it has committed, finish_reason \"length\" (default: as many as its canvas needs)")
    lim.add_argument("--static-batching", action="store_true", help="decode whole batches, one at a time, instead of "
                     "letting requests join and leave the running batch at step boundaries (for comparison)")
    lim.add_argument("--max-concurrent", type=int, default=Limits.max_concurrent, help="requests queued or decoding "
                     f"at once; more get 429 (default: {Limits.max_concurrent})")
    lim.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes, help="largest request body; larger: "
                     f"413 (default: {Limits.max_body_bytes})")
    lim.add_argument("--timeout", type=float, default=Limits.timeout_s, help="seconds a request may take, queueing "
                     f"included; then 504, or an error event in a stream (default: {Limits.timeout_s:g})")
    lim.add_argument("--body-timeout", type=float, default=Limits.body_timeout_s, help="seconds a client may take to "
                     "send its request body; then 408. A request holds a --max-concurrent slot only once its body is "
                     f"in (default: {Limits.body_timeout_s:g})")
    lim.add_argument("--send-timeout", type=float, default=Limits.send_timeout_s, help="seconds a streaming client may "
                     "go without reading; then its request is cancelled and the connection closed (default: "
                     f"{Limits.send_timeout_s:g})")
    lim.add_argument("--max-stop-chars", type=int, default=Limits.max_stop_chars, help="longest stop string, in "
                     f"characters; longer: 400 (default: {Limits.max_stop_chars})")


def _add_access_flags(acc) -> None:
    """Which Host names the server answers and the API key /v1 needs."""
    acc.add_argument("--allowed-hosts", type=lambda s: [h for h in s.split(",") if h], default=[], metavar="HOSTS",
                     help="comma-separated Host names (name or name:port) answered besides localhost, 127.0.0.1 and "
                     "[::1] with the server's port: a loopback --host answers to no others (a web page cannot reach "
                     "it by pointing its own name at 127.0.0.1), another --host to any unless this is given; '*': any")
    acc.add_argument("--api-key", metavar="KEY", help="every /v1 request must send Authorization: Bearer KEY, "
                     "else 401; / (the page: open it as /#key=KEY) and /health stay open (default: $DLM_API_KEY, "
                     "better than this flag: a command line is visible to the machine's other users)")


def serve_command(a) -> None:
    """`dlm serve`: the limit flags as Limits, then dlm.serve.serve until interrupted."""
    from dlm.serve import serve
    from dlm.serve.limits import Limits

    limits = Limits(max_tokens=a.max_tokens, default_max_tokens=a.default_max_tokens,
                    max_prompt_tokens=a.max_prompt_tokens, max_batch_size=a.max_batch_size,
                    batch_window_ms=a.batch_window_ms, max_concurrent=a.max_concurrent, max_body_bytes=a.max_body_bytes,
                    body_timeout_s=a.body_timeout, send_timeout_s=a.send_timeout, max_stop_chars=a.max_stop_chars,
                    timeout_s=a.timeout, max_nfe=a.max_nfe, continuous=not a.static_batching)
    device_first(a)
    serve(a.model, host=a.host, port=a.port, dtype=a.dtype, device=a.device, name=a.name,
          defaults=sampling_settings(a), limits=limits, allowed_hosts=a.allowed_hosts, api_key=a.api_key)
