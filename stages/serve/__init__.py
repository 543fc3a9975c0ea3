"""Serve stage: register the trained model in MLflow, serve it behind an OpenAI-compatible API.

    source model (the PPO policy by default)
      -> MLflow Model Registry: a version per changed model, alias (`champion`) moved to it, tagged with
         the pipeline run, the cache key and the model's metrics  (stages.common.model_registry)
      -> fetched back by its registry URI (models:/NAME@ALIAS), as another machine would
      -> Ray Serve LLM (`ray.serve.llm`): vLLM replicas + an OpenAI ingress with /v1/models,
         /v1/completions, /v1/chat/completions (streaming too), bound to 127.0.0.1 by default
      -> smoke load (the `openai` client, concurrent requests): latency p50/p95 and tokens/s to MLflow
      -> shut down, or keep serving until Ctrl-C (`block: true`)

Serve it on its own: `python -m pipeline serve --model models:/posttrain-policy@champion`, with
LoRA adapters on that base each under a model name of its own: `--adapter NAME=DIR` (repeatable),
requested as `<model_id>:NAME` (Serve LLM's multiplexing: one vLLM engine, adapters loaded on use).
With `http.api_key_env` set, requests without `Authorization: Bearer <key>` get 401.

The package:

    __init__.py  this stage: its config (ServeConfig), always_runs, run
    app.py       the served app (Ray Serve LLM + vLLM), deploying and removing it, the smoke load,
                 `serve_model` (what `pipeline serve` runs)
    guard.py     what one request may ask for (LimitsConfig), checked before it reaches an engine,
                 and RequestGuard, the middleware that checks it (Ray-free)
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.schema import Section
from stages.common.serving import EngineConfig, check_source
from stages.serve.guard import LimitsConfig

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext


class RegistryConfig(Section):
    """Where the model is registered in the MLflow Model Registry."""

    model_name: str = Field("posttrain-policy", min_length=1, description="Registered model name.")
    alias: str = Field("champion", min_length=1, description="Alias moved to the served version (models:/NAME@ALIAS).")
    metric_tags: list[str] = Field(["accuracy", "eval_accuracy", "eval_reward", "reward_mean"],
                                   description="Metrics of the source stage copied onto the version as tags (those it "
                                               "has).")

    @field_validator("alias")
    @classmethod
    def _valid_alias(cls, v: str) -> str:
        # MLflow reserves 'latest' and version-like aliases ('v3').
        if v.lower() == "latest" or (v[:1].lower() == "v" and v[1:].isdigit()):
            raise ValueError(f"{v!r} is reserved by MLflow; pick another alias, e.g. champion")
        return v


_ORIGIN = re.compile(r"https?://[^/\s?#@]+")  # what a browser sends as Origin (no path, no user)


class HttpConfig(Section):
    """The HTTP endpoint."""

    host: str = Field("127.0.0.1", description="Address to bind. 127.0.0.1: this machine only; 0.0.0.0: every "
                      "interface (set api_key_env then).")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI-compatible API.")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the API key; "
                                    "requests without `Authorization: Bearer <key>` then get 401. Empty: no key.")
    allow_unauthenticated: bool = Field(False, description="Allow binding a non-loopback host without api_key_env "
                                        "(anyone who reaches the port can use the model).")
    cors_origins: list[str] = Field([], description="Web origins ('https://app.example.com', scheme://host[:port]) "
                                    "whose pages may call the API from a browser (CORS; credentials allowed), or "
                                    "['*'] for any page (without credentials). Empty: no cross-origin access, no "
                                    "page of another origin can read an answer.")

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        # A browser sends `Origin: scheme://host[:port]` and CORS compares it as a string: a path, a trailing
        # slash or a missing scheme would never match, silently.
        for origin in v:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin; write scheme://host[:port] with no path or trailing "
                                 "slash (e.g. https://app.example.com), or '*' for any page")
        if "*" in v and len(v) > 1:
            raise ValueError("'*' already allows every origin; give it alone or list the origins")
        return v

    @model_validator(mode="after")
    def _key_off_loopback(self):
        loopback = self.host in ("localhost", "::1") or self.host.startswith("127.")
        if not loopback and self.api_key_env is None and not self.allow_unauthenticated:
            raise ValueError(f"host {self.host} exposes the API beyond this machine without an API key; set "
                             "api_key_env (recommended), or allow_unauthenticated: true if that is intended")
        return self


class SmokeConfig(Section):
    """The load sent right after deploying (latency and throughput go to MLflow)."""

    requests: int = Field(8, ge=1, description="Chat completion requests sent.")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    max_tokens: int = Field(16, ge=1, description="Tokens per completion.")
    prompt: str = Field("What is 2 + 3?", min_length=1, description="The user message of every request.")


class ServeConfig(Section):
    """The serve stage: registry, engine, endpoint."""

    source: Literal["policy_model", "dpo_model", "sft_model", "base_model"] | None = Field(
        None, description="Which pipeline model to register and serve; empty: the last one the pipeline trains "
        "(policy_model; without a ppo stage dpo_model, then sft_model, then base_model).")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="MLflow Model Registry settings.")
    model_id: str | None = Field(None, description="The model name clients send (`model`). Empty: registry.model_name.")
    deploy: bool = Field(True, description="Deploy and smoke-test the API; false: only register the model.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")
    replicas: int = Field(1, ge=1, description="Engine replicas behind the API (each reserves 2 logical CPUs on CPU).")
    http: HttpConfig = Field(default_factory=HttpConfig, description="HTTP endpoint.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Limits on the work of one request "
                                 "(every POST route; 400 naming the limit above them).")
    smoke: SmokeConfig = Field(default_factory=SmokeConfig, description="Load sent after deploying.")
    block: bool = Field(False,
                        description="Keep serving after the smoke load until Ctrl-C (the stage then always runs).")

    @model_validator(mode="after")
    def _smoke_within_limits(self):
        if self.smoke.max_tokens > self.limits.max_tokens:
            raise ValueError(f"smoke.max_tokens ({self.smoke.max_tokens}) exceeds limits.max_tokens "
                             f"({self.limits.max_tokens}); lower one or raise the other")
        return self

    def served_name(self) -> str:
        return self.model_id or self.registry.model_name

    def cpus_needed(self) -> int:
        """Logical CPUs of the app: per replica its actor and its engine bundle, plus the ingress."""
        return 2 * self.replicas + 1


def check(pipeline_cfg) -> None:
    """The stage's `check` hook: its source defaults to the last model the pipeline trains and must be one it
    makes; a local Ray must have room for the replicas."""
    stages = pipeline_cfg.stages
    serve = stages.serve
    if serve is None:
        return
    if serve.source is None:  # sections are frozen once validated
        last = "policy_model" if stages.ppo else "dpo_model" if stages.dpo else "sft_model" if stages.sft else \
            "base_model"
        serve = serve.model_copy(update={"source": last})
        object.__setattr__(stages, "serve", serve)
    check_source("stages.serve.source", serve.source, stages)
    have = pipeline_cfg.ray.local_cpus()
    if have is not None and serve.deploy and serve.cpus_needed() > have:
        raise ValueError(f"stages.serve.replicas: {serve.replicas} replica(s) need {serve.cpus_needed()} logical "
                         f"CPUs (2 each + the ingress) but the local Ray has {have} (ray.num_cpus); use fewer "
                         "replicas or raise ray.num_cpus")


def wire(spec, pipeline_cfg, stages: tuple) -> tuple:
    """The stage's `wire` hook: it reads its source model."""
    return (*stages, replace(spec, inputs=(pipeline_cfg.stages.serve.source,)))


