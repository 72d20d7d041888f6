"""jlora on Ray Serve: replicas of the online engine behind one OpenAI-compatible endpoint, routed by adapter.

- `Replica`: one engine (one GPU, or one tensor-parallel group) with `jlora serve`'s app in the same process:
  every request runs through that app's handling (validation, errors, streaming, metrics), called over ASGI.
  Each replica keeps its own slots and host tier and registers every adapter of the `--lora` /
  `--lora-dir` registry at start, and an adapter added to a `--lora-dir` later when it is first named.
- The adapter is Ray Serve's multiplexed model id. A replica's `get_adapter` (`@serve.multiplexed`) reads an
  adapter into its host tier the first time it is asked for it, and Ray then routes that adapter's requests
  to the replicas that hold it, loading it elsewhere only when none does (LRU within
  `max_num_models_per_replica`, the replica's host tier).
- `Router`: the HTTP ingress. It reads the body's `model`, forwards the request to a replica with it as the
  multiplexed id, and streams the replica's answer back (`x-jlora-replica` names the replica).

`/metrics`, answered by one replica, shows every live replica's metrics, each sample labelled `replica`: each
sends its own to a named actor (`MetricsHub`) every 2 s.

A replica that dies fails the requests it held: one not yet answered gets a 503 to retry; a stream already
under way ends with an error event. Ray Serve replaces the replica and does not retry a request once it runs.
A replica whose engine stopped for good (a failure it could not start over from) fails its health check, and
Ray Serve replaces it too.

    jlora serve --model DIR --lora-dir ADAPTERS --replicas 2      # a local Ray cluster, or RAY_ADDRESS's
    serve run jlora.ray:app model=DIR lora_dir=ADAPTERS replicas=2
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator

import pydantic_core
import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from jlora.engine_config import EngineConfig
from jlora.server.config import ServerConfig
from jlora.server.app import read_body
from jlora.server.errors import ApiError
from jlora.server.serve import check_start, listening_socket, served_name
from jlora.values import is_integer

__all__ = ["MetricsHub", "ReplicaSpec", "Replica", "Router", "app", "deployment", "merged_metrics", "remove_app",
           "run"]

_ROUTED = ("/v1/completions", "/v1/chat/completions")  # the routes whose body names an adapter
_METRICS_HUB = "jlora-metrics"  # the named actor holding each replica's latest metrics, in namespace "jlora"
_METRICS_PUSH_SECONDS = 2.0  # how often a replica sends its metrics there; 5 of these without: gone


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads: `jlora.server.serve.build`'s arguments."""

    model_dir: str
    config: ServerConfig = ServerConfig()
    loras: tuple[tuple[str, str], ...] = ()
    lora_dirs: tuple[str, ...] = ()
    engine: EngineConfig = EngineConfig()

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError(f"{self.model_dir!r} is not a Hugging Face model directory (no config.json)")
        if self.config.allow_runtime_lora:
            raise ValueError("runtime adapter loads would reach one replica only; register adapters with --lora "
                             "or --lora-dir under --replicas")


@ray.remote(num_cpus=0)
class MetricsHub:
    """The latest Prometheus text of each live replica, which each sends every `_METRICS_PUSH_SECONDS`, so that
    `/metrics`, answered by one replica, shows them all."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def latest(self) -> dict[str, str]:
        """Each replica's text, less those not heard from lately (a replica that died)."""
        now = time.monotonic()
        self.texts = {k: v for k, v in self.texts.items() if now - v[0] < 5 * _METRICS_PUSH_SECONDS}
        return {replica: text for replica, (_, text) in self.texts.items()}


