"""The `jlora` command line: `demo`, `selfcheck`, `generate`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
from importlib import import_module, metadata

from jlora import __version__
from jlora.values import is_integer

__all__ = ["main"]

BENCH_SCRIPTS = {"kernels": "kernels.py", "model": "model.py"}
# The modules each command runs on, imported before it starts with Ctrl-C held back (`_ctrl_c_held`)
COMMAND_MODULES = {"demo": ["jlora.demo"], "selfcheck": ["jlora.selfcheck"], "generate": ["jlora.engine"],
                   "serve": ["jlora.engine", "jlora.server.app"], "bench": []}
REQUEST_KEYS = frozenset({"prompt", "prompt_ids", "messages", "adapter"})  # a --prompts-file line's keys


def _parse_lora(spec: str) -> tuple[str, str]:
    from jlora.adapters.config import check_adapter_name

    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora takes NAME=DIR, got {spec!r}")
    try:
        check_adapter_name(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, path


def _read_requests(args) -> list[dict]:
    """Each request as {"prompt": text or ids, "adapter": name or None}; with --chat {"messages": [...], ...}
    (a text prompt as one user message)."""
    if args.prompt is not None:
        return [_chat_request(args.prompt, args.adapter) if args.chat else {"prompt": args.prompt,
                                                                             "adapter": args.adapter}]
    requests = []
    try:
        f = open(args.prompts_file, "rb")
    except OSError as err:
        raise OSError(f"cannot read --prompts-file {args.prompts_file!r}: {err.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            where = f"{args.prompts_file}:{n}"
            if not line.strip():
                continue
            try:
                req = json.loads(line.decode("utf-8-sig"))  # -sig: a byte-order mark, as some editors write, is skipped
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {err.start + 1} of the line: {err.reason})") \
                    from None
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err})") from None
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply") from None
            except ValueError:  # Python's limit on an integer's digits
                raise ValueError(f"{where}: a number of more than {sys.get_int_max_str_digits()} digits") from None
            if not isinstance(req, dict):
                raise ValueError(f"{where}: not a JSON object")
            if unknown := sorted(set(req) - REQUEST_KEYS):
                raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}: a request takes "
                                 f"{', '.join(map(repr, sorted(REQUEST_KEYS)))}; the generation's settings are "
                                 f"the command's options (--max-new-tokens, --temperature, ...)")
            if sum(key in req for key in ("prompt", "prompt_ids", "messages")) != 1:
                raise ValueError(f"{where}: give exactly one of 'prompt' (text), 'prompt_ids' or 'messages'")
            if "prompt" in req and not isinstance(req["prompt"], str):
                raise ValueError(f"{where}: 'prompt' must be text (token ids go in 'prompt_ids')")
            ids = req.get("prompt_ids", [])
            if not isinstance(ids, list) or not all(is_integer(t) for t in ids):
                raise ValueError(f"{where}: 'prompt_ids' must be a list of integer token ids")
            messages = req.get("messages")
            if "messages" in req and not (isinstance(messages, list) and messages
                                          and all(isinstance(m, dict) for m in messages)):
                raise ValueError(f"{where}: 'messages' must be a non-empty list of message objects")
            if "messages" in req and not args.chat:
                raise ValueError(f"{where}: 'messages' needs --chat")
            if "prompt_ids" in req and args.chat:
                raise ValueError(f"{where}: --chat renders text: give 'prompt' or 'messages', not 'prompt_ids'")
            adapter = req.get("adapter", args.adapter)
            if adapter is not None and not isinstance(adapter, str):
                raise ValueError(f"{where}: 'adapter' must be a name or null")
            if "messages" in req:
                requests.append({"messages": messages, "adapter": adapter})
            elif args.chat:
                requests.append(_chat_request(req["prompt"], adapter))
            else:
                requests.append({"prompt": req.get("prompt", req.get("prompt_ids")), "adapter": adapter})
    if not requests:
        raise ValueError(f"{args.prompts_file} holds no requests")
    return requests


def _chat_request(text: str, adapter: str | None) -> dict:
    return {"messages": [{"role": "user", "content": text}], "adapter": adapter}


def _generate(args) -> int:
    from tqdm.auto import tqdm

    from jlora.adapters.config import check_start_adapters
    from jlora.engine import Engine, check_sampling
    from jlora.engine_config import EngineConfig

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_p=args.min_p, stop_token_ids=args.stop, seed=args.seed,
                    ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                    frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    check_sampling(**sampling)  # before the model loads, as every check that needs none
    requests = _read_requests(args)
    config = EngineConfig.from_args(args, max_loras=max(1, len(args.lora)))  # one slot per adapter named
    check_start_adapters(args.lora)
    unknown = sorted({r["adapter"] for r in requests} - {name for name, _ in args.lora} - {None})
    if unknown:
        raise ValueError(f"adapter(s) {unknown} asked for but not given with --lora NAME=DIR "
                         f"(given: {[name for name, _ in args.lora]})")
    with _output(args.output) as out:
        engine = Engine.from_pretrained(args.model, config, progress=not args.quiet)
        for name, path in args.lora:
            engine.load_adapter(name, path)
        with tqdm(total=len(requests) * args.max_new_tokens, desc="generating", unit="tok", disable=args.quiet) as bar:
            run = engine.chat if args.chat else engine.generate
            outputs = run([r["messages" if args.chat else "prompt"] for r in requests],
                          [r["adapter"] for r in requests], progress=bar.update, **sampling)
        out.write(_render(args, requests, outputs))
    return 0


def _render(args, requests: list[dict], outputs) -> str:
    """The output's text: a JSON line per request (--json), else a line of each request's adapter and text."""
    records = [{**r, "tokens": list(o), "text": o.text, "finish_reason": o.finish_reason}
               for r, o in zip(requests, outputs)]
    if args.json:
        return "".join(json.dumps(rec) + "\n" for rec in records)
    return "".join(f"[{rec['adapter'] or 'base'}] {rec['text'] if rec['text'] is not None else rec['tokens']}\n"
                   for rec in records)


@contextlib.contextmanager
def _output(path: str | None):
    """Where the output goes: standard output, or `path` (through links). A regular file, or a new one, is written
    whole or not at all: a temporary file beside it, made before the model loads, so a directory that does not
    exist or cannot be written stops the command at once; renamed over it at the end, removed on any failure.
    Anything else there (a device such as /dev/null, a pipe, a terminal) is opened before the model loads and
    written in place, never replaced. The body writes to a buffer, which goes out at the end."""
    if path is None:
        yield sys.stdout
        return
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise ValueError(f"--output {path!r} is a directory")
    in_place = os.path.exists(target) and not os.path.isfile(target)
    tmp = None
    try:
        if in_place:
            f = open(target, "w")
        else:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".jlora-", suffix=".tmp")
            f = os.fdopen(fd, "w")
    except OSError as err:
        raise OSError(f"cannot write --output {path!r}: {err.strerror}") from None
    try:
        text = io.StringIO()
        yield text
        try:
            with f:
                f.write(text.getvalue())
        except OSError as err:  # a full disk or device
            raise OSError(f"cannot write --output {path!r}: {err.strerror}") from None
        if tmp is not None:
            os.replace(tmp, target)
    finally:
        f.close()
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _bench(args) -> int:
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    script = os.path.join(bench_dir, BENCH_SCRIPTS[args.which])
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script} not found: the benchmarks live in the repository's bench/ "
                                f"({', '.join(BENCH_SCRIPTS.values())}); run from a source checkout")
    import jax

    wants_help = any(a in ("-h", "--help") for a in args.args)
    if not wants_help and jax.default_backend() != "gpu":
        raise RuntimeError(f"the benchmarks time CUDA kernels and need an NVIDIA GPU; JAX's backend here is "
                           f"{jax.default_backend()!r} (install jlora[cuda12] or jlora[cuda13] on a GPU machine)")
    sys.argv = [script, *args.args]
    sys.path.insert(0, bench_dir)  # the scripts import their shared helpers (bench/common.py)
    runpy.run_path(script, run_name="__main__")
    return 0


def _serve(args) -> int:
    from jlora.engine_config import EngineConfig
    from jlora.server import ServerConfig, serve

    config = ServerConfig(served_model_name=args.served_model_name, host=args.host, port=args.port,
                          api_key=args.api_key, allow_runtime_lora=args.allow_runtime_lora,
                          lora_roots=tuple(args.lora_root), max_waiting=args.max_waiting,
                          max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                          header_timeout=args.header_timeout, max_connections=args.max_connections,
                          generation_config=args.generation_config)
    missing = [d for d in args.lora_dir if not os.path.isdir(d)]
    if missing:
        raise ValueError(f"--lora-dir {missing[0]!r} is not a directory")
    engine_config = EngineConfig.from_args(args)
    if args.replicas is None and args.ray_replica_options is None:
        serve(args.model, config, engine_config, loras=args.lora, lora_dirs=args.lora_dir)
        return 0
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    try:
        options = json.loads(args.ray_replica_options or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"--ray-replica-options is not valid JSON: {err}") from None
    if not isinstance(options, dict):
        raise ValueError("--ray-replica-options must be a JSON object of Ray Serve deployment options")
    if args.replicas is not None and "autoscaling_config" in options:
        raise ValueError("give --replicas or an autoscaling_config in --ray-replica-options, not both")
    try:
        from jlora.ray import ReplicaSpec, run
    except ImportError as err:
        raise RuntimeError(f"--replicas needs Ray Serve: pip install 'jlora[ray]' ({err})") from None
    run(ReplicaSpec(args.model, config, tuple(args.lora), tuple(args.lora_dir), engine_config),
        replicas=args.replicas or 1, replica_options=options)
    return 0


def _parser() -> argparse.ArgumentParser:
    from jlora.engine_config import EngineConfig  # imports JAX
    from jlora.server.config import GENERATION_CONFIGS

    parser = argparse.ArgumentParser(prog="jlora", description="Multi-LoRA inference for JAX.")
    parser.add_argument("--version", action="version", version=f"jlora {__version__} (JAX {metadata.version('jax')})")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="random model + PEFT adapters: generate a mixed batch, check against merged weights")
    demo.add_argument("--out", help="keep the model (OUT/model) and adapters (OUT/<name>) in this directory")
    sub.add_parser("selfcheck", help="check the multi-LoRA ops on random data against a float64 oracle")

    gen = sub.add_parser("generate", help="generate with a HF model and PEFT adapters")
    gen.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    gen.add_argument("--lora", type=_parse_lora, action="append", default=[], metavar="NAME=DIR",
                     help="a PEFT adapter directory to load under NAME (repeatable)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one text prompt (needs tokenizer.json in the model directory)")
    src.add_argument("--prompts-file", help="JSONL: {'prompt': text | 'prompt_ids': [ids] | 'messages': [...] "
                                            "(with --chat), 'adapter': name|null}")
    gen.add_argument("--chat", action="store_true",
                     help="render each prompt (one user message) or 'messages' with the model's chat template, as "
                          "transformers' apply_chat_template does")
    gen.add_argument("--adapter", help="adapter for requests that name none (default: the base model)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="in (0, 2]: divide the positive logits of the tokens of the prompt and output so far by it, "
                          "multiply the others (HF's; 1: off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="in [-2, 2]: subtract it from a token's logit once per time it was generated (OpenAI's; 0: off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="in [-2, 2]: subtract it from the logit of a token generated before (OpenAI's; 0: off)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="sample among the tokens at least this fraction as likely as the top one (0: off)")
    gen.add_argument("--stop", type=int, action="append",
                     help="stop token id (repeatable), beside the model's end-of-sequence ids")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate past the model's end-of-sequence ids (generation_config.json's eos_token_id)")
    gen.add_argument("--seed", type=int, default=0)
    EngineConfig.add_arguments(gen.add_argument_group("engine options"),
                               skip=("max_loras", "max_cpu_loras", "max_cpu_lora_memory", "device_cache_memory",
                                     "evict"))
    gen.add_argument("--json", action="store_true", help="one JSON record per request")
    gen.add_argument("--output", help="write results to this file instead of stdout (a regular file whole or not "
                     "at all, through links; a device or pipe in place)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")

    srv = sub.add_parser("serve", help="an OpenAI-compatible server: the model and adapters by name")
    srv.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    srv.add_argument("--lora", type=_parse_lora, action="append", default=[], metavar="NAME=DIR",
                     help="a PEFT adapter directory to serve under NAME, checked at start (repeatable)")
    srv.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                     help="serve every subdirectory of DIR with an adapter_config.json, named after it, read "
                          "when first requested; one added later is registered when first named (repeatable)")
    srv.add_argument("--served-model-name", help="the base model's name in the API (default: the directory's)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    srv.add_argument("--allow-runtime-lora", action="store_true",
                     help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-root)")
    srv.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                     help="a directory runtime loads may read adapters from (repeatable); paths resolving "
                          "elsewhere, symlinks included, answer 403")
    srv.add_argument("--max-waiting", type=int, default=256, help="waiting requests beyond which new ones get 503")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="BYTES",
                     help="the largest request body accepted (413 beyond; default 1 MiB: a prompt of 170k "
                          "characters even when each is escaped as \\uXXXX)")
    srv.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="time a request's body may take to arrive (408 beyond)")
    srv.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="time a connection may take to send a request's headers before it is closed")
    srv.add_argument("--max-connections", type=int, default=1024,
                     help="open connections beyond which new requests get 503")
    srv.add_argument("--generation-config", choices=GENERATION_CONFIGS, default="auto",
                     help="auto: a request's unset temperature, top_p, top_k, min_p, repetition_penalty and (chat) "
                          "max_tokens take the model's generation_config.json values, as vLLM's server does; none: "
                          "OpenAI's defaults")
    EngineConfig.add_arguments(srv.add_argument_group("engine options"))
    srv.add_argument("--replicas", type=int, metavar="N",
                     help="serve N engines on Ray Serve (RAY_ADDRESS's cluster, else a local one), routed by adapter")
    srv.add_argument("--ray-replica-options", metavar="JSON",
                     help="Ray Serve deployment options of the replicas, e.g. '{\"autoscaling_config\": "
                          "{\"min_replicas\": 1, \"max_replicas\": 4}}'")

    bench = sub.add_parser("bench", help="run a benchmark script from bench/ (kernels or model)")
    bench.add_argument("which", choices=sorted(BENCH_SCRIPTS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    return parser


@contextlib.contextmanager
def _ctrl_c_held():
    """Holds a Ctrl-C back until the block ends, then raises SIGINT again: for imports, which an interrupt can
    break midway (JAX's C extensions then fail with an ImportError traceback, or abort the process)."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed:
            signal.raise_signal(signal.SIGINT)  # to the handler before, as if pressed now


@contextlib.contextmanager
def _ctrl_c_kept_from_collections():
    """A Ctrl-C that lands while a garbage collection runs a Python callback (JAX has one) raises KeyboardInterrupt
    inside it, where Python drops it and prints it as an ignored exception's traceback. Within this block such an
    interrupt goes quietly to a thread that raises it in the main thread again once the collection is over, while
    Python's own handler takes Ctrl-C (the server's handlers count presses: theirs are left alone)."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    lost, done, previous = threading.Event(), threading.Event(), sys.unraisablehook
    lock = threading.Lock()  # no interrupt is raised again once the block has ended

    def hook(unraisable) -> None:
        if (unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt)
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            lost.set()
        else:
            previous(unraisable)

    def redeliver() -> None:
        while lost.wait():
            lost.clear()
            time.sleep(0.01)  # the collection's other callbacks first: one that took it would drop it again
            with lock:
                if done.is_set():
                    return
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a wait in C code ends too

    sys.unraisablehook = hook
    threading.Thread(target=redeliver, name="jlora-ctrl-c", daemon=True).start()
    try:
        yield
    finally:
        sys.unraisablehook = previous
        with lock:
            done.set()
        lost.set()


def _interrupted(who: str) -> int:
    """Ctrl-C: says so, without a traceback, and returns the shell's code for SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # another Ctrl-C while the process exits ends it, silently
    print(f"\n{who}: interrupted", file=sys.stderr)
    return 130


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        with _ctrl_c_held():  # the seconds JAX and the command's packages take to import
            args = _parser().parse_args(argv)
            for module in COMMAND_MODULES[args.command]:
                import_module(module)
    except KeyboardInterrupt:
        return _interrupted("jlora")
    except ModuleNotFoundError as err:  # an install without one of jlora's packages (pip's --no-deps, say)
        package, who = (err.name or "").partition(".")[0] or str(err), "jlora" + (f" {args.command}" if args else "")
        print(f"{who}: error: the package {package!r} is not installed; jlora needs it (pip install jlora installs "
              "it)", file=sys.stderr)
        return 1
    try:
        with _ctrl_c_kept_from_collections():
            return _run(args)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"jlora {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return _interrupted(f"jlora {args.command}")


def _run(args) -> int:
    """Runs the parsed command; its exit code."""
    if args.command == "demo":
        from jlora.demo import run_demo

        return 0 if run_demo(out_dir=args.out) else 1
    if args.command == "selfcheck":
        from jlora.selfcheck import run_selfcheck

        return 0 if run_selfcheck() else 1
    if args.command == "serve":
        return _serve(args)
    return _generate(args) if args.command == "generate" else _bench(args)


if __name__ == "__main__":
    sys.exit(main())