def settings(pipeline_cfg) -> ServeConfig:
    """The serve section the `serve` and `batch-infer` commands read (registry name, engine, endpoint): a
    pipeline without a serve stage (`stages.serve: null`) may still serve a model by hand, with the
    section's defaults."""
    return pipeline_cfg.stages.serve if pipeline_cfg.stages.serve is not None else ServeConfig()


def always_runs(cfg: ServeConfig) -> str | None:
    """A serving stage that blocks is a service, not a cached result: it runs every time."""
    return "serves until Ctrl-C (block: true), so it runs every time" if cfg.block and cfg.deploy else None


def key_tags(metrics: dict, names: list[str]) -> dict[str, str]:
    """The source stage's key metrics as registry tags (`metric.eval_accuracy`: '0.41')."""
    return {f"metric.{n}": f"{metrics[n]:.6g}" for n in names if isinstance(metrics.get(n), (int, float))}


# --------------------------------------------------------------------------- driver


def run(cfg: ServeConfig, ctx: StageContext) -> dict[str, Path]:
    """Register the source model, serve it from the registry, smoke-test it, then stop (or block)."""
    from stages.common.model_registry import fetch, register
    from stages.serve.app import Server, api_key, smoke_load, wait_for_interrupt

    upstream = ctx.upstream.get(cfg.source, {})
    tags = {"pipeline_run_id": ctx.pipeline_run_id, "stage_run_id": ctx.run_id, "source": cfg.source,
            "source_cache_key": upstream.get("key", ""), "serve_cache_key": ctx.out_dir.name,
            "run_dir": str(ctx.pipeline.run_dir), **key_tags(upstream.get("metrics", {}), cfg.registry.metric_tags)}
    info = register(ctx.mlflow_client(), cfg.registry.model_name, cfg.registry.alias, ctx.inputs[cfg.source],
                    ctx.run_id, tags)
    ctx.progress(f"{'registered new' if info['new_version'] else 'model unchanged: kept'} version {info['version']} "
                 f"of {info['name']}; {info['uri']} points to it")
    ctx.set_tags({"registered_model": info["name"], "registered_version": str(info["version"]),
                  "model_uri": info["uri"]})
    ctx.log_metrics({"registered_version": info["version"], "new_version": int(info["new_version"])})
    out = ctx.out_dir / "registered_model.json"
    if cfg.deploy:
        model_dir = fetch(info["uri"], ctx.pipeline.tracking_uri, ctx.pipeline.run_dir / "registry_cache")
        ctx.ray()
        server = Server(cfg, model_dir, ctx.progress, ctx.pipeline.seed, ctx.advance)
        with server as url:
            metrics = smoke_load(url, cfg, api_key(cfg), ctx.advance)
            sample = metrics.pop("smoke_sample")
            ctx.log_metrics({**metrics, "deploy_s": server.deploy_s})
            ctx.progress(f"{cfg.smoke.requests} requests ({cfg.smoke.concurrency} at a time): latency p50 "
                         f"{metrics['smoke_latency_p50_s']:.2f}s, p95 {metrics['smoke_latency_p95_s']:.2f}s, "
                         f"{metrics['smoke_tokens_per_s']:.1f} tokens/s; a reply: {sample!r}")
            info["smoke_sample"] = sample
            if cfg.block:
                wait_for_interrupt(ctx.progress, url)
    out.write_text(json.dumps(info, indent=2))
    return {"served_model": out}

