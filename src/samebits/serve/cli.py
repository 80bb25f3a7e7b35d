"""`samebits serve`: load the engine, start the AsyncEngine, serve HTTP with uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from samebits import cli_checks
from samebits.requests.sampling_params import LOGPROB_FORMULAS, LOGPROBS_MODES
from samebits.serve.auth import Keys
from samebits.serve.limits import Limits


def add_parser(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a checkpoint over HTTP: OpenAI /v1/completions and /v1/chat/completions, SGLang /generate",
        description="Runs the engine in a process of its own behind FastAPI + uvicorn. Endpoints: /health, "
        "/v1/models, /v1/completions, /v1/chat/completions, /generate, /abort_request, /metrics; vLLM's "
        "/get_world_size, /server_info, /reset_prefix_cache (for TRL's VLLMClient); SGLang's /model_info "
        "(/get_model_info), /server_info (/get_server_info), /health_generate, /pause_generation, "
        "/continue_generation; "
        "and SGLang's weight sync for a trainer in another process: /init_weights_update_group, "
        "/update_weights_from_distributed, /update_weights_from_tensor, /update_weights_from_disk, "
        "/release_memory_occupation, /resume_memory_occupation, /flush_cache, /get_weight_version, "
        "plus /weight_digests and /weight_specs (docs/serve.md). Logs one line when ready. "
        "With no --model: the built-in tiny model with a "
        "tiny byte-level tokenizer (CPU). Keys and limits: docs/serve.md, 'Security'.",
    )
    s.add_argument(
        "--model",
        type=cli_checks.model,
        default=None,
        help="HF checkpoint dir (default: built-in tiny model + tokenizer)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--served-model-name", default=None, help="name in the API (default: the dir's, or 'tiny')")
    s.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="report enable_memory_saver: true in /server_info and /get_server_info, as an SGLang server "
        "started with it does (slime's external-engine check compares it with its --offload-rollout); "
        "/release_memory_occupation and /resume_memory_occupation are served either way",
    )
    s.add_argument("--device", type=cli_checks.device, default="cpu", help="cpu or cuda[:i] (default cpu)")
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    s.add_argument(
        "--max-num-seqs", type=cli_checks.positive_int, default=8, help="sequences decoded together (default 8)"
    )
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens (default: min(4096, the model's limit))",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step (default: max(max_model_len, 8192) on CUDA, 2048 on the CPU)",
    )
    s.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    s.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: max_num_seqs full seqs)")
    s.add_argument("--numerics", default="exact", choices=("exact", "fast"), help="numerics profile")
    s.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="text prompts share the KV blocks of a common prefix: the n samples of a request, and "
        "later requests (bitwise equal to recomputing them; default on)",
    )
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch the next decode step while the device runs this one (the same "
        "tokens and bits under --numerics exact; default: on for CUDA, off on the CPU)",
    )
    s.add_argument(
        "--logprob-formula",
        default="log_softmax",
        choices=LOGPROB_FORMULAS,
        help="the trainer line every request's sampled-token log-probs are reported by, bit for bit "
        "(docs/logprobs.md): log_softmax (default, torch.log_softmax(logits.float() / T)), trl (TRL's "
        "fused LM head), trl_selective (TRL's selective_log_softmax), verl, logsumexp, cross_entropy",
    )
    s.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=LOGPROBS_MODES,
        help="vLLM's option, what is reported per token (docs/logprobs.md): raw_logprobs (default: the "
        "--logprob-formula line of the untruncated distribution at T), processed_logprobs (the log-prob "
        "under the temperature-scaled, top-k/top-p-truncated, renormalised distribution the token was "
        "drawn from, by --logprob-formula), raw_logits, processed_logits (the *_logits modes take only "
        "--logprob-formula log_softmax); a request's logprobs_mode field overrides it for that request",
    )
    s.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    _add_security(s)
    s.set_defaults(fn=run)


def _add_security(s) -> None:
    g = s.add_argument_group("keys (docs/serve.md, 'Security')")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics (several "
        "keys: any of them; default: $VLLM_API_KEY, as vLLM; unset: open)",
    )
    g.add_argument(
        "--admin-api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="the key of the endpoints that change or reveal the model or the server's state (weight "
        "updates, groups, memory, flush_cache, digests, specs, pause and continue, abort_all); default: "
        "$SAMEBITS_ADMIN_API_KEY, else the --api-key keys",
    )
    g.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="bind a non-loopback --host with the admin endpoints open (refused otherwise; logged)",
    )
    g.add_argument(
        "--allowed-weight-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="/update_weights_from_disk reads only under these directories, symlinks resolved "
        "(default: the directory the model was loaded from)",
    )
    g = s.add_argument_group("limits per request, refused before any work (docs/serve.md, 'Security')")
    d = Limits()
    g.add_argument(
        "--max-body-bytes", type=cli_checks.positive_int, default=d.max_body_bytes,
        help=f"request body size, 413 above (default {d.max_body_bytes})",
    )  # fmt: skip
    g.add_argument("--max-n", type=cli_checks.positive_int, default=d.max_n, help=f"n (default {d.max_n})")
    g.add_argument(
        "--max-tokens-limit", type=cli_checks.positive_int, default=None,
        help="max_tokens / max_new_tokens (default: only prompt + max_tokens <= --max-model-len)",
    )  # fmt: skip
    g.add_argument(
        "--max-top-logprobs", type=cli_checks.positive_int, default=d.max_top_logprobs,
        help=f"top log-probs per token (default {d.max_top_logprobs})",
    )  # fmt: skip
    g.add_argument(
        "--max-stop-strings", type=cli_checks.positive_int, default=d.max_stop_strings,
        help=f"stop strings per request (default {d.max_stop_strings})",
    )  # fmt: skip
    g.add_argument(
        "--max-stop-string-chars", type=cli_checks.positive_int, default=d.max_stop_string_chars,
        help=f"characters of one stop string (default {d.max_stop_string_chars})",
    )  # fmt: skip
    g.add_argument(
        "--max-concurrent-streams", type=cli_checks.positive_int, default=d.max_concurrent_streams,
        help="engine streams open at once (one per prompt, streamed or not), 429 above "
        f"(default {d.max_concurrent_streams})",
    )  # fmt: skip


def security(args, model: Path) -> tuple[Keys, Limits, list[Path]]:
    """The keys, limits and weight dirs of the options (ValueError naming the option); refuses
    a non-loopback --host with the admin endpoints open unless --allow-unauthenticated."""
    api = args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
    env_admin = os.environ.get("SAMEBITS_ADMIN_API_KEY")
    admin = args.admin_api_key or ([env_admin] if env_admin else [])
    keys = Keys.of(api, admin)
    if not keys.admin_guarded and not _loopback(args.host):
        if not args.allow_unauthenticated:
            raise ValueError(
                f"--host {args.host} is not loopback and the weight endpoints would be open: set "
                "--admin-api-key KEY (or $SAMEBITS_ADMIN_API_KEY), or pass --allow-unauthenticated"
            )
        print(
            f"samebits serve: WARNING: --allow-unauthenticated: {args.host} serves the weight and admin "
            "endpoints to anyone who reaches it",
            file=sys.stderr,
            flush=True,
        )
    limits = Limits(
        max_body_bytes=args.max_body_bytes,
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_top_logprobs=args.max_top_logprobs,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_concurrent_streams=args.max_concurrent_streams,
    )
    dirs = [Path(d) for d in args.allowed_weight_dirs] if args.allowed_weight_dirs else [model]
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"--allowed-weight-dirs: {str(d)!r} is not a directory")
    return keys, limits, dirs


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def run(args) -> int:
    import uvicorn

    from samebits.engine.engine_process import EngineProcess
    from samebits.serve.app import build_app

    model = args.model or _tiny_model()  # --model: a directory, or a cached hub id's snapshot
    try:
        keys, limits, weight_dirs = security(args, model)
    except ValueError as e:  # before the engine starts: nothing to stop
        print(f"samebits serve: {e}", file=sys.stderr)
        return 2
    try:
        engine = EngineProcess(
            settings := dict(  # also what /server_info reports
                model=model,
                device=args.device,
                dtype=args.dtype,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len or _default_len(model),
                max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                numerics=args.numerics,
                cuda_graphs=not args.no_cuda_graphs,
                enable_prefix_caching=args.enable_prefix_caching,
                async_scheduling=args.async_scheduling,
                logprob_formula=args.logprob_formula,
                logprobs_mode=args.logprobs_mode,
            )
        )
    except (ValueError, OSError, RuntimeError) as e:
        print(f"samebits serve: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (model.name if args.model else "tiny")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"samebits serve: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        engine.close()
        return 2
    sock.listen(2048)
    port = sock.getsockname()[1]
    served = settings | {"host": args.host, "port": port, "enable_memory_saver": args.enable_memory_saver}
    app = build_app(engine, name, keys, limits, weight_dirs, served)

    @asynccontextmanager
    async def lifespan(_):
        url = f"http://{args.host}:{port}"
        print(f"samebits serve: ready on {url} (model {name!r})", file=sys.stderr, flush=True)
        yield

    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    return 0


def _default_len(model: Path) -> int:
    import json

    try:
        limit = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        limit = None
    return min(4096, limit) if isinstance(limit, int) and limit > 0 else 4096


def _tiny_model() -> Path:
    from samebits.model.tiny_tokenizer import tiny_checkpoint_with_tokenizer

    return tiny_checkpoint_with_tokenizer()