def merged_metrics(texts: dict[str, str]) -> bytes:
    """One Prometheus exposition of every replica's metrics (`texts`: replica id -> its `/metrics` text), each
    sample labelled `replica` with its replica's id."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            merged.samples += [sample._replace(labels={**sample.labels, "replica": replica})
                               for sample in family.samples]
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A Prometheus collector of metric families already made."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


@serve.deployment
class Replica:
    """One engine and its app; requests arrive through `handle` with the adapter as the multiplexed id."""

    def __init__(self, spec: ReplicaSpec):
        from jlora.server.serve import build

        self.app, self.online, config = build(spec.model_dir, spec.config, spec.engine, loras=spec.loras,
                                              lora_dirs=spec.lora_dirs)
        self.online.start()  # the app's lifespan is not run here: ASGI calls go to its routes directly
        self.base = config.served_model_name
        self.id = serve.get_replica_context().replica_id.unique_id
        self.loads = 0  # adapters this replica was asked to take (the multiplexed loads)
        engine = self.online.engine
        capacity = max(engine.tiers.host.capacity, engine.pool.num_slots)

        async def load(name: str) -> str:  # a function: Ray Serve's wrapper keeps its cache on it
            return await self._load(name)

        self.get_adapter = serve.multiplexed(max_num_models_per_replica=capacity)(load)
        self.hub = MetricsHub.options(name=_METRICS_HUB, namespace="jlora", get_if_exists=True,
                                      lifetime="detached").remote()
        self.stopped = threading.Event()
        threading.Thread(target=self._send_metrics, name="jlora-metrics", daemon=True).start()

    def _send_metrics(self) -> None:
        while not self.stopped.wait(_METRICS_PUSH_SECONDS):
            self.hub.put.remote(self.id, generate_latest(self.online.metrics.registry).decode())

    async def _load(self, name: str) -> str:
        """Reads adapter `name` into the host tier (a failure is left to the request's own load to report)."""
        engine = self.online.engine
        entry = await asyncio.to_thread(engine.registry.find, name)  # one added to a --lora-dir since too
        self.loads += 1
        if entry is not None and engine.tiers.find(entry.generation)[0] == "disk":
            try:
                engine.tiers.keep(engine.tiers.host, entry,
                                  await asyncio.to_thread(engine.pool.prepare, entry.adapter_dir, entry.roots))
            except Exception:  # noqa: BLE001 - AdapterError and OS errors alike: the request reports them
                pass
        return name

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                     body: bytes) -> AsyncIterator[dict | bytes]:
        """The request through this replica's app: yields {"status", "headers"}, then the body's chunks."""
        model = serve.get_multiplexed_model_id()
        if model and model != self.base:
            await self.get_adapter(model)
        answer = _asgi(self.app, method, path, query, headers, body)
        if (method, path) == ("GET", "/metrics"):
            answer = self._all_metrics(answer)
        async for item in answer:
            if isinstance(item, dict):
                item["headers"].append(("x-jlora-replica", self.id))
                item["headers"].append(("x-jlora-replica-loads", str(self.loads)))
            yield item

    async def _all_metrics(self, answer: AsyncIterator[dict | bytes]) -> AsyncIterator[dict | bytes]:
        """The app's `/metrics` answer (its checks, as on every route), its body every live replica's metrics
        (`merged_metrics`), this one's as of now."""
        head, own = None, b""
        async for item in answer:
            if isinstance(item, dict):
                head = item
            else:
                own += item
        if head["status"] == 200:
            texts = await self.hub.latest.remote()
            own = merged_metrics({**texts, self.id: own.decode()})
            head["headers"] = [(k, v) for k, v in head["headers"] if k.lower() != "content-length"]
        yield head
        yield own

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped for good (`OnlineEngine.down`) is
        reported unhealthy, and Ray Serve replaces it."""
        if self.online.down:
            raise RuntimeError(self.online.down)

    def __del__(self):
        if hasattr(self, "stopped"):  # not when __init__ failed (Ray still calls this)
            self.stopped.set()
            self.hub.drop.remote(self.id)
        if hasattr(self, "online"):
            self.online.stop()


async def _asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes) -> AsyncIterator[dict | bytes]:
    """Calls the ASGI `app` with one HTTP request; yields the response's status and headers, then its body's
    chunks. When the caller stops reading (its client left), the app's next receive() is a disconnect."""
    messages: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    task = asyncio.create_task(app(scope, receive, messages.put))
    try:
        while True:
            getter = asyncio.create_task(messages.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app returned without finishing its response
                getter.cancel()
                task.result()
                raise RuntimeError(f"the app ended {method} {path} without a complete response")
            message = getter.result()
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
    finally:
        left.set()
        await asyncio.wait([task], timeout=5)


@serve.deployment
class Router:
    """The HTTP ingress: forwards each request to a replica, choosing by the adapter its body names."""

    def __init__(self, replica, config: ServerConfig):
        self.replica = replica
        self.base = config.served_model_name
        self.config = config

    async def __call__(self, http: HTTPRequest) -> Response:
        try:
            body = await read_body(http, self.config)
        except ApiError as err:
            return err.response()
        model = _model_of(body) if http.method == "POST" and http.url.path in _ROUTED else None
        handle = self.replica.options(stream=True, multiplexed_model_id=model if model and model != self.base else "")
        stream = handle.handle.remote(http.method, http.url.path, http.url.query.encode(), list(http.headers.raw), body)
        try:
            head = await stream.__anext__()
        except ray.exceptions.RayError as err:
            stream.cancel()
            return ApiError(503, f"the replica serving this request failed ({type(err).__name__}); retry",
                            kind="server_error", headers={"Retry-After": "1"}).response()
        headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        events = headers.get("content-type", "").startswith("text/event-stream")

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except ray.exceptions.RayError as err:  # the status line has gone out
                error = ApiError(500, f"the replica serving this request failed mid-answer ({type(err).__name__})",
                                 kind="server_error")
                yield (f"data: {json.dumps(error.body())}\n\n" if events else json.dumps(error.body())).encode()
            finally:
                stream.cancel()  # a client that left: the replica's app sees a disconnect and frees the row

        return StreamingResponse(rest(), status_code=head["status"], headers=headers)


def _model_of(body: bytes) -> str | None:
    """The body's `model` when it is a JSON object naming one (else the replica's app answers the error)."""
    try:
        value = pydantic_core.from_json(body)
    except ValueError:
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else None


def _replica_options(given: dict | None, *, replicas: int, gpus: int, max_waiting: int) -> dict:
    """The replicas' Ray Serve options: `replicas` replicas (none when `given` has an autoscaling_config), each
    taking a CPU and `gpus` GPUs, with room for `max_waiting` queued requests, under what `given` sets; its
    `ray_actor_options` are merged into those defaults, so that setting one of them (a runtime_env) does not
    take away the replica's GPUs."""
    given = dict(given or {})
    actor = given.pop("ray_actor_options", {})
    if isinstance(actor, dict):  # else left for Ray Serve to refuse
        actor = {"num_cpus": 1, "num_gpus": gpus, **actor}
    options = {"num_replicas": replicas, "max_ongoing_requests": max_waiting + 64, "ray_actor_options": actor,
               **given}
    if "autoscaling_config" in options:
        options.pop("num_replicas")
    return options


def deployment(spec: ReplicaSpec, *, replicas: int = 1, replica_options: dict | None = None) -> serve.Application:
    """The Ray Serve application: a `Router` over `replicas` `Replica`s of `spec`. `replica_options` go to
    `Replica.options` over jlora's defaults (`_replica_options`: e.g. `{"autoscaling_config": {"min_replicas": 1,
    "max_replicas": 4}}`, which takes the place of `replicas`, or `ray_actor_options`); by default a replica takes
    `tensor_parallel` GPUs when the cluster has GPUs."""
    config = dataclasses.replace(spec.config, served_model_name=served_name(spec.model_dir, spec.config))
    spec = dataclasses.replace(spec, config=config)
    gpus = spec.engine.tensor_parallel if ray.is_initialized() and ray.cluster_resources().get("GPU") else 0
    options = _replica_options(replica_options, replicas=replicas, gpus=gpus, max_waiting=config.max_waiting)
    replica = Replica.options(**options).bind(spec)
    return Router.options(max_ongoing_requests=config.max_connections,
                          ray_actor_options={"num_cpus": 0}).bind(replica, config)


def app(args: dict) -> serve.Application:
    """`serve run jlora.ray:app model=DIR [lora_dir=DIR[,DIR...]] [lora=NAME=DIR[,NAME=DIR...]] [replicas=N]
    [served_model_name=NAME] [generation_config=auto|none] [KEY=VALUE ...]`, or the same keys as the `args` of a
    Serve config file (numbers, booleans and lists as its YAML gives them): the other keys are `EngineConfig`'s
    fields (max_loras=8, prefix_caching=false, ...), text parsed as their flags parse it."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("serve run jlora.ray:app needs model=DIR")
    model = args.pop("model")
    lora_dirs = tuple(_listed(args.pop("lora_dir", ()), "lora_dir"))
    loras = tuple(tuple(item.split("=", 1)) for item in _listed(args.pop("lora", ()), "lora"))
    if any(len(lora) != 2 or not all(lora) for lora in loras):
        raise ValueError("lora takes NAME=DIR[,NAME=DIR...]")
    replicas = args.pop("replicas", 1)
    replicas = int(replicas) if isinstance(replicas, str) and replicas.isdigit() else replicas
    if not is_integer(replicas) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    config = ServerConfig(served_model_name=args.pop("served_model_name", None),
                          generation_config=args.pop("generation_config", "auto"))
    spec = ReplicaSpec(model, config, loras, lora_dirs, EngineConfig.from_settings(args))
    check_start(spec.model_dir, spec.config, spec.loras)  # here, not after each replica has loaded the model
    return deployment(spec, replicas=int(replicas))


def _listed(value, key: str) -> list[str]:
    """A list argument of `app`: comma-separated text, or a list of text."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"{key} takes comma-separated text or a list of text, got {value!r}")
    return [item for item in items if item]


def run(spec: ReplicaSpec, *, replicas: int, replica_options: dict | None = None) -> None:
    """`jlora serve --replicas N`: deploys on the Ray cluster at RAY_ADDRESS (a local one when unset), with
    Ray Serve's HTTP proxy on the config's host and port, until Ctrl-C (KeyboardInterrupt, after the clean-up) or
    SIGTERM (the process ends by it, after the clean-up). On a local cluster the proxy listens here, so an
    address it cannot take stops the start before Ray does, and port 0 becomes a free one."""
    check_start(spec.model_dir, spec.config, spec.loras)  # here, not after each replica has loaded the model
    try:  # Ray Serve's own check of the options as the deployment will give them, before Ray starts
        Replica.options(**_replica_options(replica_options, replicas=replicas, gpus=0,
                                           max_waiting=spec.config.max_waiting))
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad Ray Serve deployment options ({err})") from None
    if not os.environ.get("RAY_ADDRESS"):
        with listening_socket(spec.config.host, spec.config.port) as sock:
            port = sock.getsockname()[1]
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, port=port))
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    terminated = []

    def terminate(signum, frame):  # SIGTERM: the clean-up of Ctrl-C, then the process ends by the signal
        terminated.append(signum)
        raise KeyboardInterrupt

    # over Ray's own handler, whose SystemExit ended the process by SIGABRT after the clean-up
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if main else None
    try:
        serve.start(http_options={"host": spec.config.host, "port": spec.config.port})
        _deploy(deployment(spec, replicas=replicas, replica_options=replica_options))
        scaling = (replica_options or {}).get("autoscaling_config")
        count = "autoscaled replicas" if scaling else f"{replicas} replica(s)"
        print(f"jlora: {count} on Ray Serve at http://{spec.config.host}:{spec.config.port}/v1", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("jlora: shutting down", flush=True)
        raise  # as one server ends on Ctrl-C: `jlora serve: interrupted`, code 130
    finally:
        with contextlib.suppress(KeyboardInterrupt):  # a second interrupt leaves the rest to Ray's exit hooks
            if os.environ.get("RAY_ADDRESS"):  # a cluster others may use: only what this command deployed
                remove_app()
            else:
                serve.shutdown()
            ray.shutdown()
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if terminated or previous is None else previous)
        if terminated:
            signal.raise_signal(signal.SIGTERM)


def remove_app() -> None:
    """Deletes the "jlora" application and its metrics actor (detached: it would outlive the replicas),
    leaving Ray Serve and the cluster's other applications running."""
    serve.delete("jlora")
    with contextlib.suppress(ValueError):  # no replica ever started
        ray.kill(ray.get_actor(_METRICS_HUB, namespace="jlora"))


def _deploy(application: serve.Application) -> None:
    """Runs `application` as "jlora". Raises RuntimeError with the replicas' own error when they failed to start
    (Ray Serve's says only "Failed to update the deployments"; the replica's traceback is in its status)."""
    try:
        serve.run(application, name="jlora", route_prefix="/")
    except RuntimeError as err:
        status = serve.status().applications.get("jlora")
        replica = status.deployments.get("Replica") if status is not None else None
        lines = replica.message.strip().splitlines() if replica is not None else []
        if not lines:
            raise
        cause = re.sub(r"^[\w.]+: ", "", lines[-1])  # less the exception's type
        raise RuntimeError(f"the replicas failed to start: {cause}") from err
